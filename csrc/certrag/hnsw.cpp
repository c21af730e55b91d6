#include "certrag/hnsw.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <queue>
#include <sstream>
#include <unordered_set>

#include "certrag/checksum.h"
#include "certrag/parallel.h"

static_assert(sizeof(float) == 4, "float must be IEEE-754 binary32");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the index file format is little-endian; a big-endian port needs byte swapping in save/load"
#endif

namespace certrag {
namespace {

// Links are read without a lock by searches while inserts rewrite them under the node's lock. Writers store the ids
// first and publish the count with release; readers load the count with acquire. A reader may see a mix of old and new
// ids, but every id it can see names a fully written node, so the race costs recall at worst, never safety.
inline std::uint32_t load_acquire(const std::uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline std::uint32_t load_relaxed(const std::uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void store_release(std::uint32_t* p, std::uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void store_relaxed(std::uint32_t* p, std::uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

constexpr char kMagic[8] = {'C', 'R', 'A', 'G', 'H', 'N', 'S', 'W'};
constexpr std::size_t kHeaderSize = 128;
constexpr std::size_t kAlign = 64;
constexpr int kMaxLevel = 63;
constexpr std::uint32_t kMaxDim = 65536;
constexpr std::uint32_t kMaxM = 2048;

std::size_t align_up(std::size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

std::uint64_t pack_entry(std::uint32_t entry, int level) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(level + 1)) << 32) | entry;
}

template <class T>
void put(unsigned char* header, std::size_t offset, T value) {
  std::memcpy(header + offset, &value, sizeof(T));
}
template <class T>
T get(const unsigned char* header, std::size_t offset) {
  T value;
  std::memcpy(&value, header + offset, sizeof(T));
  return value;
}

// Byte offsets of the fields in the 128-byte header.
namespace hdr {
constexpr std::size_t magic = 0, version = 8, header_size = 12, metric = 16, dim = 20, M = 24, M0 = 28, efc = 32,
                      max_level = 36, seed = 40, count = 48, live = 56, entry = 64, payload_size = 72,
                      payload_checksum = 80, header_checksum = 120;
}

std::string errno_text() { return std::strerror(errno); }

bool all_finite(const float* v, std::size_t dim) {
  for (std::size_t j = 0; j < dim; ++j)
    if (!std::isfinite(v[j])) return false;
  return true;
}

}  // namespace

const char* metric_name(Metric metric) {
  switch (metric) {
    case Metric::ip:
      return "ip";
    case Metric::l2:
      return "l2";
    case Metric::cosine:
      return "cosine";
  }
  return "unknown";
}

std::string HnswConfig::validate() const {
  if (dim < 1) return "dim must be at least 1";
  if (dim > kMaxDim) return "dim must be at most " + std::to_string(kMaxDim);
  if (static_cast<std::uint32_t>(metric) > 2) return "metric must be ip, l2 or cosine";
  if (M < 2) return "M must be at least 2";
  if (M > kMaxM) return "M must be at most " + std::to_string(kMaxM);
  if (ef_construction < 1) return "ef_construction must be at least 1";
  return "";
}

// Epoch-tagged visited marks, one list per concurrent search, recycled between searches.
class HnswIndex::VisitedPool {
 public:
  struct List {
    std::vector<std::uint16_t> marks;
    std::uint16_t epoch = 0;
    bool test_and_set(std::uint32_t id) {
      if (marks[id] == epoch) return true;
      marks[id] = epoch;
      return false;
    }
  };
  class Handle {
   public:
    Handle(VisitedPool& pool, std::unique_ptr<List> list) : pool_(pool), list_(std::move(list)) {}
    ~Handle() { pool_.release(std::move(list_)); }
    List* operator->() { return list_.get(); }

   private:
    VisitedPool& pool_;
    std::unique_ptr<List> list_;
  };

  Handle acquire(std::size_t n) {
    std::unique_ptr<List> list;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        list = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!list) list = std::make_unique<List>();
    if (list->marks.size() < n) {
      list->marks.assign(n, 0);
      list->epoch = 0;
    }
    if (++list->epoch == 0) {
      std::fill(list->marks.begin(), list->marks.end(), 0);
      list->epoch = 1;
    }
    return Handle(*this, std::move(list));
  }

 private:
  void release(std::unique_ptr<List> list) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(list));
  }
  std::mutex mutex_;
  std::vector<std::unique_ptr<List>> free_;
};

