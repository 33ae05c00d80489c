// MSA lightning indexer for decode (and short multi-token queries such as speculative
// verification), tuned for Hopper: BF16 or FP8 (e4m3) index-K, dim 128.
//
// One launch. Grid (token, chunk): a CTA whose token starts a query group of a sequence (up
// to kMaxPairs (token, index head) pairs, so the keys read are shared by every query of the
// group) scores one contiguous chunk of that sequence's earlier blocks; chunks spread a long
// context over all SMs when the batch is small. Keys stream through a cp.async pipeline into
// XOR-swizzled shared memory; each thread scores one key for its (token, head) pairs.
//
// Exactness: every dot is the CPU reference's expression, a sequential fp32 sum over d of
// separately rounded products (__fmul_rn/__fadd_rn: no FMA contraction, no reassociation),
// and a block's score is the max of its keys' dots, so block scores equal the CPU's bit for
// bit and the selection (ties to the lower block id) is identical. The last CTA of a group to
// finish (arrival counter) selects the top_k - 1 earlier blocks per pair with a warp-level
// exact argmax tournament (k rounds, only the winning lane rescans its segment) and writes
// ascending ids plus the local block.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"
#include "backend/cuda/msa_common.cuh"

namespace m3::cuda {
namespace {

using msa::cp_async16;
using msa::cp_async_commit;
using msa::cp_async_wait;
using msa::order_key;
using msa::smem_u32;

constexpr int kDim = 128;              // index head dim
constexpr int kStageKeys = 128;        // keys per pipeline stage (whole blocks: block size divides 128)
constexpr int kThreads = 256;          // two threads per key: each takes half of the pairs
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPairs = 16;          // (token, head) pairs per query group
constexpr int kMaxTopK = 64;
constexpr int kStageBufBytes = 96 * 1024;  // 3 BF16 / 6 FP8 stages; 2 CTAs per SM
constexpr int kSelectCap = kStageBufBytes / 4 / kWarps;  // block scores per warp cached for selection
constexpr size_t kSmemBytes = kStageBufBytes + kMaxPairs * kDim * 4 + 2 * kWarps * kMaxPairs * 4;
constexpr size_t kMaxScoreBytes = size_t(512) << 20;

__device__ unsigned g_indexer_counters[msa::kMaxCounters];

template <class IK> struct IkTraits;
template <> struct IkTraits<__nv_bfloat16> {
  static constexpr int kPerChunk = 8;  // elements per 16-byte chunk
  // Elements of one chunk in order (exact conversion).
  static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[8]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};
template <> struct IkTraits<__nv_fp8_e4m3> {
  static constexpr int kPerChunk = 16;
  static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[16]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 lo(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[i] & 0xffffu), __NV_E4M3));
      const __half2 hi(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[i] >> 16), __NV_E4M3));
      const float2 a = __half22float2(lo), b = __half22float2(hi);
      f[4 * i] = a.x;
      f[4 * i + 1] = a.y;
      f[4 * i + 2] = b.x;
      f[4 * i + 3] = b.y;
    }
  }
};

struct IndexerArgs {
  const float* q;       // [tokens, heads, 128]
  const void* keys;     // [slots, 128] BF16 or FP8
  int32_t* selected;    // [heads, tokens, top_k]
  uint32_t* scores;     // scratch [tokens, heads, max_blocks]: order keys of block scores
  const int32_t* query_start;
  const int32_t* positions;
  const int32_t* block_tables;
  unsigned* counters;
  int num_seqs, num_tokens, max_blocks, bs, bs_shift, heads, top_k, group_tokens, chunks;
};

// Sequential fp32 dots of one swizzled key row with one or two query rows (the CPU's order).
template <class IK, bool kTwo>
__device__ __forceinline__ void key_dots(const unsigned char* row, int key, const float* qa, const float* qb, float& da,
                                         float& db) {
  using Tr = IkTraits<IK>;
  constexpr int kE = Tr::kPerChunk, kChunks = kDim / kE;
  float sa = 0.0f, sb = 0.0f;
#pragma unroll
  for (int ch = 0; ch < kChunks; ++ch) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + ((ch ^ (key & 7)) << 4));
    float kf[kE];
    Tr::unpack(raw, kf);
