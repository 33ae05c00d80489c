#include "kv/kv_cache_manager.h"

#include <algorithm>
#include <map>

#include "core/check.h"

namespace m3 {

Status KvCacheConfig::validate() const {
  std::string problems;
  if (num_blocks <= 0) problems += "num_blocks must be > 0 (got " + std::to_string(num_blocks) + "); ";
  if (block_size_tokens <= 0) {
    problems += "block_size_tokens must be > 0 (got " + std::to_string(block_size_tokens) + "); ";
  }
  if (num_host_blocks < 0) problems += "num_host_blocks must be >= 0 (got " + std::to_string(num_host_blocks) + "); ";
  if (num_host_blocks > 0 && !enable_prefix_caching)
    problems += "a host KV tier (num_host_blocks) needs prefix caching; ";
  if (problems.empty()) return Status::ok();
  problems.resize(problems.size() - 2);
  return Status::error("KvCacheConfig: " + problems);
}

Result<KvCacheManager> KvCacheManager::create(const KvCacheConfig& config) {
  M3_RETURN_IF_ERROR(config.validate());
  return KvCacheManager(config);
}

KvCacheManager::KvCacheManager(const KvCacheConfig& config)
    : config_(config),
      hasher_(config.hash_seed, config.block_size_tokens, config.hash_extra_keys),
      pool_(config.num_blocks) {
  if (config.num_host_blocks > 0) host_.emplace(config.num_host_blocks);
}

PrefixMatch KvCacheManager::match_hashes(std::span<const Hash128> hashes) const {
  PrefixMatch match;
  for (const Hash128& h : hashes) {
    const BlockId b = pool_.find_cached(h);
    if (b == kNoBlock) break;
    match.block_ids.push_back(b);
  }
  if (host_) {
    for (size_t i = match.block_ids.size(); i < hashes.size(); ++i) {
      const std::optional<int32_t> slot = host_->find(hashes[i]);
      if (!slot) break;
      match.host_slots.push_back(*slot);
    }
  }
  match.num_tokens = match.num_blocks() * block_size();
  return match;
}

PrefixMatch KvCacheManager::find_cached_prefix(RequestId request_id,
                                               std::span<const TokenId> tokens) {
  if (!config_.enable_prefix_caching || tokens.empty()) return {};
  const int32_t max_blocks = max_hit_blocks(tokens.size());
  RequestBlocks& rb = requests_[request_id];  // the hashes are kept for later steps
  hasher_.extend_block_hashes(tokens, &rb.block_hashes, max_blocks);
  return match_hashes(std::span(rb.block_hashes).first(max_blocks));
}

PrefixMatch KvCacheManager::find_cached_prefix(std::span<const TokenId> tokens) const {
  if (!config_.enable_prefix_caching || tokens.empty()) return {};
  std::vector<Hash128> hashes;
  hasher_.extend_block_hashes(tokens, &hashes, max_hit_blocks(tokens.size()));
  return match_hashes(hashes);
}

std::vector<Hash128> KvCacheManager::prefix_block_hashes(std::span<const TokenId> tokens) const {
  std::vector<Hash128> hashes;
  if (!tokens.empty()) hasher_.extend_block_hashes(tokens, &hashes, max_hit_blocks(tokens.size()));
  return hashes;
}

KvCacheManager::HostStore KvCacheManager::store_host_block(const Hash128& hash) {
  HostStore out;
  if (!host_) return out;
  if (host_->find(hash)) {
    out.present = true;
    return out;
  }
  if (const std::optional<int32_t> slot = host_->store(hash)) {
    out.slot = *slot;
    ++num_imported_;
  }
  return out;
}

KvCacheManager::Adoption KvCacheManager::adopt_blocks(std::span<const Hash128> hashes) {
  Adoption out;
  if (!config_.enable_prefix_caching) return out;
  std::vector<BlockId> pinned;  // the chain's blocks, cached or adopted, held while allocating
  for (size_t i = 0; i < hashes.size(); ++i) {
    BlockId b = pool_.find_cached(hashes[i]);
    if (b != kNoBlock) {
      pool_.acquire(b);
    } else {
      b = allocate_block();
      if (b == kNoBlock) break;
      pool_.register_hash(b, hashes[i]);  // not cached (just checked): it takes the hash
      out.blocks.emplace_back(int32_t(i), b);
    }
    pinned.push_back(b);
  }
  out.chain = int32_t(pinned.size());
  // Tail first, as free() does: under pressure the chain is evicted from its end.
  for (auto it = pinned.rbegin(); it != pinned.rend(); ++it) pool_.release(*it);
  return out;
}

bool KvCacheManager::allocate_slots(RequestId request_id, int32_t num_computed_tokens,
                                    int32_t num_new_tokens, const PrefixMatch* hit) {
  RequestBlocks& rb = requests_[request_id];
  const int32_t num_hit_blocks = hit ? static_cast<int32_t>(hit->block_ids.size()) : 0;
  const int32_t num_host_hits = hit ? static_cast<int32_t>(hit->host_slots.size()) : 0;
  M3_CHECK(num_hit_blocks + num_host_hits == 0 || rb.table.num_blocks() == 0,
           "prefix hit for request %llu that already holds blocks",
           static_cast<unsigned long long>(request_id));
  M3_CHECK(num_host_hits == 0 || (host_ && static_cast<int32_t>(rb.block_hashes.size()) >= num_hit_blocks + num_host_hits),
           "host-tier hit for request %llu without its block hashes", static_cast<unsigned long long>(request_id));
  const int32_t num_needed = blocks_for_tokens(int64_t{num_computed_tokens} + num_new_tokens);
  // Host hits take fresh blocks too (they are loaded into them).
  const int32_t num_fresh = std::max(0, num_needed - rb.table.num_blocks() - num_hit_blocks);
  // Hit blocks that are cached-free leave the free list when acquired: they are not
  // available as fresh blocks in the same call.
  int32_t num_hits_on_free_list = 0;
  for (int32_t i = 0; i < num_hit_blocks; ++i) {
    if (pool_.ref_count(hit->block_ids[i]) == 0) ++num_hits_on_free_list;
  }
  if (num_fresh > pool_.num_free_blocks() - num_hits_on_free_list) return false;
  for (int32_t i = 0; i < num_hit_blocks; ++i) {
    pool_.acquire(hit->block_ids[i]);
    rb.table.append(hit->block_ids[i]);
  }
  // Pinned first: the evictions the fresh blocks cause must not reuse a slot about to be read.
  for (int32_t j = 0; j < num_host_hits; ++j) host_->pin(hit->host_slots[j]);
  for (int32_t j = 0; j < num_host_hits; ++j) {
    const BlockId b = allocate_block();
    M3_CHECK(b != kNoBlock, "free count said a block was available");
    rb.table.append(b);
    loads_.push_back(KvTransfer{b, hit->host_slots[j]});
    ++num_loaded_;
    pool_.register_hash(b, rb.block_hashes[size_t(num_hit_blocks + j)]);
  }
  rb.num_published_blocks += num_hit_blocks + num_host_hits;
  for (int32_t i = num_host_hits; i < num_fresh; ++i) {
    const BlockId b = allocate_block();
    M3_CHECK(b != kNoBlock, "free count said a block was available");
    rb.table.append(b);
  }
  return true;
}

BlockId KvCacheManager::allocate_block() {
  std::optional<Hash128> evicted;
  const BlockId b = pool_.allocate(host_ ? &evicted : nullptr);
  if (b != kNoBlock && evicted && !host_->find(*evicted)) {
    if (const std::optional<int32_t> slot = host_->store(*evicted)) {
      offloads_.push_back(KvTransfer{b, *slot});
      ++num_offloaded_;
    }
  }
  return b;
}

void KvCacheManager::begin_step() {
  if (host_) host_->unpin_all();
}

void KvCacheManager::take_transfers(std::vector<KvTransfer>* offloads, std::vector<KvTransfer>* loads) {
  *offloads = std::move(offloads_);
  *loads = std::move(loads_);
  offloads_.clear();
  loads_.clear();
}

void KvCacheManager::mark_computed(RequestId request_id, std::span<const TokenId> tokens,
                                   int32_t num_computed_tokens) {
  if (!config_.enable_prefix_caching) return;
  auto it = requests_.find(request_id);
  M3_CHECK(it != requests_.end(), "mark_computed for unknown request");
  RequestBlocks& rb = it->second;
  const int32_t num_full = num_computed_tokens / block_size();
  M3_CHECK(num_full <= rb.table.num_blocks(), "computed tokens beyond allocated blocks");
  if (num_full <= rb.num_published_blocks) return;
  hasher_.extend_block_hashes(tokens.first(num_computed_tokens), &rb.block_hashes, num_full);
  for (int32_t i = rb.num_published_blocks; i < num_full; ++i) {
    // A duplicate (same content computed twice) stays private; the table keeps using it.
    pool_.register_hash(rb.table[i], rb.block_hashes[i]);
  }
  rb.num_published_blocks = num_full;
}

void KvCacheManager::unpublished_hashes(RequestId request_id, std::span<const TokenId> tokens,
                                        std::vector<Hash128>* out) {
  if (!config_.enable_prefix_caching) return;
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  RequestBlocks& rb = it->second;
  const int32_t max_blocks = max_hit_blocks(tokens.size());
  hasher_.extend_block_hashes(tokens, &rb.block_hashes, max_blocks);
  const int32_t end = std::min<int32_t>(max_blocks, static_cast<int32_t>(rb.block_hashes.size()));
  for (int32_t i = rb.num_published_blocks; i < end; ++i) out->push_back(rb.block_hashes[i]);
}

std::optional<Hash128> KvCacheManager::first_missed_hash(RequestId request_id, const PrefixMatch& hit) const {
  auto it = requests_.find(request_id);
  const size_t n = size_t(hit.num_blocks());
  if (it == requests_.end() || n >= it->second.block_hashes.size()) return std::nullopt;
  return it->second.block_hashes[n];
}

void KvCacheManager::free(RequestId request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  const std::vector<BlockId>& ids = it->second.table.block_ids();
  for (auto b = ids.rbegin(); b != ids.rend(); ++b) pool_.release(*b);
  requests_.erase(it);
}

bool KvCacheManager::holds_blocks(RequestId request_id) const {
  auto it = requests_.find(request_id);
  return it != requests_.end() && it->second.table.num_blocks() > 0;
}

const BlockTable& KvCacheManager::block_table(RequestId request_id) const {
  static const BlockTable kEmpty;  // immutable, so not mutable global state
  auto it = requests_.find(request_id);
  return it == requests_.end() ? kEmpty : it->second.table;
}

void KvCacheManager::record_prefix_query(int32_t num_query_tokens, int32_t num_hit_tokens) {
  prefix_query_tokens_ += num_query_tokens;
  prefix_hit_tokens_ += num_hit_tokens;
}

KvStats KvCacheManager::stats() const {
  KvStats s;
  s.num_blocks = pool_.num_blocks();
  s.num_used_blocks = pool_.num_used_blocks();
  s.num_free_blocks = pool_.num_free_blocks();
  s.num_cached_blocks = pool_.num_cached_blocks();
  s.num_evictions = pool_.num_evictions();
  s.prefix_query_tokens = prefix_query_tokens_;
  s.prefix_hit_tokens = prefix_hit_tokens_;
  if (host_) {
    s.num_host_blocks = host_->num_slots();
    s.num_host_used_blocks = host_->num_used_slots();
  }
  s.num_offloaded_blocks = num_offloaded_;
  s.num_loaded_blocks = num_loaded_;
  s.num_imported_blocks = num_imported_;
  return s;
}

Status KvCacheManager::check_invariants() const {
  M3_RETURN_IF_ERROR(pool_.check_invariants());
  if (host_) M3_RETURN_IF_ERROR(host_->check_invariants());
  std::vector<int32_t> holders(pool_.num_blocks(), 0);
  for (const auto& [id, rb] : requests_) {
    std::map<BlockId, int> seen;
    for (BlockId b : rb.table.block_ids()) {
      if (b < 0 || b >= pool_.num_blocks()) {
        return Status::error("request " + std::to_string(id) + " holds invalid block " +
                             std::to_string(b));
      }
      if (seen[b]++ > 0) {
        return Status::error("request " + std::to_string(id) + " holds block " +
                             std::to_string(b) + " twice");
      }
      ++holders[b];
    }
    if (rb.num_published_blocks > rb.table.num_blocks()) {
      return Status::error("request " + std::to_string(id) + " published unallocated blocks");
    }
    // A published block that carries a hash must carry this request's chained hash.
    for (int32_t i = 0; i < rb.num_published_blocks; ++i) {
      const auto& h = pool_.block_hash(rb.table[i]);
      if (h && i < static_cast<int32_t>(rb.block_hashes.size()) && *h != rb.block_hashes[i]) {
        return Status::error("request " + std::to_string(id) + " block " + std::to_string(i) +
                             " carries a foreign hash");
      }
    }
  }
  for (BlockId b = 0; b < pool_.num_blocks(); ++b) {
    if (holders[b] != pool_.ref_count(b)) {
      return Status::error("block " + std::to_string(b) + " ref " +
                           std::to_string(pool_.ref_count(b)) + " but held by " +
                           std::to_string(holders[b]) + " tables");
    }
  }
  return Status::ok();
}

}  // namespace m3
