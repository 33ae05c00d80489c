// Free list, block pool and per-request KV tables with prefix caching.
#include <gtest/gtest.h>

#include <vector>

#include "kv/block_pool.h"
#include "kv/free_block_queue.h"
#include "kv/kv_cache_manager.h"

namespace m3 {
namespace {

std::vector<BlockId> drain(const FreeBlockQueue& q) {
  std::vector<BlockId> out;
  for (BlockId b = q.front(); b != kNoBlock; b = q.next(b)) out.push_back(b);
  return out;
}

Hash128 fake_hash(uint64_t i) { return Hash128{i * 0x9e3779b97f4a7c15ull + 1, i}; }

std::vector<TokenId> iota_tokens(int32_t count, TokenId first) {
  std::vector<TokenId> t(count);
  for (int32_t i = 0; i < count; ++i) t[i] = first + i;
  return t;
}

TEST(FreeBlockQueue, PushPopRemoveAtBothEnds) {
  FreeBlockQueue q(5);
  EXPECT_EQ(drain(q), (std::vector<BlockId>{0, 1, 2, 3, 4}));
  q.remove(2);
  q.remove(0);
  q.remove(4);
  EXPECT_EQ(drain(q), (std::vector<BlockId>{1, 3}));
  q.push_back(4);
  q.push_front(0);
  EXPECT_EQ(drain(q), (std::vector<BlockId>{0, 1, 3, 4}));
  EXPECT_EQ(q.pop_front(), 0);
  EXPECT_EQ(q.pop_front(), 1);
  EXPECT_EQ(q.pop_front(), 3);
  EXPECT_EQ(q.pop_front(), 4);
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.pop_front(), kNoBlock);
  q.push_front(2);
  EXPECT_EQ(drain(q), (std::vector<BlockId>{2}));
  EXPECT_TRUE(q.contains(2));
  EXPECT_FALSE(q.contains(1));
}

TEST(BlockPool, CachedFreeBlocksSurviveUntilLruEviction) {
  BlockPool pool(3);
  const BlockId a = pool.allocate(), b = pool.allocate(), c = pool.allocate();
  EXPECT_EQ(pool.allocate(), kNoBlock);
  EXPECT_TRUE(pool.register_hash(a, fake_hash(1)));
  EXPECT_TRUE(pool.register_hash(b, fake_hash(2)));
  pool.release(a);  // cached-free, oldest
  pool.release(b);  // cached-free
  pool.release(c);  // no hash: handed out first
  ASSERT_TRUE(pool.check_invariants().is_ok());
  EXPECT_EQ(pool.num_free_blocks(), 3);
  EXPECT_EQ(pool.num_cached_blocks(), 2);
  EXPECT_EQ(pool.find_cached(fake_hash(1)), a);

  EXPECT_EQ(pool.allocate(), c);  // unhashed goes first, nothing evicted
  EXPECT_EQ(pool.num_evictions(), 0);
  pool.acquire(a);  // a hit touches a: b is now least recently used
  EXPECT_EQ(pool.ref_count(a), 1);
  EXPECT_EQ(pool.allocate(), b);  // evicts b
  EXPECT_EQ(pool.num_evictions(), 1);
  EXPECT_EQ(pool.find_cached(fake_hash(2)), kNoBlock);
  EXPECT_EQ(pool.find_cached(fake_hash(1)), a);
  EXPECT_FALSE(pool.block_hash(b).has_value());
  ASSERT_TRUE(pool.check_invariants().is_ok());
}

TEST(BlockPool, SharedBlockAndDuplicateHash) {
  BlockPool pool(2);
  const BlockId a = pool.allocate(), b = pool.allocate();
  EXPECT_TRUE(pool.register_hash(a, fake_hash(7)));
  EXPECT_FALSE(pool.register_hash(b, fake_hash(7)));  // same content computed twice
  EXPECT_FALSE(pool.block_hash(b).has_value());
  EXPECT_EQ(pool.find_cached(fake_hash(7)), a);
  pool.acquire(a);
  EXPECT_EQ(pool.ref_count(a), 2);
  pool.release(a);
  EXPECT_EQ(pool.num_free_blocks(), 0);
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  EXPECT_TRUE(pool.check_invariants().is_ok());
}

KvCacheManager make_manager(int32_t num_blocks, int32_t block_size, bool prefix = true) {
  KvCacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size_tokens = block_size;
  c.enable_prefix_caching = prefix;
  c.hash_seed = 17;
  c.hash_extra_keys = {"model_rev=test", "kv_dtype=bf16"};
  Result<KvCacheManager> m = KvCacheManager::create(c);
  EXPECT_TRUE(m.is_ok());
  return std::move(m).value();
}

TEST(KvCacheManager, ConfigValidationReportsEveryProblem) {
  KvCacheConfig c;
  const Status s = c.validate();
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("num_blocks"), std::string::npos);
  EXPECT_NE(s.message().find("block_size_tokens"), std::string::npos);
  EXPECT_FALSE(KvCacheManager::create(c).is_ok());
}

