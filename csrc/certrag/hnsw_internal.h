// Internals shared by the graph (hnsw.cpp) and the file format (hnsw_io.cpp); not part of the public API.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "certrag/hnsw.h"

static_assert(sizeof(float) == 4, "float must be IEEE-754 binary32");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the index file format is little-endian; a big-endian port needs byte swapping in save/load"
#endif

namespace certrag {
namespace hnsw_internal {

constexpr char kMagic[8] = {'C', 'R', 'A', 'G', 'H', 'N', 'S', 'W'};
constexpr std::size_t kHeaderSize = 128;
constexpr std::size_t kAlign = 64;
constexpr int kMaxLevel = 63;
constexpr std::uint32_t kMaxDim = 65536;
constexpr std::uint32_t kMaxM = 2048;

inline std::size_t align_up(std::size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

template <class T>
inline void put(unsigned char* header, std::size_t offset, T value) {
  std::memcpy(header + offset, &value, sizeof(T));
}
template <class T>
inline T get(const unsigned char* header, std::size_t offset) {
  T value;
  std::memcpy(&value, header + offset, sizeof(T));
  return value;
}

// Byte offsets of the fields in the 128-byte header.
namespace hdr {
constexpr std::size_t magic = 0, version = 8, header_size = 12, metric = 16, dim = 20, M = 24, M0 = 28, efc = 32,
                      max_level = 36, seed = 40, count = 48, live = 56, entry = 64, payload_size = 72,
                      payload_checksum = 80, header_checksum = 120;
}

inline std::string errno_text() { return std::strerror(errno); }

inline bool all_finite(const float* v, std::size_t dim) {
  for (std::size_t j = 0; j < dim; ++j)
    if (!std::isfinite(v[j])) return false;
  return true;
}

// The L2 norm in double precision: exact enough, and finite for every finite float32 vector (3.4e38^2 * 65536 is far
// below double's range), so it can judge vectors whose float32 norm would overflow or underflow.
inline double norm_of(const float* v, std::size_t dim) {
  double s = 0.0;
  for (std::size_t j = 0; j < dim; ++j) s += static_cast<double>(v[j]) * v[j];
  return std::sqrt(s);
}

// dst = v / |v| for a finite non-zero v. The usual float32 path (1 / sqrt(v.v)) is kept where v.v is a normal finite
// float, so ordinary vectors are stored bit for bit as before; otherwise (v.v overflows to inf or underflows) v is
// first divided by its largest magnitude, which brings the norm into [1, sqrt(dim)].
template <class Dot>
inline void normalise_into(const float* v, std::size_t dim, float* dst, Dot dot) {
  const float sq = dot(v, v, dim);
  if (std::isfinite(sq) && sq >= 1e-30f) {
    const float inv = 1.0f / std::sqrt(sq);
    for (std::size_t j = 0; j < dim; ++j) dst[j] = v[j] * inv;
    return;
  }
  float peak = 0.f;
  for (std::size_t j = 0; j < dim; ++j) peak = std::fmax(peak, std::fabs(v[j]));
  for (std::size_t j = 0; j < dim; ++j) dst[j] = v[j] / peak;
  const float inv = 1.0f / std::sqrt(dot(dst, dst, dim));
  for (std::size_t j = 0; j < dim; ++j) dst[j] *= inv;
}

inline std::string short_number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", x);
  return text;
}

// The reason a vector (or query) cannot be indexed or searched under a metric, or "" when it can.
inline std::string vector_problem(const float* v, std::size_t dim, bool cosine) {
  if (!all_finite(v, dim)) return "holds a NaN or infinite value";
  const double norm = norm_of(v, dim);
  if (cosine && norm == 0.0) return "is all zeros; the cosine metric needs non-zero vectors";
  if (!cosine && norm > kMaxNorm)
    return "has an L2 norm of " + short_number(norm) + ", above the 1e18 that keeps ip and l2 scores finite in "
           "float32 (scale it down, or use the cosine metric)";
  return "";
}

}  // namespace hnsw_internal
}  // namespace certrag
