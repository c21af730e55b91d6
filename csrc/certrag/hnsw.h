// Hierarchical Navigable Small World graph index (Malkov & Yashunin, 2018, arXiv:1603.09320), float32.
//
// Thread-safety contract:
//   - search() may run from any number of threads at once, and at the same time as add() and remove().
//   - add() may run from several threads at once; each call also parallelises its own batch.
//   - A search running while an add is in flight sees each new vector either fully or not at all; it may miss a
//     vector whose links are still being written, never returns a half-written one, and never crashes.
//   - remove() marks vectors deleted: they stop appearing in results but stay in the graph as waypoints, as in hnswlib.
//   - save() waits for in-flight adds and searches, writes a consistent snapshot, and blocks new ones meanwhile; the
//     same holds for an add() that must grow the storage (rare: capacity grows geometrically).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "certrag/distance.h"

namespace certrag {

enum class Metric : std::uint32_t {
  ip = 0,      // score = <q, x>
  l2 = 1,      // score = -||q - x||^2 (higher is better, like the others)
  cosine = 2,  // vectors and queries are normalised on the way in; score = cos(q, x)
};

const char* metric_name(Metric metric);

struct HnswConfig {
  std::uint32_t dim = 0;               // vector dimension
  Metric metric = Metric::ip;          //
  std::uint32_t M = 16;                // M: links per node on layers >= 1; layer 0 keeps up to Mmax0 = 2M
  std::uint32_t ef_construction = 200; // efConstruction: candidate list size while inserting
  std::uint64_t seed = 0;              // seeds the level draw, floor(-ln(U) * mL) with mL = 1 / ln(M)

