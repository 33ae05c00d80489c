#pragma once
// 128-bit seeded hash for content addressing (prefix-cache block hashes).
//
// Deterministic across processes, machines and compilers: input is consumed as bytes,
// words are assembled little-endian explicitly, and no std::hash is involved. Two
// independent 64-bit lanes (different seeds and multipliers) are cross-mixed at the end,
// so each output half depends on every input bit. It is not cryptographic: it protects
// against accidental collisions (~2^-64 per pair), not an adversary crafting prompts.
#include <compare>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace m3 {

struct Hash128 {
  uint64_t lo = 0;
  uint64_t hi = 0;
  friend bool operator==(const Hash128&, const Hash128&) = default;
  friend auto operator<=>(const Hash128&, const Hash128&) = default;
  std::string to_hex() const;  // 32 hex digits, hi then lo
};

// For unordered containers: the value is already well mixed.
struct Hash128Hasher {
  size_t operator()(const Hash128& h) const { return static_cast<size_t>(h.lo ^ h.hi); }
};

// Streaming form: update() any number of times, then finish() (which does not consume).
class Hasher128 {
 public:
  explicit Hasher128(uint64_t seed);
  void update(const void* data, size_t size_bytes);
  void update_u64(uint64_t value);       // as 8 little-endian bytes
  void update_u32(uint32_t value);       // as 4 little-endian bytes
  void update_hash(const Hash128& value);  // lo then hi
  void update_string(std::string_view text);  // length-prefixed, so concatenations differ
  Hash128 finish() const;

 private:
  void absorb_word(uint64_t word);
  uint64_t lane0_;
  uint64_t lane1_;
  uint64_t total_bytes_ = 0;
  uint8_t pending_[8] = {};
  uint32_t num_pending_ = 0;
};

Hash128 hash128(const void* data, size_t size_bytes, uint64_t seed);
Hash128 hash128(std::string_view text, uint64_t seed);

}  // namespace m3
