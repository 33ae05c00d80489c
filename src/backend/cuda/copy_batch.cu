// Many device-to-device copies in one launch (KV transfers: a page per block and tensor, tens of
// thousands of cudaMemcpyAsync calls for an M3 prompt otherwise). A CTA per piece (its runs in
// turn), 16-byte words where both ends are aligned to them, bytes elsewhere.
#include <cstdint>

#include "backend/cuda/copy_batch.h"
#include "backend/cuda/cuda_check.h"

namespace m3::cuda {
namespace {

struct Piece {
  char* dst;
  const char* src;
  unsigned long long bytes, rows, dst_pitch, src_pitch;
};

__device__ __forceinline__ void copy_run(char* dst, const char* src, unsigned long long bytes) {
  if (((uintptr_t(dst) | uintptr_t(src)) & 15) == 0) {
    const unsigned long long words = bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (unsigned long long w = threadIdx.x; w < words; w += blockDim.x) d[w] = s[w];
    for (unsigned long long b = words * 16 + threadIdx.x; b < bytes; b += blockDim.x) dst[b] = src[b];
  } else {
    for (unsigned long long b = threadIdx.x; b < bytes; b += blockDim.x) dst[b] = src[b];
  }
}

__global__ void copy_pieces_kernel(const Piece* pieces, int n) {
  for (int i = blockIdx.x; i < n; i += gridDim.x) {
    const Piece p = pieces[i];
    for (unsigned long long r = 0; r < p.rows; ++r) copy_run(p.dst + r * p.dst_pitch, p.src + r * p.src_pitch, p.bytes);
  }
}

}  // namespace

void copy_pieces(const std::vector<ops::BackendRuntime::CopyPiece>& pieces, CopyBatchBuffers& buf, cudaStream_t stream) {
  if (pieces.empty()) return;
  const size_t bytes = pieces.size() * sizeof(Piece);
  if (bytes > buf.capacity) {
    if (buf.host) cudaFreeHost(buf.host);
    if (buf.device) cudaFree(buf.device);
    buf.capacity = bytes * 2;
    M3_CUDA_CHECK(cudaMallocHost(&buf.host, buf.capacity));
    M3_CUDA_CHECK(cudaMalloc(&buf.device, buf.capacity));
  }
  // The host list is rewritten only after the previous batch's upload read it.
  M3_CUDA_CHECK(cudaStreamSynchronize(stream));
  Piece* h = static_cast<Piece*>(buf.host);
  for (size_t i = 0; i < pieces.size(); ++i)
    h[i] = Piece{static_cast<char*>(pieces[i].dst), static_cast<const char*>(pieces[i].src), pieces[i].bytes,
                 pieces[i].rows, pieces[i].dst_pitch, pieces[i].src_pitch};
  M3_CUDA_CHECK(cudaMemcpyAsync(buf.device, buf.host, bytes, cudaMemcpyHostToDevice, stream));
  const int grid = int(pieces.size() < 65535 ? pieces.size() : 65535);
  copy_pieces_kernel<<<grid, 256, 0, stream>>>(static_cast<const Piece*>(buf.device), int(pieces.size()));
  M3_CUDA_CHECK_LAUNCH();
}

void release_copy_batch(CopyBatchBuffers& buf) {
  if (buf.host) cudaFreeHost(buf.host);
  if (buf.device) cudaFree(buf.device);
  buf = CopyBatchBuffers{};
}

}  // namespace m3::cuda