TEST(KvCacheManager, AllocateIsAllOrNothingAndSlotsAreAnchored) {
  KvCacheManager kv = make_manager(4, 4);
  EXPECT_TRUE(kv.allocate_slots(1, 0, 6));  // 2 blocks
  EXPECT_EQ(kv.block_table(1).num_blocks(), 2);
  EXPECT_FALSE(kv.allocate_slots(2, 0, 9));  // needs 3, 2 free
  EXPECT_EQ(kv.block_table(2).num_blocks(), 0);
  EXPECT_EQ(kv.num_free_blocks(), 2);
  EXPECT_TRUE(kv.allocate_slots(1, 6, 2));   // 8 tokens still fit in 2 blocks
  EXPECT_EQ(kv.block_table(1).num_blocks(), 2);
  EXPECT_TRUE(kv.allocate_slots(1, 8, 1));   // position 8 opens block 2
  const BlockTable& t = kv.block_table(1);
  ASSERT_EQ(t.num_blocks(), 3);
  EXPECT_EQ(t.slot(5, 4), int64_t{t[1]} * 4 + 1);
  EXPECT_EQ(t.slot(8, 4), int64_t{t[2]} * 4);
  EXPECT_TRUE(kv.check_invariants().is_ok());
  kv.free(1);
  kv.free(2);
  EXPECT_EQ(kv.stats().num_used_blocks, 0);
  EXPECT_TRUE(kv.check_invariants().is_ok());
}

