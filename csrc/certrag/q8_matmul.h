// Matrix products with int8 weights in groups of 32 columns, each group with its own float32 scale (the layout of
// GGUF's Q8_0 blocks, kept as two arrays), for the decoder's linear layers.
//
// Batch invariance is the contract: y[m, n] is computed by the same sequence of floating-point operations whatever
// M is, whichever rows share a call, and however many threads run it (each output element belongs to one thread,
// and the tiling changes only which independent elements are computed side by side). So a sequence decoded alone
// and inside a batch gets bit-identical logits on a given CPU and SIMD level. Different SIMD levels sum in a
// different order and may differ in the last bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "certrag/distance.h"

namespace certrag {

constexpr std::size_t kQ8Group = 32;  // columns per scale

// y (M, N) = x (M, K) . W^T, W (N, K) = q (N, K) int8 * scales (N, K / kQ8Group) broadcast over each group.
// K must be a multiple of kQ8Group; all arrays row-major and contiguous; y must not alias x.
void q8_matmul(std::size_t M, std::size_t N, std::size_t K, const float* x, const std::int8_t* q,
               const float* scales, float* y, int num_threads);

// The same at a given SIMD level (tests compare levels); throws std::invalid_argument if the CPU lacks it.
void q8_matmul_at(SimdLevel level, std::size_t M, std::size_t N, std::size_t K, const float* x,
                  const std::int8_t* q, const float* scales, float* y, int num_threads);

// Symmetric round-to-nearest quantisation of float32 W (N, K): scale = max|w| / 127 per group (0 for an all-zero
// group), q = round(w / scale) clamped to [-127, 127].
void q8_quantize(std::size_t N, std::size_t K, const float* w, std::int8_t* q, float* scales, int num_threads);

// W (N, K) back to float32 (for prefill through a float GEMM and for tests).
void q8_dequantize(std::size_t N, std::size_t K, const std::int8_t* q, const float* scales, float* w,
                   int num_threads);

}  // namespace certrag
