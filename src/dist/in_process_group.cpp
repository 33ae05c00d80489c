#include "dist/in_process_group.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/check.h"

namespace m3::dist {

class InProcessCommunicator final : public ops::Communicator {
 public:
  InProcessCommunicator(InProcessGroup& g, int rank) : g_(g), rank_(rank) {}
  int size() const override { return g_.size_; }
  int rank() const override { return rank_; }
  std::string entry_name(const std::string& collective) const override { return collective + ".in_process.cpu"; }
  void abort() override { g_.abort(); }

  // Three phases between barriers: publish the input; sum a 1/size share of the elements over
  // the ranks in rank order; copy the whole sum back. The last barrier keeps the next call from
  // resizing the sum while a rank still reads it.
  void all_reduce_sum(const TensorView& x) override {
    M3_CHECK(x.device == Device::kCpu && x.dtype == DType::kF32, "in-process all_reduce takes F32 host tensors");
    const int64_t n = x.numel();
    g_.inputs_[size_t(rank_)] = x.as<float>();
    g_.counts_[size_t(rank_)] = n;
    if (rank_ == 0) g_.sum_.resize(size_t(n));
    g_.arrive_and_wait();
    for (int r = 0; r < g_.size_; ++r)
      M3_CHECK(g_.counts_[size_t(r)] == n, "all_reduce: rank %d passed %lld elements, rank %d %lld", r,
               static_cast<long long>(g_.counts_[size_t(r)]), rank_, static_cast<long long>(n));
    const int64_t begin = n * rank_ / g_.size_, end = n * (rank_ + 1) / g_.size_;
    for (int64_t i = begin; i < end; ++i) {
      float acc = g_.inputs_[0][i];
      for (int r = 1; r < g_.size_; ++r) acc += g_.inputs_[size_t(r)][i];
      g_.sum_[size_t(i)] = acc;
    }
    g_.arrive_and_wait();
    std::copy(g_.sum_.begin(), g_.sum_.begin() + n, x.as<float>());
    g_.arrive_and_wait();
  }

  // Publish; every rank copies every rank's block into its own out; the last barrier keeps a
  // rank from changing its local tensor while another still reads it.
  void all_gather_cols(const TensorView& local, const TensorView& out) override {
    M3_CHECK(local.device == Device::kCpu && local.dtype == DType::kF32 && out.dtype == DType::kF32,
             "in-process all_gather takes F32 host tensors");
    const int64_t rows = local.shape[0], cols = local.numel() / rows;
    M3_CHECK(out.numel() == rows * cols * g_.size_, "all_gather_cols: out is not [rows, ranks * cols]");
    g_.inputs_[size_t(rank_)] = local.as<float>();
    g_.counts_[size_t(rank_)] = local.numel();
    g_.arrive_and_wait();
    const int64_t width = cols * g_.size_;
    for (int r = 0; r < g_.size_; ++r) {
      M3_CHECK(g_.counts_[size_t(r)] == rows * cols, "all_gather_cols: ranks passed different shapes");
      const float* src = g_.inputs_[size_t(r)];
      for (int64_t i = 0; i < rows; ++i)
        std::copy(src + i * cols, src + (i + 1) * cols, out.as<float>() + i * width + r * cols);
    }
    g_.arrive_and_wait();
  }

 private:
  InProcessGroup& g_;
  int rank_;
};

InProcessGroup::InProcessGroup(int size) : size_(size), inputs_(size_t(size), nullptr), counts_(size_t(size), 0) {
  M3_CHECK(size >= 1, "a tensor-parallel group needs at least one rank");
}

void InProcessGroup::arrive_and_wait() {
  std::unique_lock<std::mutex> lock(mu_);
  auto fail = [] { throw std::runtime_error("tensor-parallel group aborted: another rank failed"); };
  if (aborted_) fail();
  const uint64_t phase = phase_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++phase_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return phase_ != phase || aborted_; });
  if (phase_ == phase) fail();
}

void InProcessGroup::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = true;
  cv_.notify_all();
}

std::unique_ptr<ops::Communicator> InProcessGroup::communicator(int rank) {
  M3_CHECK(rank >= 0 && rank < size_, "rank out of range");
  return std::make_unique<InProcessCommunicator>(*this, rank);
}

}  // namespace m3::dist
