// The index file format: save (temporary file, fsync, rename) and load (every size, checksum, level, link and label
// validated before use, so a damaged or crafted file raises and never crashes). The graph itself is hnsw.cpp.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <unordered_set>

#include "certrag/checksum.h"
#include "certrag/hnsw.h"
#include "certrag/hnsw_internal.h"

namespace certrag {
using namespace hnsw_internal;

// ---------------------------------------------------------------------------------------------------------------
// Persistence. Layout: a 128-byte header, then sections each starting on a 64-byte boundary:
//   levels  count x int32     top level of each node
//   labels  count x int64
//   deleted count x uint8     0 or 1
//   level0  count x stride0   [uint32 link count][Mmax0 uint32 ids][dim float32 vector]
//   upper   for each node in order, level x (M + 1) uint32: [count][M ids] for levels 1..level
// payload_checksum covers every byte after the header; header_checksum covers the header's first 120 bytes.

namespace {

struct Layout {
  std::size_t levels, labels, deleted, level0, upper, end_fixed;
};

Layout layout_for(std::size_t count, std::size_t stride0) {
  Layout l{};
  l.levels = kHeaderSize;
  l.labels = align_up(l.levels + count * sizeof(std::int32_t));
  l.deleted = align_up(l.labels + count * sizeof(std::int64_t));
  l.level0 = align_up(l.deleted + count);
  l.upper = align_up(l.level0 + count * stride0);
  l.end_fixed = l.upper;
  return l;
}

class FileWriter {
 public:
  explicit FileWriter(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw IndexIoError("could not create " + path + ": " + errno_text());
  }
  ~FileWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, std::size_t size) {
    checksum.update(data, size);
    write_raw(data, size);
  }
  void pad_to(std::size_t offset) {
    static const char zeros[kAlign] = {};
    if (offset < written_) throw std::logic_error("pad_to goes backwards");
    write(zeros, offset - written_);
  }
  void write_raw(const void* data, std::size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, p, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw IndexIoError("could not write " + path_ + ": " + errno_text());
      }
      p += n;
      size -= static_cast<std::size_t>(n);
      written_ += static_cast<std::size_t>(n);
    }
  }
  void pwrite_at(const void* data, std::size_t size, std::size_t offset) {
    if (::pwrite(fd_, data, size, static_cast<off_t>(offset)) != static_cast<ssize_t>(size))
      throw IndexIoError("could not write " + path_ + ": " + errno_text());
  }
  void sync_and_close() {
    if (::fsync(fd_) != 0) throw IndexIoError("could not fsync " + path_ + ": " + errno_text());
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw IndexIoError("could not close " + path_ + ": " + errno_text());
  }
  std::size_t written() const { return written_; }
  Checksum64 checksum;

 private:
  std::string path_;
  int fd_ = -1;
  std::size_t written_ = 0;
};

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

