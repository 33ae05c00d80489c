// The producer's store of KV transfers: held until acknowledged, expired after the time limit,
// the oldest dropped for room, one that alone is over the limit refused.
#include <gtest/gtest.h>

#include <set>

#include "disagg/transfer_store.h"

namespace m3 {
namespace {

using namespace std::chrono_literals;

std::shared_ptr<const std::string> blob(size_t n) { return std::make_shared<const std::string>(n, 'k'); }

TEST(KvTransferStore, HeldUntilAcknowledged) {
  KvTransferStore store(1000, 60s);
  const std::string id = store.put(blob(100));
  ASSERT_FALSE(id.empty());
  ASSERT_NE(store.get(id), nullptr);
  EXPECT_EQ(store.get(id)->size(), 100u);
  EXPECT_EQ(store.get(id)->size(), 100u);  // fetching twice is fine (a retried fetch)
  EXPECT_TRUE(store.acknowledge(id));
  EXPECT_EQ(store.get(id), nullptr);
  EXPECT_FALSE(store.acknowledge(id));
  EXPECT_EQ(store.get("0123"), nullptr);
  const KvTransferStoreStats s = store.stats();
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.stored, 1);
  EXPECT_EQ(s.acknowledged, 1);
}

TEST(KvTransferStore, ExpiresUnfetchedBlocks) {
  auto now = std::chrono::steady_clock::time_point{};
  KvTransferStore store(1000, 10s, [&] { return now; });
  const std::string a = store.put(blob(10));
  now += 6s;
  const std::string b = store.put(blob(10));
  now += 5s;  // a is 11 s old, b 5 s
  EXPECT_EQ(store.get(a), nullptr);
  EXPECT_EQ(store.stats().entries, 1u);  // b (a fetch would hold it longer)
  now += 5s;
  EXPECT_EQ(store.get(b), nullptr);
  EXPECT_EQ(store.stats().expired, 2);
  EXPECT_EQ(store.stats().bytes, 0u);
}

TEST(KvTransferStore, OldestGoFirstForRoom) {
  KvTransferStore store(250, 60s);
  const std::string a = store.put(blob(100)), b = store.put(blob(100)), c = store.put(blob(100));
  EXPECT_EQ(store.get(a), nullptr);
  EXPECT_NE(store.get(b), nullptr);
  EXPECT_NE(store.get(c), nullptr);
  EXPECT_EQ(store.stats().evicted, 1);
  EXPECT_EQ(store.stats().bytes, 200u);
  EXPECT_TRUE(store.put(blob(251)).empty());  // alone over the limit: refused, nothing dropped
  EXPECT_NE(store.get(b), nullptr);
}

TEST(KvTransferStore, IdsAreDistinct) {
  KvTransferStore store(1 << 20, 60s);
  std::set<std::string> ids;
  for (int i = 0; i < 100; ++i) ids.insert(store.put(blob(1)));
  EXPECT_EQ(ids.size(), 100u);
  for (const auto& id : ids) EXPECT_EQ(id.size(), 32u);
}

}  // namespace
}  // namespace m3

namespace m3 {
namespace {

using namespace std::chrono_literals;

// What a blob refers to (device slots) is freed exactly once, however the entry goes; a fetch
// holds the entry another ttl (the consumer copies from what it refers to meanwhile).
TEST(KvTransferStore, DropCallbacksAndFetchHolds) {
  auto now = std::chrono::steady_clock::time_point{};
  KvTransferStore store(250, 10s, [&] { return now; });
  int acked = 0, expired = 0, evicted = 0, refused = 0;
  const std::string a = store.put(std::make_shared<const std::string>(100, 'a'), [&] { ++acked; });
  const std::string b = store.put(std::make_shared<const std::string>(100, 'b'), [&] { ++expired; });
  EXPECT_TRUE(store.put(std::make_shared<const std::string>(300, 'x'), [&] { ++refused; }).empty());
  EXPECT_EQ(refused, 1);
  now += 8s;
  ASSERT_NE(store.get(a), nullptr);  // fetched at 8 s: held until 18 s
  now += 4s;                         // 12 s: b (10 s) expires, a does not
  EXPECT_EQ(store.get(b), nullptr);
  EXPECT_EQ(expired, 1);
  EXPECT_NE(store.get(a), nullptr);
  EXPECT_TRUE(store.acknowledge(a));
  EXPECT_FALSE(store.acknowledge(a));
  EXPECT_EQ(acked, 1);
  const std::string c = store.put(std::make_shared<const std::string>(200, 'c'), [&] { ++evicted; });
  store.put(std::make_shared<const std::string>(100, 'd'));
  EXPECT_EQ(store.get(c), nullptr);
  EXPECT_EQ(evicted, 1);
  EXPECT_EQ(acked + expired + evicted + refused, 4);
}

}  // namespace
}  // namespace m3
