#include "backend/cuda/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"

namespace m3::cuda {
namespace {

// The driver's tensor-map encoder, looked up once through the runtime.
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    M3_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || p == nullptr) throw std::runtime_error("cuTensorMapEncodeTiled is not available");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

CUtensorMap encode(const void* base, cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides,
                   const cuuint32_t* box, const char* what) {
  if (box[0] * 2 != 128) throw std::logic_error(std::string(what) + ": the box's inner extent must be 128 bytes");
  CUtensorMap map{};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims, strides, box, elem,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw std::runtime_error(std::string("cuTensorMapEncodeTiled failed for ") + what + " (" + std::to_string(int(r)) + ")");
  return map;
}

}  // namespace

CUtensorMap bf16_map_2d(const void* base, uint64_t cols, uint64_t rows, uint64_t pitch_bytes, uint32_t box_cols,
                        uint32_t box_rows) {
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {pitch_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  return encode(base, 2, dims, strides, box, "a 2-D bf16 tensor");
}

CUtensorMap bf16_map_3d(const void* base, uint64_t dim, uint64_t heads, uint64_t slots, uint32_t box_dim, uint32_t box_slots) {
  const cuuint64_t dims[3] = {dim, heads, slots};
  const cuuint64_t strides[2] = {dim * 2, heads * dim * 2};
  const cuuint32_t box[3] = {box_dim, 1, box_slots};
  return encode(base, 3, dims, strides, box, "a paged KV cache");
}

}  // namespace m3::cuda
