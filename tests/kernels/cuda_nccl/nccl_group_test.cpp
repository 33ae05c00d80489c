// cuda::NcclGroup's all_reduce on every GPU of the host (2, then all of them): the sum of every
// rank's tensor in rank order, bit for bit, on every rank (the in-process group's bits), for sizes
// from one element to a prefill's activations; eagerly and replayed from a CUDA graph.
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/nccl_group.h"
#include "dist/in_process_group.h"
#include "dist/rank_threads.h"

namespace m3 {
namespace {

std::vector<float> data_of(int rank, size_t n) {
  std::mt19937 rng(uint32_t(rank * 7919 + n));
  std::normal_distribution<float> d(0.f, rank == 0 ? 1e4f : 1.f);  // rank 0 large: order matters
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

void check_group(int size, bool invariant) {
  std::vector<int> devices;
  for (int r = 0; r < size; ++r) devices.push_back(r);
  auto group = cuda::NcclGroup::create(devices);
  if (!group) GTEST_SKIP() << group.error();
  const std::vector<size_t> sizes = {1, 6144, 6144 * 3 + 5, size_t(2048) * 6144};
  // The expected bits: the in-process group's rank-order sums.
  std::vector<std::vector<float>> want;
  for (size_t n : sizes) {
    std::vector<std::vector<float>> in;
    for (int r = 0; r < size; ++r) in.push_back(data_of(r, n));
    std::vector<float> sum = in[0];
    for (int r = 1; r < size; ++r)
      for (size_t i = 0; i < n; ++i) sum[i] += in[size_t(r)][i];
    want.push_back(sum);
  }
  std::vector<std::unique_ptr<ops::BackendRuntime>> rts(static_cast<size_t>(size));
  std::vector<std::unique_ptr<ops::Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back((*group)->communicator(r, invariant));
  dist::RankThreads threads(size);
  std::vector<std::string> errors(static_cast<size_t>(size));
  threads.run([&](int r) {
    rts[size_t(r)] = cuda::make_cuda_runtime(r);
    ops::BackendRuntime* rt = rts[size_t(r)].get();
    rt->activate();
    for (size_t c = 0; c < sizes.size(); ++c) {
      const size_t n = sizes[c];
      const auto mine = data_of(r, n);
      ops::DeviceBuffer buf(rt, n * 4);
      const TensorView x{buf.data(), DType::kF32, {1, int64_t(n)}, Device::kCuda};
      for (int graph = 0; graph < 2; ++graph) {
        rt->upload(buf.data(), mine.data(), n * 4);
        if (graph) rt->replay(rt->capture([&] { comms[size_t(r)]->all_reduce_sum(x); }));
        else comms[size_t(r)]->all_reduce_sum(x);
        std::vector<float> got(n);
        rt->download(got.data(), buf.data(), n * 4);
        // Two ranks, or the ordered path: exactly the rank-order sum.
        const bool exact = invariant || size == 2;
        size_t bad = 0;
        for (size_t i = 0; i < n; ++i) bad += exact ? got[i] != want[c][i] : std::fabs(got[i] - want[c][i]) > 1e-2f;
        if (bad) errors[size_t(r)] += "size " + std::to_string(n) + (graph ? " (graph)" : "") + ": " +
                                      std::to_string(bad) + " elements differ; ";
      }
    }
    // all_gather_cols: [3, 1000] per rank -> [3, 1000 * size], rank r's block at columns r * 1000.
    const int64_t rows = 3, cols = 1000;
    std::vector<float> local(size_t(rows * cols));
    for (size_t i = 0; i < local.size(); ++i) local[i] = float(r * 100000 + int(i));
    ops::DeviceBuffer dl(rt, local.size() * 4), dout(rt, local.size() * 4 * size_t(size));
    rt->upload(dl.data(), local.data(), local.size() * 4);
    comms[size_t(r)]->all_gather_cols(TensorView{dl.data(), DType::kF32, {rows, cols}, Device::kCuda},
                                      TensorView{dout.data(), DType::kF32, {rows, cols * size}, Device::kCuda});
    std::vector<float> got(local.size() * size_t(size));
    rt->download(got.data(), dout.data(), got.size() * 4);
    for (int64_t i = 0; i < rows; ++i)
      for (int k = 0; k < size; ++k)
        for (int64_t c = 0; c < cols; ++c)
          if (got[size_t(i * cols * size + k * cols + c)] != float(k * 100000 + int(i * cols + c))) {
            errors[size_t(r)] += "all_gather_cols misplaced; ";
            return;
          }
  });
  for (int r = 0; r < size; ++r) EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << ": " << errors[size_t(r)];
  std::printf("%d ranks (%s): %s\n", size, invariant ? "rank-order" : "nccl all-reduce",
              comms[0]->entry_name("all_reduce").c_str());
}

TEST(NcclGroup, AllReduceSumsInRankOrder) {
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << n << " CUDA device(s): tensor parallelism needs two";
  check_group(2, true);
  if (n > 2) {
    check_group(n, true);
    check_group(n, false);
  }
}

TEST(NcclGroup, RefusesAbsentAndRepeatedDevices) {
  const int n = cuda::device_count();
  if (n < 1) GTEST_SKIP() << "no CUDA device";
  auto absent = cuda::NcclGroup::create({0, n});
  ASSERT_FALSE(absent.is_ok());
  if (absent.error().find("NCCL is not loadable") != std::string::npos) GTEST_SKIP() << absent.error();
  EXPECT_NE(absent.error().find("needs CUDA device " + std::to_string(n)), std::string::npos) << absent.error();
  auto repeated = cuda::NcclGroup::create({0, 0});
  ASSERT_FALSE(repeated.is_ok());
  EXPECT_NE(repeated.error().find("both name CUDA device 0"), std::string::npos) << repeated.error();
}

}  // namespace
}  // namespace m3
