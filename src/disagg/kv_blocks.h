#pragma once
// KV blocks moved between engines (prefill/decode disaggregation): the full blocks of a prompt,
// each under its chained prefix hash, as the pages the engine's host KV tier holds (every
// layer's K, V and index keys, per tensor-parallel rank; an EAGLE-3 draft's K/V after them).
//
// The wire form is self-checking: a header (what the pages are and each block's hash and
// checksum) and the pages. parse_kv_blocks names the first problem it finds (a short body, a
// wrong length, a block whose bytes do not match their checksum), so a broken transfer is
// refused instead of decoded into wrong KV.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/hash128.h"
#include "core/status.h"

namespace m3 {

struct KvBlocks {
  // What the pages are: the engine's KV layout key (the prefix hashes' root, page bytes, ranks,
  // draft). Two engines exchange blocks only when their keys are equal.
  std::string layout;
  int32_t block_size = 0;  // tokens per block
  int32_t tp = 1;          // ranks; each block holds one page per rank
  int64_t page_bytes = 0;  // one rank's page
  std::vector<Hash128> hashes;  // blocks 0..n-1 of the prompt, chained
  std::vector<char> bytes;      // block-major, then rank: n * tp * page_bytes
  // Or the pages stay in the producer's device memory (M3CudaIpcConnector, engines of one host):
  // rank r's page of block i at byte device_slots[i] * page_bytes of the memory `device_memory[r]`
  // names (a BackendRuntime::export_memory handle). `bytes` is then empty.
  std::vector<int32_t> device_slots;
  std::vector<std::string> device_memory;
  bool on_device() const { return !device_slots.empty() || !device_memory.empty(); }

  int32_t num_blocks() const { return int32_t(hashes.size()); }
  char* page(int32_t block, int32_t rank) { return bytes.data() + (int64_t(block) * tp + rank) * page_bytes; }
  const char* page(int32_t block, int32_t rank) const {
    return bytes.data() + (int64_t(block) * tp + rank) * page_bytes;
  }
  // Consistent sizes (what parse_kv_blocks checks, minus the checksums).
  Status validate() const;
};

std::string serialize_kv_blocks(const KvBlocks& blocks);
Result<KvBlocks> parse_kv_blocks(std::string_view wire);

}  // namespace m3
