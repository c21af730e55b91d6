// The HNSW graph: insertion, search, removal and statistics. The file format (save, load) is hnsw_io.cpp.
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

#include "certrag/hnsw_internal.h"
#include "certrag/parallel.h"

namespace certrag {
using namespace hnsw_internal;

namespace {

// Links are read without a lock by searches while inserts rewrite them under the node's lock. Writers store the ids
// first and publish the count with release; readers load the count with acquire. A reader may see a mix of old and new
// ids, but every id it can see names a fully written node, so the race costs recall at worst, never safety.
inline std::uint32_t load_acquire(const std::uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline std::uint32_t load_relaxed(const std::uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void store_release(std::uint32_t* p, std::uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void store_relaxed(std::uint32_t* p, std::uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

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
    const std::string problem = vector_problem(vectors + i * dim, dim, config_.metric == Metric::cosine);
    if (!problem.empty()) throw std::invalid_argument("vectors[" + std::to_string(i) + "] " + problem);
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
            normalise_into(src, dim, dst, kernels_.dot);
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

void HnswIndex::link_out(std::uint32_t id, const std::vector<DistId>& neighbours, int level) {
  std::lock_guard<std::mutex> lock(link_lock(id));
  std::uint32_t* links = links_of(id, level);
  std::uint32_t n = 0;
  for (const DistId& nb : neighbours) store_relaxed(links + 1 + n++, nb.second);
  store_release(links, n);
}

void HnswIndex::link_back(std::uint32_t id, const std::vector<DistId>& neighbours, int level) {
  const std::size_t cap = max_links(level);
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

// Three phases, so that a concurrent search never reaches the new node before it can leave it: (1) top-down, the
// searches that choose its neighbours at every level (they read only the level being searched, so deferring the
// links below changes no choice); (2) its own links at every level; (3) bottom-up, its id written into its
// neighbours' lists, the only step that makes it reachable. Linking level by level from the top, as the paper
// writes it, published the node at an upper level while its level-0 list was still empty: a search descending
// through it saw one result and k - 1 empty slots.
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
  const int top = std::min(level, max_level);
  std::vector<std::vector<DistId>> chosen(static_cast<std::size_t>(top) + 1);
  for (int l = top; l >= 0; --l) {
    std::vector<DistId> found = search_layer(q, cur, config_.ef_construction, l, false);
    // A concurrent insert may already have linked this node at this level; never link a node to itself.
    found.erase(std::remove_if(found.begin(), found.end(), [id](const DistId& d) { return d.second == id; }),
                found.end());
    if (found.empty()) continue;
    cur = found.front().second;
    select_neighbours(found, config_.M);
    chosen[static_cast<std::size_t>(l)] = std::move(found);
  }
  for (int l = 0; l <= top; ++l) link_out(id, chosen[static_cast<std::size_t>(l)], l);
  for (int l = 0; l <= top; ++l) link_back(id, chosen[static_cast<std::size_t>(l)], l);
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
  const std::size_t dim = config_.dim;
  for (std::size_t i = 0; i < n; ++i) {
    const std::string problem = vector_problem(queries + i * dim, dim, config_.metric == Metric::cosine);
    if (!problem.empty()) throw std::invalid_argument("queries[" + std::to_string(i) + "] " + problem);
  }
  if (k == 0) return;  // an empty index: the caller sized its results min(k, size()) = 0
  std::shared_lock<std::shared_mutex> shared(grow_mutex_);
  const bool normalise = config_.metric == Metric::cosine;
  parallel_for(n, num_threads, 4, [&](std::size_t i) {
    const float* q = queries + i * dim;
    std::vector<float> unit;
    if (normalise) {
      unit.resize(dim);
      normalise_into(q, dim, unit.data(), kernels_.dot);
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

}  // namespace certrag