void HnswIndex::save(const std::string& path) const {
  std::unique_lock<std::shared_mutex> exclusive(grow_mutex_);
  static std::atomic<unsigned> serial{0};
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
  const std::size_t count = count_.load();
  const Layout lay = layout_for(count, stride0_);
  try {
    FileWriter out(tmp);
    unsigned char header[kHeaderSize] = {};
    out.write_raw(header, kHeaderSize);  // placeholder, rewritten once the payload checksum is known

    out.pad_to(lay.levels);
    out.write(levels_.data(), count * sizeof(std::int32_t));
    out.pad_to(lay.labels);
    out.write(labels_.data(), count * sizeof(std::int64_t));
    out.pad_to(lay.deleted);
    std::vector<std::uint8_t> deleted(count);
    for (std::size_t i = 0; i < count; ++i) deleted[i] = deleted_[i].load();
    out.write(deleted.data(), count);
    out.pad_to(lay.level0);
    out.write(data0_, count * stride0_);
    out.pad_to(lay.upper);
    for (std::size_t id = 0; id < count; ++id)
      if (levels_[id] > 0)
        out.write(upper_[id].get(), static_cast<std::size_t>(levels_[id]) * (config_.M + 1) * sizeof(std::uint32_t));

    std::memcpy(header + hdr::magic, kMagic, sizeof(kMagic));
    put<std::uint32_t>(header, hdr::version, kFormatVersion);
    put<std::uint32_t>(header, hdr::header_size, kHeaderSize);
    put<std::uint32_t>(header, hdr::metric, static_cast<std::uint32_t>(config_.metric));
    put<std::uint32_t>(header, hdr::dim, config_.dim);
    put<std::uint32_t>(header, hdr::M, config_.M);
    put<std::uint32_t>(header, hdr::M0, static_cast<std::uint32_t>(M0_));
    put<std::uint32_t>(header, hdr::efc, config_.ef_construction);
    put<std::int32_t>(header, hdr::max_level, max_level_);
    put<std::uint64_t>(header, hdr::seed, config_.seed);
    put<std::uint64_t>(header, hdr::count, count);
    put<std::uint64_t>(header, hdr::live, count - deleted_count_.load());
    put<std::uint32_t>(header, hdr::entry, entry_);
    put<std::uint64_t>(header, hdr::payload_size, out.written() - kHeaderSize);
    put<std::uint64_t>(header, hdr::payload_checksum, out.checksum.digest());
    put<std::uint64_t>(header, hdr::header_checksum, checksum64(header, hdr::header_checksum));
    out.pwrite_at(header, kHeaderSize, 0);
    out.sync_and_close();
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw IndexIoError("could not rename " + tmp + " to " + path + ": " + errno_text());
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  const int dir = ::open(parent_dir(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

namespace {

class FileReader {
 public:
  explicit FileReader(const std::string& path) : path_(path) {
    // O_NONBLOCK: a FIFO or a device in place of an index must be refused by the check below, not block the open
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) {
      if (errno == ENOENT) throw IndexIoError("no index file at " + path);  // an OSError, as a missing file is
      throw IndexIoError("could not open " + path + ": " + errno_text());
    }
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw IndexIoError("could not stat " + path + ": " + errno_text());
    if (!S_ISREG(st.st_mode)) throw IndexFormatError(path + " is not a regular file");
    size_ = static_cast<std::size_t>(st.st_size);
  }
  ~FileReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  void read_at(void* dst, std::size_t size, std::size_t offset) {
    char* p = static_cast<char*>(dst);
    while (size > 0) {
      const ssize_t n = ::pread(fd_, p, size, static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw IndexFormatError(path_ + ": unexpected end of file at byte " + std::to_string(offset));
      p += n;
      size -= static_cast<std::size_t>(n);
      offset += static_cast<std::size_t>(n);
    }
  }
  int fd() const { return fd_; }
  std::size_t size() const { return size_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::size_t size_ = 0;
};

}  // namespace

std::unique_ptr<HnswIndex> HnswIndex::load(const std::string& path, bool use_mmap) {
  FileReader in(path);
  auto bad = [&path](const std::string& what) { return IndexFormatError(path + ": " + what); };
  if (in.size() < kHeaderSize)
    throw bad("not a certrag index: " + std::to_string(in.size()) + " bytes, shorter than the " +
              std::to_string(kHeaderSize) + "-byte header");
  unsigned char header[kHeaderSize];
  in.read_at(header, kHeaderSize, 0);
  if (std::memcmp(header, kMagic, sizeof(kMagic)) != 0) throw bad("not a certrag HNSW index (wrong magic bytes)");
  const auto version = get<std::uint32_t>(header, hdr::version);
  if (version > kFormatVersion)
    throw bad("written by a newer certrag (index format version " + std::to_string(version) +
              "); this build reads versions up to " + std::to_string(kFormatVersion) + ": upgrade certrag");
  if (get<std::uint64_t>(header, hdr::header_checksum) != checksum64(header, hdr::header_checksum))
    throw bad("header checksum mismatch: the file is corrupted");
  if (version == 0) throw bad("invalid format version 0");
  if (get<std::uint32_t>(header, hdr::header_size) != kHeaderSize) throw bad("unexpected header size");

  HnswConfig config;
  const auto metric = get<std::uint32_t>(header, hdr::metric);
  if (metric > 2) throw bad("unknown metric code " + std::to_string(metric));
  config.metric = static_cast<Metric>(metric);
  config.dim = get<std::uint32_t>(header, hdr::dim);
  config.M = get<std::uint32_t>(header, hdr::M);
  config.ef_construction = get<std::uint32_t>(header, hdr::efc);
  config.seed = get<std::uint64_t>(header, hdr::seed);
  const std::string problem = config.validate();
  if (!problem.empty()) throw bad("invalid parameters: " + problem);
  if (get<std::uint32_t>(header, hdr::M0) != 2 * config.M) throw bad("Mmax0 is not 2M");
  const auto count64 = get<std::uint64_t>(header, hdr::count);
  const auto live = get<std::uint64_t>(header, hdr::live);
  const auto max_level = get<std::int32_t>(header, hdr::max_level);
  const auto entry = get<std::uint32_t>(header, hdr::entry);
  const auto payload_size = get<std::uint64_t>(header, hdr::payload_size);
  if (count64 >= kNone) throw bad("node count out of range");
  const std::size_t count = static_cast<std::size_t>(count64);
  if (live > count) throw bad("more live nodes than nodes");
  if (max_level < -1 || max_level > kMaxLevel) throw bad("top level out of range");
  if ((count == 0) != (entry == kNone) || (count == 0) != (max_level == -1))
    throw bad("entry point inconsistent with the node count");
  if (count > 0 && entry >= count) throw bad("entry point out of range");
  if (payload_size != in.size() - kHeaderSize)
    throw bad("truncated or padded: header promises " + std::to_string(payload_size + kHeaderSize) +
              " bytes, file has " + std::to_string(in.size()));

  auto index = std::make_unique<HnswIndex>(config);
  const std::size_t stride0 = index->stride0_;
  if (count > (in.size() / stride0) + 1) throw bad("node count does not fit the file size");
  const Layout lay = layout_for(count, stride0);
  if (lay.end_fixed > in.size()) throw bad("file too short for its node count");

  // The checksum first: everything below then reads bytes known to be what save() wrote, and the structural checks
  // that follow guard against files crafted to pass it.
  void* map = nullptr;
  const unsigned char* mapped = nullptr;
  if (use_mmap) {
    map = ::mmap(nullptr, in.size(), PROT_READ, MAP_SHARED, in.fd(), 0);
    if (map == MAP_FAILED) throw IndexIoError("could not mmap " + path + ": " + errno_text());
    index->map_base_ = map;  // owned by the index from here, so a throw below unmaps it
    index->map_size_ = in.size();
    mapped = static_cast<const unsigned char*>(map);
    if (checksum64(mapped + kHeaderSize, payload_size) != get<std::uint64_t>(header, hdr::payload_checksum))
      throw bad("payload checksum mismatch: the file is corrupted");
  }
  Checksum64 running;
  std::size_t cursor = kHeaderSize;
  std::vector<unsigned char> scratch;
  auto take = [&](void* dst, std::size_t offset, std::size_t size) {
    if (mapped) {
      std::memcpy(dst, mapped + offset, size);
      return;
    }
    if (offset > cursor) {  // padding
      scratch.resize(offset - cursor);
      in.read_at(scratch.data(), scratch.size(), cursor);
      running.update(scratch.data(), scratch.size());
    }
    in.read_at(dst, size, offset);
    running.update(dst, size);
    cursor = offset + size;
  };

  index->capacity_ = count;
  index->levels_.resize(count);
  index->labels_.resize(count);
  index->upper_.resize(count);
  index->deleted_.reset(new std::atomic<std::uint8_t>[count]);
  take(index->levels_.data(), lay.levels, count * sizeof(std::int32_t));
  take(index->labels_.data(), lay.labels, count * sizeof(std::int64_t));
  std::vector<std::uint8_t> deleted(count);
  take(deleted.data(), lay.deleted, count);
  if (mapped) {
    index->data0_ = const_cast<char*>(reinterpret_cast<const char*>(mapped + lay.level0));
  } else {
    index->owned0_.reset(new char[count * stride0 + 1]);
    index->data0_ = index->owned0_.get();
    take(index->data0_, lay.level0, count * stride0);
  }
  std::size_t upper_words = 0;
  for (std::size_t id = 0; id < count; ++id) {
    const int level = index->levels_[id];
    if (level < 0 || level > max_level) throw bad("node " + std::to_string(id) + " has an invalid level");
    upper_words += static_cast<std::size_t>(level) * (config.M + 1);
  }
  if (lay.upper + upper_words * sizeof(std::uint32_t) != in.size())
    throw bad("upper-layer section size does not match the node levels");
  std::vector<std::uint32_t> upper(upper_words);
  if (mapped) {
    std::memcpy(upper.data(), mapped + lay.upper, upper_words * sizeof(std::uint32_t));
  } else {
    std::uint64_t dummy = 0;
    take(upper_words ? static_cast<void*>(upper.data()) : &dummy, lay.upper, upper_words * sizeof(std::uint32_t));
    if (running.digest() != get<std::uint64_t>(header, hdr::payload_checksum))
      throw bad("payload checksum mismatch: the file is corrupted");
  }

  if (count > 0 && index->levels_[entry] != max_level) throw bad("entry point is not on the top level");
  std::size_t live_seen = 0;
  index->label_to_id_.reserve(static_cast<std::size_t>(live) * 2);
  for (std::size_t id = 0; id < count; ++id) {
    if (deleted[id] > 1) throw bad("invalid deleted flag at node " + std::to_string(id));
    index->deleted_[id].store(deleted[id]);
    const std::int64_t label = index->labels_[id];
    if (label < 0) throw bad("negative label at node " + std::to_string(id));
    index->max_label_ = std::max(index->max_label_, label);
    if (deleted[id]) continue;
    ++live_seen;
    if (!index->label_to_id_.emplace(label, static_cast<std::uint32_t>(id)).second)
      throw bad("label " + std::to_string(label) + " is live twice");
  }
  if (live_seen != live) throw bad("live count does not match the deleted flags");
  index->count_.store(count);
  index->deleted_count_.store(count - live_seen);

  for (std::size_t id = 0; id < count; ++id) {
    const auto* rec = reinterpret_cast<const std::uint32_t*>(index->data0_ + id * stride0);
    if (rec[0] > index->M0_) throw bad("node " + std::to_string(id) + " has too many level-0 links");
    for (std::uint32_t j = 1; j <= rec[0]; ++j)
      if (rec[j] >= count) throw bad("node " + std::to_string(id) + " links to a node out of range");
    const float* v = index->vector_of(static_cast<std::uint32_t>(id));
    if (!all_finite(v, config.dim)) throw bad("node " + std::to_string(id) + " holds a non-finite vector");
    // what the metric promises: cosine rows were normalised on the way in; ip and l2 rows keep scores finite
    const double norm = norm_of(v, config.dim);
    if (config.metric == Metric::cosine && std::fabs(norm - 1.0) > 1e-3)
      throw bad("node " + std::to_string(id) + " holds a vector of norm " + short_number(norm) +
                " under the cosine metric (stored vectors are unit length)");
    if (config.metric != Metric::cosine && norm > kMaxNorm)
      throw bad("node " + std::to_string(id) + " holds a vector of norm " + short_number(norm) +
                ", above the limit that keeps scores finite");
  }
  std::size_t offset = 0;
  for (std::size_t id = 0; id < count; ++id) {
    const int level = index->levels_[id];
    if (level == 0) continue;
    const std::size_t words = static_cast<std::size_t>(level) * (config.M + 1);
    std::unique_ptr<std::uint32_t[]> links(new std::uint32_t[words]);
    std::memcpy(links.get(), upper.data() + offset, words * sizeof(std::uint32_t));
    offset += words;
    for (int l = 1; l <= level; ++l) {
      const std::uint32_t* list = links.get() + static_cast<std::size_t>(l - 1) * (config.M + 1);
      if (list[0] > config.M) throw bad("node " + std::to_string(id) + " has too many links on a layer");
      for (std::uint32_t j = 1; j <= list[0]; ++j)
        if (list[j] >= count || index->levels_[list[j]] < l)
          throw bad("node " + std::to_string(id) + " links to a node absent from its layer");
    }
    index->upper_[id] = std::move(links);
  }
  index->entry_ = entry;
  index->max_level_ = max_level;
  index->rng_.seed(config.seed ^ (0x9E3779B97F4A7C15ULL * (count + 1)));
  return index;
}

}  // namespace certrag
