#include "certrag/q8_packed.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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

constexpr std::size_t kBlock = kQ8Tile * 4;             // bytes of one VNNI operand: 16 rows x 4 columns
constexpr std::size_t kBlocksPerGroup = kQ8Group / 4;  // 8
constexpr std::size_t kRowsAtOnce = 8;                  // rows of x per pass over a tile

// x's rows quantised: unsigned bytes (q + 128) and one scale per group; a group with a non-finite value gets a NaN
// scale, so every output of its row is NaN rather than a finite wrong number.
struct QuantisedX {
  std::vector<std::uint8_t> q;
  std::vector<float> scales;
};

void quantise_group(const float* src, std::uint8_t* dst, float* scale) {
  float amax = 0.f;
  bool finite = true;
  for (std::size_t i = 0; i < kQ8Group; ++i) {
    finite = finite && std::isfinite(src[i]);
    amax = std::max(amax, std::fabs(src[i]));
  }
  if (!finite) {
    *scale = std::numeric_limits<float>::quiet_NaN();
    std::fill(dst, dst + kQ8Group, std::uint8_t{128});
    return;
  }
  const float s = amax / 127.f;
  const float inv = s > 0.f ? 1.f / s : 0.f;
  *scale = s;
  for (std::size_t i = 0; i < kQ8Group; ++i) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(src[i] * inv)));
    dst[i] = static_cast<std::uint8_t>(static_cast<int>(v) + 128);
  }
}

#ifdef CERTRAG_X86
// The same quantisation 16 / 8 lanes at a time (the same operations: max of |x|, one float division per group, x
// times the inverse rounded to nearest even under the default rounding mode, clamped): equal bytes and scales.
__attribute__((target("avx512f,avx512bw"))) void quantise_group_avx512(const float* src, std::uint8_t* dst,
                                                                       float* scale) {
  const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
  // x - x is 0 for a finite x and NaN otherwise
  const __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), _mm512_setzero_ps(), _CMP_NEQ_UQ) |
                        _mm512_cmp_ps_mask(_mm512_sub_ps(b, b), _mm512_setzero_ps(), _CMP_NEQ_UQ);
  if (bad) {
    *scale = std::numeric_limits<float>::quiet_NaN();
    std::memset(dst, 128, kQ8Group);
    return;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float s = amax / 127.f;
  const float inv = s > 0.f ? 1.f / s : 0.f;
  *scale = s;
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
  // nearest even under the default rounding mode, as std::nearbyint; then clamped and offset
  const __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv)), rb = _mm512_cvtps_epi32(_mm512_mul_ps(b, iv));
  const __m512i qa = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(ra, lo), hi), off);
  const __m512i qb = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(rb, lo), hi), off);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qb));
}

__attribute__((target("avx2,fma"))) void quantise_group_avx2(const float* src, std::uint8_t* dst, float* scale) {
  __m256 v[4];
  __m256 bad = _mm256_setzero_ps(), mx = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v[i], v[i]), _mm256_setzero_ps(), _CMP_NEQ_UQ));
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  if (_mm256_movemask_ps(bad)) {
    *scale = std::numeric_limits<float>::quiet_NaN();
    std::memset(dst, 128, kQ8Group);
    return;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float amax = 0.f;
  for (float l : lanes) amax = std::max(amax, l);
  const float s = amax / 127.f;
  const float inv = s > 0.f ? 1.f / s : 0.f;
  *scale = s;
  const __m256 iv = _mm256_set1_ps(inv);
  alignas(32) std::int32_t q[kQ8Group];
  for (int i = 0; i < 4; ++i) {
    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i),
                       _mm256_min_epi32(_mm256_max_epi32(r, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127)));
  }
  for (std::size_t i = 0; i < kQ8Group; ++i) dst[i] = static_cast<std::uint8_t>(q[i] + 128);
}
#endif

QuantisedX quantise_x(Q8Path path, std::size_t M, std::size_t K, const float* x) {
  const std::size_t groups = K / kQ8Group;
  QuantisedX out{std::vector<std::uint8_t>(M * K), std::vector<float>(M * groups)};
  void (*fn)(const float*, std::uint8_t*, float*) = quantise_group;
#ifdef CERTRAG_X86
  if (path == Q8Path::vnni) fn = quantise_group_avx512;
  if (path == Q8Path::avx2) fn = quantise_group_avx2;
#else
  (void)path;
#endif
  for (std::size_t m = 0; m < M; ++m)
    for (std::size_t g = 0; g < groups; ++g)
      fn(x + m * K + g * kQ8Group, out.q.data() + m * K + g * kQ8Group, out.scales.data() + m * groups + g);
  return out;
}

