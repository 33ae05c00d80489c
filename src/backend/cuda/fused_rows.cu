// Per-row fusions of a layer's small ops, each the bits of the separate CUDA entries it replaces
// (elementwise.cu): the residual add with the RMSNorm after it, and the attention prologue (q/k
// norms, RoPE, KV and index-key cache writes). A decode step at batch 1 is a chain of short
// launches; these take 15 of a sparse layer's ~29 down to 3.
//
// Both launch as programmatic dependents of the kernel before them and wait for it at once: what
// overlaps is their launch with its tail.

#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/row_ops.cuh"

namespace m3::cuda {
namespace {

// rms_norm_gemma_kernel's reduction for rows of up to 256 elements: thread i of its 256 holds
// x_i^2, each warp folds its 32 by xor butterfly, then warp 0 folds the 8 warp sums the same
// way. Here one warp holds the row (lane l: elements l + 32c) and replays those folds in order.
constexpr int kRowWarps = 8;      // rms_norm_gemma_kernel's warps per CTA
constexpr int kMaxRowDim = 32 * kRowWarps;
constexpr int kNormThreads = 256;  // rms_norm_gemma_kernel's CTA (the per-thread order depends on it)

// Sum of squares of a row held as x[c] = element lane + 32 c (zeros past the row).
__device__ __forceinline__ float row_sum_sq(const float (&x)[kRowWarps], int nch, int lane) {
  float part = 0.0f;
#pragma unroll
  for (int c = 0; c < kRowWarps; ++c) {
    if (c < nch) {
      const float s = __shfl_sync(0xffffffffu, xor_fold(x[c] * x[c]), 0);
      if (lane == c) part = s;
    }
  }
  return __shfl_sync(0xffffffffu, xor_fold(part), 0);
}

// x += y, out = rms_norm(x): rms_norm_gemma_kernel with the add in its first pass.
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(float* x, const float* y, const float* w, float* out,
                                                                    int64_t dim, float eps) {
  pdl_launch_dependents();
  pdl_wait();
  __shared__ float partial[32];
  const int64_t row = blockIdx.x;
  float* xr = x + row * dim;
  const float* yr = y + row * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = xr[i] + yr[i];
    xr[i] = v;
    sum += v * v;
  }
  const float inv = gemma_inv_rms(cta_sum(sum, partial), dim, eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) out[row * dim + i] = gemma_norm(xr[i], inv, w[i]);
}

// The prologue's rows of one token, in order: Hq query heads, Hkv key heads, Hkv value heads,
// then (sparse layers) Hi index query heads and the index key. A warp per row.
struct PrologueArgs {
  float* q;
  float* k;
  const float* v;
  float* iq;
  float* ik;
  const float* q_norm;
  const float* k_norm;
  const float* iq_norm;
  const float* ik_norm;
  void* k_cache;
  void* v_cache;
  void* ik_cache;
  CacheType kv_dt, ik_dt;
  const int32_t* positions;
  const int64_t* slots;
  int hq, hkv, hi, d, di, half, rows_per_token;
  int64_t rows;
  float eps;
  RopeInvFreq inv;
};

__global__ void __launch_bounds__(32 * kRowWarps) attn_prologue_kernel(const __grid_constant__ PrologueArgs a) {
  pdl_launch_dependents();
  pdl_wait();
  __shared__ float rot[kRowWarps][kMaxRowDim];  // a warp's row for the rotation's pairs
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + warp;
  if (r >= a.rows) return;
  const int64_t t = r / a.rows_per_token;
  int j = int(r % a.rows_per_token);
  float* row = nullptr;          // rewritten in place when normed
  const float* src = nullptr;
  const float* nw = nullptr;     // null: cached as is (values)
  void* cache = nullptr;
  int dim = a.d;
  CacheType dt = a.kv_dt;
  int64_t cache_row = int64_t(a.hkv) * a.d, cache_off = 0;  // a slot's elements, this row's offset in it
  if (j < a.hq) {
    row = a.q + (t * a.hq + j) * a.d;
    nw = a.q_norm;
  } else if ((j -= a.hq) < a.hkv) {
    row = a.k + (t * a.hkv + j) * a.d;
    nw = a.k_norm;
    cache = a.k_cache;
    cache_off = int64_t(j) * a.d;
  } else if ((j -= a.hkv) < a.hkv) {
    src = a.v + (t * a.hkv + j) * a.d;
    cache = a.v_cache;
    cache_off = int64_t(j) * a.d;
  } else if ((j -= a.hkv) < a.hi) {
    row = a.iq + (t * a.hi + j) * a.di;
    nw = a.iq_norm;
    dim = a.di;
  } else {
    row = a.ik + t * a.di;
    nw = a.ik_norm;
    dim = a.di;
    cache = a.ik_cache;
    dt = a.ik_dt;
    cache_row = a.di;
  }
  if (row) src = row;
  const int nch = (dim + 31) / 32;
  float x[kRowWarps];
#pragma unroll
  for (int c = 0; c < kRowWarps; ++c) x[c] = c < nch && lane + 32 * c < dim ? src[lane + 32 * c] : 0.0f;
  if (nw) {
    // rms_norm_gemma_kernel, then rope_neox_kernel (separately rounded products), as separate calls.
    const float inv = gemma_inv_rms(row_sum_sq(x, nch, lane), dim, a.eps);
    float* b = rot[warp];
#pragma unroll
    for (int c = 0; c < kRowWarps; ++c) {
      const int e = lane + 32 * c;
      if (c < nch && e < dim) b[e] = gemma_norm(x[c], inv, nw[e]);
    }
    __syncwarp();
    const float pos = float(a.positions[t]);
    for (int i = lane; i < a.half; i += 32) {
      float cs, sn;
      rope_cos_sin(pos, a.inv.v[i], cs, sn);
      rope_rotate(cs, sn, b[i], b[i + a.half]);
    }
    __syncwarp();
#pragma unroll
    for (int c = 0; c < kRowWarps; ++c) {
      const int e = lane + 32 * c;
      if (c < nch && e < dim) {
        x[c] = b[e];
        row[e] = x[c];
      }
    }
  }
  if (!cache) return;
  const int64_t slot = a.slots[t];
  if (slot < 0) return;  // padding token: nothing to cache
  const int64_t base = slot * cache_row + cache_off;
#pragma unroll
  for (int c = 0; c < kRowWarps; ++c) {
    const int e = lane + 32 * c;
    if (c < nch && e < dim) store_cache(cache, dt, base + e, x[c]);
  }
}

void launch_add_rms_norm(const TensorView& x, const TensorView& y, const TensorView& w, float eps, const TensorView& out) {
  if (x.shape[0] == 0) return;
  launch_kernel(add_rms_norm_kernel, dim3(unsigned(x.shape[0])), dim3(kNormThreads), 0, true, x.as<float>(),
                y.as<const float>(), w.as<const float>(), out.as<float>(), x.shape[1], eps);
}

void launch_attn_prologue(const ops::AttnPrologue& p) {
  const int64_t T = p.q.shape[0];
  if (T == 0) return;
  PrologueArgs a{};
  a.q = p.q.as<float>();
  a.k = p.k.as<float>();
  a.v = p.v.as<const float>();
  a.q_norm = p.q_norm.as<const float>();
  a.k_norm = p.k_norm.as<const float>();
  a.k_cache = p.k_cache.data;
  a.v_cache = p.v_cache.data;
  a.kv_dt = cache_type(p.k_cache.dtype);
  a.hq = int(p.q.shape[1]);
  a.hkv = int(p.k.shape[1]);
  a.d = int(p.q.shape[2]);
  if (p.sparse()) {
    a.iq = p.index_q.as<float>();
    a.ik = p.index_k.as<float>();
    a.iq_norm = p.index_q_norm.as<const float>();
    a.ik_norm = p.index_k_norm.as<const float>();
    a.ik_cache = p.index_k_cache.data;
    a.ik_dt = cache_type(p.index_k_cache.dtype);
    a.hi = int(p.index_q.shape[1]);
    a.di = int(p.index_q.shape[2]);
  }
  a.positions = p.positions;
  a.slots = p.slot_mapping;
  a.half = p.rotary_dim / 2;
  a.rows_per_token = a.hq + 2 * a.hkv + (p.sparse() ? a.hi + 1 : 0);
  a.rows = T * a.rows_per_token;
  a.eps = p.eps;
  a.inv = rope_inv_freq(p.rotary_dim, p.theta);
  launch_kernel(attn_prologue_kernel, dim3(unsigned((a.rows + kRowWarps - 1) / kRowWarps)), dim3(32 * kRowWarps), 0,
                true, a);
}

bool cache_dtype_ok(DType dt) { return dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF8E4M3; }

}  // namespace

