#pragma once
// The runtime of host memory: what the CPU backend (and any caller without a device) uses.
#include "ops/runtime.h"

namespace m3::ops {

// One process-wide instance; stateless apart from the allocations it hands out. Its memory comes
// zeroed, and large buffers stay untouched (no pages) until written.
BackendRuntime* host_runtime();

}  // namespace m3::ops