// Portable path: the same integer sums and the same float operations as the VNNI path.
void tile_scalar(const Q8Packed& w, std::size_t t, std::size_t M, const std::uint8_t* xq, const float* xs,
                 float* y, std::size_t N) {
  const std::size_t K = w.k, groups = K / kQ8Group;
  const std::int8_t* wt = w.q.data() + t * kQ8Tile * K;
  for (std::size_t m = 0; m < M; ++m) {
    float acc[kQ8Tile] = {};
    for (std::size_t g = 0; g < groups; ++g) {
      const float* sw = w.scales.data() + (t * groups + g) * kQ8Tile;
      const std::uint8_t* xg = xq + m * K + g * kQ8Group;
      std::int32_t isum[kQ8Tile];
      for (std::size_t r = 0; r < kQ8Tile; ++r) isum[r] = 0;
      for (std::size_t j = 0; j < kBlocksPerGroup; ++j) {
        const std::int8_t* blk = wt + (g * kBlocksPerGroup + j) * kBlock;
        for (std::size_t r = 0; r < kQ8Tile; ++r)
          for (std::size_t b = 0; b < 4; ++b)
            isum[r] += (static_cast<std::int32_t>(xg[j * 4 + b]) - 128) * static_cast<std::int32_t>(blk[r * 4 + b]);
      }
      const float sx = xs[m * groups + g];
      for (std::size_t r = 0; r < kQ8Tile; ++r) acc[r] = std::fma(static_cast<float>(isum[r]), sw[r] * sx, acc[r]);
    }
    const std::size_t n0 = t * kQ8Tile;
    for (std::size_t r = 0; r < kQ8Tile && n0 + r < N; ++r) y[m * N + n0 + r] = acc[r];
  }
}

#ifdef CERTRAG_X86

// Four activation bytes broadcast to every lane (one VNNI operand's worth of x).
__attribute__((target("avx512f"))) inline __m512i x4(const std::uint8_t* xg, std::size_t j) {
  std::int32_t v;
  std::memcpy(&v, xg + 4 * j, 4);
  return _mm512_set1_epi32(v);
}

// MT rows of x against one tile. Per group: the tile's 8 blocks of weights are loaded once and feed every row; a
// row's group sum runs in four independent chains (the multiply-add's latency, not its rate, would bound one).
// Weights are prefetched a few KB ahead: the tiles are one sequential stream, and the hardware prefetcher alone
// kept the 136 MB output head at 16 GB/s on one core here against 19-24 GB/s with this.
template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile_vnni_rows(
    const Q8Packed& w, std::size_t t, const std::uint8_t* xq, const float* xs, float* y, std::size_t N,
    std::size_t valid) {
  constexpr std::size_t kPrefetch = 4096;
  const std::size_t K = w.k, groups = K / kQ8Group;
  const std::int8_t* wt = w.q.data() + t * kQ8Tile * K;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (std::size_t g = 0; g < groups; ++g) {
    const std::int8_t* blk = wt + g * kBlocksPerGroup * kBlock;
    __m512i wv[kBlocksPerGroup];
    for (std::size_t j = 0; j < kBlocksPerGroup; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(blk + j * kBlock + kPrefetch), _MM_HINT_T0);
      wv[j] = _mm512_loadu_si512(blk + j * kBlock);
    }
    // -128 * sum(w) per row: the unsigned activations' offset, taken off once per group for every row of x
    const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i o0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, wv[0]);
    __m512i o1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, wv[1]);
    for (std::size_t j = 2; j < kBlocksPerGroup; j += 2) {
      o0 = _mm512_dpbusd_epi32(o0, c128, wv[j]);
      o1 = _mm512_dpbusd_epi32(o1, c128, wv[j + 1]);
    }
    const __m512i off = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_add_epi32(o0, o1));
    const __m512 sw = _mm512_loadu_ps(w.scales.data() + (t * groups + g) * kQ8Tile);
    for (int m = 0; m < MT; ++m) {
      const std::uint8_t* xg = xq + m * K + g * kQ8Group;
      __m512i a = _mm512_dpbusd_epi32(off, x4(xg, 0), wv[0]);
      __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x4(xg, 1), wv[1]);
      __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x4(xg, 2), wv[2]);
      __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x4(xg, 3), wv[3]);
      a = _mm512_dpbusd_epi32(a, x4(xg, 4), wv[4]);
      b = _mm512_dpbusd_epi32(b, x4(xg, 5), wv[5]);
      c = _mm512_dpbusd_epi32(c, x4(xg, 6), wv[6]);
      d = _mm512_dpbusd_epi32(d, x4(xg, 7), wv[7]);
      const __m512i isum = _mm512_add_epi32(_mm512_add_epi32(a, b), _mm512_add_epi32(c, d));
      const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(xs[m * groups + g]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[m]);
    }
  }
  const __mmask16 keep = valid >= kQ8Tile ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * N + t * kQ8Tile, keep, acc[m]);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const Q8Packed& w, std::size_t t,
                                                                       std::size_t M, const std::uint8_t* xq,
                                                                       const float* xs, float* y, std::size_t N) {
  const std::size_t K = w.k, groups = K / kQ8Group;
  const std::size_t valid = std::min(kQ8Tile, N - t * kQ8Tile);
  std::size_t m = 0;
  for (; m + kRowsAtOnce <= M; m += kRowsAtOnce)
    tile_vnni_rows<kRowsAtOnce>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid);
  switch (M - m) {
    case 0: break;
    case 1: tile_vnni_rows<1>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid); break;
    case 2: tile_vnni_rows<2>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid); break;
    case 3: tile_vnni_rows<3>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid); break;
    case 4: tile_vnni_rows<4>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid); break;
    case 5: tile_vnni_rows<5>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid); break;
    case 6: tile_vnni_rows<6>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid); break;
    default: tile_vnni_rows<7>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid); break;
  }
}

