// BackendRuntime's defaults: memory handles that map within the exporting process only.
#include "ops/runtime.h"

#include <cstdint>
#include <cstdio>

#include <unistd.h>

namespace m3::ops {

// Handles name the process and the pointer; within the exporting process the pointer is the
// mapping. Backends that share memory between processes add their own handle (CUDA IPC).
std::string BackendRuntime::export_memory(void* base, std::string* error) {
  if (!base) {
    *error = "no memory to export";
    return "";
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "m3mem/1 pid=%ld ptr=%llx", long(getpid()), (unsigned long long)uintptr_t(base));
  return buf;
}

void* BackendRuntime::import_memory(const std::string& handle, std::string* error) {
  long pid = 0;
  unsigned long long ptr = 0;
  if (std::sscanf(handle.c_str(), "m3mem/1 pid=%ld ptr=%llx", &pid, &ptr) != 2) {
    *error = "not a memory handle: '" + handle.substr(0, 80) + "'";
    return nullptr;
  }
  if (pid != long(getpid())) {
    *error = "memory of process " + std::to_string(pid) + " cannot be mapped by " + describe() +
             " (host memory is shared within one process only)";
    return nullptr;
  }
  return reinterpret_cast<void*>(uintptr_t(ptr));
}

}  // namespace m3::ops
