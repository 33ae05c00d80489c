// Paged causal GQA attention (dense and MSA block-sparse) and the MSA lightning indexer.
// Every key is read through the page table; no contiguous copy of a sequence's KV is made.
// Caches may be F32, BF16 or (index-K only) F8E4M3: elements are converted to fp32 on read
// and every product and sum is the same fp32 expression, so a GPU kernel reading the same
// cache can match these results (bit for bit for the indexer's block scores).
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_parallel.h"
#include "backend/cpu/eligibility.h"

namespace m3::cpu {
namespace {

// fn(t, s) for every batch token t of a sequence s, one item per token on the host's threads; the
// call's cost is its causal (token, key) pairs x per_key.
template <class F>
void for_each_token(const ops::AttentionMetadata& meta, int64_t per_key, F&& fn) {
  if (meta.num_seqs == 0) return;
  const int* const qs = meta.query_start;
  const int first = qs[0], last = qs[meta.num_seqs];
  int64_t causal_keys = 0;
  for (int t = first; t < last; ++t) causal_keys += int64_t(meta.positions[t]) + 1;
  parallel_for(last - first, causal_keys * per_key, [&](int64_t i) {
    const int t = first + int(i);
    // The last sequence starting at or before t (empty sequences share their start with the next).
    const int s = int(std::upper_bound(qs, qs + meta.num_seqs + 1, t) - qs) - 1;
    fn(t, s);
  });
}

// Cache element -> fp32 (exact for every cache dtype).
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
// e4m3 through a table of its 256 values (the conversion's ldexp per element made a 3000-token
// prompt over an FP8 index-K cache 5x slower than over an F32 one; with the table 2x).
inline float load(const uint8_t* p, int64_t i) {
  static const std::array<float, 256> kE4m3 = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[size_t(b)] = fp8_e4m3_to_f32(uint8_t(b));
    return t;
  }();
  return kE4m3[p[i]];
}

template <class KV>
void attention_ref(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                   const ops::AttentionMetadata& meta, const TensorView& selected, int top_k, const TensorView& out) {
  const int64_t num_tokens = q.shape[0], q_heads = q.shape[1], head_dim = q.shape[2];
  const int64_t kv_heads = k_cache.shape[1];
  const int64_t group = q_heads / kv_heads;
  const float scale = 1.0f / std::sqrt(float(head_dim));
  const KV* kc = k_cache.as<const KV>();
  const KV* vc = v_cache.as<const KV>();
  const int32_t* sel = selected.data ? selected.as<const int32_t>() : nullptr;
  // Per token: its outputs alone.
  for_each_token(meta, q_heads * head_dim, [&](int t, int s) {
    thread_local std::vector<float> scores;  // scratch kept across a thread's tokens
    thread_local std::vector<int64_t> slots;
    thread_local std::vector<char> block_on;
    const int64_t pos = meta.positions[t];
    for (int64_t g = 0; g < kv_heads; ++g) {
      // Keys this KV group may see: causal, and (MSA) inside its selected blocks.
      slots.clear();
      if (sel) {
        block_on.assign(size_t(pos / meta.block_size + 1), 0);
        for (int i = 0; i < top_k; ++i) {
          int32_t b = sel[(g * num_tokens + t) * top_k + i];
          if (b >= 0 && b < int32_t(block_on.size())) block_on[size_t(b)] = 1;
        }
      }
      for (int64_t j = 0; j <= pos; ++j) {
        if (sel && !block_on[size_t(j / meta.block_size)]) continue;
        slots.push_back(meta.slot_of(s, j));
      }
      for (int64_t hq = g * group; hq < (g + 1) * group; ++hq) {
        const float* qv = q.as<const float>() + (int64_t(t) * q_heads + hq) * head_dim;
        scores.resize(slots.size());
        float max_score = -std::numeric_limits<float>::infinity();
        for (size_t i = 0; i < slots.size(); ++i) {
          const KV* kv = kc + (slots[i] * kv_heads + g) * head_dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qv[d] * load(kv, d);
          scores[i] = dot * scale;
          max_score = std::max(max_score, scores[i]);
        }
        float denom = 0.0f;
        for (float& sc : scores) {
          sc = std::exp(sc - max_score);
          denom += sc;
        }
        float* o = out.as<float>() + (int64_t(t) * q_heads + hq) * head_dim;
        std::fill(o, o + head_dim, 0.0f);
        for (size_t i = 0; i < slots.size(); ++i) {
          const KV* vv = vc + (slots[i] * kv_heads + g) * head_dim;
          const float p = scores[i] / denom;
          for (int64_t d = 0; d < head_dim; ++d) o[d] += p * load(vv, d);
        }
      }
    }
  });
}

// Block score = max over the block's keys at or before the query (causal cut before pooling;
// the partial last block is right-padded with -inf). The local block is always kept; the other
// top_k - 1 are the highest-scoring earlier blocks (ties: lower block id). Output is ascending
// block ids, then -1 padding.
template <class IK>
void indexer_topk_ref(const TensorView& index_q, const TensorView& index_k_cache, const ops::AttentionMetadata& meta,
                      const ops::IndexerParams& params, const TensorView& selected) {
  const int64_t num_tokens = index_q.shape[0], heads = index_q.shape[1], dim = index_q.shape[2];
  const int bs = params.block_size, top_k = params.top_k;
  const IK* ik = index_k_cache.as<const IK>();
  int32_t* out = selected.as<int32_t>();
  // Per token: its heads' selections alone.
  for_each_token(meta, heads * dim, [&](int t, int s) {
    thread_local std::vector<float> block_score;  // scratch kept across a thread's tokens
    thread_local std::vector<int32_t> order;
    const int64_t pos = meta.positions[t];
    const int32_t num_blocks = int32_t(pos / bs + 1), local = num_blocks - 1;
    for (int64_t h = 0; h < heads; ++h) {
      int32_t* dst = out + (h * num_tokens + t) * top_k;
      std::fill(dst, dst + top_k, -1);
      if (num_blocks <= top_k) {  // every valid block fits: exactly dense causal attention
        for (int32_t b = 0; b < num_blocks; ++b) dst[b] = b;
        continue;
      }
      const float* qv = index_q.as<const float>() + (int64_t(t) * heads + h) * dim;
      block_score.assign(size_t(local), -std::numeric_limits<float>::infinity());
      for (int32_t b = 0; b < local; ++b) {  // earlier blocks are complete and fully in the past
        for (int64_t j = int64_t(b) * bs; j < int64_t(b + 1) * bs; ++j) {
          const IK* kv = ik + meta.slot_of(s, j) * dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < dim; ++d) dot += qv[d] * load(kv, d);
          block_score[size_t(b)] = std::max(block_score[size_t(b)], dot);
        }
      }
      order.resize(size_t(local));
      for (int32_t b = 0; b < local; ++b) order[size_t(b)] = b;
      std::partial_sort(order.begin(), order.begin() + (top_k - 1), order.end(), [&](int32_t a, int32_t b) {
        float sa = block_score[size_t(a)], sb = block_score[size_t(b)];
        return sa > sb || (sa == sb && a < b);
      });
      std::copy(order.begin(), order.begin() + (top_k - 1), dst);
      dst[top_k - 1] = local;
      std::sort(dst, dst + top_k);
    }
  });
}

