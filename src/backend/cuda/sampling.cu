// On-device sampling for F32 device logits: one CTA per row. Pass 1 finds the raw argmax
// (greedy token, top-1 and the max) and, for T > 0, the argmax of logit / T + Gumbel noise
// (ops/sample_gumbel.h); pass 2 sums expf(logit - max); each further top-N entry is one more
// pass taking the best (value, id) strictly after the previous pick. Block reductions are
// fixed-order; (value, id) reductions prefer the lower id on ties, so argmaxes are exact.
// Params are read from device memory by the kernel: no host sync, no copy, capturable into a
// CUDA graph whose replays pick up new params (seed, step) written to the same buffer.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/row_ops.cuh"
#include "ops/sample_gumbel.h"

namespace m3::cuda {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int32_t kNone = INT_MAX;

__device__ __forceinline__ void warp_argmax(float& v, int32_t& id) {
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int32_t oid = __shfl_xor_sync(0xffffffffu, id, off);
    if (ops::sample_before(ov, oid, v, id)) v = ov, id = oid;
  }
}

// Block-wide best (value, id); every thread returns with it. All threads must call.
__device__ __forceinline__ void block_argmax(float& v, int32_t& id, float* sv, int32_t* sid) {
  warp_argmax(v, id);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();  // the previous reduction's readers are done with sv/sid
  if (lane == 0) sv[warp] = v, sid[warp] = id;
  __syncthreads();
  v = lane < warps ? sv[lane] : -INFINITY;
  id = lane < warps ? sid[lane] : kNone;
  warp_argmax(v, id);  // every warp reduces the same values in the same order
}

__global__ void __launch_bounds__(kMaxThreads)
    sample_gumbel_argmax_kernel(const float* __restrict__ logits, const ops::SampleRowParams* __restrict__ params,
                                int64_t vocab, int32_t* __restrict__ tokens, float* __restrict__ logprobs,
                                int32_t* __restrict__ top_ids, float* __restrict__ top_logprobs) {
  __shared__ float s_val[32];
  __shared__ int32_t s_id[32];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * vocab;
  const ops::SampleRowParams p = params[row];
  const bool gumbel = p.temperature > 0.0f;  // uniform across the block
  const uint64_t key = ops::sample_row_key(p.seed, p.step);

  float best_v = -INFINITY, pert_v = -INFINITY;
  int32_t best_id = kNone, pert_id = kNone;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float xi = x[i];
    const int32_t id = int32_t(i);
    if (ops::sample_before(xi, id, best_v, best_id)) best_v = xi, best_id = id;
    if (gumbel) {
      // IEEE division then addition, no contraction: the CPU reference's x / T + g.
      const float s = __fadd_rn(__fdiv_rn(xi, p.temperature), ops::sample_gumbel(key, uint32_t(id)));
      if (ops::sample_before(s, id, pert_v, pert_id)) pert_v = s, pert_id = id;
    }
  }
  block_argmax(best_v, best_id, s_val, s_id);
  if (gumbel) block_argmax(pert_v, pert_id, s_val, s_id);
  const float m = best_v;

  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(x[i] - m);
  __syncthreads();  // every thread has read s_val in block_argmax before cta_sum writes it
  sum = cta_sum(sum, s_val);
  const float log_sum = logf(sum);

  if (threadIdx.x == 0) {
    int32_t token = gumbel ? pert_id : best_id;
    if (token == kNone) token = 0;  // every logit NaN
    tokens[row] = token;
    logprobs[row] = (x[token] - m) - log_sum;
  }

  const int n = min(max(p.top_n, 0), ops::kMaxTopLogprobs);  // the engine validates; clamped for memory safety
  int32_t* ids_out = top_ids + row * ops::kMaxTopLogprobs;
  float* lp_out = top_logprobs + row * ops::kMaxTopLogprobs;
  float pick_v = best_v;  // pick 0: the raw argmax
  int32_t pick_id = best_id;
  for (int k = 0; k < ops::kMaxTopLogprobs; ++k) {
    if (k > 0 && k < n) {
      float cv = -INFINITY;
      int32_t cid = kNone;
      for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float xi = x[i];
        const int32_t id = int32_t(i);
        if (ops::sample_before(pick_v, pick_id, xi, id) && ops::sample_before(xi, id, cv, cid)) cv = xi, cid = id;
      }
      block_argmax(cv, cid, s_val, s_id);
      pick_v = cv;
      pick_id = cid;
    }
    if (threadIdx.x == 0) {
      const bool valid = k < n && pick_id != kNone;
      ids_out[k] = valid ? pick_id : -1;
      lp_out[k] = valid ? (pick_v - m) - log_sum : -INFINITY;
    }
  }
}

void launch_sample(const TensorView& logits, const TensorView& params, const TensorView& tokens,
                   const TensorView& logprobs, const TensorView& top_ids, const TensorView& top_logprobs) {
  const std::string bad = ops::sample_check_views(logits, params, tokens, logprobs, top_ids, top_logprobs, Device::kCuda);
  if (!bad.empty()) throw std::invalid_argument(bad);
  const int64_t rows = logits.shape[0], vocab = logits.shape[1];
  if (rows == 0) return;
  if (rows > INT_MAX) throw std::invalid_argument("sample: more than 2^31 - 1 rows");
  if (reinterpret_cast<uintptr_t>(params.data) % alignof(ops::SampleRowParams) != 0)
    throw std::invalid_argument("sample: params must be aligned to SampleRowParams");
  const int threads = int(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (vocab + 31) / 32 * 32)));
  sample_gumbel_argmax_kernel<<<unsigned(rows), threads, 0, current_stream()>>>(
      logits.as<const float>(), params.as<const ops::SampleRowParams>(), vocab, tokens.as<int32_t>(),
      logprobs.as<float>(), top_ids.as<int32_t>(), top_logprobs.as<float>());
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_sampling(ops::KernelTable& table) {
  table.sample.add({"sample.gumbel_argmax.sm90",
                    "device F32 logits and params; one CTA per row, fixed-order fp32 block reductions, argmax ties "
                    "to the lower id, top-N by repeated block argmax; no host sync (graph-capturable); top_n "
                    "clamped to 0..20 on the device (the engine validates)",
                    need_cuda_f32, launch_sample});
}

}  // namespace m3::cuda
