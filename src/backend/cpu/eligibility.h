#pragma once
// Eligibility helpers shared by the CPU entries.
#include <string>

#include "ops/dispatch.h"

namespace m3::cpu {

inline std::string need_cpu_f32(const ops::Problem& p) {
  if (p.device != Device::kCpu) return "tensors are not in host memory";
  if (p.dtype != DType::kF32) return "CPU reference takes F32 (weights are dequantised at load), got " + std::string(dtype_name(p.dtype));
  return "";
}

// Entries that keep each row's result independent of the batch (listed first, so they win
// whenever the context asks for batch invariance).
inline std::string need_cpu_f32_invariant(const ops::Problem& p) {
  if (!p.batch_invariant) return "batch invariance not requested (the batched GEMM entry is faster)";
  return need_cpu_f32(p);
}

}  // namespace m3::cpu
