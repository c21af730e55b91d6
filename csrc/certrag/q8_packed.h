// The q8 weights packed for integer products: int8 activations (per row and group of 32, symmetric, as GGUF's
// Q8_0) times the int8 weights, summed exactly in int32 within each group, then scaled and accumulated in float32.
// This is the decoder's product: on a CPU with AVX-512 VNNI one instruction does 64 multiply-adds, four times the
// float path's rate, which is what batched decoding and prefill are bound by.
//
// Layout: W's rows in tiles of 16 (the last tile padded with zero rows); inside a tile, 4 columns at a time, the 16
// rows' 4 bytes side by side (64 bytes: one VNNI operand). Each (tile, group) has 16 float32 scales. 1.125 bytes a
// weight, as the unpacked form. Activations are held as unsigned bytes q + 128 (VNNI multiplies unsigned by signed
// bytes); the 128 * sum(w) this adds is taken off by the same instruction on a constant operand.
//
// Exactness and invariance: a group's integer sum is exact, and y[m, n] = sum over groups, in order, of
// fma(float(isum), w_scale * x_scale, acc) -- the same operations at every SIMD level, whatever M is, whichever rows
// share a call and however many threads run it. So the portable path and the VNNI path agree bit for bit, and a
// sequence's logits do not depend on what it is decoded beside.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "certrag/distance.h"
#include "certrag/q8.h"

namespace certrag {

constexpr std::size_t kQ8Tile = 16;  // W rows per tile

struct Q8Packed {
  std::size_t n = 0, k = 0, tiles = 0;
  std::vector<std::int8_t> q;         // tiles * 16 * k
  std::vector<float> scales;          // tiles * (k / 32) * 16
  std::size_t nbytes() const { return q.size() + 4 * scales.size(); }
};

// From q8 weights (q (N, K) int8, scales (N, K / 32)); K a positive multiple of 32.
Q8Packed q8_pack(std::size_t N, std::size_t K, const std::int8_t* q, const float* scales, int num_threads);

// W's rows ids[0..count) de-quantised into out (count, K) float32 (an embedding table's lookup).
void q8_packed_rows(const Q8Packed& w, const std::int64_t* ids, std::size_t count, float* out);

// The packed weights back in their q8 form: q (N, K) int8 and scales (N, K / 32).
void q8_unpack(const Q8Packed& w, std::int8_t* q, float* scales);

// y (M, N) = x (M, K) . W^T through the integer path. A non-finite value in a row of x makes that row of y NaN.
void q8_packed_matmul(std::size_t M, const float* x, const Q8Packed& w, float* y, int num_threads);

// The kernels: AVX-512 VNNI, AVX2 (maddubs + madd: the same exact integers), portable.
enum class Q8Path { scalar = 0, avx2 = 1, vnni = 2 };

// The same with a given kernel (std::invalid_argument if the CPU lacks it), for tests.
void q8_packed_matmul_at(Q8Path path, std::size_t M, const float* x, const Q8Packed& w, float* y, int num_threads);

bool cpu_supports_vnni();
bool q8_path_supported(Q8Path path);
// The kernel q8_packed_matmul uses: the best the CPU has, capped by CERTRAG_SIMD as the distance kernels are.
Q8Path q8_packed_path();
const char* q8_path_name(Q8Path path);

}  // namespace certrag
