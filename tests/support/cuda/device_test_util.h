// Test support for the GPU parity tests: a device buffer that can be poisoned, host/device
// tensor views, and a ragged paged-KV batch whose pages are shuffled over the pool.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace m3::cuda_test {

// Device buffer. poison() fills it with 0x7f bytes (float 3.4e38, int 0x7f7f7f7f) before a GPU
// run, so an element the kernel should have written and did not fails the comparison.
class DevBuf {
 public:
  explicit DevBuf(size_t bytes) : bytes_(std::max<size_t>(bytes, 16)) { M3_CUDA_CHECK(cudaMalloc(&ptr_, bytes_)); }
  template <class T>
  explicit DevBuf(const std::vector<T>& v) : DevBuf(v.size() * sizeof(T)) {
    upload(v);
  }
  ~DevBuf() { cudaFree(ptr_); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T> T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  template <class T> void upload(const std::vector<T>& v) {
    if (!v.empty()) M3_CUDA_CHECK(cudaMemcpy(ptr_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  void fill(int byte) { M3_CUDA_CHECK(cudaMemset(ptr_, byte, bytes_)); }
  void poison() { fill(0x7f); }
  template <class T> std::vector<T> get(size_t n) const {
    std::vector<T> v(n);
    M3_CUDA_CHECK(cudaMemcpy(v.data(), ptr_, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

inline TensorView host(const void* p, DType dt, Shape s) {
  return TensorView{const_cast<void*>(p), dt, std::move(s), Device::kCpu};
}
inline TensorView dev(const DevBuf& b, DType dt, Shape s) { return TensorView{b.as<void>(), dt, std::move(s), Device::kCuda}; }

// A non-blocking stream, current for the scope (graph capture needs a non-default stream).
// Construction waits for earlier work on the legacy stream (test uploads); destruction makes
// the default stream current again, drains and destroys the stream.
class ScopedStream {
 public:
  ScopedStream() {
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    M3_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cuda::set_current_stream(stream_);
  }
  ~ScopedStream() {
    cuda::set_current_stream(nullptr);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  ScopedStream(const ScopedStream&) = delete;
  ScopedStream& operator=(const ScopedStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A sequence of the batch: `cached` tokens already in the KV cache, `fresh` query tokens.
struct SeqSpec {
  int cached, fresh;
};

// A ragged batch with pages shuffled over the pool (every read must go through the tables),
// three spare pages nobody owns, and the metadata on the host and on the device.
// extra_table_blocks widens every block table past the longest sequence, as the engine's are.
struct Batch {
  int block_size = 0, max_blocks = 0, num_pages = 0, num_tokens = 0;
  std::vector<int32_t> query_start, positions, seq_lens, block_tables;
  std::vector<int64_t> slots;
  ops::AttentionMetadata host_meta, dev_meta;
  std::vector<std::unique_ptr<DevBuf>> dev_arrays;

  Batch(const std::vector<SeqSpec>& seqs, int bs, std::mt19937& rng, int extra_table_blocks = 0) : block_size(bs) {
    query_start.push_back(0);
    for (const auto& s : seqs) {
      max_blocks = std::max(max_blocks, (s.cached + s.fresh + bs - 1) / bs);
      num_pages += (s.cached + s.fresh + bs - 1) / bs;
    }
    max_blocks += extra_table_blocks;
    num_pages += 3;
    std::vector<int32_t> pages(static_cast<size_t>(num_pages));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    block_tables.assign(seqs.size() * size_t(max_blocks), -1);
    size_t next = 0;
    for (size_t s = 0; s < seqs.size(); ++s) {
      const int len = seqs[s].cached + seqs[s].fresh;
      for (int b = 0; b < (len + bs - 1) / bs; ++b) block_tables[s * size_t(max_blocks) + size_t(b)] = pages[next++];
      for (int p = seqs[s].cached; p < len; ++p) positions.push_back(p);
      query_start.push_back(int32_t(positions.size()));
      seq_lens.push_back(len);
    }
    num_tokens = int(positions.size());
    host_meta.num_seqs = int(seqs.size());
    host_meta.num_tokens = num_tokens;
    host_meta.query_start = query_start.data();
    host_meta.positions = positions.data();
    host_meta.seq_lens = seq_lens.data();
    host_meta.block_tables = block_tables.data();
    host_meta.max_blocks_per_seq = max_blocks;
    host_meta.block_size = bs;
    for (size_t s = 0; s < seqs.size(); ++s) {
      for (int t = query_start[s]; t < query_start[s + 1]; ++t) slots.push_back(host_meta.slot_of(int(s), positions[size_t(t)]));
    }
    host_meta.slot_mapping = slots.data();
    dev_meta = host_meta;
    dev_meta.query_start = upload(query_start);
    dev_meta.positions = upload(positions);
    dev_meta.seq_lens = upload(seq_lens);
    dev_meta.block_tables = upload(block_tables);
    dev_meta.slot_mapping = upload(slots);
  }
  int64_t num_slots() const { return int64_t(num_pages) * block_size; }

 private:
  template <class T> const T* upload(const std::vector<T>& v) {
    dev_arrays.push_back(std::make_unique<DevBuf>(v));
    return dev_arrays.back()->as<const T>();
  }
};

}  // namespace m3::cuda_test