#pragma unroll
    for (int e = 0; e < kE; e += 4) {
      const float4 x = *reinterpret_cast<const float4*>(qa + ch * kE + e);
      sa = __fadd_rn(sa, __fmul_rn(x.x, kf[e]));
      sa = __fadd_rn(sa, __fmul_rn(x.y, kf[e + 1]));
      sa = __fadd_rn(sa, __fmul_rn(x.z, kf[e + 2]));
      sa = __fadd_rn(sa, __fmul_rn(x.w, kf[e + 3]));
      if (kTwo) {
        const float4 y = *reinterpret_cast<const float4*>(qb + ch * kE + e);
        sb = __fadd_rn(sb, __fmul_rn(y.x, kf[e]));
        sb = __fadd_rn(sb, __fmul_rn(y.y, kf[e + 1]));
        sb = __fadd_rn(sb, __fmul_rn(y.z, kf[e + 2]));
        sb = __fadd_rn(sb, __fmul_rn(y.w, kf[e + 3]));
      }
    }
  }
  da = sa;
  db = sb;
}

// Exact top-k of one warp: the k best of keys[0, n) by (score desc, id asc), as ascending ids
// into dst[0, k). Composite (score key << 32 | ~id) is unique, so each round's max names one
// block; only the lane that held it rescans its segment (for its best below the winner).
__device__ void warp_select(const uint32_t* keys, int n, int k, uint32_t* cache, int* chosen, int32_t* dst) {
  const int lane = threadIdx.x & 31;
  const bool cached = n <= kSelectCap;
  if (cached) {
    for (int b = lane; b < n; b += 32) cache[b] = __ldcg(keys + b);
    __syncwarp();
  }
  const uint32_t* src = cached ? cache : keys;
  const int per = (n + 31) / 32;
  const int lo = min(n, lane * per), hi = min(n, lo + per);
  auto composite = [&](int b) {
    const uint32_t key = cached ? src[b] : __ldcg(src + b);
    return (uint64_t(key) << 32) | uint32_t(~uint32_t(b));
  };
  uint64_t best = 0;
  for (int b = lo; b < hi; ++b) best = max(best, composite(b));
  for (int r = 0; r < k; ++r) {
    const uint32_t whi = __reduce_max_sync(0xffffffffu, uint32_t(best >> 32));
    const uint32_t wlo = __reduce_max_sync(0xffffffffu, uint32_t(best >> 32) == whi ? uint32_t(best) : 0u);
    const uint64_t win = (uint64_t(whi) << 32) | wlo;
    if (lane == 0) chosen[r] = int(~wlo);
    if (best == win) {
      best = 0;
      for (int b = lo; b < hi; ++b) {
        const uint64_t c = composite(b);
        if (c < win && c > best) best = c;
      }
    }
  }
  __syncwarp();
  for (int i = lane; i < k; i += 32) {
    const int id = chosen[i];
    int rank = 0;
    for (int j = 0; j < k; ++j) rank += chosen[j] < id ? 1 : 0;
    dst[rank] = id;
  }
  __syncwarp();
}

