#include "certrag/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "certrag/distance.h"
#include "certrag/worker_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#define CERTRAG_X86 1
#include <immintrin.h>
#endif

namespace certrag {
namespace {

float dot_scalar(const float* a, const float* b, std::size_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void axpy_scalar(float w, const float* x, float* y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] += w * x[i];
}

#ifdef CERTRAG_X86
// e^x for x <= 0 (softmax arguments after the max is taken off): x = n ln2 + r with |r| <= ln2 / 2, e^r by a
// degree-6 polynomial (Cephes' expf coefficients; about 1 ulp), times 2^n built in the exponent bits. Arguments below
// -87 give 0. One set of constants for both vector widths.
constexpr float kExpMin = -87.33654f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// 16 lanes.
__attribute__((target("avx512f"))) inline __m512 exp_avx512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpMin);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[1]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[2]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[3]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[4]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[5]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// The AVX-512 form of one_head for head_dim a multiple of 16 (up to 256): a key is loaded once for every query
// head of its group; four keys' dot products are reduced together; the weighted values are summed in registers.
__attribute__((target("avx512f"))) void one_head_avx512(std::size_t D, std::size_t group, std::size_t n,
                                                        const float* qh0, const float* K, const float* V,
                                                        float scale, float* w, float* out) {
  const std::size_t C = D / 16;
  for (std::size_t g = 0; g < group; ++g) {
    const float* qh = qh0 + g * D;
    __m512 qv[16];
    for (std::size_t c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qh + c * 16);
    float* wg = w + g * n;
    std::size_t t = 0;
    for (; t + 4 <= n; t += 4) {
      __m512 a[4];
      for (int u = 0; u < 4; ++u) {
        const float* k = K + (t + u) * D;
        a[u] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (std::size_t c = 1; c < C; ++c) a[u] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * 16), a[u]);
      }
      // four horizontal sums at once: fold 512 -> 256 -> 128 bits per vector, then transpose-add the four
      __m256 h[4];
      for (int u = 0; u < 4; ++u)
        h[u] = _mm256_add_ps(_mm512_castps512_ps256(a[u]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[u]), 1)));
      __m128 f[4];
      for (int u = 0; u < 4; ++u) f[u] = _mm_add_ps(_mm256_castps256_ps128(h[u]), _mm256_extractf128_ps(h[u], 1));
      const __m128 s01 = _mm_hadd_ps(f[0], f[1]), s23 = _mm_hadd_ps(f[2], f[3]);
      _mm_storeu_ps(wg + t, _mm_mul_ps(_mm_hadd_ps(s01, s23), _mm_set1_ps(scale)));
    }
    for (; t < n; ++t) {
      const float* k = K + t * D;
      __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
      for (std::size_t c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * 16), a);
      wg[t] = _mm512_reduce_add_ps(a) * scale;
    }
    // softmax over the n scores
    __m512 mx = _mm512_set1_ps(-INFINITY);
    t = 0;
    for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(wg + t));
    float m = _mm512_reduce_max_ps(mx);
    for (; t < n; ++t) m = std::max(m, wg[t]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    t = 0;
    for (; t + 16 <= n; t += 16) {
      const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(wg + t), mv));
      _mm512_storeu_ps(wg + t, e);
      sv = _mm512_add_ps(sv, e);
    }
    if (t < n) {
      const __mmask16 km = static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(km, wg + t), mv));
      _mm512_mask_storeu_ps(wg + t, km, e);
      sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(km, e));
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sv));
    t = 0;
    for (; t + 16 <= n; t += 16) _mm512_storeu_ps(wg + t, _mm512_mul_ps(_mm512_loadu_ps(wg + t), inv));
    if (t < n) {
      const __mmask16 km = static_cast<__mmask16>((1u << (n - t)) - 1);
      _mm512_mask_storeu_ps(wg + t, km, _mm512_mul_ps(_mm512_maskz_loadu_ps(km, wg + t), inv));
    }
    // weights times values, the output in registers
    __m512 o[16];
    for (std::size_t c = 0; c < C; ++c) o[c] = _mm512_setzero_ps();
    for (t = 0; t < n; ++t) {
      const __m512 wt = _mm512_set1_ps(wg[t]);
      const float* v = V + t * D;
      for (std::size_t c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(v + c * 16), o[c]);
    }
    for (std::size_t c = 0; c < C; ++c) _mm512_storeu_ps(out + g * D + c * 16, o[c]);
  }
}

