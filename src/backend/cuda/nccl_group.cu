#include "backend/cuda/nccl_group.h"

#include <dlfcn.h>
#include <nccl.h>

#include <mutex>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"

namespace m3::cuda {
namespace {

// The NCCL entry points this file uses, resolved from the library at first use.
struct NcclApi {
  ncclResult_t (*comm_init_all)(ncclComm_t*, int, const int*) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_abort)(ncclComm_t) = nullptr;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = nullptr;
  const char* (*error_string)(ncclResult_t) = nullptr;
  std::string error;  // why it could not be loaded
};

const NcclApi& nccl() {
  static const NcclApi api = [] {
    NcclApi a;
    void* lib = nullptr;
    std::string tried;
    for (const char* name : {"libnccl.so.2", "libnccl.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib) break;
      const char* why = dlerror();
      tried += std::string(tried.empty() ? "" : "; ") + name + ": " + (why ? why : "not found");
    }
    if (!lib) {
      a.error = "NCCL is not loadable (" + tried +
                "); put the directory of libnccl.so.2 on LD_LIBRARY_PATH (PyTorch ships it in "
                "site-packages/nvidia/nccl/lib)";
      return a;
    }
    auto sym = [&](const char* name) {
      void* p = dlsym(lib, name);
      if (!p && a.error.empty()) a.error = std::string("libnccl has no symbol ") + name;
      return p;
    };
    a.comm_init_all = reinterpret_cast<decltype(a.comm_init_all)>(sym("ncclCommInitAll"));
    a.comm_destroy = reinterpret_cast<decltype(a.comm_destroy)>(sym("ncclCommDestroy"));
    a.comm_abort = reinterpret_cast<decltype(a.comm_abort)>(sym("ncclCommAbort"));
    a.all_reduce = reinterpret_cast<decltype(a.all_reduce)>(sym("ncclAllReduce"));
    a.all_gather = reinterpret_cast<decltype(a.all_gather)>(sym("ncclAllGather"));
    a.error_string = reinterpret_cast<decltype(a.error_string)>(sym("ncclGetErrorString"));
    return a;
  }();
  return api;
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + " failed: " + nccl().error_string(r));
}

// out[i] = in[0][i] + in[1][i] + ... in rank order (in: `ranks` blocks of n floats).
__global__ void sum_in_rank_order(const float* __restrict__ in, int64_t n, int ranks, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float acc = in[i];
    for (int r = 1; r < ranks; ++r) acc += in[int64_t(r) * n + i];
    out[i] = acc;
  }
}

// out[row, r * cols + c] = in[r][row][c] (in: `ranks` blocks of rows x cols floats).
__global__ void interleave_rank_blocks(const float* __restrict__ in, int64_t rows, int64_t cols, int ranks,
                                       float* __restrict__ out) {
  const int64_t total = rows * cols * ranks;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / (rows * cols), rest = i % (rows * cols), row = rest / cols, c = rest % cols;
    out[row * cols * ranks + r * cols + c] = in[i];
  }
}

class NcclCommunicator final : public ops::Communicator {
 public:
  NcclCommunicator(NcclGroup* group, ncclComm_t comm, int rank, int size, bool ordered)
      : group_(group), comm_(comm), rank_(rank), size_(size), ordered_(ordered && size > 2) {}
  void abort() override { group_->abort(); }
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  std::string entry_name(const std::string& collective) const override {
    return collective + (ordered_ && collective == "all_reduce" ? ".nccl_gather_ordered_sum.sm90" : ".nccl.sm90");
  }
  void all_reduce_sum(const TensorView& x) override {
    const size_t n = size_t(x.numel());
    cudaStream_t s = current_stream();
    if (!ordered_) {
      // Two ranks: x0 + x1 is one rounding, the same whichever rank adds (fp addition commutes).
      nccl_check(nccl().all_reduce(x.data, x.data, n, ncclFloat32, ncclSum, comm_, s), "ncclAllReduce");
      return;
    }
    Scratch gathered(n * size_t(size_) * 4);
    nccl_check(nccl().all_gather(x.data, gathered.as<float>(), n, ncclFloat32, comm_, s), "ncclAllGather");
    const int blocks = int(std::min<size_t>((n + 255) / 256, 1024));
    sum_in_rank_order<<<blocks, 256, 0, s>>>(gathered.as<float>(), int64_t(n), size_, x.as<float>());
    M3_CUDA_CHECK_LAUNCH();
  }
  void all_gather_cols(const TensorView& local, const TensorView& out) override {
    const int64_t rows = local.shape[0], cols = local.numel() / rows;
    const size_t n = size_t(rows * cols);
    cudaStream_t s = current_stream();
    Scratch gathered(n * size_t(size_) * 4);
    nccl_check(nccl().all_gather(local.data, gathered.as<float>(), n, ncclFloat32, comm_, s), "ncclAllGather");
    const int blocks = int(std::min<size_t>((n * size_t(size_) + 255) / 256, 4096));
    interleave_rank_blocks<<<blocks, 256, 0, s>>>(gathered.as<float>(), rows, cols, size_, out.as<float>());
    M3_CUDA_CHECK_LAUNCH();
  }

 private:
  NcclGroup* group_;
  ncclComm_t comm_;
  int rank_, size_;
  bool ordered_;
};

}  // namespace

struct NcclGroup::Impl {
  std::vector<ncclComm_t> comms;
  std::mutex mu;
  bool aborted = false;
};

NcclGroup::NcclGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

NcclGroup::~NcclGroup() {
  if (!impl_ || impl_->aborted) return;  // aborted communicators are freed by the abort
  for (ncclComm_t c : impl_->comms)
    if (c) nccl().comm_destroy(c);
}

void NcclGroup::abort() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->aborted) return;
  impl_->aborted = true;
  for (ncclComm_t c : impl_->comms)
    if (c) nccl().comm_abort(c);
}

int NcclGroup::size() const { return int(impl_->comms.size()); }

Result<std::unique_ptr<NcclGroup>> NcclGroup::create(const std::vector<int>& devices) {
  const NcclApi& api = nccl();
  if (!api.error.empty()) return Status::error(api.error);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0 || devices[i] >= count)
      return Status::error("tensor parallel rank " + std::to_string(i) + " needs CUDA device " +
                           std::to_string(devices[i]) + ", but " + std::to_string(count) + " are visible");
    for (size_t j = 0; j < i; ++j)
      if (devices[j] == devices[i])
        return Status::error("tensor parallel ranks " + std::to_string(j) + " and " + std::to_string(i) +
                             " both name CUDA device " + std::to_string(devices[i]) + " (NCCL needs one rank per device)");
  }
  auto impl = std::make_unique<Impl>();
  impl->comms.assign(devices.size(), nullptr);
  const ncclResult_t r = api.comm_init_all(impl->comms.data(), int(devices.size()), devices.data());
  if (r != ncclSuccess) return Status::error(std::string("ncclCommInitAll failed: ") + api.error_string(r));
  return std::unique_ptr<NcclGroup>(new NcclGroup(std::move(impl)));
}

std::unique_ptr<ops::Communicator> NcclGroup::communicator(int rank, bool batch_invariant) {
  return std::make_unique<NcclCommunicator>(this, impl_->comms.at(size_t(rank)), rank, size(), batch_invariant);
}

}  // namespace m3::cuda
