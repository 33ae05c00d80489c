// Paged causal GQA attention (dense and MSA block-sparse) and the MSA lightning indexer for
// device tensors: F32 activations, F32 or BF16 caches (index-K also F8E4M3), converted to fp32
// on read. Every key is read through the page table. Simple, not tuned: one CTA per (token,
// query head) for attention, per (token, index head) for the indexer. The generic fallback
// behind the tuned MSA entries (msa_*.cu) for shapes they do not take.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"

namespace m3::cuda {
namespace {

constexpr int kAttnWarps = 4;
constexpr int kMaxDimPerLane = 8;  // head_dim <= 256
constexpr int kMaxTopK = 64;
constexpr int kIndexerThreads = 256;
constexpr size_t kMaxSharedBytes = 227 * 1024;

// Cache element -> fp32 (exact).
__device__ __forceinline__ float load_f32(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load_f32(const __nv_fp8_e4m3* p, int64_t i) { return float(p[i]); }

// The sequence owning batch token t: the last s with query_start[s] <= t (empty sequences
// share their start with the next one, so the last is the right one).
__device__ int seq_of_token(const int32_t* query_start, int num_seqs, int t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

struct PagedArgs {
  const int32_t* query_start;
  const int32_t* positions;
  const int32_t* block_tables;
  int num_seqs, num_tokens, max_blocks, block_size;
};

// Each warp runs an online softmax over its share of the keys (lanes across head_dim), then
// the warps' partial states are merged. Keys: causal, restricted to the selected blocks when
// `sel` is given (invalid and repeated block ids ignored, as in the CPU reference).
template <class KV>
__global__ void __launch_bounds__(kAttnWarps * 32)
    paged_attention_kernel(const float* q, const KV* k_cache, const KV* v_cache, float* out, PagedArgs a,
                           int q_heads, int kv_heads, int head_dim, const int32_t* sel, int top_k, float scale) {
  __shared__ int blocks[kMaxTopK];
  __shared__ int num_listed;
  __shared__ float warp_m[kAttnWarps], warp_l[kAttnWarps];
  __shared__ float warp_acc[kAttnWarps][kMaxDimPerLane * 32];
  const int t = blockIdx.x, hq = blockIdx.y;
  const int g = hq / (q_heads / kv_heads);
  const int s = seq_of_token(a.query_start, a.num_seqs, t);
  const int64_t pos = a.positions[t];
  const int num_blocks = int(pos / a.block_size + 1);
  if (threadIdx.x == 0) {
    int n = 0;
    if (sel) {  // sorted, unique, valid block ids
      for (int i = 0; i < top_k; ++i) {
        const int b = sel[(int64_t(g) * a.num_tokens + t) * top_k + i];
        if (b < 0 || b >= num_blocks) continue;
        int j = n;
        bool dup = false;
        for (int u = 0; u < n; ++u) dup |= blocks[u] == b;
        if (dup) continue;
        while (j > 0 && blocks[j - 1] > b) {
          blocks[j] = blocks[j - 1];
          --j;
        }
        blocks[j] = b;
        ++n;
      }
    } else {
      n = num_blocks;
    }
    num_listed = n;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* qv = q + (int64_t(t) * q_heads + hq) * head_dim;
  float qr[kMaxDimPerLane], acc[kMaxDimPerLane];
#pragma unroll
  for (int i = 0; i < kMaxDimPerLane; ++i) {
    const int d = lane + 32 * i;
    qr[i] = d < head_dim ? qv[d] : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
  for (int li = 0; li < num_listed; ++li) {
    const int b = sel ? blocks[li] : li;
    const int64_t start = int64_t(b) * a.block_size;
    const int64_t end = start + a.block_size < pos + 1 ? start + a.block_size : pos + 1;
    const int64_t page_base = int64_t(table[b]) * a.block_size;
    for (int64_t j = start + warp; j < end; j += kAttnWarps) {
      const int64_t row = ((page_base + (j - start)) * kv_heads + g) * head_dim;
      const KV* kp = k_cache + row;
      const KV* vp = v_cache + row;
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < kMaxDimPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) dot += qr[i] * load_f32(kp, d);
      }
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      const float score = dot * scale;
      const float m_new = fmaxf(m, score);
      const float corr = expf(m - m_new);
      const float p = expf(score - m_new);
      l = l * corr + p;
#pragma unroll
      for (int i = 0; i < kMaxDimPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) acc[i] = acc[i] * corr + p * load_f32(vp, d);
      }
      m = m_new;
    }
  }
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kMaxDimPerLane; ++i) warp_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float m_all = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) m_all = fmaxf(m_all, warp_m[w]);
  float l_all = 0.0f;
  for (int w = 0; w < kAttnWarps; ++w) l_all += warp_m[w] == -INFINITY ? 0.0f : warp_l[w] * expf(warp_m[w] - m_all);
  float* o = out + (int64_t(t) * q_heads + hq) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) {
      if (warp_m[w] != -INFINITY) sum += warp_acc[w][d] * expf(warp_m[w] - m_all);
    }
    o[d] = l_all > 0.0f ? sum / l_all : 0.0f;  // no visible key (MSA without the local block): zeros, as the CPU
  }
}