template <class IK>
__global__ void __launch_bounds__(kThreads, 2) msa_indexer_kernel(IndexerArgs a) {
  constexpr int kRowBytes = kDim * int(sizeof(IK));
  constexpr int kChunks = kRowBytes / 16;
  constexpr int kStageBytes = kStageKeys * kRowBytes;
  constexpr int kStages = kStageBufBytes / kStageBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* const stage_buf = smem;
  float* const qs = reinterpret_cast<float*>(smem + kStageBufBytes);       // [kMaxPairs][kDim]
  uint32_t* const red = reinterpret_cast<uint32_t*>(qs + kMaxPairs * kDim);  // [2][kWarps][kMaxPairs]
  __shared__ int s_pos[kMaxPairs];
  __shared__ int s_chosen[kWarps][kMaxTopK];
  __shared__ int s_last;

  const int t0 = blockIdx.x;
  const int s = msa::seq_of_token(a.query_start, a.num_seqs, t0);
  const int q_begin = a.query_start[s], q_end = a.query_start[s + 1];
  if ((t0 - q_begin) % a.group_tokens != 0) return;  // not the first token of a query group
  const int T = min(a.group_tokens, q_end - t0), H = a.heads, P = T * H;
  const int bs = a.bs, bs_shift = a.bs_shift, top_k = a.top_k;
  if (threadIdx.x < T) s_pos[threadIdx.x] = a.positions[t0 + threadIdx.x];
  __syncthreads();
  // Blocks to score: those before the local block of any token that has more than top_k.
  int nb = 0;
  for (int tt = 0; tt < T; ++tt) {
    const int local = s_pos[tt] >> bs_shift;
    if (local + 1 > top_k) nb = max(nb, local);
  }
  auto write_dense = [&](int p) {  // every valid block fits: ids 0..n-1, then -1
    const int t = t0 + p / H, h = p % H;
    const int n = (s_pos[p / H] >> bs_shift) + 1;
    int32_t* dst = a.selected + (int64_t(h) * a.num_tokens + t) * top_k;
    for (int i = threadIdx.x & 31; i < top_k; i += 32) dst[i] = i < n ? i : -1;
  };
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (nb == 0) {
    if (blockIdx.y == 0) {
      for (int p = warp; p < P; p += kWarps) write_dense(p);
    }
    return;
  }

  const int chunk = blockIdx.y;
  const int b0 = int(int64_t(chunk) * nb / a.chunks), b1 = int(int64_t(chunk + 1) * nb / a.chunks);
  if (b0 < b1) {
    for (int i = threadIdx.x; i < P * kDim; i += kThreads) qs[i] = a.q[int64_t(t0) * H * kDim + i];
    const int key_begin = b0 << bs_shift, key_end = b1 << bs_shift;
    const int nstage = (key_end - key_begin + kStageKeys - 1) / kStageKeys;
    const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
    const unsigned char* keys = static_cast<const unsigned char*>(a.keys);
    auto load_stage = [&](int i) {
      unsigned char* buf = stage_buf + (i % kStages) * kStageBytes;
      const int j0 = key_begin + i * kStageKeys;
#pragma unroll 4
      for (int ci = threadIdx.x; ci < kStageKeys * kChunks; ci += kThreads) {
        const int row = ci / kChunks, ch = ci % kChunks;
        const int j = j0 + row;
        const bool ok = j < key_end;
        const int jj = ok ? j : key_begin;
        const int64_t slot = int64_t(table[jj >> bs_shift]) * bs + (jj & (bs - 1));
        cp_async16(smem_u32(buf + row * kRowBytes + ((ch ^ (row & 7)) << 4)), keys + slot * kRowBytes + ch * 16, ok);
      }
    };
    const int key = threadIdx.x & (kStageKeys - 1), half = threadIdx.x / kStageKeys;
    const int blocks_per_stage = kStageKeys >> bs_shift;
    auto local_of = [&](int p) { return s_pos[p / H] >> bs_shift; };
    auto score_dst = [&](int p, int blk) {
      return a.scores + (int64_t(t0 + p / H) * H + p % H) * a.max_blocks + blk;
    };
    // Per pair: the max of this key's block (segmented over lanes when blocks are < 32 keys,
    // else per warp into `red`, combined by flush()).
    auto reduce = [&](int p, float dot, int j, uint32_t* red_buf) {
      const int blk = j >> bs_shift;
      const bool valid = j < key_end && blk < local_of(p);
      uint32_t k = valid ? order_key(dot) : 0u;  // 0 is below every real key
      if (bs >= 32) {
        k = __reduce_max_sync(0xffffffffu, k);
        if (lane == 0) red_buf[warp * kMaxPairs + p] = k;
      } else {
        for (int off = 1; off < bs; off <<= 1) k = max(k, __shfl_xor_sync(0xffffffffu, k, off));
        if ((lane & (bs - 1)) == 0 && valid) *score_dst(p, blk) = k;
      }
    };
    auto flush = [&](int i) {
      if (bs < 32) return;
      const uint32_t* red_buf = red + (i & 1) * kWarps * kMaxPairs;
      const int first_blk = (key_begin + i * kStageKeys) >> bs_shift;
      const int warps_per_blk = bs / 32;
      for (int e = threadIdx.x; e < blocks_per_stage * P; e += kThreads) {
        const int bi = e / P, p = e % P, blk = first_blk + bi;
        if (blk >= b1 || blk >= local_of(p)) continue;
        const int w0 = (p & 1) * (kStageKeys / 32) + bi * warps_per_blk;
        uint32_t m = 0;
        for (int w = w0; w < w0 + warps_per_blk; ++w) m = max(m, red_buf[w * kMaxPairs + p]);
        *score_dst(p, blk) = m;
      }
    };
#pragma unroll 1
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < nstage) load_stage(i);
      cp_async_commit();
    }
#pragma unroll 1
    for (int i = 0; i < nstage; ++i) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      if (i > 0) flush(i - 1);
      if (i + kStages - 1 < nstage) load_stage(i + kStages - 1);
      cp_async_commit();
      const unsigned char* row = stage_buf + (i % kStages) * kStageBytes + key * kRowBytes;
      const int j = key_begin + i * kStageKeys + key;
      uint32_t* red_buf = red + (i & 1) * kWarps * kMaxPairs;
