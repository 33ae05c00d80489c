// The host KV tier's metadata (least recently used out, pinned slots kept) and the manager's
// transfers: an evicted hashed block is offloaded, a later lookup finds it on the host and its
// allocation loads it into a fresh block under the same hash.
#include <gtest/gtest.h>

#include "kv/kv_cache_manager.h"

namespace m3 {
namespace {

Hash128 h(uint64_t v) { return hash128(&v, sizeof v, 7); }

TEST(HostBlockTier, LeastRecentlyUsedOutPinnedKept) {
  HostBlockTier t(2);
  const auto a = t.store(h(1)), b = t.store(h(2));
  ASSERT_TRUE(a && b);
  EXPECT_NE(*a, *b);
  EXPECT_EQ(t.find(h(1)), a);
  t.pin(*a);                    // most recent, and not reusable this step
  const auto c = t.store(h(3));  // takes b's slot (h(2) out)
  EXPECT_EQ(c, b);
  EXPECT_FALSE(t.find(h(2)));
  t.pin(*c);
  EXPECT_FALSE(t.store(h(4)));   // every slot pinned: nothing to give
  t.unpin_all();
  EXPECT_EQ(t.store(h(4)), a);   // a is now the least recently used
  EXPECT_FALSE(t.find(h(1)));
  EXPECT_TRUE(t.check_invariants().is_ok()) << t.check_invariants().message();
}

TEST(KvCacheManager, EvictedBlocksGoToTheHostTierAndComeBack) {
  KvCacheConfig c;
  c.num_blocks = 3;
  c.block_size_tokens = 2;
  c.num_host_blocks = 4;
  auto kv = std::move(*KvCacheManager::create(c));
  const std::vector<TokenId> a{1, 2, 3, 4, 5}, b{9, 8, 7, 6, 5};
  // a computes blocks [1 2] [3 4] (+ 5), publishes them, finishes.
  kv.begin_step();
  ASSERT_TRUE(kv.allocate_slots(1, 0, 5, nullptr));
  kv.mark_computed(1, a, 5);
  kv.free(1);
  std::vector<KvTransfer> off, load;
  kv.take_transfers(&off, &load);
  EXPECT_TRUE(off.empty() && load.empty());
  // b needs all three blocks: a's two cached ones are evicted and offloaded.
  kv.begin_step();
  ASSERT_TRUE(kv.allocate_slots(2, 0, 5, nullptr));
  kv.take_transfers(&off, &load);
  EXPECT_EQ(off.size(), 2u);
  EXPECT_TRUE(load.empty());
  kv.mark_computed(2, b, 5);
  kv.free(2);
  // a again: no device hit, two host hits; the allocation loads them into fresh blocks.
  kv.begin_step();
  PrefixMatch hit = kv.find_cached_prefix(3, a);
  EXPECT_TRUE(hit.block_ids.empty());
  ASSERT_EQ(hit.host_slots.size(), 2u);
  EXPECT_EQ(hit.num_tokens, 4);
  ASSERT_TRUE(kv.allocate_slots(3, hit.num_tokens, 1, &hit));
  kv.take_transfers(&off, &load);
  ASSERT_EQ(load.size(), 2u);
  EXPECT_EQ(load[0].host_slot, hit.host_slots[0]);
  EXPECT_EQ(load[0].device_block, kv.block_table(3)[0]);
  EXPECT_EQ(load[1].device_block, kv.block_table(3)[1]);
  // The loaded blocks are published: another request with a's prefix hits them on the device.
  const PrefixMatch dev = kv.find_cached_prefix(4, a);
  EXPECT_EQ(dev.block_ids.size(), 2u);
  EXPECT_TRUE(kv.check_invariants().is_ok()) << kv.check_invariants().message();
  const KvStats st = kv.stats();
  EXPECT_EQ(st.num_loaded_blocks, 2);
  EXPECT_GE(st.num_offloaded_blocks, 2);
  KvCacheConfig bad = c;
  bad.enable_prefix_caching = false;
  EXPECT_FALSE(bad.validate().is_ok());
}

}  // namespace
}  // namespace m3
