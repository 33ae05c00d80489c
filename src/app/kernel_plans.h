#pragma once
// The plans section of docs/kernel_paths.md (kernel_plans.cpp): empty without the CUDA backend.
#include <string>

namespace m3::app {

std::string kernel_plans_markdown();

}  // namespace m3::app
