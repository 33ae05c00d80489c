#include "disagg/kv_blocks.h"

#include <bit>
#include <cstring>

#include <nlohmann/json.hpp>

namespace m3 {
namespace {

constexpr char kMagic[8] = {'M', '3', 'K', 'V', 'B', 'L', 'K', 'S'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kChecksumSeed = 0x6b76626c6f636b73ULL;  // "kvblocks"
constexpr size_t kFixedBytes = sizeof(kMagic) + 4 + 4 + 8;  // magic, version, reserved, header length

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}
void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}
uint64_t get_le(const char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t(uint8_t(p[i])) << (8 * i);
  return v;
}

bool parse_hex_hash(const std::string& s, Hash128* out) {
  if (s.size() != 32) return false;
  uint64_t parts[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    const char c = s[i];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0) return false;
    parts[i / 16] = (parts[i / 16] << 4) | uint64_t(d);
  }
  out->hi = parts[0];  // to_hex writes hi then lo
  out->lo = parts[1];
  return true;
}

// A page's checksum: four independent 64-bit multiply-xor lanes over 32-byte strides (the lanes'
// dependency chains overlap, ~4x hash128's rate), folded with the length through hash128. Catches
// damage in transfer, not an adversary (the prefix hashes and the layout key carry identity).
Hash128 checksum(const char* data, int64_t bytes) {
  constexpr uint64_t kMul[4] = {0x9e3779b97f4a7c15ULL, 0xc2b2ae3d27d4eb4fULL, 0x165667b19e3779f9ULL,
                                0xd6e8feb86659fd93ULL};
  uint64_t lane[4] = {kChecksumSeed, kChecksumSeed ^ 1, kChecksumSeed ^ 2, kChecksumSeed ^ 3};
  const int64_t body = bytes / 32 * 32;
  for (int64_t i = 0; i < body; i += 32) {
    for (int j = 0; j < 4; ++j) {
      uint64_t w;
      std::memcpy(&w, data + i + 8 * j, 8);
      if constexpr (std::endian::native == std::endian::big) w = __builtin_bswap64(w);  // little-endian words everywhere
      lane[j] = (lane[j] ^ w) * kMul[j];
      lane[j] ^= lane[j] >> 29;
    }
  }
  Hasher128 h(kChecksumSeed);
  for (uint64_t l : lane) h.update_u64(l);
  h.update(data + body, size_t(bytes - body));  // the tail, byte by byte
  h.update_u64(uint64_t(bytes));
  return h.finish();
}

}  // namespace

Status KvBlocks::validate() const {
  if (block_size < 1) return Status::error("KV blocks: block_size must be >= 1, got " + std::to_string(block_size));
  if (tp < 1) return Status::error("KV blocks: tp must be >= 1, got " + std::to_string(tp));
  if (page_bytes < 1) return Status::error("KV blocks: page_bytes must be >= 1, got " + std::to_string(page_bytes));
  if (on_device()) {
    if (!bytes.empty()) return Status::error("KV blocks: pages in device memory and in bytes at once");
    if (device_slots.size() != hashes.size() || device_memory.size() != size_t(tp))
      return Status::error("KV blocks: " + std::to_string(hashes.size()) + " blocks of " + std::to_string(tp) +
                           " ranks need as many device slots and one memory handle per rank, got " +
                           std::to_string(device_slots.size()) + " and " + std::to_string(device_memory.size()));
    for (int32_t s : device_slots)
      if (s < 0) return Status::error("KV blocks: negative device slot " + std::to_string(s));
    return Status::ok();
  }
  const int64_t want = int64_t(hashes.size()) * tp * page_bytes;
  if (int64_t(bytes.size()) != want)
    return Status::error("KV blocks: " + std::to_string(hashes.size()) + " blocks of " + std::to_string(tp) + " x " +
                         std::to_string(page_bytes) + " bytes need " + std::to_string(want) + " bytes, got " +
                         std::to_string(bytes.size()));
  return Status::ok();
}

