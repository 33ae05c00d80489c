// Host-side selection among the CUDA attention entries (no device needed): which entry a
// problem reaches is decided by the eligibility rules and their order in the table, and a
// prefill must not land on a decode kernel (or the reverse) by a change elsewhere in the table.
#include <gtest/gtest.h>

#include <string>

#include "backend/cuda/cuda_backend.h"
#include "ops/ops.h"

namespace m3 {
namespace {

std::string pick(const ops::KernelTable& t, int64_t tokens, int64_t top_k, bool invariant,
                 DType kv = DType::kBF16, int64_t head_dim = 128) {
  ops::Problem p;
  p.op = "attention";
  p.device = Device::kCuda;
  p.dtype = kv;
  p.m = tokens;
  p.n = 64;
  p.k = head_dim;
  p.extra = top_k;
  p.batch_invariant = invariant;
  return t.attention.select(p, nullptr).name;
}

TEST(AttentionDispatch, PrefillAndDecodeReachTheirKernels) {
  ops::KernelTable t;
  cuda::register_cuda_kernels(t);
  // Dense (M3 layers 0-2): prefills on the wgmma dense kernel, decode and short chunks query-major.
  EXPECT_EQ(pick(t, 8192, 0, true), "attention.msa_dense_prefill.sm90");
  EXPECT_EQ(pick(t, 64, 0, true), "attention.msa_dense_prefill.sm90");
  EXPECT_EQ(pick(t, 63, 0, true), "attention.msa_query_major.sm90");
  EXPECT_EQ(pick(t, 1, 0, false), "attention.msa_query_major.sm90");
  // Block-sparse (MSA layers): prefills block-major (the bf16 variant only without invariance).
  EXPECT_EQ(pick(t, 8192, 16, true), "attention.msa_block_major_prefill.sm90");
  EXPECT_EQ(pick(t, 8192, 16, false), "attention.msa_block_major_prefill_fast.sm90");
  EXPECT_EQ(pick(t, 1023, 16, true), "attention.msa_query_major.sm90");
  EXPECT_EQ(pick(t, 4, 16, true), "attention.msa_query_major.sm90");
  // Shapes the tuned entries do not take fall through to the generic kernels.
  EXPECT_EQ(pick(t, 8192, 0, true, DType::kF32).find("msa_"), std::string::npos);
  EXPECT_EQ(pick(t, 8192, 0, true, DType::kBF16, 64).find("msa_"), std::string::npos);
}

}  // namespace
}  // namespace m3
