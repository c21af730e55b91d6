#include "certrag/q8_matmul.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "certrag/parallel.h"
#include "certrag/worker_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#define CERTRAG_X86 1
#include <immintrin.h>
#endif

namespace certrag {
namespace {

constexpr std::size_t kRowsPerTask = 16;  // output columns (rows of W) a thread takes at a time

// Portable path: one output element at a time, eight partial sums per group so the compiler can vectorise without
// reassociating; the order is fixed per element.
void q8_rows_scalar(std::size_t M, std::size_t K, const float* x, const std::int8_t* q, const float* scales,
                    float* y, std::size_t N, std::size_t n0, std::size_t n1) {
  const std::size_t groups = K / kQ8Group;
  for (std::size_t n = n0; n < n1; ++n) {
    const std::int8_t* wrow = q + n * K;
    const float* srow = scales + n * groups;
    for (std::size_t m = 0; m < M; ++m) {
      const float* xrow = x + m * K;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (std::size_t g = 0; g < groups; ++g) {
        const float s = srow[g];
        const std::int8_t* wg = wrow + g * kQ8Group;
        const float* xg = xrow + g * kQ8Group;
        for (std::size_t i = 0; i < kQ8Group; i += 8)
          for (int j = 0; j < 8; ++j) acc[j] += (static_cast<float>(wg[i + j]) * s) * xg[i + j];
      }
      y[m * N + n] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
  }
}

#ifdef CERTRAG_X86

// A tile of MT rows of x by NT rows of W: each group's 32 weights are widened to float and scaled once per W row,
// then multiplied into every x row of the tile. One 16-lane accumulator per output element, reduced at the end.
template <int MT, int NT>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void q8_tile_avx512(
    std::size_t K, const float* x, std::size_t ldx, const std::int8_t* q, const float* scales, float* y,
    std::size_t ldy) {
  const std::size_t groups = K / kQ8Group;
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  for (std::size_t g = 0; g < groups; ++g) {
    __m512 wa[NT], wb[NT];
    for (int n = 0; n < NT; ++n) {
      const std::int8_t* wg = q + n * K + g * kQ8Group;
      const __m512 s = _mm512_set1_ps(scales[n * groups + g]);
      wa[n] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                reinterpret_cast<const __m128i*>(wg)))), s);
      wb[n] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                reinterpret_cast<const __m128i*>(wg + 16)))), s);
    }
    for (int m = 0; m < MT; ++m) {
      const float* xg = x + m * ldx + g * kQ8Group;
      const __m512 xa = _mm512_loadu_ps(xg), xb = _mm512_loadu_ps(xg + 16);
      for (int n = 0; n < NT; ++n) {
        acc[m][n] = _mm512_fmadd_ps(wa[n], xa, acc[m][n]);
        acc[m][n] = _mm512_fmadd_ps(wb[n], xb, acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m][n]);
}

// All W rows of [n0, n1) against MT rows of x, NT W rows at a time (then one at a time).
template <int MT, int NT>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void q8_block_avx512(
    std::size_t K, const float* x, const std::int8_t* q, const float* scales, float* y, std::size_t N,
    std::size_t n0, std::size_t n1) {
  const std::size_t groups = K / kQ8Group;
  std::size_t n = n0;
  for (; n + NT <= n1; n += NT) q8_tile_avx512<MT, NT>(K, x, K, q + n * K, scales + n * groups, y + n, N);
  for (; n < n1; ++n) q8_tile_avx512<MT, 1>(K, x, K, q + n * K, scales + n * groups, y + n, N);
}

// Rows of x go eight at a time, so a group's weights are widened once per eight rows. With one row of x the call
// is bound by reading W, which is read one row at a time: a single sequential stream is what the hardware
// prefetcher follows best (measured on a 2-core EPYC VM streaming a 136 MB matrix: 15-25 GB/s one row at a time,
// 5-10 GB/s with four or eight side by side). With more rows it is bound by the multiply-adds, and several W rows
// per tile let each load of x feed several of them; MT * NT <= 16 keeps every accumulator in a register.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void q8_rows_avx512(
    std::size_t M, std::size_t K, const float* x, const std::int8_t* q, const float* scales, float* y,
    std::size_t N, std::size_t n0, std::size_t n1) {
  for (std::size_t m0 = 0; m0 < M; m0 += 8) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (std::min<std::size_t>(8, M - m0)) {
      case 1: q8_block_avx512<1, 1>(K, xm, q, scales, ym, N, n0, n1); break;
      case 2: q8_block_avx512<2, 4>(K, xm, q, scales, ym, N, n0, n1); break;
      case 3: q8_block_avx512<3, 4>(K, xm, q, scales, ym, N, n0, n1); break;
      case 4: q8_block_avx512<4, 4>(K, xm, q, scales, ym, N, n0, n1); break;
      case 5: q8_block_avx512<5, 2>(K, xm, q, scales, ym, N, n0, n1); break;
      case 6: q8_block_avx512<6, 2>(K, xm, q, scales, ym, N, n0, n1); break;
      case 7: q8_block_avx512<7, 2>(K, xm, q, scales, ym, N, n0, n1); break;
      default: q8_block_avx512<8, 2>(K, xm, q, scales, ym, N, n0, n1); break;
    }
  }
}