HnswIndex::HnswIndex(const HnswConfig& config)
    : config_(config),
      M0_(2 * static_cast<std::size_t>(config.M)),
      level_mult_(0.0),
      stride0_(0),
      vec_offset_(0),
      kernels_(distance_kernels()),
      rng_(config.seed),
      link_locks_(new std::mutex[kLinkLocks]),
      visited_(new VisitedPool()) {
  const std::string problem = config_.validate();
  if (!problem.empty()) throw std::invalid_argument(problem);
  level_mult_ = 1.0 / std::log(static_cast<double>(config_.M));
  vec_offset_ = sizeof(std::uint32_t) * (M0_ + 1);
  stride0_ = vec_offset_ + sizeof(float) * config_.dim;
}

HnswIndex::~HnswIndex() {
  if (map_base_ != nullptr) munmap(map_base_, map_size_);
}

float HnswIndex::distance(const float* a, const float* b) const {
  if (config_.metric == Metric::l2) return kernels_.l2sq(a, b, config_.dim);
  return -kernels_.dot(a, b, config_.dim);
}

const float* HnswIndex::vector_of(std::uint32_t id) const {
  return reinterpret_cast<const float*>(data0_ + id * stride0_ + vec_offset_);
}

std::uint32_t* HnswIndex::links0_of(std::uint32_t id) const {
  return reinterpret_cast<std::uint32_t*>(data0_ + id * stride0_);
}

std::uint32_t* HnswIndex::links_of(std::uint32_t id, int level) const {
  if (level == 0) return links0_of(id);
  return upper_[id].get() + static_cast<std::size_t>(level - 1) * (config_.M + 1);
}