// The same e^x over 8 lanes (AVX2 + FMA).
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpMin);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[1]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[2]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[3]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[4]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[5]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  __m128 f = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  f = _mm_hadd_ps(f, f);
  return _mm_cvtss_f32(_mm_hadd_ps(f, f));
}

// The lanes of a tail of m < 8 floats: all bits set for the first m.
__attribute__((target("avx2,fma"))) inline __m256i tail_mask(std::size_t m) {
  static const std::int32_t bits[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 8 - m));
}

// The AVX2 form of one_head for head_dim a multiple of 8 (up to 256), the AVX-512 form's steps on 8 lanes: a key is
// loaded once per query head, four keys' dot products are reduced together, the weighted values summed in
// registers. CPUs without AVX-512 (most desktop and many cloud x86 machines) ran the portable loop before.
__attribute__((target("avx2,fma"))) void one_head_avx2(std::size_t D, std::size_t group, std::size_t n,
                                                       const float* qh0, const float* K, const float* V,
                                                       float scale, float* w, float* out) {
  const std::size_t C = D / 8;
  for (std::size_t g = 0; g < group; ++g) {
    const float* qh = qh0 + g * D;
    __m256 qv[32];
    for (std::size_t c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(qh + c * 8);
    float* wg = w + g * n;
    std::size_t t = 0;
    for (; t + 4 <= n; t += 4) {
      __m128 f[4];
      for (int u = 0; u < 4; ++u) {
        const float* k = K + (t + u) * D;
        __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
        for (std::size_t c = 1; c < C; ++c) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k + c * 8), a);
        f[u] = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      }
      const __m128 s01 = _mm_hadd_ps(f[0], f[1]), s23 = _mm_hadd_ps(f[2], f[3]);
      _mm_storeu_ps(wg + t, _mm_mul_ps(_mm_hadd_ps(s01, s23), _mm_set1_ps(scale)));
    }
    for (; t < n; ++t) {
      const float* k = K + t * D;
      __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
      for (std::size_t c = 1; c < C; ++c) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k + c * 8), a);
      wg[t] = hsum_avx2(a) * scale;
    }
    // softmax over the n scores
    float m = -INFINITY;
    {
      __m256 mx = _mm256_set1_ps(-INFINITY);
      for (t = 0; t + 8 <= n; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(wg + t));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      for (float v : lanes) m = std::max(m, v);
      for (; t < n; ++t) m = std::max(m, wg[t]);
    }
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
      const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(wg + t), mv));
      _mm256_storeu_ps(wg + t, e);
      sv = _mm256_add_ps(sv, e);
    }
    if (t < n) {
      const __m256i km = tail_mask(n - t);
      const __m256 e = _mm256_and_ps(exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(wg + t, km), mv)),
                                     _mm256_castsi256_ps(km));
      _mm256_maskstore_ps(wg + t, km, e);
      sv = _mm256_add_ps(sv, e);
    }
    const __m256 inv = _mm256_set1_ps(1.f / hsum_avx2(sv));
    for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(wg + t, _mm256_mul_ps(_mm256_loadu_ps(wg + t), inv));
    if (t < n) {
      const __m256i km = tail_mask(n - t);
      _mm256_maskstore_ps(wg + t, km, _mm256_mul_ps(_mm256_maskload_ps(wg + t, km), inv));
    }
    // weights times values, the output in registers
    __m256 o[32];
    for (std::size_t c = 0; c < C; ++c) o[c] = _mm256_setzero_ps();
    for (t = 0; t < n; ++t) {
      const __m256 wt = _mm256_set1_ps(wg[t]);
      const float* v = V + t * D;
      for (std::size_t c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + c * 8), o[c]);
    }
    for (std::size_t c = 0; c < C; ++c) _mm256_storeu_ps(out + g * D + c * 8, o[c]);
  }
}

#endif

enum class Kernel { scalar, avx2, avx512 };

Kernel kernel_for(std::size_t D) {
#ifdef CERTRAG_X86
  static const SimdLevel level = distance_kernels().level;  // the CPU's best, capped by CERTRAG_SIMD
  if (level == SimdLevel::avx512 && D % 16 == 0 && D <= 256) return Kernel::avx512;
  if (level >= SimdLevel::avx2 && D % 8 == 0 && D <= 256) return Kernel::avx2;
#endif
  return Kernel::scalar;
}