// Float -> int with the same order (for atomicMax in shared memory; NaN not expected).
__device__ int ordered_key(float f) {
  const int i = __float_as_int(f);
  return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ float from_ordered_key(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }

// Block scores as the CPU computes them, bit for bit: each key's dot product is a sequential
// fp32 sum of separately rounded products (no FMA), and the block score is their max. Then
// the top_k - 1 best earlier blocks (ties to the lower id) by rank counting, plus the local
// block; ascending ids.
template <class IK>
__global__ void __launch_bounds__(kIndexerThreads)
    indexer_topk_kernel(const float* index_q, const IK* index_k, int32_t* selected, PagedArgs a, int heads,
                        int dim, int top_k) {
  extern __shared__ unsigned char smem[];
  float* qs = reinterpret_cast<float*>(smem);
  int* score_key = reinterpret_cast<int*>(qs + dim);
  unsigned char* chosen = reinterpret_cast<unsigned char*>(score_key + a.max_blocks);
  const int t = blockIdx.x, h = blockIdx.y;
  const int bs = a.block_size;
  const int s = seq_of_token(a.query_start, a.num_seqs, t);
  const int64_t pos = a.positions[t];
  const int num_blocks = int(pos / bs + 1), local = num_blocks - 1;
  int32_t* dst = selected + (int64_t(h) * a.num_tokens + t) * top_k;
  if (num_blocks <= top_k) {  // every valid block fits: dense causal attention
    for (int i = threadIdx.x; i < top_k; i += blockDim.x) dst[i] = i < num_blocks ? i : -1;
    return;
  }
  const float* qv = index_q + (int64_t(t) * heads + h) * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) qs[d] = qv[d];
  for (int b = threadIdx.x; b < local; b += blockDim.x) score_key[b] = ordered_key(-INFINITY);
  __syncthreads();
  const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
  const int64_t keys = int64_t(local) * bs;  // earlier blocks are complete and in the past
  for (int64_t j = threadIdx.x; j < keys; j += blockDim.x) {
    const int b = int(j / bs);
    const IK* kv = index_k + (int64_t(table[b]) * bs + (j - int64_t(b) * bs)) * dim;
    float dot = 0.0f;
    for (int d = 0; d < dim; ++d) dot = __fadd_rn(dot, __fmul_rn(qs[d], load_f32(kv, d)));
    atomicMax(&score_key[b], ordered_key(dot));
  }
  __syncthreads();
  for (int b = threadIdx.x; b < local; b += blockDim.x) {
    const float sb = from_ordered_key(score_key[b]);
    int rank = 0;
    for (int c = 0; c < local && rank < top_k - 1; ++c) {
      const float sc = from_ordered_key(score_key[c]);
      rank += (sc > sb || (sc == sb && c < b)) ? 1 : 0;
    }
    chosen[b] = rank < top_k - 1 ? 1 : 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int n = 0;
    for (int b = 0; b < local && n < top_k - 1; ++b) {
      if (chosen[b]) dst[n++] = b;
    }
    dst[top_k - 1] = local;  // the local block has the highest id
  }
}

PagedArgs paged_args(const ops::AttentionMetadata& meta) {
  return PagedArgs{meta.query_start, meta.positions, meta.block_tables, meta.num_seqs, meta.num_tokens,
                   meta.max_blocks_per_seq, meta.block_size};
}

template <class KV>
void launch_attention_typed(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                            const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                            const TensorView& out) {
  const int64_t tokens = q.shape[0], q_heads = q.shape[1], head_dim = q.shape[2];
  const dim3 grid{unsigned(tokens), unsigned(q_heads)};
  paged_attention_kernel<KV><<<grid, kAttnWarps * 32, 0, current_stream()>>>(
      q.as<const float>(), k_cache.as<const KV>(), v_cache.as<const KV>(), out.as<float>(), paged_args(meta),
      int(q_heads), int(k_cache.shape[1]), int(head_dim), selected.data ? selected.as<const int32_t>() : nullptr,
      top_k, 1.0f / std::sqrt(float(head_dim)));
  M3_CUDA_CHECK_LAUNCH();
}