#pragma unroll 1
      for (int p0 = half; p0 < P; p0 += 4) {
        const int p1 = p0 + 2;
        float d0, d1;
        if (p1 < P) {
          key_dots<IK, true>(row, key, qs + p0 * kDim, qs + p1 * kDim, d0, d1);
          reduce(p0, d0, j, red_buf);
          reduce(p1, d1, j, red_buf);
        } else {
          key_dots<IK, false>(row, key, qs + p0 * kDim, nullptr, d0, d1);
          reduce(p0, d0, j, red_buf);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    flush(nstage - 1);
  }

  msa::allow_next_kernel();  // the attention kernel may start its setup while the selection runs
  if (!msa::arrive_last(&a.counters[t0], unsigned(a.chunks), &s_last)) return;
  // Last CTA of the group: one warp per pair selects its blocks.
  const int k = top_k - 1;
  for (int p = warp; p < P; p += kWarps) {
    const int local = s_pos[p / H] >> bs_shift;
    if (local + 1 <= top_k) {
      write_dense(p);
      continue;
    }
    const int t = t0 + p / H, h = p % H;
    int32_t* dst = a.selected + (int64_t(h) * a.num_tokens + t) * top_k;
    if (k > 0) {
      warp_select(a.scores + (int64_t(t) * H + h) * a.max_blocks, local, k,
                  reinterpret_cast<uint32_t*>(stage_buf) + warp * kSelectCap, s_chosen[warp], dst);
    }
    if (lane == 0) dst[k] = local;  // the local block has the highest id
  }
}

int ilog2(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

}  // namespace

int current_sm_count() {
  static int counts[64] = {};
  int dev = 0;
  M3_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64) dev = 63;
  if (counts[dev] == 0) {
    int n = 0;
    M3_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    counts[dev] = n;
  }
  return counts[dev];
}

// Shapes outside the tuned kernel (index dim != 128, block size not a power of two <= 128,
// more than kMaxPairs heads, top_k > 64, huge score scratch) run the generic kernel.
void launch_msa_indexer(const TensorView& index_q, const TensorView& index_k_cache, const ops::AttentionMetadata& meta,
                        const ops::IndexerParams& params, const TensorView& selected) {
  const int64_t tokens = index_q.shape[0], heads = index_q.shape[1], dim = index_q.shape[2];
  if (tokens == 0) return;
  if (params.block_size != meta.block_size) throw std::runtime_error("indexer_topk: block size differs from the page size");
  const int bs = params.block_size;
  const size_t score_bytes = size_t(tokens) * size_t(heads) * size_t(std::max(1, meta.max_blocks_per_seq)) * 4;
  const bool tuned = dim == kDim && bs >= 1 && bs <= kStageKeys && (bs & (bs - 1)) == 0 && heads <= kMaxPairs &&
                     params.top_k >= 1 && params.top_k <= kMaxTopK && tokens <= msa::kMaxCounters &&
                     score_bytes <= kMaxScoreBytes &&
                     (index_k_cache.dtype == DType::kBF16 || index_k_cache.dtype == DType::kF8E4M3);
  if (!tuned) return launch_generic_indexer_topk(index_q, index_k_cache, meta, params, selected);

  Scratch scores(score_bytes);
  static unsigned* counters_of[64] = {};  // per device
  int dev = 0;
  M3_CUDA_CHECK(cudaGetDevice(&dev));
  unsigned*& counters = counters_of[dev & 63];
  if (!counters) M3_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&counters), g_indexer_counters));
  IndexerArgs a{};
  a.q = index_q.as<const float>();
  a.keys = index_k_cache.data;
  a.selected = selected.as<int32_t>();
  a.scores = scores.as<uint32_t>();
  a.query_start = meta.query_start;
  a.positions = meta.positions;
  a.block_tables = meta.block_tables;
  a.counters = counters;
  a.num_seqs = meta.num_seqs;
  a.num_tokens = int(tokens);
  a.max_blocks = meta.max_blocks_per_seq;
  a.bs = bs;
  a.bs_shift = ilog2(bs);
  a.heads = int(heads);
  a.top_k = params.top_k;
  a.group_tokens = std::max(1, kMaxPairs / int(heads));
  // Chunks per query group: enough CTAs for two per SM over the groups there are (the host
  // does not know the contexts: chunks past a sequence's blocks exit at once).
  const int64_t groups = tokens == meta.num_seqs ? tokens : (tokens + a.group_tokens - 1) / a.group_tokens + meta.num_seqs;
  const int64_t max_scored = std::max(1, meta.max_blocks_per_seq - 1);
  const int64_t target = 2 * int64_t(current_sm_count());
  a.chunks = int(std::clamp<int64_t>(target / std::max<int64_t>(1, groups), 1, std::min<int64_t>(max_scored, 1024)));
  const dim3 grid{unsigned(tokens), unsigned(a.chunks)};
  auto run = [&](auto kernel) {
    M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
    kernel<<<grid, kThreads, kSmemBytes, current_stream()>>>(a);
  };
  if (index_k_cache.dtype == DType::kBF16) run(msa_indexer_kernel<__nv_bfloat16>);
  else run(msa_indexer_kernel<__nv_fp8_e4m3>);
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace m3::cuda
