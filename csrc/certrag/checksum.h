// A fast non-cryptographic 64-bit checksum for detecting corrupted files (not tampering).
//
// Four independent lanes each absorb every fourth 8-byte word by xor and multiplication with an odd constant (a
// bijection, so a changed word always changes its lane), then the lanes, the tail and the length are mixed together.
// Streaming: update() may be called with pieces of any size; the result equals one call over the concatenation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace certrag {

class Checksum64 {
 public:
  void update(const void* data, std::size_t size) {
    const auto* p = static_cast<const unsigned char*>(data);
    total_ += size;
    if (buffered_ > 0) {
      const std::size_t take = size < 32 - buffered_ ? size : 32 - buffered_;
      std::memcpy(buffer_ + buffered_, p, take);
      buffered_ += take;
      p += take;
      size -= take;
      if (buffered_ < 32) return;
      block(buffer_);
      buffered_ = 0;
    }
    for (; size >= 32; p += 32, size -= 32) block(p);
    std::memcpy(buffer_, p, size);
    buffered_ = size;
  }

  std::uint64_t digest() const {
    std::uint64_t lane[4] = {lane_[0], lane_[1], lane_[2], lane_[3]};
    for (std::size_t i = 0; i < buffered_; ++i) lane[i / 8] = absorb(lane[i / 8], buffer_[i] + 0x100ULL * (i + 1));
    std::uint64_t h = static_cast<std::uint64_t>(total_) * kMul;
    for (int j = 0; j < 4; ++j) h = mix(h ^ lane[j]) * kMul;
    return mix(h);
  }

 private:
  static constexpr std::uint64_t kMul = 0x9E3779B97F4A7C15ULL;

  static std::uint64_t mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
  }
  static std::uint64_t absorb(std::uint64_t lane, std::uint64_t word) {
    lane = (lane ^ word) * kMul;
    return (lane << 31) | (lane >> 33);
  }
  void block(const unsigned char* p) {
    for (int j = 0; j < 4; ++j) {
      std::uint64_t w;
      std::memcpy(&w, p + 8 * j, 8);
      lane_[j] = absorb(lane_[j], w);
    }
  }

  std::uint64_t lane_[4] = {0x243F6A8885A308D3ULL, 0x13198A2E03707344ULL, 0xA4093822299F31D0ULL,
                            0x082EFA98EC4E6C89ULL};
  unsigned char buffer_[32] = {};
  std::size_t buffered_ = 0;
  std::size_t total_ = 0;
};

inline std::uint64_t checksum64(const void* data, std::size_t size) {
  Checksum64 c;
  c.update(data, size);
  return c.digest();
}

}  // namespace certrag