void register_fused_rows(ops::KernelTable& table) {
  table.add_rms_norm.add({"add_rms_norm.fused.sm90", "device F32 rows: the bits of add.inplace then rms_norm.gemma in one launch (elsewhere, the CPU "
                          "included, the op runs as add then rms_norm)",
                          need_cuda_f32, launch_add_rms_norm});
  table.attn_prologue.add(
      {"attn_prologue.fused_rows.sm90",
       "device F32 q/k/v, head dims <= 256, even rotary_dim <= min(head dims, 256); F32, BF16 or F8E4M3 "
       "caches; a warp per head row, the bits of rms_norm.gemma, rope.neox_partial and kv_write.scatter in "
       "one launch (elsewhere, the CPU included, the op runs as those separate ops)",
       [](const ops::Problem& p) -> std::string {
         std::string why = need_cuda_f32(p);
         if (!why.empty()) return why;
         if (p.n > kMaxRowDim || p.k > kMaxRowDim) return "head_dim above 256";
         if (p.extra <= 0 || p.extra % 2 || p.extra > p.n || (p.k > 0 && p.extra > p.k))
           return "rotary_dim must be even and <= every head_dim";
         return "";
       },
       [](const ops::AttnPrologue& p) {
         for (const TensorView* c : {&p.k_cache, &p.v_cache, &p.index_k_cache})
           if (c->data && !cache_dtype_ok(c->dtype))
             throw std::runtime_error("attn_prologue.fused_rows.sm90: cache dtype " + std::string(dtype_name(c->dtype)));
         launch_attn_prologue(p);
       }});
}

}  // namespace m3::cuda
