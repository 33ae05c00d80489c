#pragma once
// Shared pieces of the CUDA entries: eligibility helpers, stream-ordered scratch, the
// per-thread cuBLAS handle and the GEMM helper every GEMM-using op goes through.
// Convention: when an op's tensors are device tensors, every raw pointer it receives (token
// ids, positions, slot mappings, all AttentionMetadata arrays) is a device pointer too.
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "ops/ops.h"

namespace m3::cuda {

// The stream every entry launches on and every Scratch is ordered on (per host thread).
// The engine's runtime sets its own stream so decode steps can be captured into graphs;
// unset, it is the legacy default stream (tests).
cudaStream_t current_stream();
void set_current_stream(cudaStream_t stream);

void register_msa(ops::KernelTable& table);  // tuned MSA entries (first: preferred where eligible)
void register_elementwise(ops::KernelTable& table);
void register_fused_rows(ops::KernelTable& table);  // add + rms_norm, the attention prologue
void register_attention(ops::KernelTable& table);
void register_gemm(ops::KernelTable& table);
void register_sampling(ops::KernelTable& table);

// NeoX inverse frequencies of the first rotary_dim / 2 pairs, computed on the host with the CPU
// entry's exact expression (every CUDA RoPE uses these, so fused and separate rotations agree).
constexpr int kMaxRotaryHalf = 128;  // rotary_dim <= 256
struct RopeInvFreq {
  float v[kMaxRotaryHalf];
};
RopeInvFreq rope_inv_freq(int rotary_dim, double theta);

// "" when the problem is on the device with F32 operands.
std::string need_cuda_f32(const ops::Problem& p);

// Device scratch from the stream-ordered pool (cudaMallocAsync on current_stream()); freed at
// scope exit, ordered after the work queued on that stream. Legal inside graph capture.
//
// The second constructor takes a call site's fixed device buffer (a __device__ array, see
// FixedScratch) and uses it when the request fits, the pool otherwise: a captured graph then has no memory nodes
// around the call's kernels, so a programmatic dependent launch (PDL) edge into the kernel
// survives capture (an alloc or free node between two kernels turns it into a full
// dependency, and costs the step a few microseconds). Only for call sites whose consecutive
// uses on a stream cannot overlap in time (the call site says why).
class FixedScratch;
class Scratch {
 public:
  explicit Scratch(size_t size_bytes);
  Scratch(size_t size_bytes, FixedScratch& fixed);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T> T* as() const { return static_cast<T*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  bool owned_ = false;
};

// A __device__ array's address on the current device, cached per device (scratch buffers, and
// state such as arrival counters that kernels re-arm themselves):
//   __device__ __align__(256) uint4 g_buf[kBytes / 16];  // (the pool's alignment)
//   static FixedScratch buf_of(g_buf);  ...  Scratch s(bytes, buf_of);
class FixedScratch {
 public:
  template <class T, size_t N>
  explicit FixedScratch(const T (&symbol)[N]) : symbol_(symbol), bytes_(sizeof(T) * N) {}
  void* address();
  size_t bytes() const { return bytes_; }

 private:
  const void* symbol_;
  size_t bytes_;
  void* cache_[64] = {};
};

// Raises a kernel's dynamic shared-memory limit to `bytes` once per (kernel, device), so graph
// capture (the engine's replays, the benchmarks) never meets the call; returns the SM count.
int allow_dynamic_smem(const void* kernel, size_t bytes);
// An attribute of the current device, read once per (attribute, device); no lock.
int current_device_attribute(cudaDeviceAttr attr);

// y[m, n] = x[m, k] * w[n, k]^T with fp32 accumulation; x, y F32 device rows; w F32 or BF16.
// invariant: one fixed-order warp reduction per output (a row's result never depends on m);
// otherwise cuBLAS (F32: SGEMM, pedantic math, no TF32; BF16: x split into bf16 hi + lo and
// two BF16 GEMMs accumulating in fp32, so activations keep ~16 mantissa bits).
void gemm_xwt(const float* x, int64_t m, const ops::LinearWeight& w, float* y, bool invariant);

}  // namespace m3::cuda
