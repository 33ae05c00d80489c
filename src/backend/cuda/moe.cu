// MoE on the device: the sigmoid router and the experts, with no host synchronisation (the
// routing never leaves the device), all on current_stream(), so a decode step can be captured.
//
// moe_experts, one entry for every mode (it is batch-invariant):
//   1. route: one CTA builds the permutation in the CPU reference's order (routed experts 0..E-1,
//      then the shared expert E taking every token; within an expert, assignments in increasing
//      (token, slot) order), each assignment's position in it, and work items (expert, rows) of
//      at most kRowsPerItem rows, non-empty experts only;
//   2. gate+up: grouped fused row-dot, h[p] = swiglu_oai(x[perm[p]] . gate_e, x[perm[p]] . up_e);
//   3. down: grouped row-dot, y[p] = h[p] . down_e;
//   4. combine: out[t] = sum over t's assignments in ascending expert order (ties by slot; the
//      shared expert last, weight 1) of w * y, as acc = fadd(acc, fmul(w, y)) from 0.
// Scratch sizes depend only on tokens, top_k, the expert count and the widths. Per-expert
// weight pointers and sizes travel as kernel parameters (rowdot::GroupTable, 10 KB), so there is
// no device pointer table to build or cache and nothing to copy from the host.
#include <algorithm>
#include <cstdint>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/moe_route.cuh"
#include "backend/cuda/moe_router.h"
#include "backend/cuda/rowdot.cuh"

namespace m3::cuda {
namespace {

using rowdot::kMaxExperts;
using rowdot::kMaxTopK;
using rowdot::kRowsPerItem;
using rowdot::WType;

// One thread per token: sigmoid, selection by prob + bias (descending, ties to the lower id),
// then the unbiased probabilities of the chosen experts renormalised and scaled. The i-th
// pick is the best expert strictly after the (i-1)-th in that total order: no scratch.
__global__ void router_select_kernel(const float* logits, const float* bias, int64_t tokens, int experts, int top_k,
                                     float scale, int32_t* ids, float* weights) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const float* lg = logits + t * experts;
  float prev_choice = INFINITY;
  int prev_id = -1;
  float sum = 0.0f;
  for (int i = 0; i < top_k; ++i) {
    int best = -1;
    float best_choice = -INFINITY;
    for (int e = 0; e < experts; ++e) {
      const float c = 1.0f / (1.0f + expf(-lg[e])) + (bias ? bias[e] : 0.0f);
      const bool after_prev = c < prev_choice || (c == prev_choice && e > prev_id);
      if (!after_prev) continue;
      if (best < 0 || c > best_choice) {
        best = e;
        best_choice = c;
      }
    }
    ids[t * top_k + i] = best;
    sum += 1.0f / (1.0f + expf(-lg[best]));
    prev_choice = best_choice;
    prev_id = best;
  }
  for (int i = 0; i < top_k; ++i) {
    const float p = 1.0f / (1.0f + expf(-lg[ids[t * top_k + i]]));
    weights[t * top_k + i] = p / sum * scale;
  }
}

constexpr int kRouteThreads = 1024;

// Step 1, one CTA. ids: [tokens * top_k]. Writes perm[p] (token of permuted row p), pos[a]
// (permuted row of assignment a, -1 for an id outside [0, routed): ignored), items[0, *num_items)
// as (expert, row_begin, row_end, 0), and *shared_base (first row of the shared expert).
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const int32_t* ids, int tokens, int top_k,
                                                                  int routed, int has_shared, int32_t* perm,
                                                                  int32_t* pos, int4* items, int* num_items,
                                                                  int* shared_base) {
  __shared__ int cnt[kMaxExperts], start[kMaxExperts], item_start[kMaxExperts], run[kMaxExperts];
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31, nwarps = int(blockDim.x) >> 5;
  const int n_assign = tokens * top_k;
  for (int e = int(threadIdx.x); e < kMaxExperts; e += int(blockDim.x)) cnt[e] = run[e] = 0;
  __syncthreads();
  // Counts: warp w owns experts w, w + nwarps, ...; every warp reads the ids 32 at a time.
  for (int base = 0; base < n_assign; base += 32) {
    const int a = base + lane;
    const int id = a < n_assign ? ids[a] : -1;
    for (int e = warp; e < routed; e += nwarps) {
      const unsigned b = __ballot_sync(0xffffffffu, id == e);
      if (lane == 0) cnt[e] += __popc(b);
    }
  }
  __syncthreads();
  scan_and_emit_items(cnt, start, item_start, routed, has_shared, tokens, kRowsPerItem, items, num_items, shared_base,
                      false);
  // Routed rows: an assignment's rank within its expert = earlier assignments with that id.
  for (int base = 0; base < n_assign; base += 32) {
    const int a = base + lane;
    const int id = a < n_assign ? ids[a] : -1;
    if (warp == 0 && a < n_assign && (id < 0 || id >= routed)) pos[a] = -1;
    for (int e = warp; e < routed; e += nwarps) {
      const unsigned b = __ballot_sync(0xffffffffu, id == e);
      if (b) {
        if (id == e) {
          const int p = start[e] + run[e] + __popc(b & ((1u << lane) - 1u));
          perm[p] = a / top_k;
          pos[a] = p;
        }
        __syncwarp();
        if (lane == 0) run[e] += __popc(b);
        __syncwarp();
      }
    }
  }
  if (has_shared) {
    const int sb = start[routed];
    for (int t = int(threadIdx.x); t < tokens; t += int(blockDim.x)) perm[sb + t] = t;
  }
}

