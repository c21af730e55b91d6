// Fused scorer for SAGE's segmentation head over adjacent sentence pairs.
//
// The head is p(x1, x2) = sigmoid(w2 . relu(W1 [x1, x2, x1 - x2, x1 * x2] + b1) + b2), with W1 of shape (H, 4d)
// split into four (H, d) blocks Wa, Wb, Wc, Wd. Since Wa x1 + Wb x2 + Wc (x1 - x2) = (Wa + Wc) x1 + (Wb - Wc) x2,
// the weights fold once into Wf = [Wa + Wc, Wb - Wc, Wd] of shape (H, 3d), and each pair needs only the 3d-long
// row [x_i, x_{i+1}, x_i * x_{i+1}]: a quarter less work than the unfused MLP, and the 4d feature row never exists.
//
// The kernel runs the product transposed: a block of NR pairs forms a packed (3d x NR) panel (built on the fly from
// the row-major embeddings), hidden units come MR at a time from the packed folded weights, and the epilogue applies
// b1, relu and w2 in registers and accumulates the output logit, so the (pairs x H) hidden matrix is never written.
// AVX-512 and AVX2+FMA kernels are compiled with target attributes and chosen at run time (see distance.h); a
// scalar kernel serves other CPUs. Thread-safety: score() is const and may run from many threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "certrag/distance.h"

namespace certrag {

struct PairHeadWeights {
  std::uint32_t dim = 0;     // d: sentence-embedding size
  std::uint32_t hidden = 0;  // H: hidden units of the head
  const float* w1 = nullptr; // (H, 4d) row-major, as torch.nn.Linear(4d, H).weight
  const float* b1 = nullptr; // (H)
  const float* w2 = nullptr; // (H), torch.nn.Linear(H, 1).weight flattened
  float b2 = 0.f;

  // Empty when valid, else a message naming the field.
  std::string validate() const;
};

// float32 is the default and matches the unfused float32 MLP within 1e-5. bfloat16 (opt-in, CPUs with
// AVX512_BF16) rounds the folded weights and the pair features to bfloat16 and accumulates in float32 with
// vdpbf16ps: about twice the arithmetic rate, at an error of order 1e-2 in probability (measured and tested).
enum class PairPrecision { float32 = 0, bfloat16 = 1 };

bool cpu_supports_bf16();

class PairScorer {
 public:
  // Folds and packs the weights (copies them: the caller's buffers may go away).
  explicit PairScorer(const PairHeadWeights& weights, SimdLevel level = distance_kernels().level,
                      PairPrecision precision = PairPrecision::float32);

  // x: n embeddings, row-major (n, dim). Writes n - 1 probabilities: out[i] = p(x_i, x_{i+1}). Non-finite input
  // raises std::invalid_argument naming the row.
  void score_adjacent(std::size_t n, const float* x, float* out, int num_threads) const;

  std::uint32_t dim() const { return dim_; }
  std::uint32_t hidden() const { return hidden_; }
  SimdLevel level() const { return level_; }
  PairPrecision precision() const { return precision_; }

 private:
  void run_block_scalar(const float* x, std::size_t first, std::size_t count, float* out) const;
  void run_block_avx2(const float* x, std::size_t first, std::size_t count, float* panel, float* out) const;
  void run_block_avx512(const float* x, std::size_t first, std::size_t count, float* panel, float* out) const;
  void run_block_bf16(const float* x, std::size_t first, std::size_t count, std::uint32_t* panel, float* out) const;
  void pack_panel(const float* x, std::size_t first, std::size_t count, std::size_t nr, float* panel) const;

  std::uint32_t dim_;
  std::uint32_t hidden_;
  SimdLevel level_;
  PairPrecision precision_;
  std::size_t k_pairs_ = 0;         // bfloat16: ceil(3d / 2) pairs of consecutive features
  std::vector<std::uint32_t> packed_bf16_;  // tiles x k_pairs x mr words, each two bfloat16 (k even, k odd)
  std::size_t mr_;                 // hidden units per register tile
  std::size_t nr_;                 // pairs per block (a multiple of the vector width)
  std::size_t tiles_;              // ceil(H / mr)
  std::vector<float> folded_;      // (H, 3d) row-major: the scalar kernel's weights
  std::vector<float> packed_;      // tiles x 3d x mr: broadcast order for the vector kernels
  std::vector<float> b1_, w2_;     // padded to tiles * mr with zeros
  float b2_;
};

}  // namespace certrag
