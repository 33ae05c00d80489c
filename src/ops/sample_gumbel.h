#pragma once
// The definition of the `sample` op's randomness and ordering, shared verbatim by the CPU
// reference, the CUDA entry and the tests (C++17, host and device).
//
// Per row with temperature T > 0 the token is argmax_v (logit[v] / T + g(seed, step, v))
// (Gumbel-max: exactly a draw from softmax(logits / T)), with
//   g = -log(-log(u)),  u = (bits + 0.5) * 2^-23,  bits = 23 bits of a counter-based hash of
//   (seed, step, v).
// The integer part is identical everywhere; u is exact in fp32 and lies in [2^-24, 1 - 2^-24]
// (never 0 or 1). 23 bits, not 24: (bits + 0.5) of a 24-bit value is not representable in
// fp32 and 1 - 2^-25 would round to 1. g is computed in fp32 with logf (device; not __logf)
// or std::log(float) (host), so CPU and GPU agree up to the last ulp of the two logs.
// T == 0 (or anything not > 0) is greedy: argmax of the raw logits.
// Every argmax orders (value, id) by value descending, then id ascending (ties to the lower
// id); NaN values never win.
#include <cmath>
#include <cstdint>
#include <string>

#include "ops/ops.h"

#if defined(__CUDACC__)
#define M3_SAMPLE_HD __host__ __device__ __forceinline__
#else
#define M3_SAMPLE_HD inline
#endif

namespace m3::ops {

// splitmix64's finaliser (a bijection on 64 bits).
M3_SAMPLE_HD uint64_t sample_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Per-row part of the hash, computed once per row.
M3_SAMPLE_HD uint64_t sample_row_key(uint64_t seed, uint64_t step) {
  const uint64_t h = sample_mix64(seed + 0x9E3779B97F4A7C15ull);
  return sample_mix64(h ^ (step * 0xD1B54A32D192ED03ull + 0x8CB92BA72F3D8DD7ull));
}

// 23 uniformly distributed bits for token `token` of the row keyed by `row_key`.
M3_SAMPLE_HD uint32_t sample_token_bits(uint64_t row_key, uint32_t token) {
  const uint64_t h = sample_mix64(row_key ^ (uint64_t(token) * 0xA0761D6478BD642Full + 0xE7037ED1A0B428DBull));
  return uint32_t(h >> 41);
}

// u in (0, 1), exact in fp32.
M3_SAMPLE_HD float sample_uniform(uint32_t bits23) { return (float(bits23) + 0.5f) * (1.0f / 8388608.0f); }

// The Gumbel(0, 1) perturbation of `token` in the row keyed by `row_key`.
M3_SAMPLE_HD float sample_gumbel(uint64_t row_key, uint32_t token) {
  const float u = sample_uniform(sample_token_bits(row_key, token));
#if defined(__CUDA_ARCH__)
  return -logf(-logf(u));
#else
  return -std::log(-std::log(u));
#endif
}

// True when (av, aid) comes strictly before (bv, bid): larger value, then lower id. NaN never
// comes before anything.
M3_SAMPLE_HD bool sample_before(float av, int32_t aid, float bv, int32_t bid) {
  return av > bv || (av == bv && aid < bid);
}

// Host-side shape/dtype/device check shared by every entry: "" when the views fit the op's
// contract (ops.h), else what is wrong. Row contents (top_n, temperature) are not looked at.
inline std::string sample_check_views(const TensorView& logits, const TensorView& params, const TensorView& tokens,
                                      const TensorView& logprobs, const TensorView& top_ids,
                                      const TensorView& top_logprobs, Device device) {
  const TensorView* all[] = {&logits, &params, &tokens, &logprobs, &top_ids, &top_logprobs};
  for (const TensorView* v : all) {
    if (v->device != device) return "sample: every tensor must be in the entry's memory (host or device)";
  }
  if (logits.shape.rank() != 2 || logits.dtype != DType::kF32) return "sample: logits must be F32 [rows, vocab]";
  const int64_t rows = logits.shape[0], vocab = logits.shape[1];
  if (vocab < 1 || vocab > INT32_MAX - 1) return "sample: vocab must be in [1, 2^31 - 2]";
  if (params.dtype != DType::kU8 || params.numel() != rows * int64_t(sizeof(SampleRowParams)))
    return "sample: params must be U8 holding rows * sizeof(SampleRowParams) bytes";
  if (tokens.dtype != DType::kI32 || tokens.numel() != rows) return "sample: tokens must be I32 [rows]";
  if (logprobs.dtype != DType::kF32 || logprobs.numel() != rows) return "sample: logprobs must be F32 [rows]";
  if (top_ids.dtype != DType::kI32 || top_ids.numel() != rows * kMaxTopLogprobs)
    return "sample: top_ids must be I32 [rows, kMaxTopLogprobs]";
  if (top_logprobs.dtype != DType::kF32 || top_logprobs.numel() != rows * kMaxTopLogprobs)
    return "sample: top_logprobs must be F32 [rows, kMaxTopLogprobs]";
  if (rows > 0 && (!logits.data || !params.data || !tokens.data || !logprobs.data || !top_ids.data ||
                   !top_logprobs.data))
    return "sample: null tensor data";
  return "";
}

}  // namespace m3::ops

#undef M3_SAMPLE_HD