template <int MT, int NT>
__attribute__((target("avx2,fma"))) inline void q8_tile_avx2(std::size_t K, const float* x, std::size_t ldx,
                                                             const std::int8_t* q, const float* scales, float* y,
                                                             std::size_t ldy) {
  const std::size_t groups = K / kQ8Group;
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  for (std::size_t g = 0; g < groups; ++g) {
    for (int part = 0; part < 4; ++part) {
      __m256 w[NT];
      for (int n = 0; n < NT; ++n) {
        const std::int8_t* wg = q + n * K + g * kQ8Group + part * 8;
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wg));
        w[n] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                             _mm256_set1_ps(scales[n * groups + g]));
      }
      for (int m = 0; m < MT; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * ldx + g * kQ8Group + part * 8);
        for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(w[n], xv, acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      const __m128 lo = _mm256_castps256_ps128(acc[m][n]), hi = _mm256_extractf128_ps(acc[m][n], 1);
      __m128 s = _mm_add_ps(lo, hi);
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      y[m * ldy + n] = _mm_cvtss_f32(s);
    }
}

template <int NT>
__attribute__((target("avx2,fma"))) void q8_cols_avx2(std::size_t M, std::size_t K, const float* x,
                                                      const std::int8_t* q, const float* scales, float* y,
                                                      std::size_t N) {
  std::size_t m = 0;
  for (; m + 2 <= M; m += 2) q8_tile_avx2<2, NT>(K, x + m * K, K, q, scales, y + m * N, N);
  for (; m < M; ++m) q8_tile_avx2<1, NT>(K, x + m * K, K, q, scales, y + m * N, N);
}

__attribute__((target("avx2,fma"))) void q8_rows_avx2(std::size_t M, std::size_t K, const float* x,
                                                      const std::int8_t* q, const float* scales, float* y,
                                                      std::size_t N, std::size_t n0, std::size_t n1) {
  const std::size_t groups = K / kQ8Group;
  std::size_t n = n0;
  for (; n + 4 <= n1; n += 4) q8_cols_avx2<4>(M, K, x, q + n * K, scales + n * groups, y + n, N);
  for (; n < n1; ++n) q8_cols_avx2<1>(M, K, x, q + n * K, scales + n * groups, y + n, N);
}

#endif  // CERTRAG_X86

using RowsFn = void (*)(std::size_t, std::size_t, const float*, const std::int8_t*, const float*, float*,
                        std::size_t, std::size_t, std::size_t);

RowsFn rows_for(SimdLevel level) {
  if (!cpu_supports(level))
    throw std::invalid_argument(std::string("this CPU does not support ") + simd_level_name(level));
#ifdef CERTRAG_X86
  if (level == SimdLevel::avx512) return q8_rows_avx512;
  if (level == SimdLevel::avx2) return q8_rows_avx2;
#endif
  return q8_rows_scalar;
}

void check_k(std::size_t K) {
  if (K == 0 || K % kQ8Group != 0)
    throw std::invalid_argument("K must be a positive multiple of " + std::to_string(kQ8Group) + "; got " +
                                std::to_string(K));
}

}  // namespace

void q8_matmul_at(SimdLevel level, std::size_t M, std::size_t N, std::size_t K, const float* x,
                  const std::int8_t* q, const float* scales, float* y, int num_threads) {
  check_k(K);
  const RowsFn rows = rows_for(level);
  if (M == 0 || N == 0) return;
  const std::size_t blocks = (N + kRowsPerTask - 1) / kRowsPerTask;
  const unsigned parts = static_cast<unsigned>(std::min<std::size_t>(std::max(num_threads, 1), blocks));
  // Each thread takes one contiguous range of W's rows (whole blocks of kRowsPerTask): one sequential stream per
  // thread, and the split never cuts an output element.
  auto part = [&](unsigned p) {
    const std::size_t b0 = blocks * p / parts, b1 = blocks * (p + 1) / parts;
    rows(M, K, x, q, scales, y, N, b0 * kRowsPerTask, std::min(N, b1 * kRowsPerTask));
  };
  if (parts <= 1) {
    part(0);
    return;
  }
  WorkerPool::instance(parts).run(parts, part);
}

void q8_matmul(std::size_t M, std::size_t N, std::size_t K, const float* x, const std::int8_t* q,
               const float* scales, float* y, int num_threads) {
  q8_matmul_at(distance_kernels().level, M, N, K, x, q, scales, y, num_threads);
}

void q8_quantize(std::size_t N, std::size_t K, const float* w, std::int8_t* q, float* scales, int num_threads) {
  check_k(K);
  const std::size_t groups = K / kQ8Group;
  parallel_for(N, num_threads, 64, [&](std::size_t n) {
    for (std::size_t g = 0; g < groups; ++g) {
      const float* src = w + n * K + g * kQ8Group;
      float amax = 0.f;
      for (std::size_t i = 0; i < kQ8Group; ++i) {
        if (!std::isfinite(src[i])) throw std::invalid_argument("weights must be finite");
        amax = std::max(amax, std::fabs(src[i]));
      }
      const float scale = amax / 127.f;
      scales[n * groups + g] = scale;
      std::int8_t* dst = q + n * K + g * kQ8Group;
      for (std::size_t i = 0; i < kQ8Group; ++i) {
        const float v = scale > 0.f ? std::nearbyint(src[i] / scale) : 0.f;
        dst[i] = static_cast<std::int8_t>(std::min(127.f, std::max(-127.f, v)));
      }
    }
  });
}

void q8_dequantize(std::size_t N, std::size_t K, const std::int8_t* q, const float* scales, float* w,
                   int num_threads) {
  check_k(K);
  const std::size_t groups = K / kQ8Group;
  parallel_for(N, num_threads, 64, [&](std::size_t n) {
    for (std::size_t g = 0; g < groups; ++g) {
      const float s = scales[n * groups + g];
      for (std::size_t i = 0; i < kQ8Group; ++i)
        w[n * K + g * kQ8Group + i] = static_cast<float>(q[n * K + g * kQ8Group + i]) * s;
    }
  });
}

}  // namespace certrag
