#include "core/hash128.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace m3 {
namespace {

// Odd constants with well-spread bits (golden ratio and two 64-bit primes from the
// mixing literature); the lanes use different ones so they are independent.
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
constexpr uint64_t kLaneMul0 = 0xc2b2ae3d27d4eb4full;
constexpr uint64_t kLaneMul1 = 0x165667b19e3779f9ull;
constexpr uint64_t kLaneSalt1 = 0xd6e8feb86659fd93ull;

constexpr uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// A bijective 64-bit finaliser (xor-shift / multiply rounds): every input bit affects
// every output bit with probability close to 1/2.
constexpr uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

std::string Hash128::to_hex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return std::string(buf, 32);
}

Hasher128::Hasher128(uint64_t seed)
    : lane0_(mix64(seed + kGolden)), lane1_(mix64((seed ^ kLaneSalt1) + 2 * kGolden)) {}

void Hasher128::absorb_word(uint64_t word) {
  // Each lane step is a bijection of the lane for a fixed word and of the word for a fixed
  // lane, so two inputs differing in one word always leave different lane states.
  lane0_ = mix64(lane0_ ^ (word * kLaneMul0));
  lane1_ = mix64(rotl64(lane1_, 23) + (word * kLaneMul1) + kGolden);
}

void Hasher128::update(const void* data, size_t size_bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  total_bytes_ += size_bytes;
  if (num_pending_ > 0) {
    const size_t take = std::min<size_t>(8 - num_pending_, size_bytes);
    std::memcpy(pending_ + num_pending_, p, take);
    num_pending_ += static_cast<uint32_t>(take);
    p += take;
    size_bytes -= take;
    if (num_pending_ < 8) return;
    absorb_word(load_le64(pending_));
    num_pending_ = 0;
  }
  for (; size_bytes >= 8; size_bytes -= 8, p += 8) absorb_word(load_le64(p));
  std::memcpy(pending_, p, size_bytes);
  num_pending_ = static_cast<uint32_t>(size_bytes);
}

void Hasher128::update_u64(uint64_t value) {
  uint8_t bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(value >> (8 * i));
  update(bytes, 8);
}

void Hasher128::update_u32(uint32_t value) {
  uint8_t bytes[4];
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<uint8_t>(value >> (8 * i));
  update(bytes, 4);
}

void Hasher128::update_hash(const Hash128& value) {
  update_u64(value.lo);
  update_u64(value.hi);
}

void Hasher128::update_string(std::string_view text) {
  update_u64(text.size());
  update(text.data(), text.size());
}

Hash128 Hasher128::finish() const {
  uint64_t l0 = lane0_;
  uint64_t l1 = lane1_;
  // The tail is zero-padded; the total length below tells "ab" from "ab\0".
  if (num_pending_ > 0) {
    uint8_t tail[8] = {};
    for (uint32_t i = 0; i < num_pending_; ++i) tail[i] = pending_[i];
    const uint64_t word = load_le64(tail);
    l0 = mix64(l0 ^ (word * kLaneMul0));
    l1 = mix64(rotl64(l1, 23) + (word * kLaneMul1) + kGolden);
  }
  l0 = mix64(l0 ^ total_bytes_);
  l1 = mix64(l1 + total_bytes_ * kLaneMul0);
  Hash128 out;
  out.lo = mix64(l0 + rotl64(l1, 32));
  out.hi = mix64(l1 ^ rotl64(l0, 17) ^ kLaneSalt1);
  return out;
}

Hash128 hash128(const void* data, size_t size_bytes, uint64_t seed) {
  Hasher128 h(seed);
  h.update(data, size_bytes);
  return h.finish();
}

Hash128 hash128(std::string_view text, uint64_t seed) {
  return hash128(text.data(), text.size(), seed);
}

}  // namespace m3
