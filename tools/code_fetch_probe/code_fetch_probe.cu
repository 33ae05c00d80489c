// What a kernel pays for fetching its own instructions (docs/msa_kernels.md, thirty-fourth round).
// Two kernels of ~177 KB of straight-line code each (6000 dependent FFMAs with distinct immediates),
// one warp, timed inside the kernel (%globaltimer):
//   cold         L2 flushed (a 256 MB read) before the run: every line from DRAM;
//   l2_warm      after the flush the same kernel ran, then the other big kernel (on the same SM: it
//                evicts that SM's instruction caches, not L2's 50 MB): lines from L2;
//   warm         after the flush the same kernel ran just before: lines from the SM's own caches.
// It also prints the device-side address of the kernel (what `&kernel` gives in device code): 0
// on sm_90a with or without -rdc, so a kernel cannot prefetch another kernel's code into L2.
//   code_fetch_probe [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

// One FFMA per expansion, each with its own immediates (__COUNTER__), so no two lines of code repeat.
#define F1 a = fmaf(a, 1.0f + float(__COUNTER__) * 1e-7f, float(__COUNTER__));
#define F10 F1 F1 F1 F1 F1 F1 F1 F1 F1 F1
#define F100 F10 F10 F10 F10 F10 F10 F10 F10 F10 F10
#define F1000 F100 F100 F100 F100 F100 F100 F100 F100 F100 F100

__device__ __forceinline__ uint64_t gtime() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// t[0]: ns from the first to the last instruction; t[1]: the SM.
__device__ __forceinline__ void record(unsigned long long* t, uint64_t t0) {
  const uint64_t t1 = gtime();
  if (threadIdx.x == 0) {
    t[0] = t1 - t0;
    t[1] = smid();
  }
}
__global__ void big_a(float* out, unsigned long long* t) {
  const uint64_t t0 = gtime();
  float a = out[threadIdx.x];
  F1000 F1000 F1000 F1000 F1000 F1000
  out[threadIdx.x] = a;
  record(t, t0);
}
__global__ void big_b(float* out, unsigned long long* t) {
  const uint64_t t0 = gtime();
  float a = out[threadIdx.x] + 1.0f;
  F1000 F1000 F1000 F1000 F1000 F1000
  out[threadIdx.x] = a;
  record(t, t0);
}

__global__ void address_of_big_a(unsigned long long* out) {
  unsigned long long v;
  asm volatile("mov.b64 %0, %1;" : "=l"(v) : "l"((unsigned long long)(const void*)&big_a));
  out[0] = v;
}

__global__ void flush_read(const int4* buf, size_t n, int4* sink) {
  int x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) x ^= buf[i].x;
  if (x == 0x7fffffff) sink[0] = make_int4(x, x, x, x);
}

int main(int argc, char** argv) {
  const char* json = nullptr;
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--json")) json = argv[i + 1];
  unsigned long long *t, *t_other, *addr;
  float* out;
  int4* flush;
  const size_t flush_n = (size_t(256) << 20) / 16;
  CHECK(cudaMalloc(&t, 16));
  CHECK(cudaMalloc(&t_other, 16));
  CHECK(cudaMalloc(&addr, 8));
  CHECK(cudaMalloc(&out, 128));
  CHECK(cudaMalloc(&flush, flush_n * 16));
  CHECK(cudaMemset(out, 0, 128));
  CHECK(cudaMemset(flush, 1, flush_n * 16));
  address_of_big_a<<<1, 1>>>(addr);
  unsigned long long device_address = 0;
  CHECK(cudaMemcpy(&device_address, addr, 8, cudaMemcpyDeviceToHost));
  std::printf("device-side &big_a: 0x%llx%s\n", device_address, device_address == 0 ? " (not a code address)" : "");

  const char* names[3] = {"cold", "l2_warm", "warm"};
  double med[3];
  for (int v = 0; v < 3; ++v) {
    std::vector<double> us;
    int same_sm = 0;
    for (int it = 0; it < 21; ++it) {
      flush_read<<<264, 512>>>(flush, flush_n, flush + 1);
      if (v >= 1) big_a<<<1, 32>>>(out, t_other);  // its lines into L2 and this SM's caches
      if (v == 1) big_b<<<1, 32>>>(out, t_other);  // this SM's instruction caches now hold big_b
      big_a<<<1, 32>>>(out, t);
      unsigned long long h[2], o[2];
      CHECK(cudaMemcpy(h, t, 16, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(o, t_other, 16, cudaMemcpyDeviceToHost));
      if (it == 0) continue;  // module load
      us.push_back(double(h[0]) * 1e-3);
      same_sm += v == 0 || h[1] == o[1];
    }
    std::sort(us.begin(), us.end());
    med[v] = us[us.size() / 2];
    std::printf("%-8s median %7.2f us (min %.2f, max %.2f); the warming kernel on the same SM in %d of %zu\n", names[v],
                med[v], us.front(), us.back(), v == 0 ? 0 : same_sm, us.size());
  }
  cudaFuncAttributes fa{};
  CHECK(cudaFuncGetAttributes(&fa, big_a));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  if (json) {
    FILE* f = std::fopen(json, "w");
    if (!f) return 1;
    std::fprintf(f,
                 "{\"device\": \"%s\", \"device_side_address\": %llu, \"cold_us\": %.3f, \"l2_warm_us\": %.3f, "
                 "\"warm_us\": %.3f}\n",
                 prop.name, device_address, med[0], med[1], med[2]);
    std::fclose(f);
  }
  return 0;
}
