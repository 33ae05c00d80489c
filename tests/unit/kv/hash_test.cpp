// Hash128 (core) and the chained prefix-block hashes built on it.
#include <gtest/gtest.h>

#include <bit>
#include <set>
#include <string>
#include <vector>

#include "core/hash128.h"
#include "kv/prefix_hash.h"

namespace m3 {
namespace {

TEST(Hash128, KnownAnswersPinTheConstruction) {
  // Pinned values: a change here breaks cache agreement between nodes and releases, so it
  // must come with a new prefix-hash scheme tag.
  EXPECT_EQ(hash128("", 0).to_hex(), "772535e81c014e75b2c5852d66c418ab");
  EXPECT_EQ(hash128("m3serve", 0).to_hex(), "1f4c86ea7515965a544039ebd6403522");
  EXPECT_EQ(hash128("m3serve", 42).to_hex(), "72daac4d76f77f8c2dbd017ff2d79616");
}

TEST(Hash128, StreamingSplitsEqualOneShot) {
  std::vector<uint8_t> bytes(77);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 37 + 11);
  const Hash128 one_shot = hash128(bytes.data(), bytes.size(), 7);
  for (size_t a = 0; a <= bytes.size(); ++a) {
    for (size_t b = a; b <= bytes.size(); b += 5) {
      Hasher128 h(7);
      h.update(bytes.data(), a);
      h.update(bytes.data() + a, b - a);
      h.update(bytes.data() + b, bytes.size() - b);
      ASSERT_EQ(h.finish(), one_shot) << a << " " << b;
    }
  }
}

TEST(Hash128, TypedUpdatesAreLittleEndianBytes) {
  Hasher128 typed(3);
  typed.update_u32(0x04030201u);
  typed.update_u64(0x0c0b0a0908070605ull);
  const uint8_t bytes[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_EQ(typed.finish(), hash128(bytes, sizeof(bytes), 3));
}

TEST(Hash128, SeedLengthAndEveryBitMatter) {
  EXPECT_NE(hash128("abc", 0), hash128("abc", 1));
  const uint8_t zeros[3] = {0, 0, 0};
  EXPECT_NE(hash128(zeros, 2, 0), hash128(zeros, 3, 0));  // zero padding vs real zero
  EXPECT_NE(hash128(zeros, 0, 0), hash128(zeros, 1, 0));

  std::vector<uint8_t> base(64);
  for (size_t i = 0; i < base.size(); ++i) base[i] = static_cast<uint8_t>(i);
  const Hash128 h0 = hash128(base.data(), base.size(), 99);
  std::set<Hash128> distinct{h0};
  int64_t total_flipped = 0;
  int min_flipped = 128, max_flipped = 0;
  for (size_t bit = 0; bit < base.size() * 8; ++bit) {
    std::vector<uint8_t> m = base;
    m[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    const Hash128 h1 = hash128(m.data(), m.size(), 99);
    distinct.insert(h1);
    const int flipped = std::popcount(h0.lo ^ h1.lo) + std::popcount(h0.hi ^ h1.hi);
    total_flipped += flipped;
    min_flipped = std::min(min_flipped, flipped);
    max_flipped = std::max(max_flipped, flipped);
  }
  EXPECT_EQ(distinct.size(), base.size() * 8 + 1);
  // Avalanche: each single-bit change flips about half of the 128 output bits.
  const double mean = double(total_flipped) / double(base.size() * 8);
  EXPECT_GT(mean, 60.0);
  EXPECT_LT(mean, 68.0);
  EXPECT_GT(min_flipped, 30);
  EXPECT_LT(max_flipped, 98);
}

TEST(Hash128, BothHalvesDependOnInput) {
  std::set<uint64_t> los, his;
  for (uint32_t i = 0; i < 1000; ++i) {
    const Hash128 h = hash128(&i, sizeof(i), 5);
    los.insert(h.lo);
    his.insert(h.hi);
  }
  EXPECT_EQ(los.size(), 1000u);
  EXPECT_EQ(his.size(), 1000u);
}

TEST(PrefixHasher, ChainDependsOnParentTokensKeysAndBlockSize) {
  const std::vector<std::string> keys{"model_rev=abc", "kv_dtype=bf16"};
  const PrefixHasher hasher(1234, 4, keys);
  const std::vector<TokenId> block{1, 2, 3, 4};
  const Hash128 h = hasher.block_hash(hasher.root(), block);
  EXPECT_EQ(h, PrefixHasher(1234, 4, keys).block_hash(hasher.root(), block));  // deterministic
  EXPECT_NE(h, hasher.block_hash(h, block));                                   // parent
  EXPECT_NE(h, hasher.block_hash(hasher.root(), std::vector<TokenId>{1, 2, 3, 5}));
  EXPECT_NE(h, hasher.block_hash(hasher.root(), std::vector<TokenId>{2, 1, 3, 4}));  // order

  EXPECT_NE(hasher.root(), PrefixHasher(1235, 4, keys).root());  // seed
  EXPECT_NE(hasher.root(), PrefixHasher(1234, 8, keys).root());  // block size
  const std::vector<std::string> fp8{"model_rev=abc", "kv_dtype=fp8"};
  EXPECT_NE(hasher.root(), PrefixHasher(1234, 4, fp8).root());
  // Key boundaries are part of the hash: {"ab","c"} != {"a","bc"}.
  const std::vector<std::string> k1{"ab", "c"}, k2{"a", "bc"};
  EXPECT_NE(PrefixHasher(1, 4, k1).root(), PrefixHasher(1, 4, k2).root());
}

TEST(PrefixHasher, KnownAnswerForAnM3Block) {
  // Nodes sharing KV (prefill/decode) must agree on these bytes; pinned like Hash128's.
  const std::vector<std::string> keys{"model_rev=r1", "kv_dtype=bf16"};
  const PrefixHasher hasher(2026, 128, keys);
  std::vector<TokenId> block(128);
  for (int i = 0; i < 128; ++i) block[i] = 200000 - 7 * i;
  EXPECT_EQ(hasher.root().to_hex(), "1885dfacd6d564de6fe1cc3589264e47");
  EXPECT_EQ(hasher.block_hash(hasher.root(), block).to_hex(), "bfbaa8c5024780f0572914174bfb1b81");
}

TEST(PrefixHasher, ExtendIsIncrementalAndFullBlocksOnly) {
  const PrefixHasher hasher(7, 4, {});
  std::vector<TokenId> tokens;
  for (int i = 0; i < 18; ++i) tokens.push_back(100 + i);
  std::vector<Hash128> all;
  hasher.extend_block_hashes(tokens, &all);
  ASSERT_EQ(all.size(), 4u);  // 18 tokens = 4 full blocks + 2
  EXPECT_EQ(all[0], hasher.block_hash(hasher.root(), std::span(tokens).subspan(0, 4)));
  EXPECT_EQ(all[3], hasher.block_hash(all[2], std::span(tokens).subspan(12, 4)));

  std::vector<Hash128> step;
  hasher.extend_block_hashes(std::span(tokens).first(5), &step);
  EXPECT_EQ(step.size(), 1u);
  hasher.extend_block_hashes(tokens, &step, 3);
  EXPECT_EQ(step.size(), 3u);
  hasher.extend_block_hashes(tokens, &step);
  EXPECT_EQ(step, all);

  // A different first block changes every later hash (chaining).
  std::vector<TokenId> other = tokens;
  other[0] = 7;
  std::vector<Hash128> other_hashes;
  hasher.extend_block_hashes(other, &other_hashes);
  for (size_t i = 0; i < all.size(); ++i) EXPECT_NE(all[i], other_hashes[i]) << i;
}

}  // namespace
}  // namespace m3
