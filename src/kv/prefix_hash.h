#pragma once
// Chained hashes of full KV blocks, the keys of the prefix cache.
//
// hash(block i) = H(seed; hash(block i-1), token ids of block i), and the parent of
// block 0 is a root hash over (seed, scheme version, block size, extra keys). Because
// every chain starts at the root, every block hash depends on the extra keys (model
// revision, KV cache dtype, ...): prefill and decode nodes that share seed and keys agree
// on every hash, and caches built under different keys never match. A block id owns all
// of that block's streams (K, V and index-K), so a hit reuses index-K too.
#include <span>
#include <string>
#include <vector>

#include "core/hash128.h"
#include "kv/kv_types.h"

namespace m3 {

class PrefixHasher {
 public:
  PrefixHasher(uint64_t seed, int32_t block_size_tokens, std::span<const std::string> extra_keys);

  const Hash128& root() const { return root_; }
  int32_t block_size_tokens() const { return block_size_tokens_; }

  // Hash of one full block given its parent's hash (root() for block 0).
  Hash128 block_hash(const Hash128& parent, std::span<const TokenId> block_tokens) const;

  // Appends to *hashes the chained hashes of the full blocks of `tokens` beyond the
  // hashes->size() already there, stopping after max_blocks in total (-1: all full blocks).
  void extend_block_hashes(std::span<const TokenId> tokens, std::vector<Hash128>* hashes,
                           int32_t max_blocks = -1) const;

 private:
  uint64_t seed_;
  int32_t block_size_tokens_;
  Hash128 root_;
};

}  // namespace m3
