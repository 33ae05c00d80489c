#include "backend/cpu/cpu_backend.h"

namespace m3::cpu {

void register_elementwise(ops::KernelTable& table);
void register_linear(ops::KernelTable& table);
void register_attention(ops::KernelTable& table);
void register_moe(ops::KernelTable& table);
void register_sampling(ops::KernelTable& table);

void register_cpu_kernels(ops::KernelTable& table) {
  register_elementwise(table);
  register_linear(table);
  register_attention(table);
  register_moe(table);
  register_sampling(table);
}

}  // namespace m3::cpu