void attention_cpu(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                   const ops::AttentionMetadata& meta, const TensorView& selected, int top_k, const TensorView& out) {
  if (k_cache.dtype != v_cache.dtype) throw std::runtime_error("attention: K and V caches differ in dtype");
  if (k_cache.dtype == DType::kBF16) attention_ref<uint16_t>(q, k_cache, v_cache, meta, selected, top_k, out);
  else attention_ref<float>(q, k_cache, v_cache, meta, selected, top_k, out);
}

void indexer_topk_cpu(const TensorView& index_q, const TensorView& index_k_cache, const ops::AttentionMetadata& meta,
                      const ops::IndexerParams& params, const TensorView& selected) {
  switch (index_k_cache.dtype) {
    case DType::kBF16: return indexer_topk_ref<uint16_t>(index_q, index_k_cache, meta, params, selected);
    case DType::kF8E4M3: return indexer_topk_ref<uint8_t>(index_q, index_k_cache, meta, params, selected);
    default: return indexer_topk_ref<float>(index_q, index_k_cache, meta, params, selected);
  }
}

// Host memory; caches in `dtypes` (activations stay F32).
std::string need_cpu_cache(const ops::Problem& p, std::initializer_list<DType> dtypes) {
  if (p.device != Device::kCpu) return "tensors are not in host memory";
  for (DType d : dtypes) {
    if (p.dtype == d) return "";
  }
  return "cache dtype " + std::string(dtype_name(p.dtype)) + " not supported";
}

}  // namespace

void register_attention(ops::KernelTable& table) {
  table.attention.add({"attention.paged_reference.cpu",
                       "host F32 or BF16 KV cache (converted to fp32 on read); dense or block-sparse (any block size)",
                       [](const ops::Problem& p) { return need_cpu_cache(p, {DType::kF32, DType::kBF16}); },
                       attention_cpu});
  table.indexer_topk.add({"indexer_topk.reference.cpu",
                          "host F32, BF16 or F8E4M3 index-K cache (converted to fp32 on read)",
                          [](const ops::Problem& p) {
                            return need_cpu_cache(p, {DType::kF32, DType::kBF16, DType::kF8E4M3});
                          },
                          indexer_topk_cpu});
}

}  // namespace m3::cpu
