#include "kv/prefix_hash.h"

#include <algorithm>

#include "core/check.h"

namespace m3 {
namespace {
// Bump when the byte layout fed to the hasher changes, so old caches never match.
constexpr std::string_view kSchemeTag = "m3.kv.prefix.v1";
}  // namespace

PrefixHasher::PrefixHasher(uint64_t seed, int32_t block_size_tokens,
                           std::span<const std::string> extra_keys)
    : seed_(seed), block_size_tokens_(block_size_tokens) {
  M3_CHECK(block_size_tokens > 0, "block size %d", block_size_tokens);
  Hasher128 h(seed);
  h.update_string(kSchemeTag);
  h.update_u32(static_cast<uint32_t>(block_size_tokens));
  h.update_u64(extra_keys.size());
  for (const std::string& key : extra_keys) h.update_string(key);
  root_ = h.finish();
}

Hash128 PrefixHasher::block_hash(const Hash128& parent,
                                 std::span<const TokenId> block_tokens) const {
  Hasher128 h(seed_);
  h.update_hash(parent);
  h.update_u32(static_cast<uint32_t>(block_tokens.size()));
  for (TokenId t : block_tokens) h.update_u32(static_cast<uint32_t>(t));
  return h.finish();
}

void PrefixHasher::extend_block_hashes(std::span<const TokenId> tokens,
                                       std::vector<Hash128>* hashes, int32_t max_blocks) const {
  const size_t bs = static_cast<size_t>(block_size_tokens_);
  size_t num_full = tokens.size() / bs;
  if (max_blocks >= 0) num_full = std::min(num_full, static_cast<size_t>(max_blocks));
  while (hashes->size() < num_full) {
    const size_t i = hashes->size();
    const Hash128& parent = i == 0 ? root_ : (*hashes)[i - 1];
    hashes->push_back(block_hash(parent, tokens.subspan(i * bs, bs)));
  }
}

}  // namespace m3