// AVX2 has no VNNI: each 4-byte product sum is made by maddubs (unsigned |w| times x with w's sign, at most
// 2 * 127 * 127 per pair: no saturation) and madd against ones, which gives the same exact integer as the VNNI path.
// A tile's 16 rows are two halves of 8.
template <int MT>
__attribute__((target("avx2,fma"))) inline void tile_avx2_rows(const Q8Packed& w, std::size_t t,
                                                                const std::uint8_t* xq, const float* xs, float* y,
                                                                std::size_t N, std::size_t valid) {
  const std::size_t K = w.k, groups = K / kQ8Group;
  const std::int8_t* wt = w.q.data() + t * kQ8Tile * K;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (std::size_t g = 0; g < groups; ++g) {
    const std::int8_t* blk = wt + g * kBlocksPerGroup * kBlock;
    const float* sws = w.scales.data() + (t * groups + g) * kQ8Tile;
    const __m256 sw[2] = {_mm256_loadu_ps(sws), _mm256_loadu_ps(sws + 8)};
    for (int m = 0; m < MT; ++m) {
      const std::uint8_t* xg = xq + m * K + g * kQ8Group;
      __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (std::size_t j = 0; j < kBlocksPerGroup; ++j) {
        std::int32_t v;
        std::memcpy(&v, xg + 4 * j, 4);
        const __m256i xsg = _mm256_xor_si256(_mm256_set1_epi32(v), flip);  // q + 128 back to signed q
        for (int half = 0; half < 2; ++half) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + j * kBlock + half * 32));
          const __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xsg, wv));
          isum[half] = _mm256_add_epi32(isum[half], _mm256_madd_epi16(p16, ones));
        }
      }
      const __m256 sx = _mm256_set1_ps(xs[m * groups + g]);
      for (int half = 0; half < 2; ++half)
        acc[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[half]), _mm256_mul_ps(sw[half], sx), acc[m][half]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    float buf[kQ8Tile];
    _mm256_storeu_ps(buf, acc[m][0]);
    _mm256_storeu_ps(buf + 8, acc[m][1]);
    std::memcpy(y + m * N + t * kQ8Tile, buf, valid * sizeof(float));
  }
}

__attribute__((target("avx2,fma"))) void tile_avx2(const Q8Packed& w, std::size_t t, std::size_t M,
                                                   const std::uint8_t* xq, const float* xs, float* y, std::size_t N) {
  const std::size_t K = w.k, groups = K / kQ8Group;
  const std::size_t valid = std::min(kQ8Tile, N - t * kQ8Tile);
  std::size_t m = 0;
  for (; m + 4 <= M; m += 4) tile_avx2_rows<4>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid);
  for (; m < M; ++m) tile_avx2_rows<1>(w, t, xq + m * K, xs + m * groups, y + m * N, N, valid);
}

#endif  // CERTRAG_X86

}  // namespace

