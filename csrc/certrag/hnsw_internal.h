// Internals shared by the graph (hnsw.cpp) and the file format (hnsw_io.cpp); not part of the public API.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

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

}  // namespace hnsw_internal
}  // namespace certrag