// Step 4: one CTA per token.
__global__ void moe_combine_kernel(const float* y, const float* w, const int32_t* ids, const int32_t* pos, int top_k,
                                   const int* shared_base, int has_shared, float* out, int64_t hidden) {
  __shared__ int s_row[kMaxTopK + 1];
  __shared__ float s_w[kMaxTopK + 1];
  __shared__ int s_n;
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) s_n = combine_rows(ids, pos, w, t, top_k, has_shared ? *shared_base + int(t) : -1, s_row, s_w);
  __syncthreads();
  const int n = s_n;
  for (int64_t d = threadIdx.x; d < hidden; d += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc = __fadd_rn(acc, __fmul_rn(s_w[i], y[int64_t(s_row[i]) * hidden + d]));
    out[t * hidden + d] = acc;
  }
}

template <WType WT, bool kFused>
void launch_grouped_t(bool vec, dim3 grid, const rowdot::GroupArgs& a) {
  if (vec) rowdot::rowdot_grouped_kernel<WT, kFused, true><<<grid, rowdot::kThreads, 0, current_stream()>>>(a);
  else rowdot::rowdot_grouped_kernel<WT, kFused, false><<<grid, rowdot::kThreads, 0, current_stream()>>>(a);
}

template <bool kFused>
void launch_grouped(WType wt, bool vec, dim3 grid, const rowdot::GroupArgs& a) {
  switch (wt) {
    case WType::kF32: launch_grouped_t<WType::kF32, kFused>(vec, grid, a); break;
    case WType::kBF16: launch_grouped_t<WType::kBF16, kFused>(vec, grid, a); break;
    case WType::kFP8: launch_grouped_t<WType::kFP8, kFused>(vec, grid, a); break;
  }
  M3_CUDA_CHECK_LAUNCH();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

void router_entry(const TensorView& x, const TensorView& router_w, const TensorView& bias,
                  const ops::RouterParams& params, const TensorView& expert_ids, const TensorView& expert_weights) {
  const int64_t tokens = x.shape[0], experts = router_w.shape[0];
  if (tokens == 0) return;
  const float* b = params.use_bias && bias.data ? bias.as<const float>() : nullptr;
  if (fused_router_problem(experts, x.shape[1], params.top_k, x.as<const float>(), x.shape[1],
                           router_w.as<const float>())
          .empty()) {
    launch_fused_router(x.as<const float>(), x.shape[1], tokens, router_w.as<const float>(), experts, x.shape[1], b,
                        params.top_k, params.routed_scale, expert_ids.as<int32_t>(), expert_weights.as<float>());
    return;
  }
  // Other shapes: batch-invariant row-dot logits, one thread per token selects.
  Scratch logits(size_t(tokens * experts) * 4);
  rowdot_linear(x.as<const float>(), x.shape[1], tokens, ops::LinearWeight{router_w, {}, {}}, logits.as<float>(), experts);
  router_select_kernel<<<unsigned((tokens + 127) / 128), 128, 0, current_stream()>>>(
      logits.as<const float>(), b, tokens, int(experts), params.top_k, params.routed_scale, expert_ids.as<int32_t>(),
      expert_weights.as<float>());
  M3_CUDA_CHECK_LAUNCH();
}

[[noreturn]] void moe_fail(const std::string& why) {
  throw std::runtime_error("moe_experts.grouped_rowdot.sm90: " + why);
}

void moe_entry(const TensorView& x, const TensorView& expert_ids, const TensorView& expert_weights,
               const ops::ExpertWeights& experts, const ops::SwigluParams& act, const TensorView& out) {
  const int64_t tokens = x.shape[0], hidden = x.shape[1], top_k = expert_ids.shape[1];
  if (tokens == 0) return;
  const int routed = experts.num_routed, total = routed + (experts.has_shared ? 1 : 0);
  if (routed < 1 || total > kMaxExperts) moe_fail("needs 1..256 experts including the shared one");
  if (top_k < 1 || top_k > kMaxTopK) moe_fail("top_k must be in [1, 64]");
  if (expert_ids.shape[0] != tokens || expert_weights.shape[0] != tokens || expert_weights.shape[1] != top_k) {
    moe_fail("expert_ids / expert_weights must be [tokens, top_k]");
  }
  if (tokens * (top_k + 1) > INT32_MAX / 2 || hidden > INT32_MAX) moe_fail("problem too large");
  // Per-expert shapes and dtypes (host-side views only: nothing is read from the device).
  const DType gate_dt = experts.gate[0].data.dtype, down_dt = experts.down[0].data.dtype;
  int64_t max_inter = 0;
  bool vec_gu = aligned16(x.data) && hidden % 4 == 0, vec_down = true;
  rowdot::GroupArgs gu{}, dn{};
  for (int e = 0; e < total; ++e) {
    const ops::LinearWeight &g = experts.gate[e], &u = experts.up[e], &d = experts.down[e];
    for (const ops::LinearWeight* w : {&g, &u, &d}) {
      const std::string why = rowdot_weight_problem(*w);
      if (!why.empty()) moe_fail("expert " + std::to_string(e) + ": " + why);
    }
    const int64_t inter = g.out_features();
    if (g.data.dtype != gate_dt || u.data.dtype != gate_dt || d.data.dtype != down_dt) {
      moe_fail("gate and up weights must share one dtype across experts, and down weights one dtype");
    }
    if (g.in_features() != hidden || !(u.data.shape == g.data.shape) || d.out_features() != hidden ||
        d.in_features() != inter || inter < 1 || inter > INT32_MAX) {
      moe_fail("expert " + std::to_string(e) + ": gate/up must be [inter, hidden] and down [hidden, inter]");
    }
    max_inter = std::max(max_inter, inter);
    const size_t gb = dtype_size_bytes(gate_dt), db = dtype_size_bytes(down_dt);
    vec_gu = vec_gu && aligned16(g.data.data) && aligned16(u.data.data) && (size_t(hidden) * gb) % 16 == 0;
    vec_down = vec_down && aligned16(d.data.data) && (size_t(inter) * db) % 16 == 0;
    gu.t.m0[e] = rowdot::Mat{g.data.data, g.scale.as<const uint8_t>()};
    gu.t.m1[e] = rowdot::Mat{u.data.data, u.scale.as<const uint8_t>()};
    gu.t.n[e] = int(inter);
    gu.t.k[e] = int(hidden);
    dn.t.m0[e] = rowdot::Mat{d.data.data, d.scale.as<const uint8_t>()};
    dn.t.m1[e] = dn.t.m0[e];
    dn.t.n[e] = int(hidden);
    dn.t.k[e] = int(inter);
  }

  // Scratch, sized from shapes only.
  const int64_t n_assign = tokens * top_k;
  const int64_t rows = n_assign + (experts.has_shared ? tokens : 0);
  const int64_t item_bound = (rows + kRowsPerItem - 1) / kRowsPerItem + std::min<int64_t>(total, rows);
  const int64_t ldh = (max_inter + 3) / 4 * 4;  // 16-byte rows for the down row-dot's vector loads
  const size_t off_items = 0, off_perm = round_up(off_items + size_t(item_bound) * 16, 256),
               off_pos = round_up(off_perm + size_t(rows) * 4, 256), off_meta = round_up(off_pos + size_t(n_assign) * 4, 256),
               off_h = round_up(off_meta + 16, 256), off_y = round_up(off_h + size_t(rows * ldh) * 4, 256),
               bytes = off_y + size_t(rows * hidden) * 4;
  Scratch scratch(bytes);
  char* base = scratch.as<char>();
  int4* items = reinterpret_cast<int4*>(base + off_items);
  int32_t* perm = reinterpret_cast<int32_t*>(base + off_perm);
  int32_t* pos = reinterpret_cast<int32_t*>(base + off_pos);
  int* num_items = reinterpret_cast<int*>(base + off_meta);
  int* shared_base = num_items + 1;
  float* h = reinterpret_cast<float*>(base + off_h);
  float* y = reinterpret_cast<float*>(base + off_y);
  const cudaStream_t stream = current_stream();
  vec_down = vec_down && aligned16(h);

  moe_route_kernel<<<1, kRouteThreads, 0, stream>>>(expert_ids.as<const int32_t>(), int(tokens), int(top_k), routed,
                                                    experts.has_shared ? 1 : 0, perm, pos, items, num_items,
                                                    shared_base);
  M3_CUDA_CHECK_LAUNCH();

  const rowdot::Act a = rowdot_act(act);
  gu.x = x.as<const float>();
  gu.gather = perm;
  gu.ldx = hidden;
  gu.y = h;
  gu.ldy = ldh;
  gu.items = items;
  gu.num_items = num_items;
  gu.act = a;
  const int64_t gu_tiles = (max_inter + rowdot::kWarps - 1) / rowdot::kWarps;
  const int64_t dn_tiles = (hidden + 2 * rowdot::kWarps - 1) / (2 * rowdot::kWarps);
  if (gu_tiles > 65535 || dn_tiles > 65535 || item_bound > INT32_MAX) moe_fail("problem too large for the grid");
  launch_grouped<true>(rowdot_wtype(gate_dt), vec_gu, dim3(unsigned(item_bound), unsigned(gu_tiles)), gu);

  dn.x = h;
  dn.gather = nullptr;
  dn.ldx = ldh;
  dn.y = y;
  dn.ldy = hidden;
  dn.items = items;
  dn.num_items = num_items;
  dn.act = a;
  launch_grouped<false>(rowdot_wtype(down_dt), vec_down, dim3(unsigned(item_bound), unsigned(dn_tiles)), dn);

  moe_combine_kernel<<<unsigned(tokens), 256, 0, stream>>>(y, expert_weights.as<const float>(),
                                                           expert_ids.as<const int32_t>(), pos, int(top_k),
                                                           shared_base, experts.has_shared ? 1 : 0, out.as<float>(),
                                                           hidden);
  M3_CUDA_CHECK_LAUNCH();
}

std::string need_moe(const ops::Problem& p) {
  if (p.device != Device::kCuda) return "tensors are not in device memory";
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16 && p.dtype != DType::kF8E4M3) {
    return "F32, BF16 or MXFP8 (F8E4M3 + e8m0 scale) device expert weights, got " + std::string(dtype_name(p.dtype));
  }
  if (p.dtype == DType::kF8E4M3 && (p.k % 32 != 0 || p.n % 32 != 0)) {
    return "MXFP8 experts need hidden and intermediate sizes divisible by 32";
  }
  if (p.extra < 1 || p.extra > kMaxTopK) return "top_k must be in [1, 64]";
  return "";
}

