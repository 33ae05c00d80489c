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

}  // namespace m3::cpu
