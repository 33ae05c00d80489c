#pragma once
// Shared by the GPU kernel benchmarks (tools/msa_bench, tools/moe_bench): a device buffer,
// uploads, list parsing, GPU time of a graph replay with L2 flushed before each, and the
// device-to-device copy bandwidth every roofline ratio is measured against.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/graph_capture.h"
#include "gpu_bench_flush.h"

namespace m3::gpu_bench {

inline std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoi(x));
  return v;
}
inline std::vector<std::string> parse_words(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(x);
  return v;
}

// Command-line options: for (Options o(argc, argv); o.next();) { if (o.key() == "--x") x = o.value();
// ... else o.unknown(); }
class Options {
 public:
  Options(int argc, char** argv) : argc_(argc), argv_(argv) {}
  bool next() {
    if (++i_ >= argc_) return false;
    key_ = argv_[i_];
    return true;
  }
  const std::string& key() const { return key_; }
  std::string value() {
    if (i_ + 1 >= argc_) throw std::runtime_error("missing value for " + key_);
    return argv_[++i_];
  }
  [[noreturn]] void unknown() const { throw std::runtime_error("unknown option " + key_); }

 private:
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string key_;
};

class Dev {
 public:
  Dev() = default;
  explicit Dev(size_t bytes) : bytes_(bytes) { M3_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(bytes, 256))); }
  ~Dev() {
    if (p_) cudaFree(p_);
  }
  Dev(Dev&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  Dev& operator=(Dev&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

template <class T>
inline Dev upload(const std::vector<T>& v) {
  Dev d(v.size() * sizeof(T));
  M3_CUDA_CHECK(cudaMemcpy(d.as<void>(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

struct Timing {
  double median_us = 0, min_us = 0;
};

// GPU time of one graph replay, L2 flushed before each (events bracket the replay only), by
// the mode of gpu_bench_flush.h (a 256 MB read by default; M3_BENCH_FLUSH=memset, or
// M3_BENCH_WARM_L2=1 for no flush: a diagnostic of how much of a small step is cold misses).
// `warm` (optional): a graph replayed after each flush, before the timed replay, outside the
// timing (a diagnostic: the same kernels on other buffers leave their code, not the step's data,
// in L2).
inline Timing time_graph(const std::function<void()>& step, cudaStream_t stream, const Dev& flush, int iters,
                         const std::function<void()>& warm = {}) {
  const Flush mode = flush_mode();
  step();  // eager warm-up (module loads, pool growth)
  M3_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraphExec_t exec = m3::cuda::capture_graph(stream, step);
  cudaGraphExec_t warm_exec = nullptr;
  if (warm) {
    warm();
    M3_CUDA_CHECK(cudaStreamSynchronize(stream));
    warm_exec = m3::cuda::capture_graph(stream, warm);
  }
  cudaEvent_t e0, e1;
  M3_CUDA_CHECK(cudaEventCreate(&e0));
  M3_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int i = 0; i < iters + 2; ++i) {
    flush_l2(mode, flush.as<void>(), flush.bytes(), i, stream);
    if (warm_exec) M3_CUDA_CHECK(cudaGraphLaunch(warm_exec, stream));
    M3_CUDA_CHECK(cudaEventRecord(e0, stream));
    M3_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    M3_CUDA_CHECK(cudaEventRecord(e1, stream));
    M3_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    M3_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) us.push_back(double(ms) * 1e3);  // first replays upload the graph
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec);
  if (warm_exec) cudaGraphExecDestroy(warm_exec);
  std::sort(us.begin(), us.end());
  return Timing{us[us.size() / 2], us.front()};
}

// The shortest of `reps` event-timed runs of launch() on `stream`, in ms, the first `skip` runs
// not counted (warm-up); 0 when no counted run succeeded (launch() returning false stops).
inline double best_ms(cudaStream_t stream, int reps, int skip, const std::function<bool()>& launch) {
  cudaEvent_t e0, e1;
  M3_CUDA_CHECK(cudaEventCreate(&e0));
  M3_CUDA_CHECK(cudaEventCreate(&e1));
  double best = 0;
  for (int i = 0; i < reps; ++i) {
    M3_CUDA_CHECK(cudaEventRecord(e0, stream));
    const bool ok = launch();
    M3_CUDA_CHECK(cudaEventRecord(e1, stream));
    M3_CUDA_CHECK(cudaEventSynchronize(e1));
    if (!ok) break;
    float ms = 0;
    M3_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= skip && (best == 0 || ms < best)) best = ms;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return best;
}

// Device-to-device copy bandwidth (bytes read + written per second), best of a few.
inline double copy_bandwidth(cudaStream_t stream) {
  const size_t bytes = size_t(1) << 30;
  Dev a(bytes), b(bytes);
  M3_CUDA_CHECK(cudaMemsetAsync(a.as<void>(), 1, bytes, stream));
  const double ms = best_ms(stream, 8, 0, [&] {
    M3_CUDA_CHECK(cudaMemcpyAsync(b.as<void>(), a.as<void>(), bytes, cudaMemcpyDeviceToDevice, stream));
    return true;
  });
  return 2.0 * double(bytes) / (ms * 1e-3);
}

// Device 0, a non-blocking stream made the stream every entry launches on (current_stream()),
// the buffer time_graph() flushes L2 with (256 MB), and the copy bandwidth of this run.
struct BenchDevice {
  cudaDeviceProp prop{};
  cudaStream_t stream = nullptr;
  Dev flush;
  double copy_bw = 0;
};
inline BenchDevice open_bench_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) throw std::runtime_error("no CUDA device");
  BenchDevice d;
  M3_CUDA_CHECK(cudaSetDevice(0));
  M3_CUDA_CHECK(cudaGetDeviceProperties(&d.prop, 0));
  M3_CUDA_CHECK(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
  m3::cuda::set_current_stream(d.stream);
  d.flush = Dev(size_t(256) << 20);
  d.copy_bw = copy_bandwidth(d.stream);
  return d;
}

// Writes the run's JSON with the L2 flush mode its timings used (`l2_flush`), prints where, and
// hands the stream back (current_stream() unset first).
template <class Json>
inline void finish_bench(const std::string& json_path, Json doc, BenchDevice& d) {
  doc["l2_flush"] = flush_name(flush_mode());
  std::ofstream(json_path) << doc.dump(2) << "\n";
  std::printf("wrote %s\n", json_path.c_str());
  m3::cuda::set_current_stream(nullptr);
  cudaStreamDestroy(d.stream);
  d.stream = nullptr;
}

// main() of a benchmark: run(argc, argv), any exception printed as "<name>: <what>", exit 1.
inline int bench_main(const char* name, int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace m3::gpu_bench
