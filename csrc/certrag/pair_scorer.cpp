#include "certrag/pair_scorer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "certrag/parallel.h"

#if defined(__x86_64__) || defined(_M_X64)
#define CERTRAG_X86 1
#include <immintrin.h>
#endif

namespace certrag {
namespace {

constexpr std::uint32_t kMaxDim = 65536;
constexpr std::uint32_t kMaxHidden = 65536;

inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// Round-to-nearest-even float32 -> bfloat16 (inputs are finite: checked before scoring).
inline std::uint16_t to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

inline std::uint32_t bf16_pair(float even, float odd) {
  return static_cast<std::uint32_t>(to_bf16(even)) | (static_cast<std::uint32_t>(to_bf16(odd)) << 16);
}

}  // namespace

std::string PairHeadWeights::validate() const {
  if (dim < 1 || dim > kMaxDim) return "dim must be between 1 and " + std::to_string(kMaxDim);
  if (hidden < 1 || hidden > kMaxHidden) return "hidden must be between 1 and " + std::to_string(kMaxHidden);
  if (!w1 || !b1 || !w2) return "w1, b1 and w2 are required";
  const std::size_t n1 = static_cast<std::size_t>(hidden) * 4 * dim;
  for (std::size_t i = 0; i < n1; ++i)
    if (!std::isfinite(w1[i])) return "w1 holds a NaN or infinite value";
  for (std::size_t i = 0; i < hidden; ++i)
    if (!std::isfinite(b1[i]) || !std::isfinite(w2[i])) return "b1 or w2 holds a NaN or infinite value";
  if (!std::isfinite(b2)) return "b2 is not finite";
  return "";
}

bool cpu_supports_bf16() {
#ifdef CERTRAG_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

PairScorer::PairScorer(const PairHeadWeights& w, SimdLevel level, PairPrecision precision)
    : dim_(w.dim), hidden_(w.hidden), level_(level), precision_(precision), b2_(w.b2) {
  const std::string problem = w.validate();
  if (!problem.empty()) throw std::invalid_argument(problem);
  if (!cpu_supports(level)) throw std::invalid_argument(std::string("this CPU does not support ") + simd_level_name(level));
  if (precision_ == PairPrecision::bfloat16) {
    if (!cpu_supports_bf16()) throw std::invalid_argument("the bfloat16 path needs a CPU with AVX512_BF16");
    level_ = SimdLevel::avx512;
  }
  switch (level_) {
    case SimdLevel::avx512:
      mr_ = 8;
      nr_ = 48;
      break;
    case SimdLevel::avx2:
      mr_ = 4;
      nr_ = 24;
      break;
    default:
      mr_ = 1;
      nr_ = 1;
  }
  const std::size_t d = dim_, H = hidden_, K = 3 * d;
  folded_.assign(H * K, 0.f);
  for (std::size_t h = 0; h < H; ++h) {
    const float* row = w.w1 + h * 4 * d;
    float* f = folded_.data() + h * K;
    for (std::size_t j = 0; j < d; ++j) {
      f[j] = row[j] + row[2 * d + j];          // Wa + Wc
      f[d + j] = row[d + j] - row[2 * d + j];  // Wb - Wc
      f[2 * d + j] = row[3 * d + j];           // Wd
    }
  }
  tiles_ = (H + mr_ - 1) / mr_;
  b1_.assign(tiles_ * mr_, 0.f);
  w2_.assign(tiles_ * mr_, 0.f);
  std::copy(w.b1, w.b1 + H, b1_.begin());
  std::copy(w.w2, w.w2 + H, w2_.begin());
  if (precision_ == PairPrecision::bfloat16) {
    k_pairs_ = (K + 1) / 2;
    packed_bf16_.assign(tiles_ * k_pairs_ * mr_, 0u);
    for (std::size_t t = 0; t < tiles_; ++t)
      for (std::size_t kp = 0; kp < k_pairs_; ++kp)
        for (std::size_t r = 0; r < mr_; ++r) {
          const std::size_t h = t * mr_ + r;
          if (h >= H) continue;
          const float even = folded_[h * K + 2 * kp];
          const float odd = 2 * kp + 1 < K ? folded_[h * K + 2 * kp + 1] : 0.f;
          packed_bf16_[(t * k_pairs_ + kp) * mr_ + r] = bf16_pair(even, odd);
        }
  } else if (level_ != SimdLevel::scalar) {
    packed_.assign(tiles_ * K * mr_, 0.f);
    for (std::size_t t = 0; t < tiles_; ++t)
      for (std::size_t k = 0; k < K; ++k)
        for (std::size_t r = 0; r < mr_; ++r) {
          const std::size_t h = t * mr_ + r;
          packed_[(t * K + k) * mr_ + r] = h < H ? folded_[h * K + k] : 0.f;
        }
  }
}

// Panel layout: K = 3d rows of nr floats. Rows [0, d) hold x_i, rows [d, 2d) hold x_{i+1}, rows [2d, 3d) hold
// x_i * x_{i+1}, column c for pair first + c; columns past count are zero.
void PairScorer::pack_panel(const float* x, std::size_t first, std::size_t count, std::size_t nr, float* panel) const {
  const std::size_t d = dim_;
  if (count < nr) {
    for (std::size_t k = 0; k < 3 * d; ++k) std::fill(panel + k * nr + count, panel + (k + 1) * nr, 0.f);
  }
  for (std::size_t c = 0; c < count; ++c) {
    const float* a = x + (first + c) * d;
    const float* b = a + d;
    for (std::size_t j = 0; j < d; ++j) {
      panel[j * nr + c] = a[j];
      panel[(d + j) * nr + c] = b[j];
      panel[(2 * d + j) * nr + c] = a[j] * b[j];
    }
  }
}

void PairScorer::run_block_scalar(const float* x, std::size_t first, std::size_t count, float* out) const {
  const std::size_t d = dim_, K = 3 * d;
  std::vector<float> f(K);
  for (std::size_t c = 0; c < count; ++c) {
    const float* a = x + (first + c) * d;
    const float* b = a + d;
    for (std::size_t j = 0; j < d; ++j) {
      f[j] = a[j];
      f[d + j] = b[j];
      f[2 * d + j] = a[j] * b[j];
    }
    float logit = b2_;
    for (std::size_t h = 0; h < hidden_; ++h) {
      const float* wrow = folded_.data() + h * K;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      std::size_t k = 0;
      for (; k + 4 <= K; k += 4) {
        s0 += wrow[k] * f[k];
        s1 += wrow[k + 1] * f[k + 1];
        s2 += wrow[k + 2] * f[k + 2];
        s3 += wrow[k + 3] * f[k + 3];
      }
      for (; k < K; ++k) s0 += wrow[k] * f[k];
      const float pre = (s0 + s1) + (s2 + s3) + b1_[h];
      logit += w2_[h] * std::max(pre, 0.f);
    }
    out[c] = sigmoid(logit);
  }
}

#ifdef CERTRAG_X86

namespace {

// One register tile of 8 hidden units x 48 pairs: relu(acc + b1) weighted by w2, added into the pairs' logits.
// Shared by the float32 and bfloat16 AVX-512 kernels; always inlined so the arrays stay in registers.
__attribute__((target("avx512f"), always_inline)) inline void tile_epilogue_avx512(const __m512 (&acc)[8][3],
                                                                                  const float* b1, const float* w2,
                                                                                  __m512 (&logit)[3]) {
  const __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (std::size_t r = 0; r < 8; ++r) {
    const __m512 bias = _mm512_set1_ps(b1[r]);
    const __m512 out_w = _mm512_set1_ps(w2[r]);
#pragma GCC unroll 3
    for (std::size_t v = 0; v < 3; ++v)
      logit[v] = _mm512_fmadd_ps(_mm512_max_ps(_mm512_add_ps(acc[r][v], bias), zero), out_w, logit[v]);
  }
}

__attribute__((target("avx512f"), always_inline)) inline void store_probabilities_avx512(const __m512 (&logit)[3],
                                                                                        std::size_t count,
                                                                                        float* out) {
  alignas(64) float z[48];
  for (std::size_t v = 0; v < 3; ++v) _mm512_store_ps(z + 16 * v, logit[v]);
  for (std::size_t c = 0; c < count; ++c) out[c] = sigmoid(z[c]);
}

}  // namespace

__attribute__((target("avx512f"))) void PairScorer::run_block_avx512(const float* x, std::size_t first,
                                                                      std::size_t count, float* panel,
                                                                      float* out) const {
  constexpr std::size_t MR = 8, NV = 3, NR = 48;
  const std::size_t K = 3 * static_cast<std::size_t>(dim_);
  pack_panel(x, first, count, NR, panel);
  __m512 logit[NV];
  for (std::size_t v = 0; v < NV; ++v) logit[v] = _mm512_set1_ps(b2_);
  for (std::size_t t = 0; t < tiles_; ++t) {
    const float* w = packed_.data() + t * K * MR;
    __m512 acc[MR][NV];
#pragma GCC unroll 8
    for (std::size_t r = 0; r < MR; ++r)
#pragma GCC unroll 3
      for (std::size_t v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    const float* f = panel;
    for (std::size_t k = 0; k < K; ++k, f += NR, w += MR) {
      const __m512 f0 = _mm512_loadu_ps(f), f1 = _mm512_loadu_ps(f + 16), f2 = _mm512_loadu_ps(f + 32);
#pragma GCC unroll 8
      for (std::size_t r = 0; r < MR; ++r) {
        const __m512 wr = _mm512_set1_ps(w[r]);
        acc[r][0] = _mm512_fmadd_ps(wr, f0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(wr, f1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(wr, f2, acc[r][2]);
      }
    }
    tile_epilogue_avx512(acc, b1_.data() + t * MR, w2_.data() + t * MR, logit);
  }
  store_probabilities_avx512(logit, count, out);
}

__attribute__((target("avx2,fma"))) void PairScorer::run_block_avx2(const float* x, std::size_t first,
                                                                    std::size_t count, float* panel,
                                                                    float* out) const {
  constexpr std::size_t MR = 4, NV = 3, NR = 24;
  const std::size_t K = 3 * static_cast<std::size_t>(dim_);
  pack_panel(x, first, count, NR, panel);
  __m256 logit[NV];
  for (std::size_t v = 0; v < NV; ++v) logit[v] = _mm256_set1_ps(b2_);
  for (std::size_t t = 0; t < tiles_; ++t) {
    const float* w = packed_.data() + t * K * MR;
    __m256 acc[MR][NV];
#pragma GCC unroll 4
    for (std::size_t r = 0; r < MR; ++r)
#pragma GCC unroll 3
      for (std::size_t v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
    const float* f = panel;
    for (std::size_t k = 0; k < K; ++k, f += NR, w += MR) {
      const __m256 f0 = _mm256_loadu_ps(f), f1 = _mm256_loadu_ps(f + 8), f2 = _mm256_loadu_ps(f + 16);
#pragma GCC unroll 4
      for (std::size_t r = 0; r < MR; ++r) {
        const __m256 wr = _mm256_broadcast_ss(w + r);
        acc[r][0] = _mm256_fmadd_ps(wr, f0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(wr, f1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(wr, f2, acc[r][2]);
      }
    }
    const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (std::size_t r = 0; r < MR; ++r) {
      const __m256 bias = _mm256_set1_ps(b1_[t * MR + r]);
      const __m256 out_w = _mm256_set1_ps(w2_[t * MR + r]);
#pragma GCC unroll 3
      for (std::size_t v = 0; v < NV; ++v)
        logit[v] = _mm256_fmadd_ps(_mm256_max_ps(_mm256_add_ps(acc[r][v], bias), zero), out_w, logit[v]);
    }
  }
  alignas(32) float z[NR];
  for (std::size_t v = 0; v < NV; ++v) _mm256_store_ps(z + 8 * v, logit[v]);
  for (std::size_t c = 0; c < count; ++c) out[c] = sigmoid(z[c]);
}

// The bfloat16 panel holds, per pair of consecutive features (k, k+1) and per column, one 32-bit word of two
// bfloat16 values; vdpbf16ps multiplies word by word and adds both products into a float32 lane.
__attribute__((target("avx512f,avx512bf16"))) void PairScorer::run_block_bf16(const float* x, std::size_t first,
                                                                              std::size_t count,
                                                                              std::uint32_t* panel,
                                                                              float* out) const {
  constexpr std::size_t MR = 8, NV = 3, NR = 48;
  const std::size_t d = dim_, K = 3 * d, KP = k_pairs_;
  const std::size_t kpad = (K + 31) / 32 * 32;
  // Scratch after the panel: one feature row in float32 and the same row in bfloat16. In natural order the
  // bfloat16 row read as 32-bit words is exactly the (k even, k odd) pairs that vdpbf16ps wants.
  float* row = reinterpret_cast<float*>(panel + KP * NR);
  std::uint32_t* words = panel + KP * NR + kpad;
  if (count < NR) std::memset(panel, 0, KP * NR * sizeof(std::uint32_t));
  for (std::size_t k = K; k < kpad; ++k) row[k] = 0.f;
  for (std::size_t c = 0; c < count; ++c) {
    const float* a = x + (first + c) * d;
    const float* b = a + d;
    for (std::size_t j = 0; j < d; ++j) {
      row[j] = a[j];
      row[d + j] = b[j];
      row[2 * d + j] = a[j] * b[j];
    }
    for (std::size_t k = 0; k < kpad; k += 32) {
      const __m512bh bf = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(row + k));
      _mm512_storeu_si512(words + k / 2, (__m512i)bf);
    }
    for (std::size_t kp = 0; kp < KP; ++kp) panel[kp * NR + c] = words[kp];
  }
  __m512 logit[NV];
  for (std::size_t v = 0; v < NV; ++v) logit[v] = _mm512_set1_ps(b2_);
  for (std::size_t t = 0; t < tiles_; ++t) {
    const std::uint32_t* w = packed_bf16_.data() + t * KP * MR;
    __m512 acc[MR][NV];
#pragma GCC unroll 8
    for (std::size_t r = 0; r < MR; ++r)
#pragma GCC unroll 3
      for (std::size_t v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    const std::uint32_t* f = panel;
    for (std::size_t kp = 0; kp < KP; ++kp, f += NR, w += MR) {
      const __m512bh f0 = (__m512bh)_mm512_loadu_si512(f);
      const __m512bh f1 = (__m512bh)_mm512_loadu_si512(f + 16);
      const __m512bh f2 = (__m512bh)_mm512_loadu_si512(f + 32);
#pragma GCC unroll 8
      for (std::size_t r = 0; r < MR; ++r) {
        const __m512bh wr = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[r]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wr, f0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], wr, f1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], wr, f2);
      }
    }
    tile_epilogue_avx512(acc, b1_.data() + t * MR, w2_.data() + t * MR, logit);
  }
  store_probabilities_avx512(logit, count, out);
}

#else

void PairScorer::run_block_bf16(const float*, std::size_t, std::size_t, std::uint32_t*, float*) const {
  throw std::logic_error("bfloat16 kernel not compiled");
}
void PairScorer::run_block_avx512(const float*, std::size_t, std::size_t, float*, float*) const {
  throw std::logic_error("AVX-512 kernel not compiled");
}
void PairScorer::run_block_avx2(const float*, std::size_t, std::size_t, float*, float*) const {
  throw std::logic_error("AVX2 kernel not compiled");
}

#endif

void PairScorer::score_adjacent(std::size_t n, const float* x, float* out, int num_threads) const {
  const std::size_t d = dim_;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j)
      if (!std::isfinite(x[i * d + j]))
        throw std::invalid_argument("embeddings[" + std::to_string(i) + "] holds a NaN or infinite value");
  if (n < 2) return;
  const std::size_t pairs = n - 1;
  const std::size_t blocks = (pairs + nr_ - 1) / nr_;
  const std::size_t panel_floats = 3 * d * nr_;
  const unsigned workers = workers_for(blocks, num_threads, 1);
  std::vector<std::unique_ptr<float[]>> panels(workers);
  std::vector<std::unique_ptr<std::uint32_t[]>> panels_bf16(workers);
  if (precision_ == PairPrecision::bfloat16) {
    const std::size_t kpad = (3 * static_cast<std::size_t>(dim_) + 31) / 32 * 32;
    for (auto& p : panels_bf16) p.reset(new std::uint32_t[k_pairs_ * nr_ + kpad + kpad / 2 + 16]);
  } else if (level_ != SimdLevel::scalar) {
    for (auto& p : panels) p.reset(new float[panel_floats]);
  }
  parallel_for_workers(blocks, num_threads, 1, [&](std::size_t b, unsigned worker) {
    float* panel = panels[worker].get();
    const std::size_t first = b * nr_;
    const std::size_t count = std::min(nr_, pairs - first);
    if (precision_ == PairPrecision::bfloat16) {
      run_block_bf16(x, first, count, panels_bf16[worker].get(), out + first);
      return;
    }
    switch (level_) {
      case SimdLevel::avx512:
        run_block_avx512(x, first, count, panel, out + first);
        break;
      case SimdLevel::avx2:
        run_block_avx2(x, first, count, panel, out + first);
        break;
      default:
        run_block_scalar(x, first, count, out + first);
    }
  });
}

}  // namespace certrag