std::string serialize_kv_blocks(const KvBlocks& b) {
  nlohmann::json h;
  h["layout"] = b.layout;
  h["block_size"] = b.block_size;
  h["tp"] = b.tp;
  h["page_bytes"] = b.page_bytes;
  nlohmann::json hashes = nlohmann::json::array(), sums = nlohmann::json::array();
  const int64_t block_bytes = int64_t(b.tp) * b.page_bytes;
  for (int32_t i = 0; i < b.num_blocks(); ++i) {
    hashes.push_back(b.hashes[size_t(i)].to_hex());
    // (Pages left in device memory travel without bytes, so without checksums.)
    sums.push_back(b.on_device() ? Hash128{}.to_hex() : checksum(b.bytes.data() + i * block_bytes, block_bytes).to_hex());
  }
  h["hashes"] = std::move(hashes);
  h["checksums"] = std::move(sums);
  if (b.on_device()) {
    h["device_slots"] = b.device_slots;
    h["device_memory"] = b.device_memory;
  }
  const std::string header = h.dump();
  std::string out;
  out.reserve(kFixedBytes + header.size() + b.bytes.size());
  out.append(kMagic, sizeof(kMagic));
  put_u32(out, kVersion);
  put_u32(out, 0);
  put_u64(out, header.size());
  out += header;
  out.append(b.bytes.data(), b.bytes.size());
  return out;
}

Result<KvBlocks> parse_kv_blocks(std::string_view wire) {
  if (wire.size() < kFixedBytes || std::memcmp(wire.data(), kMagic, sizeof(kMagic)) != 0)
    return Status::error("KV blocks: not an m3serve KV block transfer (" + std::to_string(wire.size()) +
                         " bytes, no M3KVBLKS header)");
  const uint32_t version = uint32_t(get_le(wire.data() + 8, 4));
  if (version != kVersion)
    return Status::error("KV blocks: format version " + std::to_string(version) + ", this m3serve reads version " +
                         std::to_string(kVersion));
  const uint64_t header_len = get_le(wire.data() + 16, 8);
  if (header_len > wire.size() - kFixedBytes)
    return Status::error("KV blocks: header of " + std::to_string(header_len) + " bytes runs past the body (" +
                         std::to_string(wire.size()) + " bytes)");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(wire.substr(kFixedBytes, header_len));
  } catch (const std::exception& e) {
    return Status::error(std::string("KV blocks: header is not valid JSON: ") + e.what());
  }
  KvBlocks b;
  std::vector<Hash128> sums;
  try {
    b.layout = h.at("layout").get<std::string>();
    b.block_size = h.at("block_size").get<int32_t>();
    b.tp = h.at("tp").get<int32_t>();
    b.page_bytes = h.at("page_bytes").get<int64_t>();
    const auto& hs = h.at("hashes");
    const auto& cs = h.at("checksums");
    if (!hs.is_array() || !cs.is_array() || hs.size() != cs.size())
      return Status::error("KV blocks: header needs arrays 'hashes' and 'checksums' of equal length");
    for (size_t i = 0; i < hs.size(); ++i) {
      Hash128 x, s;
      if (!parse_hex_hash(hs[i].get<std::string>(), &x) || !parse_hex_hash(cs[i].get<std::string>(), &s))
        return Status::error("KV blocks: block " + std::to_string(i) + "'s hash or checksum is not 32 hex digits");
      b.hashes.push_back(x);
      sums.push_back(s);
    }
    if (h.contains("device_slots") || h.contains("device_memory")) {
      b.device_slots = h.at("device_slots").get<std::vector<int32_t>>();
      b.device_memory = h.at("device_memory").get<std::vector<std::string>>();
    }
  } catch (const std::exception& e) {
    return Status::error(std::string("KV blocks: header field missing or of the wrong type: ") + e.what());
  }
  if (b.block_size < 1 || b.tp < 1 || b.page_bytes < 1)
    return Status::error("KV blocks: block_size, tp and page_bytes must be >= 1");
  const uint64_t payload = wire.size() - kFixedBytes - header_len;
  if (b.on_device()) {
    if (payload != 0) return Status::error("KV blocks: pages in device memory, but the body carries page bytes too");
    M3_RETURN_IF_ERROR(b.validate());
    return b;
  }
  const long double want = (long double)b.hashes.size() * b.tp * b.page_bytes;
  if ((long double)payload != want)
    return Status::error("KV blocks: " + std::to_string(b.hashes.size()) + " blocks of " + std::to_string(b.tp) + " x " +
                         std::to_string(b.page_bytes) + " bytes, but the body carries " + std::to_string(payload) +
                         " bytes of pages (truncated transfer?)");
  const char* pages = wire.data() + kFixedBytes + header_len;
  const int64_t block_bytes = int64_t(b.tp) * b.page_bytes;
  for (size_t i = 0; i < sums.size(); ++i) {
    if (checksum(pages + int64_t(i) * block_bytes, block_bytes) != sums[i])
      return Status::error("KV blocks: block " + std::to_string(i) + " (hash " + b.hashes[i].to_hex() +
                           ") does not match its checksum: its bytes were damaged in transfer");
  }
  b.bytes.assign(pages, pages + payload);
  return b;
}

}  // namespace m3
