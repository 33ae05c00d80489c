#include "model/minimax_m3/tp_shard.h"

#include <cstring>
#include <string_view>

#include "core/check.h"

namespace m3 {
namespace {

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

TpSlice tp_slice(const WeightSpec& spec, const MiniMaxM3Config& c) {
  if (c.tp_size == 1) return {};
  const std::string_view n = spec.name;
  const int64_t D = c.head_dim, r = c.tp_rank;
  auto rows = [](int64_t offset, int64_t count) { return TpSlice{0, offset, count}; };
  auto cols = [](int64_t offset, int64_t count) { return TpSlice{1, offset, count}; };
  // The embedding and the LM head by vocabulary (rows summed / logits gathered after).
  if (spec.role == WeightRole::kLmHead || spec.role == WeightRole::kEmbedding) return vocab_slice(c);
  if (spec.role != WeightRole::kLinear) return {};
  if (ends_with(n, "self_attn.q_proj.weight")) return rows(r * c.num_attention_heads * D, c.num_attention_heads * D);
  if (ends_with(n, "self_attn.k_proj.weight") || ends_with(n, "self_attn.v_proj.weight"))
    return rows(int64_t(c.kv_head_offset) * D, c.num_key_value_heads * D);
  if (ends_with(n, "self_attn.index_q_proj.weight"))
    return rows(int64_t(c.kv_head_offset) * c.index_head_dim, int64_t(c.index_n_heads) * c.index_head_dim);
  if (ends_with(n, "self_attn.o_proj.weight")) return cols(r * c.num_attention_heads * D, c.num_attention_heads * D);
  if (ends_with(n, "self_attn.index_k_proj.weight")) return {};  // one shared key head
  int64_t width = 0;  // the rank's share of the MLP's intermediate dim
  if (n.find("block_sparse_moe.shared_experts.") != std::string_view::npos)
    width = c.shared_intermediate_size * c.n_shared_experts;
  else if (n.find("block_sparse_moe.experts.") != std::string_view::npos)
    width = c.intermediate_size;
  else if (n.find(".mlp.") != std::string_view::npos)
    width = c.dense_intermediate_size;
  M3_CHECK(width > 0, "tp_slice: no tensor-parallel rule for %s", spec.name.c_str());
  const bool down = ends_with(n, "down_proj.weight") || ends_with(n, ".w2.weight");
  return down ? cols(r * width, width) : rows(r * width, width);
}

TpSlice vocab_slice(const MiniMaxM3Config& c) {
  if (c.tp_size == 1 || c.vocab_size % c.tp_size != 0) return {};
  const int64_t rows = c.vocab_size / c.tp_size;
  return TpSlice{0, c.tp_rank * rows, rows};
}

Shape sliced_shape(const Shape& shape, const TpSlice& s) {
  if (s.whole()) return shape;
  Shape out = shape;
  out.dims[size_t(s.dim)] = s.count;
  return out;
}

std::vector<uint8_t> slice_bytes(const uint8_t* data, const Shape& shape, size_t elem_bytes, const TpSlice& s) {
  const int64_t rows = shape[0], cols = shape.rank() > 1 ? shape[1] : 1;
  if (s.whole()) return std::vector<uint8_t>(data, data + size_t(rows * cols) * elem_bytes);
  if (s.dim == 0) {
    M3_CHECK(s.offset + s.count <= rows, "tp slice rows out of range");
    const size_t row_bytes = size_t(cols) * elem_bytes;
    return std::vector<uint8_t>(data + size_t(s.offset) * row_bytes, data + size_t(s.offset + s.count) * row_bytes);
  }
  const int64_t c0 = s.offset, nc = s.count;
  M3_CHECK(c0 + nc <= cols, "tp slice columns out of range");
  std::vector<uint8_t> out(size_t(rows * nc) * elem_bytes);
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(out.data() + size_t(i * nc) * elem_bytes, data + size_t(i * cols + c0) * elem_bytes, size_t(nc) * elem_bytes);
  return out;
}

Mxfp8Slice slice_mxfp8(const StoredWeight& w, const TpSlice& s, int64_t block_k) {
  M3_CHECK(w.is_mxfp8(), "slice_mxfp8: not an MXFP8 weight");
  M3_CHECK(s.dim != 1 || (s.offset % block_k == 0 && s.count % block_k == 0), "a column slice splits a scale block");
  const TpSlice scale_slice = s.dim == 1 ? TpSlice{1, s.offset / block_k, s.count / block_k} : s;
  Mxfp8Slice out;
  out.weight = slice_bytes(w.weight->data, w.weight->shape, 1, s);
  out.scale = slice_bytes(w.scale->data, w.scale->shape, 1, scale_slice);
  out.weight_shape = sliced_shape(w.weight->shape, s);
  out.scale_shape = sliced_shape(w.scale->shape, scale_slice);
  return out;
}

}  // namespace m3
