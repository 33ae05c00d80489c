#pragma once
// The tuned MSA entries (msa_indexer.cu, msa_decode.cu) and the generic kernels of
// attention.cu they hand shapes they do not take to (so a BF16 cache always has a kernel).
#include "ops/ops.h"

namespace m3::cuda {

// Generic entries (attention.cu): any head_dim <= 256, block size, top_k <= 64.
void launch_generic_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                              const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                              const TensorView& out);
void launch_generic_indexer_topk(const TensorView& index_q, const TensorView& index_k_cache,
                                 const ops::AttentionMetadata& meta, const ops::IndexerParams& params,
                                 const TensorView& selected);

// Tuned entries, callable directly (the benchmark times them without the dispatch table).
void launch_msa_indexer(const TensorView& index_q, const TensorView& index_k_cache, const ops::AttentionMetadata& meta,
                        const ops::IndexerParams& params, const TensorView& selected);
void launch_msa_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                          const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                          const TensorView& out);

// Multiprocessor count of the current device (cached per device).
int current_sm_count();

}  // namespace m3::cuda
