// The KV block transfer's wire form: a round trip keeps every byte and hash; every way a body
// can arrive damaged (not ours, another version, cut short, a flipped byte, a bad header) is
// refused with a message naming it, never parsed into wrong KV.
#include <gtest/gtest.h>

#include "disagg/kv_blocks.h"

namespace m3 {
namespace {

KvBlocks sample(int blocks = 3, int tp = 2, int64_t page = 40) {
  KvBlocks b;
  b.layout = "m3kv/1 test";
  b.block_size = 16;
  b.tp = tp;
  b.page_bytes = page;
  for (int i = 0; i < blocks; ++i) b.hashes.push_back(hash128(&i, sizeof i, 7));
  b.bytes.resize(size_t(blocks) * size_t(tp) * size_t(page));
  for (size_t i = 0; i < b.bytes.size(); ++i) b.bytes[i] = char((i * 131 + 7) & 0xff);
  return b;
}

TEST(KvBlocks, RoundTripKeepsEverything) {
  const KvBlocks b = sample();
  ASSERT_TRUE(b.validate().is_ok());
  auto p = parse_kv_blocks(serialize_kv_blocks(b));
  ASSERT_TRUE(p.is_ok()) << p.error();
  EXPECT_EQ(p->layout, b.layout);
  EXPECT_EQ(p->block_size, 16);
  EXPECT_EQ(p->tp, 2);
  EXPECT_EQ(p->page_bytes, 40);
  EXPECT_EQ(p->hashes, b.hashes);
  EXPECT_EQ(p->bytes, b.bytes);
  // Pages are block-major, then rank.
  EXPECT_EQ(p->page(1, 1) - p->page(0, 0), 3 * 40);
}

TEST(KvBlocks, NoBlocksRoundTrips) {
  auto p = parse_kv_blocks(serialize_kv_blocks(sample(0)));
  ASSERT_TRUE(p.is_ok()) << p.error();
  EXPECT_EQ(p->num_blocks(), 0);
}

TEST(KvBlocks, DamageIsRefusedByName) {
  const std::string wire = serialize_kv_blocks(sample());
  auto expect_error = [](const std::string& w, const std::string& needle) {
    auto p = parse_kv_blocks(w);
    ASSERT_FALSE(p.is_ok()) << "parsed a damaged body, expected: " << needle;
    EXPECT_NE(p.error().find(needle), std::string::npos) << p.error();
  };
  expect_error("", "not an m3serve KV block transfer");
  expect_error("{\"error\": \"not found\"}", "not an m3serve KV block transfer");
  std::string w = wire;
  w[8] = 2;  // version
  expect_error(w, "format version 2");
  expect_error(wire.substr(0, wire.size() - 1), "truncated transfer");
  expect_error(wire + "x", "body carries");
  // A flipped byte in the second block's pages (blocks are 2 ranks x 40 bytes: the last 80 are block 2).
  w = wire;
  w[w.size() - 80 - 5] ^= 0x10;
  expect_error(w, "block 1 ");
  w = wire;
  w[w.size() - 1] ^= 0x01;
  expect_error(w, "block 2 ");
  // Header damage: a header length past the body, a header that is not JSON.
  w = wire;
  w[16] = char(0xff);
  w[17] = char(0xff);
  w[18] = char(0xff);
  expect_error(w, "runs past the body");
  w = wire;
  w[24] = '[';  // the header's first byte
  expect_error(w, "not valid JSON");
}

TEST(KvBlocks, ValidateChecksSizes) {
  KvBlocks b = sample();
  b.bytes.pop_back();
  EXPECT_NE(b.validate().message().find("need 240 bytes, got 239"), std::string::npos) << b.validate().message();
  b = sample();
  b.page_bytes = 0;
  EXPECT_FALSE(b.validate().is_ok());
}

}  // namespace
}  // namespace m3
