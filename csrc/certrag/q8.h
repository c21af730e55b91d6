// GGUF's Q8_0 layout kept as two arrays: int8 weights in groups of 32 columns, each group with its own float32 scale.
// The decoder multiplies them packed (certrag/q8_packed.h); this is the quantisation and its inverse.
#pragma once

#include <cstddef>
#include <cstdint>

namespace certrag {

constexpr std::size_t kQ8Group = 32;  // columns per scale

// Symmetric round-to-nearest quantisation of float32 W (N, K): scale = max|w| / 127 per group (0 for an all-zero
// group), q = round(w / scale) clamped to [-127, 127].
void q8_quantize(std::size_t N, std::size_t K, const float* w, std::int8_t* q, float* scales, int num_threads);

// W (N, K) back to float32 (the float32 reference format and tests).
void q8_dequantize(std::size_t N, std::size_t K, const std::int8_t* q, const float* scales, float* w,
                   int num_threads);

}  // namespace certrag