// Portable form: the same steps one score at a time.
void one_head_scalar(std::size_t D, std::size_t group, std::size_t n, const float* qh0, const float* K,
                     const float* V, float scale, float* w, float* out) {
  for (std::size_t g = 0; g < group; ++g) {
    const float* qh = qh0 + g * D;
    float* wg = w + g * n;
    float mx = -INFINITY;
    for (std::size_t t = 0; t < n; ++t) {
      wg[t] = dot_scalar(qh, K + t * D, D) * scale;
      mx = std::max(mx, wg[t]);
    }
    float sum = 0.f;
    for (std::size_t t = 0; t < n; ++t) {
      wg[t] = std::exp(wg[t] - mx);
      sum += wg[t];
    }
    const float inv = 1.f / sum;
    float* o = out + g * D;
    std::fill(o, o + D, 0.f);
    for (std::size_t t = 0; t < n; ++t) {
      wg[t] *= inv;
      axpy_scalar(wg[t], V + t * D, o, D);
    }
  }
}

// Row b, key-value head h: its query heads' scores, softmax, weighted values, and span masses.
void one_head(const AttentionShape& s, std::size_t b, std::size_t h, const float* q, const AttentionRow& row,
              float scale, float* out, std::vector<float>& w) {
  const std::size_t D = s.head_dim, n = row.length, group = s.heads / s.kv_heads;
  const float* K = row.k + h * row.capacity * D;
  const float* V = row.v + h * row.capacity * D;
  w.resize(group * n);
  const float* qh = q + (b * s.heads + h * group) * D;
  float* o = out + b * s.heads * D + h * group * D;
#ifdef CERTRAG_X86
  switch (kernel_for(D)) {
    case Kernel::avx512: one_head_avx512(D, group, n, qh, K, V, scale, w.data(), o); break;
    case Kernel::avx2: one_head_avx2(D, group, n, qh, K, V, scale, w.data(), o); break;
    default: one_head_scalar(D, group, n, qh, K, V, scale, w.data(), o);
  }
#else
  one_head_scalar(D, group, n, qh, K, V, scale, w.data(), o);
#endif
  for (std::size_t g = 0; g < group; ++g) {
    const std::size_t head = h * group + g;
    const float* wg = w.data() + g * n;
    for (std::size_t sp = 0; sp < row.n_spans; ++sp) {
      const std::int64_t a = std::max<std::int64_t>(0, row.spans[2 * sp]);
      const std::int64_t e = std::min<std::int64_t>(static_cast<std::int64_t>(n), row.spans[2 * sp + 1]);
      float m = 0.f;
      for (std::int64_t t = a; t < e; ++t) m += wg[t];
      row.masses[head * row.n_spans + sp] = m;
    }
  }
}

}  // namespace

const char* decode_attention_kernel(std::size_t head_dim) {
  switch (kernel_for(head_dim)) {
    case Kernel::avx512: return "avx512";
    case Kernel::avx2: return "avx2";
    default: return "scalar";
  }
}

void decode_attention(const AttentionShape& s, std::size_t B, const float* q, const float* k_new, const float* v_new,
                      const AttentionRow* rows, float scale, float* out, int num_threads) {
  const std::size_t D = s.head_dim;
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < s.kv_heads; ++h) {
      const std::size_t pos = rows[b].length - 1;
      std::memcpy(rows[b].k + (h * rows[b].capacity + pos) * D, k_new + (b * s.kv_heads + h) * D, D * sizeof(float));
      std::memcpy(rows[b].v + (h * rows[b].capacity + pos) * D, v_new + (b * s.kv_heads + h) * D, D * sizeof(float));
    }
  const std::size_t items = B * s.kv_heads;
  const unsigned parts = static_cast<unsigned>(std::min<std::size_t>(std::max(num_threads, 1), items));
  auto part = [&](unsigned p) {
    std::vector<float> w;
    for (std::size_t i = items * p / parts; i < items * (p + 1) / parts; ++i)
      one_head(s, i / s.kv_heads, i % s.kv_heads, q, rows[i / s.kv_heads], scale, out, w);
  };
  if (parts <= 1) {
    part(0);
    return;
  }
  WorkerPool::instance(parts).run(parts, part);
}

}  // namespace certrag
