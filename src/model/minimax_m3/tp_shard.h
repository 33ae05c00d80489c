#pragma once
// Which part of a checkpoint tensor a tensor-parallel rank holds (MiniMaxM3Config::shard):
// column-parallel projections (q, k, v, index q, MLP and expert gate / up) keep a range of
// output rows, row-parallel ones (o_proj, MLP and expert down) a range of input columns, whose
// partial outputs the forward sums over the ranks; the embedding and the LM head keep a range of
// the vocabulary where it divides (embedded rows are summed over the ranks, logits gathered);
// everything else (norms, router, index-key projection) is whole on every rank.
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/minimax_m3/config.h"
#include "model/minimax_m3/weight_reader.h"
#include "model/minimax_m3/weight_specs.h"

namespace m3 {

struct TpSlice {
  int dim = -1;  // -1: the whole tensor; 0: rows [offset, offset + count); 1: columns
  int64_t offset = 0, count = 0;
  bool whole() const { return dim < 0; }
};

// The slice of `spec` (a tensor of the whole model) that the rank of `local` (a shard() result) holds.
TpSlice tp_slice(const WeightSpec& spec, const MiniMaxM3Config& local);

// The rows of the vocabulary the rank of `local` holds in the embedding and the LM head: a range
// where the vocabulary divides by the TP size, else whole.
TpSlice vocab_slice(const MiniMaxM3Config& local);

Shape sliced_shape(const Shape& shape, const TpSlice& s);

// The slice of a row-major [rows, cols] tensor of `elem_bytes` elements, copied out.
std::vector<uint8_t> slice_bytes(const uint8_t* data, const Shape& shape, size_t elem_bytes, const TpSlice& s);

// A rank's slice of a stored MXFP8 linear: e4m3 weights and their e8m0 scales (a column slice of
// the weight is a column slice of the scales, block_k times narrower).
struct Mxfp8Slice {
  std::vector<uint8_t> weight, scale;
  Shape weight_shape, scale_shape;
};
Mxfp8Slice slice_mxfp8(const StoredWeight& w, const TpSlice& s, int64_t block_k);

}  // namespace m3