  // Empty when valid, else a message naming the field.
  std::string validate() const;
};

// Raised by load() for a file that is not a valid certrag index: truncated, corrupted, foreign or too new.
class IndexFormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Raised by save() and load() when the file system refuses (a missing folder, no permission, a full disk).
class IndexIoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Under ip and l2, vectors and queries whose L2 norm exceeds this are refused: below it every score (|q.x| <=
// |q||x| <= 1e36, |q - x|^2 <= 4e36) stays finite in float32. Under cosine every non-zero finite vector is accepted:
// it is scaled before it is normalised, so its norm never overflows.
constexpr double kMaxNorm = 1e18;

struct HnswStats {
  std::size_t nodes = 0;       // vectors in the graph, deleted ones included
  std::size_t live = 0;        // vectors that searches can return
  std::size_t deleted = 0;
  std::size_t capacity = 0;
  int max_level = -1;
  std::vector<std::size_t> nodes_per_level;  // nodes whose top level is at least l
  double mean_degree_level0 = 0.0;
  std::size_t memory_bytes = 0;
  bool mmapped = false;
};

class HnswIndex {
 public:
  static constexpr std::uint32_t kFormatVersion = 1;

  explicit HnswIndex(const HnswConfig& config);
  ~HnswIndex();
  HnswIndex(const HnswIndex&) = delete;
  HnswIndex& operator=(const HnswIndex&) = delete;

  // Adds n vectors (row-major, n x dim) under the given labels. All-or-nothing with respect to validation: a
  // non-finite value, a zero vector under the cosine metric, a norm above kMaxNorm under ip or l2, a negative label,
  // a label repeated in the batch or already live in the index throws std::invalid_argument before anything
  // changes.
  void add(std::size_t n, const float* vectors, const std::int64_t* labels, int num_threads);

  // For each of n queries writes the k best labels and scores, best first; rows with fewer than k results are padded
  // with label -1 and score -inf. ef is the search breadth (raised to k if smaller). Callers size k by size(): k
  // above the live count only pads (the binding passes min(k, size())); k = 0 checks the queries and writes nothing.
  void search(std::size_t n, const float* queries, std::size_t k, std::size_t ef, int num_threads,
              std::int64_t* out_labels, float* out_scores) const;

  // Marks the labels deleted; returns how many were live. Unknown labels are ignored.
  std::size_t remove(std::size_t n, const std::int64_t* labels);

  // Copies the stored vectors of n labels into out (n x dim); throws std::invalid_argument for a label not live.
  // Under the cosine metric these are the normalised vectors.
  void get_vectors(std::size_t n, const std::int64_t* labels, float* out) const;

  bool contains(std::int64_t label) const;
  std::size_t size() const;               // live vectors
  std::int64_t max_label() const;         // -1 when no label was ever added
  std::vector<std::int64_t> labels() const;  // live labels in insertion order
  const HnswConfig& config() const { return config_; }
  HnswStats stats() const;

  // Atomic: writes path + ".tmp-<pid>-<n>", fsyncs it, renames it over path, fsyncs the directory.
  void save(const std::string& path) const;
  // Validates the whole file (header, checksums, every offset, level and neighbour id) before using any of it.
  // With use_mmap the level-0 block (links and vectors) is mapped read-only instead of copied; the first add()
  // copies it into memory.
  static std::unique_ptr<HnswIndex> load(const std::string& path, bool use_mmap);

 private:
  struct Neighbours;
  class VisitedPool;

  using DistId = std::pair<float, std::uint32_t>;

  float distance(const float* a, const float* b) const;
  const float* vector_of(std::uint32_t id) const;
  std::uint32_t* links0_of(std::uint32_t id) const;
  std::uint32_t* links_of(std::uint32_t id, int level) const;
  std::size_t max_links(int level) const { return level == 0 ? M0_ : config_.M; }

  int draw_level();
  void reserve_locked(std::size_t capacity);
  void materialise_locked();
  void insert(std::uint32_t id, int level);
  std::uint32_t greedy_descent(const float* q, std::uint32_t entry, int from_level, int to_level) const;
  std::vector<DistId> search_layer(const float* q, std::uint32_t entry, std::size_t ef, int level,
                                   bool skip_deleted) const;
  void select_neighbours(std::vector<DistId>& candidates, std::size_t m) const;
  void link_out(std::uint32_t id, const std::vector<DistId>& neighbours, int level);   // the node's own list
  void link_back(std::uint32_t id, const std::vector<DistId>& neighbours, int level);  // into its neighbours' lists
  void search_one(const float* q, std::size_t k, std::size_t ef, std::int64_t* out_labels, float* out_scores) const;
  bool is_deleted(std::uint32_t id) const;
  void prefetch_vector(std::uint32_t id) const;
  std::mutex& link_lock(std::uint32_t id) const { return link_locks_[id & (kLinkLocks - 1)]; }

  static constexpr std::uint32_t kNone = 0xFFFFFFFFu;
  static constexpr std::size_t kLinkLocks = 4096;
  static constexpr std::uint32_t kPrefetchAhead = 2;   // vectors prefetched ahead of the one being scored
  static constexpr std::size_t kPrefetchBytes = 512;   // leading bytes of each prefetched vector

  HnswConfig config_;
  std::size_t M0_;
  double level_mult_;
  std::size_t stride0_;       // bytes per node in the level-0 block: [count][M0 ids][dim floats]
  std::size_t vec_offset_;    // byte offset of the vector inside a level-0 record
  DistanceKernels kernels_;

  // Storage. Reallocated only under an exclusive grow_mutex_.
  std::size_t capacity_ = 0;
  char* data0_ = nullptr;
  std::unique_ptr<char[]> owned0_;
  void* map_base_ = nullptr;
  std::size_t map_size_ = 0;
  std::vector<std::unique_ptr<std::uint32_t[]>> upper_;  // per node: level * (M + 1) words, null when level == 0
  std::vector<std::int32_t> levels_;
  std::vector<std::int64_t> labels_;
  std::unique_ptr<std::atomic<std::uint8_t>[]> deleted_;

  std::atomic<std::size_t> count_{0};
  std::atomic<std::size_t> deleted_count_{0};
  std::uint32_t entry_ = kNone;
  int max_level_ = -1;
  std::mt19937_64 rng_;

  std::unordered_map<std::int64_t, std::uint32_t> label_to_id_;
  std::int64_t max_label_ = -1;

  mutable std::shared_mutex grow_mutex_;  // shared: add/search/remove; exclusive: grow, save
  mutable std::mutex label_mutex_;        // label_to_id_, labels_, rng_, count_ updates
  mutable std::mutex entry_mutex_;        // entry_, max_level_
  mutable std::unique_ptr<std::mutex[]> link_locks_;
  std::unique_ptr<VisitedPool> visited_;
};

}  // namespace certrag