void launch_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                      const ops::AttentionMetadata& meta, const TensorView& selected, int top_k, const TensorView& out) {
  if (q.shape[0] == 0) return;
  if (k_cache.dtype != v_cache.dtype) throw std::runtime_error("attention: K and V caches differ in dtype");
  if (k_cache.dtype == DType::kBF16) launch_attention_typed<__nv_bfloat16>(q, k_cache, v_cache, meta, selected, top_k, out);
  else launch_attention_typed<float>(q, k_cache, v_cache, meta, selected, top_k, out);
}

size_t indexer_smem_bytes(int64_t dim, int64_t max_blocks) {
  return size_t(dim) * 4 + size_t(max_blocks) * 5;
}

void launch_indexer_topk(const TensorView& index_q, const TensorView& index_k_cache, const ops::AttentionMetadata& meta,
                         const ops::IndexerParams& params, const TensorView& selected) {
  const int64_t tokens = index_q.shape[0], heads = index_q.shape[1], dim = index_q.shape[2];
  if (tokens == 0) return;
  if (params.block_size != meta.block_size) throw std::runtime_error("indexer_topk: block size differs from the page size");
  const size_t smem = indexer_smem_bytes(dim, meta.max_blocks_per_seq);
  if (smem > kMaxSharedBytes) throw std::runtime_error("indexer_topk.sm90: too many blocks per sequence for shared memory");
  const dim3 grid{unsigned(tokens), unsigned(heads)};
  auto run = [&](auto* kernel, const auto* keys) {
    if (smem > 48 * 1024) M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<grid, kIndexerThreads, smem, current_stream()>>>(index_q.as<const float>(), keys, selected.as<int32_t>(),
                                                              paged_args(meta), int(heads), int(dim), params.top_k);
  };
  switch (index_k_cache.dtype) {
    case DType::kBF16: run(indexer_topk_kernel<__nv_bfloat16>, index_k_cache.as<const __nv_bfloat16>()); break;
    case DType::kF8E4M3: run(indexer_topk_kernel<__nv_fp8_e4m3>, index_k_cache.as<const __nv_fp8_e4m3>()); break;
    default: run(indexer_topk_kernel<float>, index_k_cache.as<const float>());
  }
  M3_CUDA_CHECK_LAUNCH();
}

// Device tensors with a cache of one of `dtypes`.
std::string need_cuda_cache(const ops::Problem& p, std::initializer_list<DType> dtypes) {
  if (p.device != Device::kCuda) return "tensors are not in device memory";
  for (DType d : dtypes) {
    if (p.dtype == d) return "";
  }
  return "cache dtype " + std::string(dtype_name(p.dtype)) + " not supported";
}

}  // namespace

void launch_generic_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                              const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                              const TensorView& out) {
  launch_attention(q, k_cache, v_cache, meta, selected, top_k, out);
}

void launch_generic_indexer_topk(const TensorView& index_q, const TensorView& index_k_cache,
                                 const ops::AttentionMetadata& meta, const ops::IndexerParams& params,
                                 const TensorView& selected) {
  launch_indexer_topk(index_q, index_k_cache, meta, params, selected);
}

void register_attention(ops::KernelTable& table) {
  table.attention.add({"attention.paged_online_softmax.sm90",
                       "device F32 or BF16 KV cache and metadata; head_dim <= 256; dense or block-sparse with top_k <= "
                       "64; one CTA per (token, query head), fp32 online softmax",
                       [](const ops::Problem& p) -> std::string {
                         std::string why = need_cuda_cache(p, {DType::kF32, DType::kBF16});
                         if (!why.empty()) return why;
                         if (p.k > kMaxDimPerLane * 32) return "head_dim above 256";
                         if (p.extra > kMaxTopK) return "top_k above 64";
                         return "";
                       },
                       launch_attention});
  table.indexer_topk.add({"indexer_topk.block_max_rank.sm90",
                          "device F32, BF16 or F8E4M3 index-K cache and metadata; top_k >= 1; block scores "
                          "bit-identical to the CPU (sequential fp32 dots, no FMA); max_blocks_per_seq within shared "
                          "memory",
                          [](const ops::Problem& p) -> std::string {
                            std::string why = need_cuda_cache(p, {DType::kF32, DType::kBF16, DType::kF8E4M3});
                            if (!why.empty()) return why;
                            if (p.extra < 1) return "top_k must be >= 1";
                            return "";
                          },
                          launch_indexer_topk});
}

}  // namespace m3::cuda