void HnswIndex::prefetch_vector(std::uint32_t id) const {
  const char* p = reinterpret_cast<const char*>(vector_of(id));
  const std::size_t bytes = std::min<std::size_t>(config_.dim * sizeof(float), kPrefetchBytes);
  for (std::size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

bool HnswIndex::is_deleted(std::uint32_t id) const { return deleted_[id].load(std::memory_order_relaxed) != 0; }

int HnswIndex::draw_level() {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double u = 1.0 - uniform(rng_);  // in (0, 1]
  const double level = -std::log(u) * level_mult_;
  return static_cast<int>(std::min<double>(level, kMaxLevel));
}

void HnswIndex::reserve_locked(std::size_t capacity) {
  if (capacity <= capacity_) return;
  if (capacity > kNone) throw std::length_error("an index holds at most 4294967294 vectors");
  const std::size_t count = count_.load();
  std::unique_ptr<char[]> data(new char[capacity * stride0_]);
  if (count > 0) std::memcpy(data.get(), data0_, count * stride0_);
  std::unique_ptr<std::atomic<std::uint8_t>[]> deleted(new std::atomic<std::uint8_t>[capacity]);
  for (std::size_t i = 0; i < capacity; ++i) deleted[i].store(i < count ? deleted_[i].load() : 0);
  levels_.resize(capacity, 0);
  labels_.resize(capacity, -1);
  upper_.resize(capacity);
  if (map_base_ != nullptr) {
    munmap(map_base_, map_size_);
    map_base_ = nullptr;
    map_size_ = 0;
  }
  owned0_ = std::move(data);
  data0_ = owned0_.get();
  deleted_ = std::move(deleted);
  capacity_ = capacity;
}

void HnswIndex::add(std::size_t n, const float* vectors, const std::int64_t* labels, int num_threads) {
  if (n == 0) return;
  const std::size_t dim = config_.dim;
  for (std::size_t i = 0; i < n; ++i) {
    const float* v = vectors + i * dim;
    if (!all_finite(v, dim))
      throw std::invalid_argument("vectors[" + std::to_string(i) + "] holds a NaN or infinite value");
    if (config_.metric == Metric::cosine && kernels_.dot(v, v, dim) <= 0.f)
      throw std::invalid_argument("vectors[" + std::to_string(i) +
                                  "] is all zeros; the cosine metric needs non-zero vectors");
    if (labels[i] < 0)
      throw std::invalid_argument("ids[" + std::to_string(i) + "] is " + std::to_string(labels[i]) +
                                  "; ids must be >= 0");
  }
  {
    std::unordered_set<std::int64_t> seen;
    seen.reserve(n * 2);
    for (std::size_t i = 0; i < n; ++i)
      if (!seen.insert(labels[i]).second)
        throw std::invalid_argument("ids[" + std::to_string(i) + "] = " + std::to_string(labels[i]) +
                                    " appears more than once in the batch");
  }

  std::vector<std::uint32_t> ids(n);
  std::vector<int> levels(n);
  // Nodes are allocated and inserted under one shared hold of grow_mutex_, so save() (exclusive) never sees a node
  // that is allocated but not yet linked. Growing the storage needs the exclusive hold: drop, grow, retry.
  for (;;) {
    std::shared_lock<std::shared_mutex> shared(grow_mutex_);
    bool allocated = false;
    {
      std::lock_guard<std::mutex> lock(label_mutex_);
      for (std::size_t i = 0; i < n; ++i) {
        auto it = label_to_id_.find(labels[i]);
        if (it != label_to_id_.end())
          throw std::invalid_argument("ids[" + std::to_string(i) + "] = " + std::to_string(labels[i]) +
                                      " is already in the index; remove it first");
      }
      const std::size_t start = count_.load();
      if (start + n <= capacity_ && map_base_ == nullptr) {
        for (std::size_t i = 0; i < n; ++i) {
          const auto id = static_cast<std::uint32_t>(start + i);
          const int level = draw_level();
          ids[i] = id;
          levels[i] = level;
          char* record = data0_ + id * stride0_;
          std::memset(record, 0, vec_offset_);
          float* dst = reinterpret_cast<float*>(record + vec_offset_);
          const float* src = vectors + i * dim;
          if (config_.metric == Metric::cosine) {
            const float inv = 1.0f / std::sqrt(kernels_.dot(src, src, dim));
            for (std::size_t j = 0; j < dim; ++j) dst[j] = src[j] * inv;
          } else {
            std::memcpy(dst, src, dim * sizeof(float));
          }
          levels_[id] = level;
          labels_[id] = labels[i];
          deleted_[id].store(0);
          if (level > 0) {
            const std::size_t words = static_cast<std::size_t>(level) * (config_.M + 1);
            upper_[id].reset(new std::uint32_t[words]());
          } else {
            upper_[id].reset();
          }
          label_to_id_[labels[i]] = id;
          max_label_ = std::max(max_label_, labels[i]);
        }
        count_.store(start + n);
        allocated = true;
      }
    }
    if (allocated) {
      parallel_for(n, num_threads, 1, [&](std::size_t i) { insert(ids[i], levels[i]); });
      return;
    }
    shared.unlock();
    std::unique_lock<std::shared_mutex> exclusive(grow_mutex_);
    std::lock_guard<std::mutex> lock(label_mutex_);
    const std::size_t need = count_.load() + n;
    reserve_locked(std::max<std::size_t>({need, capacity_ + capacity_ / 2, 1024}));
    if (map_base_ != nullptr) reserve_locked(capacity_ + 1);
  }
}

std::uint32_t HnswIndex::greedy_descent(const float* q, std::uint32_t entry, int from_level, int to_level) const {
  std::uint32_t cur = entry;
  float cur_dist = distance(q, vector_of(cur));
  for (int level = from_level; level >= to_level; --level) {
    bool moved = true;
    while (moved) {
      moved = false;
      const std::uint32_t* links = links_of(cur, level);
      const std::uint32_t cnt = std::min<std::uint32_t>(load_acquire(links), config_.M);
      for (std::uint32_t j = 1; j <= cnt; ++j) {
        const std::uint32_t nb = load_relaxed(links + j);
        const float d = distance(q, vector_of(nb));
        if (d < cur_dist) {
          cur_dist = d;
          cur = nb;
          moved = true;
        }
      }
    }
  }
  return cur;
}

std::vector<HnswIndex::DistId> HnswIndex::search_layer(const float* q, std::uint32_t entry, std::size_t ef, int level,
                                                       bool skip_deleted) const {
  auto visited = visited_->acquire(capacity_);
  std::priority_queue<DistId> top;  // worst result on top
  std::priority_queue<DistId, std::vector<DistId>, std::greater<DistId>> frontier;  // closest candidate on top
  const float d0 = distance(q, vector_of(entry));
  visited->test_and_set(entry);
  frontier.emplace(d0, entry);
  if (!skip_deleted || !is_deleted(entry)) top.emplace(d0, entry);
  float bound = top.empty() ? std::numeric_limits<float>::infinity() : top.top().first;
  const std::uint32_t limit = static_cast<std::uint32_t>(max_links(level));
  std::vector<std::uint32_t> todo(limit);

  while (!frontier.empty()) {
    const DistId current = frontier.top();
    if (current.first > bound && top.size() >= ef) break;
    frontier.pop();
    const std::uint32_t* links = links_of(current.second, level);
    const std::uint32_t cnt = std::min(load_acquire(links), limit);
    // Gather the unvisited neighbours first, then score them while prefetching a few vectors ahead: the scoring is
    // bound by memory latency, and a gathered list lets the prefetches run further ahead than the next link.
    std::uint32_t fresh = 0;
    for (std::uint32_t j = 1; j <= cnt; ++j) {
      const std::uint32_t nb = load_relaxed(links + j);
      if (!visited->test_and_set(nb)) todo[fresh++] = nb;
    }
    for (std::uint32_t j = 0; j < std::min<std::uint32_t>(fresh, kPrefetchAhead); ++j) prefetch_vector(todo[j]);
    for (std::uint32_t j = 0; j < fresh; ++j) {
      if (j + kPrefetchAhead < fresh) prefetch_vector(todo[j + kPrefetchAhead]);
      const std::uint32_t nb = todo[j];
      const float d = distance(q, vector_of(nb));
      if (top.size() < ef || d < bound) {
        frontier.emplace(d, nb);
        if (!skip_deleted || !is_deleted(nb)) {
          top.emplace(d, nb);
          if (top.size() > ef) top.pop();
        }
        if (!top.empty()) bound = top.top().first;
      }
    }
  }
  std::vector<DistId> out;
  out.reserve(top.size());
  while (!top.empty()) {
    out.push_back(top.top());
    top.pop();
  }
  std::reverse(out.begin(), out.end());
  return out;
}

// The paper's heuristic (Algorithm 4, no extension, no kept-pruned): walk candidates from the closest and keep one
// only if it is closer to the base than to every neighbour kept so far. Leaves the kept ones sorted, closest first.
void HnswIndex::select_neighbours(std::vector<DistId>& candidates, std::size_t m) const {
  std::sort(candidates.begin(), candidates.end());
  if (candidates.size() <= m) return;
  std::vector<DistId> kept;
  kept.reserve(m);
  for (const DistId& c : candidates) {
    if (kept.size() >= m) break;
    const float* cv = vector_of(c.second);
    bool good = true;
    for (const DistId& r : kept) {
      if (distance(cv, vector_of(r.second)) < c.first) {
        good = false;
        break;
      }
    }
    if (good) kept.push_back(c);
  }
  candidates.swap(kept);
}

void HnswIndex::connect(std::uint32_t id, const std::vector<DistId>& neighbours, int level) {
  const std::size_t cap = max_links(level);
  {
    std::lock_guard<std::mutex> lock(link_lock(id));
    std::uint32_t* links = links_of(id, level);
    std::uint32_t n = 0;
    for (const DistId& nb : neighbours) store_relaxed(links + 1 + n++, nb.second);
    store_release(links, n);
  }
  std::vector<DistId> pool;
  for (const DistId& nb : neighbours) {
    std::lock_guard<std::mutex> lock(link_lock(nb.second));
    std::uint32_t* links = links_of(nb.second, level);
    const std::uint32_t cnt = links[0];
    bool present = false;
    for (std::uint32_t j = 1; j <= cnt; ++j) present |= (links[j] == id);
    if (present) continue;
    if (cnt < cap) {
      store_relaxed(links + 1 + cnt, id);
      store_release(links, cnt + 1);
      continue;
    }
    const float* base = vector_of(nb.second);
    pool.clear();
    pool.emplace_back(nb.first, id);
    for (std::uint32_t j = 1; j <= cnt; ++j) pool.emplace_back(distance(base, vector_of(links[j])), links[j]);
    select_neighbours(pool, cap);
    std::uint32_t n = 0;
    for (const DistId& p : pool) store_relaxed(links + 1 + n++, p.second);
    store_release(links, n);
  }
}

void HnswIndex::insert(std::uint32_t id, int level) {
  std::unique_lock<std::mutex> top_lock(entry_mutex_);
  const std::uint32_t entry = entry_;
  const int max_level = max_level_;
  if (level <= max_level) top_lock.unlock();  // only a node that raises the top level holds it throughout
  if (entry == kNone) {
    entry_ = id;
    max_level_ = level;
    return;
  }
  const float* q = vector_of(id);
  std::uint32_t cur = entry;
  if (level < max_level) cur = greedy_descent(q, entry, max_level, level + 1);
  for (int l = std::min(level, max_level); l >= 0; --l) {
    std::vector<DistId> found = search_layer(q, cur, config_.ef_construction, l, false);
    // A concurrent insert may already have linked this node at this level; never link a node to itself.
    found.erase(std::remove_if(found.begin(), found.end(), [id](const DistId& d) { return d.second == id; }),
                found.end());
    if (found.empty()) continue;
    cur = found.front().second;
    select_neighbours(found, config_.M);
    connect(id, found, l);
  }
  if (level > max_level) {
    entry_ = id;
    max_level_ = level;
  }
}

void HnswIndex::search_one(const float* q, std::size_t k, std::size_t ef, std::int64_t* out_labels,
                           float* out_scores) const {
  std::fill(out_labels, out_labels + k, -1);
  std::fill(out_scores, out_scores + k, -std::numeric_limits<float>::infinity());
  std::uint32_t entry;
  int max_level;
  {
    std::lock_guard<std::mutex> lock(entry_mutex_);
    entry = entry_;
    max_level = max_level_;
  }
  if (entry == kNone) return;
  const std::uint32_t start = max_level > 0 ? greedy_descent(q, entry, max_level, 1) : entry;
  const std::vector<DistId> found = search_layer(q, start, std::max(ef, k), 0, true);
  const std::size_t m = std::min(k, found.size());
  for (std::size_t i = 0; i < m; ++i) {
    out_labels[i] = labels_[found[i].second];
    out_scores[i] = -found[i].first;
  }
}

void HnswIndex::search(std::size_t n, const float* queries, std::size_t k, std::size_t ef, int num_threads,
                       std::int64_t* out_labels, float* out_scores) const {
  if (k < 1) throw std::invalid_argument("k must be at least 1");
  const std::size_t dim = config_.dim;
  for (std::size_t i = 0; i < n; ++i) {
    const float* q = queries + i * dim;
    if (!all_finite(q, dim))
      throw std::invalid_argument("queries[" + std::to_string(i) + "] holds a NaN or infinite value");
    if (config_.metric == Metric::cosine && kernels_.dot(q, q, dim) <= 0.f)
      throw std::invalid_argument("queries[" + std::to_string(i) +
                                  "] is all zeros; the cosine metric needs non-zero queries");
  }
  std::shared_lock<std::shared_mutex> shared(grow_mutex_);
  const bool normalise = config_.metric == Metric::cosine;
  parallel_for(n, num_threads, 4, [&](std::size_t i) {
    const float* q = queries + i * dim;
    std::vector<float> unit;
    if (normalise) {
      unit.assign(q, q + dim);
      const float inv = 1.0f / std::sqrt(kernels_.dot(q, q, dim));
      for (float& x : unit) x *= inv;
      q = unit.data();
    }
    search_one(q, k, ef, out_labels + i * k, out_scores + i * k);
  });
}

std::size_t HnswIndex::remove(std::size_t n, const std::int64_t* labels) {
  std::shared_lock<std::shared_mutex> shared(grow_mutex_);
  std::lock_guard<std::mutex> lock(label_mutex_);
  std::size_t removed = 0;
  for (std::size_t i = 0; i < n; ++i) {
    auto it = label_to_id_.find(labels[i]);
    if (it == label_to_id_.end()) continue;
    deleted_[it->second].store(1);
    label_to_id_.erase(it);
    ++removed;
  }
  deleted_count_ += removed;
  return removed;
}

void HnswIndex::get_vectors(std::size_t n, const std::int64_t* labels, float* out) const {
  std::shared_lock<std::shared_mutex> shared(grow_mutex_);
  std::lock_guard<std::mutex> lock(label_mutex_);
  for (std::size_t i = 0; i < n; ++i) {
    auto it = label_to_id_.find(labels[i]);
    if (it == label_to_id_.end())
      throw std::invalid_argument("ids[" + std::to_string(i) + "] = " + std::to_string(labels[i]) +
                                  " is not in the index");
    std::memcpy(out + i * config_.dim, vector_of(it->second), config_.dim * sizeof(float));
  }
}

bool HnswIndex::contains(std::int64_t label) const {
  std::lock_guard<std::mutex> lock(label_mutex_);
  return label_to_id_.count(label) != 0;
}

std::size_t HnswIndex::size() const {
  std::lock_guard<std::mutex> lock(label_mutex_);
  return label_to_id_.size();
}

std::int64_t HnswIndex::max_label() const {
  std::lock_guard<std::mutex> lock(label_mutex_);
  return max_label_;
}

std::vector<std::int64_t> HnswIndex::labels() const {
  std::shared_lock<std::shared_mutex> shared(grow_mutex_);
  std::lock_guard<std::mutex> lock(label_mutex_);
  std::vector<std::int64_t> out;
  out.reserve(label_to_id_.size());
  const std::size_t count = count_.load();
  for (std::size_t id = 0; id < count; ++id)
    if (!is_deleted(static_cast<std::uint32_t>(id))) out.push_back(labels_[id]);
  return out;
}

HnswStats HnswIndex::stats() const {
  std::unique_lock<std::shared_mutex> exclusive(grow_mutex_);
  HnswStats s;
  s.nodes = count_.load();
  s.deleted = deleted_count_.load();
  s.live = s.nodes - s.deleted;
  s.capacity = capacity_;
  s.max_level = max_level_;
  s.nodes_per_level.assign(static_cast<std::size_t>(max_level_ + 1), 0);
  std::size_t links0 = 0, upper_words = 0;
  for (std::size_t id = 0; id < s.nodes; ++id) {
    const int level = levels_[id];
    for (int l = 0; l <= level; ++l) ++s.nodes_per_level[static_cast<std::size_t>(l)];
    links0 += links0_of(static_cast<std::uint32_t>(id))[0];
    upper_words += static_cast<std::size_t>(level) * (config_.M + 1);
  }
  s.mean_degree_level0 = s.nodes ? static_cast<double>(links0) / static_cast<double>(s.nodes) : 0.0;
  s.memory_bytes = capacity_ * (stride0_ + sizeof(std::int32_t) + sizeof(std::int64_t) + 1 +
                                sizeof(std::unique_ptr<std::uint32_t[]>)) +
                   upper_words * sizeof(std::uint32_t) + label_to_id_.size() * 32;
  s.mmapped = map_base_ != nullptr;
  return s;
}

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
    if (fd_ < 0) throw std::runtime_error("could not create " + path + ": " + errno_text());
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
        throw std::runtime_error("could not write " + path_ + ": " + errno_text());
      }
      p += n;
      size -= static_cast<std::size_t>(n);
      written_ += static_cast<std::size_t>(n);
    }
  }
  void pwrite_at(const void* data, std::size_t size, std::size_t offset) {
    if (::pwrite(fd_, data, size, static_cast<off_t>(offset)) != static_cast<ssize_t>(size))
      throw std::runtime_error("could not write " + path_ + ": " + errno_text());
  }
  void sync_and_close() {
    if (::fsync(fd_) != 0) throw std::runtime_error("could not fsync " + path_ + ": " + errno_text());
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw std::runtime_error("could not close " + path_ + ": " + errno_text());
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
      throw std::runtime_error("could not rename " + tmp + " to " + path + ": " + errno_text());
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
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      if (errno == ENOENT) throw std::invalid_argument("no index file at " + path);
      throw std::runtime_error("could not open " + path + ": " + errno_text());
    }
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw std::runtime_error("could not stat " + path + ": " + errno_text());
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
    if (map == MAP_FAILED) throw std::runtime_error("could not mmap " + path + ": " + errno_text());
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
    if (!all_finite(index->vector_of(static_cast<std::uint32_t>(id)), config.dim))
      throw bad("node " + std::to_string(id) + " holds a non-finite vector");
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