TEST(KvCacheManager, PrefixHitsFullBlocksOnlyAndNeverTheLastToken) {
  KvCacheManager kv = make_manager(16, 4);
  const std::vector<TokenId> a = iota_tokens(10, 100);  // blocks [0,4) [4,8), tail 2
  EXPECT_EQ(kv.find_cached_prefix(1, a).num_tokens, 0);
  ASSERT_TRUE(kv.allocate_slots(1, 0, 10));
  kv.mark_computed(1, a, 6);  // only block 0 is full and computed
  EXPECT_EQ(kv.stats().num_cached_blocks, 1);
  kv.mark_computed(1, a, 10);
  EXPECT_EQ(kv.stats().num_cached_blocks, 2);  // the partial tail never gets a hash

  const BlockTable ta = kv.block_table(1);
  // Same 8 tokens then different: both blocks hit.
  std::vector<TokenId> b(a.begin(), a.begin() + 8);
  b.push_back(1);
  PrefixMatch hit = kv.find_cached_prefix(2, b);
  EXPECT_EQ(hit.num_tokens, 8);
  EXPECT_EQ(hit.block_ids, (std::vector<BlockId>{ta[0], ta[1]}));
  // Shares 6 tokens: only the one full block.
  std::vector<TokenId> c(a.begin(), a.begin() + 6);
  c.push_back(5);
  c.push_back(6);
  c.push_back(7);
  EXPECT_EQ(kv.find_cached_prefix(3, c).num_tokens, 4);
  // Exactly the 8 cached tokens: capped at 7, rounded down to one block.
  const std::vector<TokenId> d(a.begin(), a.begin() + 8);
  EXPECT_EQ(kv.find_cached_prefix(4, d).num_tokens, 4);
  // 9 tokens: both blocks, the 9th is computed.
  const std::vector<TokenId> e(a.begin(), a.begin() + 9);
  EXPECT_EQ(kv.find_cached_prefix(5, e).num_tokens, 8);
  // Different first token: nothing (hashes are chained).
  std::vector<TokenId> f = a;
  f[0] = 1;
  EXPECT_EQ(kv.find_cached_prefix(6, f).num_tokens, 0);
  // The request-free lookup agrees.
  EXPECT_EQ(kv.find_cached_prefix(b).block_ids, hit.block_ids);
  EXPECT_EQ(kv.find_cached_prefix(d).num_tokens, 4);
  EXPECT_EQ(kv.find_cached_prefix(f).num_tokens, 0);

  ASSERT_TRUE(kv.allocate_slots(2, hit.num_tokens, 1, &hit));
  EXPECT_EQ(kv.block_table(2)[0], ta[0]);
  EXPECT_EQ(kv.block_table(2)[1], ta[1]);
  EXPECT_NE(kv.block_table(2)[2], ta[2]);
  for (RequestId id = 3; id <= 6; ++id) kv.free(id);  // lookups only
  ASSERT_TRUE(kv.check_invariants().is_ok()) << kv.check_invariants().message();
  EXPECT_EQ(kv.stats().num_used_blocks, 4);  // 3 for request 1, 1 fresh for request 2
  kv.free(1);
  kv.free(2);
  EXPECT_TRUE(kv.check_invariants().is_ok());
  // Freed, but still cached: a new request hits them.
  EXPECT_EQ(kv.find_cached_prefix(7, b).num_tokens, 8);
  kv.free(7);
}

TEST(KvCacheManager, HitsOnCachedFreeBlocksAreNotCountedAsFreshBlocks) {
  KvCacheManager kv = make_manager(3, 4);
  const std::vector<TokenId> a = iota_tokens(9, 1);
  ASSERT_TRUE(kv.allocate_slots(1, 0, 9));
  kv.mark_computed(1, a, 9);
  kv.free(1);  // 3 free, 2 of them cached
  std::vector<TokenId> b(a.begin(), a.begin() + 8);
  for (int i = 0; i < 9; ++i) b.push_back(50 + i);  // 17 tokens → 5 blocks
  PrefixMatch hit = kv.find_cached_prefix(2, b);
  ASSERT_EQ(hit.num_tokens, 8);
  // Needs 2 hits + 3 fresh, but acquiring the hits leaves only 1 free block.
  EXPECT_FALSE(kv.allocate_slots(2, 8, 9, &hit));
  EXPECT_TRUE(kv.check_invariants().is_ok());
  EXPECT_EQ(kv.stats().num_cached_blocks, 2);  // the failed call evicted nothing
  EXPECT_TRUE(kv.allocate_slots(2, 8, 4, &hit));  // 12 tokens → 1 fresh block
  EXPECT_EQ(kv.num_free_blocks(), 0);
  kv.free(2);
  EXPECT_TRUE(kv.check_invariants().is_ok());
}

TEST(KvCacheManager, FreeingEvictsTailBlocksFirst) {
  KvCacheManager kv = make_manager(4, 2);
  const std::vector<TokenId> a = iota_tokens(8, 10);
  ASSERT_TRUE(kv.allocate_slots(1, 0, 8));
  kv.mark_computed(1, a, 8);
  const BlockTable t = kv.block_table(1);
  kv.free(1);
  // The next fresh block comes from the request's last block, so its prefix stays hittable.
  ASSERT_TRUE(kv.allocate_slots(2, 0, 1));
  EXPECT_EQ(kv.block_table(2)[0], t[3]);
  EXPECT_EQ(kv.find_cached_prefix(3, a).num_tokens, 6);
  kv.free(3);
  kv.free(2);
  EXPECT_EQ(kv.stats().num_evictions, 1);
}

