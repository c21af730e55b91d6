// Distance kernels with run-time SIMD dispatch.
//
// The default build carries a scalar, an AVX2+FMA and an AVX-512 version of each kernel, compiled with per-function
// target attributes rather than -march flags, and picks one the first time distance_kernels() is called from what the
// CPU reports. CERTRAG_SIMD=scalar|avx2|avx512 caps the choice (for tests and benchmarks); it never raises it above
// what the CPU supports.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace certrag {

enum class SimdLevel { scalar = 0, avx2 = 1, avx512 = 2 };

// Both take two float32 vectors of length dim; neither requires alignment.
using DistanceFn = float (*)(const float* a, const float* b, std::size_t dim);

struct DistanceKernels {
  DistanceFn dot;   // sum_i a_i * b_i
  DistanceFn l2sq;  // sum_i (a_i - b_i)^2
  SimdLevel level;
};

// Thread-safe; the choice is made once per process.
const DistanceKernels& distance_kernels();

// Kernels of one level, for tests that compare levels against each other. Throws if the CPU lacks the level.
DistanceKernels distance_kernels_for(SimdLevel level);

const char* simd_level_name(SimdLevel level);
std::vector<std::string> simd_levels_compiled();
bool cpu_supports(SimdLevel level);

}  // namespace certrag
