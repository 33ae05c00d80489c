// Dispatch entries of the tuned MSA kernels. Registered before the generic CUDA entries, so
// they win wherever eligible; shapes the eligibility cannot see (page size, batch layout)
// and the kernels do not take are handed to the generic kernels by the launchers.
#include <string>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"

namespace m3::cuda {

void register_msa(ops::KernelTable& table) {
  table.indexer_topk.add(
      {"indexer_topk.msa_split_pages.sm90",
       "device BF16 or F8E4M3 index-K cache, index dim 128, <= 16 index heads, 1 <= top_k <= 64 (page size a power "
       "of two <= 128, else the generic kernel runs); pages of each query group split over CTAs, block scores "
       "bit-identical to the CPU (sequential fp32 dots, no FMA), the last CTA selects exactly (ties to the lower id)",
       [](const ops::Problem& p) -> std::string {
         if (p.device != Device::kCuda) return "tensors are not in device memory";
         if (p.dtype != DType::kBF16 && p.dtype != DType::kF8E4M3) return "index-K cache is not BF16 or F8E4M3";
         if (p.k != 128) return "index head dim is not 128";
         if (p.n > 16) return "more than 16 index heads";
         if (p.extra < 1 || p.extra > 64) return "top_k outside 1..64";
         return "";
       },
       launch_msa_indexer});
  table.attention.add(
      {"attention.msa_mma_splitkv.sm90",
       "device BF16 KV cache, head_dim 128, dense or block-sparse with top_k <= 64 (query heads per KV head <= 64, "
       "else the generic kernel runs); the query heads of a KV group (and up to 64 rows of consecutive tokens) share "
       "each K/V tile, bf16 hi+lo tensor-core MMAs, fp32 softmax folded per 64-key unit in a fixed order "
       "(batch-invariant), split-KV merged in the same launch for small batches",
       [](const ops::Problem& p) -> std::string {
         if (p.device != Device::kCuda) return "tensors are not in device memory";
         if (p.dtype != DType::kBF16) return "KV cache is not BF16";
         if (p.k != 128) return "head_dim is not 128";
         if (p.extra > 64) return "top_k above 64";
         return "";
       },
       launch_msa_attention});
}

}  // namespace m3::cuda
