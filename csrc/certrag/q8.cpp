#include "certrag/q8.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "certrag/parallel.h"

namespace certrag {
namespace {

void check_k(std::size_t K) {
  if (K == 0 || K % kQ8Group != 0)
    throw std::invalid_argument("K must be a positive multiple of " + std::to_string(kQ8Group) + "; got " +
                                std::to_string(K));
}

}  // namespace

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