bool cpu_supports_vnni() {
#ifdef CERTRAG_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

Q8Packed q8_pack(std::size_t N, std::size_t K, const std::int8_t* q, const float* scales, int num_threads) {
  if (K == 0 || K % kQ8Group != 0)
    throw std::invalid_argument("K must be a positive multiple of " + std::to_string(kQ8Group) + "; got " +
                                std::to_string(K));
  const std::size_t groups = K / kQ8Group;
  Q8Packed p;
  p.n = N;
  p.k = K;
  p.tiles = (N + kQ8Tile - 1) / kQ8Tile;
  p.q.assign(p.tiles * kQ8Tile * K, 0);
  p.scales.assign(p.tiles * groups * kQ8Tile, 0.f);
  parallel_for(N, num_threads, 64, [&](std::size_t n) {
    const std::size_t t = n / kQ8Tile, r = n % kQ8Tile;
    std::int8_t* wt = p.q.data() + t * kQ8Tile * K;
    for (std::size_t k4 = 0; k4 < K / 4; ++k4) std::memcpy(wt + k4 * kBlock + r * 4, q + n * K + k4 * 4, 4);
    for (std::size_t g = 0; g < groups; ++g) p.scales[(t * groups + g) * kQ8Tile + r] = scales[n * groups + g];
  });
  return p;
}

void q8_packed_rows(const Q8Packed& w, const std::int64_t* ids, std::size_t count, float* out) {
  const std::size_t K = w.k, groups = K / kQ8Group;
  for (std::size_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || static_cast<std::size_t>(ids[i]) >= w.n)
      throw std::out_of_range("row " + std::to_string(ids[i]) + " is outside [0, " + std::to_string(w.n) + ")");
    const std::size_t n = static_cast<std::size_t>(ids[i]), t = n / kQ8Tile, r = n % kQ8Tile;
    const std::int8_t* wt = w.q.data() + t * kQ8Tile * K;
    for (std::size_t k = 0; k < K; ++k)
      out[i * K + k] = static_cast<float>(wt[(k / 4) * kBlock + r * 4 + k % 4]) *
                       w.scales[(t * groups + k / kQ8Group) * kQ8Tile + r];
  }
}

void q8_unpack(const Q8Packed& w, std::int8_t* q, float* scales) {
  const std::size_t K = w.k, groups = K / kQ8Group;
  for (std::size_t n = 0; n < w.n; ++n) {
    const std::size_t t = n / kQ8Tile, r = n % kQ8Tile;
    const std::int8_t* wt = w.q.data() + t * kQ8Tile * K;
    for (std::size_t k = 0; k < K; ++k) q[n * K + k] = wt[(k / 4) * kBlock + r * 4 + k % 4];
    for (std::size_t g = 0; g < groups; ++g) scales[n * groups + g] = w.scales[(t * groups + g) * kQ8Tile + r];
  }
}

bool q8_path_supported(Q8Path path) {
  switch (path) {
    case Q8Path::vnni: return cpu_supports_vnni();
    case Q8Path::avx2: return cpu_supports(SimdLevel::avx2);
    default: return true;
  }
}

Q8Path q8_packed_path() {
  static const Q8Path path = [] {
    const SimdLevel level = distance_kernels().level;  // the CPU's best, capped by CERTRAG_SIMD
    if (level == SimdLevel::avx512 && cpu_supports_vnni()) return Q8Path::vnni;
    if (level >= SimdLevel::avx2) return Q8Path::avx2;
    return Q8Path::scalar;
  }();
  return path;
}

const char* q8_path_name(Q8Path path) {
  switch (path) {
    case Q8Path::vnni: return "vnni";
    case Q8Path::avx2: return "avx2";
    default: return "scalar";
  }
}

void q8_packed_matmul_at(Q8Path path, std::size_t M, const float* x, const Q8Packed& w, float* y, int num_threads) {
  if (!q8_path_supported(path))
    throw std::invalid_argument(std::string("this CPU does not support the ") + q8_path_name(path) + " kernel");
  if (M == 0 || w.n == 0) return;
  const QuantisedX xq = quantise_x(path, M, w.k, x);
  const std::size_t tiles = w.tiles;
  const unsigned parts = static_cast<unsigned>(std::min<std::size_t>(std::max(num_threads, 1), tiles));
  // Each thread takes one contiguous range of tiles: one sequential stream of weights per thread, and no output
  // element is split.
  auto part = [&](unsigned p) {
    const std::size_t t0 = tiles * p / parts, t1 = tiles * (p + 1) / parts;
    for (std::size_t t = t0; t < t1; ++t) {
#ifdef CERTRAG_X86
      if (path == Q8Path::vnni) {
        tile_vnni(w, t, M, xq.q.data(), xq.scales.data(), y, w.n);
        continue;
      }
      if (path == Q8Path::avx2) {
        tile_avx2(w, t, M, xq.q.data(), xq.scales.data(), y, w.n);
        continue;
      }
#endif
      tile_scalar(w, t, M, xq.q.data(), xq.scales.data(), y, w.n);
    }
  };
  if (parts <= 1) {
    part(0);
    return;
  }
  WorkerPool::instance(parts).run(parts, part);
}

void q8_packed_matmul(std::size_t M, const float* x, const Q8Packed& w, float* y, int num_threads) {
  q8_packed_matmul_at(q8_packed_path(), M, x, w, y, num_threads);
}

}  // namespace certrag