TEST(KvCacheManager, DuplicateContentFromTwoRequestsStaysConsistent) {
  KvCacheManager kv = make_manager(8, 4);
  const std::vector<TokenId> a = iota_tokens(8, 1);
  ASSERT_TRUE(kv.allocate_slots(1, 0, 8));
  ASSERT_TRUE(kv.allocate_slots(2, 0, 8));  // admitted in the same step: no hit yet
  kv.mark_computed(1, a, 8);
  kv.mark_computed(2, a, 8);
  EXPECT_EQ(kv.stats().num_cached_blocks, 2);
  ASSERT_TRUE(kv.check_invariants().is_ok()) << kv.check_invariants().message();
  kv.free(1);
  kv.free(2);
  EXPECT_TRUE(kv.check_invariants().is_ok());
  EXPECT_EQ(kv.stats().num_free_blocks, 8);
}

TEST(KvCacheManager, PrefixCachingCanBeDisabled) {
  KvCacheManager kv = make_manager(8, 4, /*prefix=*/false);
  const std::vector<TokenId> a = iota_tokens(12, 1);
  ASSERT_TRUE(kv.allocate_slots(1, 0, 12));
  kv.mark_computed(1, a, 12);
  EXPECT_EQ(kv.stats().num_cached_blocks, 0);
  EXPECT_EQ(kv.find_cached_prefix(2, a).num_tokens, 0);
  kv.free(1);
  kv.free(2);
  EXPECT_TRUE(kv.check_invariants().is_ok());
}

}  // namespace
}  // namespace m3

namespace m3 {
namespace {

// KV transfer into the KV cache: the blocks after the chain's cached ones are adopted (published,
// cached-free), none of the chain's own blocks is evicted to make room, and a full pool stops
// the chain where it is.
TEST(KvCacheManager, AdoptBlocksExtendsTheCachedChain) {
  KvCacheManager kv = make_manager(6, 4);
  const std::vector<TokenId> prompt = iota_tokens(22, 100);  // 5 full blocks a hit may cover
  const std::vector<Hash128> chain = kv.prefix_block_hashes(prompt);
  ASSERT_EQ(chain.size(), 5u);
  // Blocks 0 and 1 computed by a request, then freed: cached-free, the LRU end.
  ASSERT_TRUE(kv.allocate_slots(1, 0, 8));
  kv.mark_computed(1, prompt, 8);
  kv.free(1);
  const KvCacheManager::Adoption a = kv.adopt_blocks(chain);
  EXPECT_EQ(a.chain, 5);
  ASSERT_EQ(a.blocks.size(), 3u);
  EXPECT_EQ(a.blocks[0].first, 2);
  EXPECT_EQ(a.blocks[2].first, 4);
  EXPECT_TRUE(kv.check_invariants().is_ok()) << kv.check_invariants().message();
  EXPECT_EQ(kv.stats().num_used_blocks, 0);  // adopted blocks are cached-free
  const PrefixMatch m = kv.find_cached_prefix(prompt);
  EXPECT_EQ(m.num_tokens, 20);
  EXPECT_EQ(m.block_ids[2], a.blocks[0].second);
  // A second adoption of the same chain finds it cached.
  EXPECT_TRUE(kv.adopt_blocks(chain).blocks.empty());
  // A longer chain than the pool: adoption stops at the pool's size without evicting its own.
  const std::vector<TokenId> longer = iota_tokens(41, 500);  // 10 blocks, 6 in the pool
  const KvCacheManager::Adoption b = kv.adopt_blocks(kv.prefix_block_hashes(longer));
  EXPECT_EQ(b.chain, 6);
  EXPECT_EQ(kv.find_cached_prefix(longer).num_tokens, 24);
  EXPECT_EQ(kv.find_cached_prefix(prompt).num_tokens, 0);  // the older chain made room
  EXPECT_TRUE(kv.check_invariants().is_ok()) << kv.check_invariants().message();
}

}  // namespace
}  // namespace m3