// moe_router problems carry tokens (m), experts (n), hidden (k) and top_k (extra).
std::string plan_router(const ops::Problem& p) {
  if (!fused_router_problem(p.n, p.k, int(p.extra), nullptr, p.k, nullptr).empty()) {
    return "row-dot logits, a thread per token selects";
  }
  return fused_router_plan_text(fused_router_plan(p.m, p.n, p.k));
}

}  // namespace

void register_moe(ops::KernelTable& table) {
  table.router.add({"moe_router.sigmoid_bias_topk.sm90",
                    "device F32 router weight and bias; logits as fixed-order FMA chains over 192-wide segments "
                    "(batch-invariant; rows staged in shared memory when decoding, register-tiled past 256 tokens) and a warp per token "
                    "selecting (<= 256 experts, top_k <= 32, widths % 4 == 0); other shapes: row-dot logits, a thread "
                    "per token selects",
                    [](const ops::Problem& p) -> std::string {
                      std::string why = need_cuda_f32(p);
                      if (!why.empty()) return why;
                      if (p.extra < 1 || p.extra > p.n) return "top_k must be in [1, experts]";
                      return "";
                    },
                    router_entry, plan_router});
  table.moe.add({"moe_experts.grouped_rowdot.sm90",
                 "device F32/BF16/MXFP8 expert weights (gate+up one dtype, down one dtype, across experts; any "
                 "intermediate size per expert), <= 256 experts incl. the shared one (last, weight 1), top_k <= 64, any "
                 "batch-invariance setting: routing permuted on the device, grouped fused gate+up SwiGLU and down "
                 "row-dots over non-empty experts only, combine in the CPU's order; batch-invariant, no host sync; "
                 "expert pointers passed as kernel parameters",
                 need_moe, moe_entry});
}

}  // namespace m3::cuda
