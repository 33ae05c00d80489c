#pragma once
// Vocabulary shared by the KV metadata layer and the scheduler.
#include <cstdint>

namespace m3 {

using TokenId = int32_t;
using BlockId = int32_t;     // physical KV block index into the backend's cache tensors
using RequestId = uint64_t;  // engine-assigned; unique among live requests

inline constexpr BlockId kNoBlock = -1;

}  // namespace m3
