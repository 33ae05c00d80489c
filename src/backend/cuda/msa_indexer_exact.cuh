#pragma once
// The decode indexer's exact scan (msa_indexer_decode.cu): a CTA whose chunk holds few (row,
// block) pairs computes every (row, key) dot as the reference does, instead of streaming the
// blocks' units warp by warp through the approximate MMA pass.
//
// The warp-streamed scan gives each warp whole 128-key units: at B = 1 an 8K context is 63
// units, so 63 warps each run eight dependent 16-key tiles (two ring refills, then the
// candidates' exact dots) while the rest of the GPU idles. Here the CTA copies one block's keys
// into shared memory in one round (the next block's copies in flight while this one is
// computed) and its 256 threads compute all of the block's (row, key) dots at once, two rows per
// thread from q in shared memory: with a few rows that is less work on the critical path than
// the MMA tiles, exact by construction, and no key is read twice. The chain costs ~3x the
// instructions per key of the MMA pass, so chunks of many blocks keep the streamed scan.
#include "backend/cuda/msa_indexer_common.cuh"
#include "backend/cuda/msa_timeline.cuh"

namespace m3::cuda::msa_index {

constexpr int kExactThreads = 256;
constexpr int kExactMaxRows = 16;        // (token, head) rows of a query group
constexpr int kExactMaxBs = 128;         // keys per block
constexpr int kExactMaxChunkBlocks = 64;  // a chunk's page ids kept in shared memory

template <class IK>
struct ExactLayout {  // offsets in the scan's shared-memory area
  static constexpr int kRowBytes = IkTraits<IK>::kRowBytes;
  static constexpr int kStageBytes = kExactMaxBs * kRowBytes;  // one block's keys, swizzled rows
  static constexpr size_t kQOff = 2 * size_t(kStageBytes);     // two stages, then the q rows
  static constexpr size_t kPageOff = kQOff + size_t(kExactMaxRows) * kDim * 4;
  static constexpr size_t kMaxOff = kPageOff + kExactMaxChunkBlocks * 4;
  static constexpr size_t kBytes = kMaxOff + kExactMaxRows * 4;
};

// Block scores of rows [0, P) of the group at token t0 (sequence s) for the chunk's blocks
// [b0, b0 + nbc) (nbc <= kExactMaxChunkBlocks), written to a.scores: the maximum of the
// reference's dots over the block's keys (NaN skipped; kKeyMinusInf when none is a number) for
// the rows whose local block lies past it. All kExactThreads threads call it; `area` holds
// ExactLayout<IK>::kBytes of shared memory (128-byte aligned), free when it returns.
template <class IK, bool kWait>
__device__ __forceinline__ void exact_scan(const IndexerArgs& a, int t0, int s, int P, const int* s_pos, int b0,
                                           int nbc, unsigned char* area) {
  using L = ExactLayout<IK>;
  constexpr int kRowBytes = L::kRowBytes, kKeyChunks = kRowBytes / 16;
  float* const q_s = reinterpret_cast<float*>(area + L::kQOff);
  int* const page_s = reinterpret_cast<int*>(area + L::kPageOff);
  unsigned* const max_s = reinterpret_cast<unsigned*>(area + L::kMaxOff);
  const int tid = threadIdx.x, lane = tid & 31, H = a.heads, bs = a.bs, bs_shift = a.bs_shift;
  const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
  const unsigned char* keys = static_cast<const unsigned char*>(a.keys);
  const uint32_t stage0 = smem_u32(area);
  // Block bi of the chunk (page `page`) into stage bi & 1: 16-byte copies, rows swizzled as
  // exact_dots reads them.
  auto load_block = [&](int bi, int page) {
    const uint32_t dst = stage0 + uint32_t(bi & 1) * uint32_t(L::kStageBytes);
    const unsigned char* src = keys + uint64_t(uint32_t(page) * uint32_t(bs)) * kRowBytes;
    for (int i = tid; i < bs * kKeyChunks; i += kExactThreads) {
      const int key = i / kKeyChunks, ch = i % kKeyChunks;
      cp_async16(dst + uint32_t(key * kRowBytes + ((ch ^ (key & 7)) << 4)), src + size_t(i) * 16, true);
    }
    cp_async_commit();
  };
  load_block(0, __ldg(table + b0));  // every thread reads the same page id (one request per warp)
  for (int i = 1 + tid; i < nbc; i += kExactThreads) page_s[i] = __ldg(table + b0 + i);
  if constexpr (kWait) pdl_wait();  // the q rows are the previous kernel's (a dependent launch)
  for (int e = tid; e < P * (kDim / 4); e += kExactThreads) {
    reinterpret_cast<float4*>(q_s)[e] = *reinterpret_cast<const float4*>(group_q_row(a, t0, e / (kDim / 4)) + (e % (kDim / 4)) * 4);
  }
  if (tid < kExactMaxRows) max_s[tid] = 0u;
  // Items: (row pair rp, key), the keys of one row pair contiguous, so a warp's lanes hold
  // consecutive keys of one block (blocks of 16 keys: two row pairs per warp, segments of 16).
  const int items = bs * ((P + 1) >> 1), items_w = (items + 31) & ~31, seg = min(bs, 32);
#pragma unroll 1
  for (int bi = 0; bi < nbc; ++bi) {
    __syncthreads();  // page ids, q rows visible (bi = 0); block bi - 1's stage reads and maxima done
    if (bi + 1 < nbc) load_block(bi + 1, page_s[bi + 1]);
    else cp_async_commit();  // an empty group keeps the wait below uniform
    cp_async_wait<1>();
    __syncthreads();  // block bi's keys are visible
    if (bi == 0) M3_TL_MARK(indexer, blockIdx.x == 0 ? int(blockIdx.y) : -1, 2);
    const unsigned char* stage = area + size_t(bi & 1) * L::kStageBytes;
    const int blk = b0 + bi;
    for (int it = tid; it < items_w; it += kExactThreads) {
      const int rp = it >> bs_shift, key = it & (bs - 1);
      const int r0 = 2 * rp, r1 = min(2 * rp + 1, P - 1);  // an odd last row is computed twice
      uint32_t v0 = 0u, v1 = 0u;                             // order keys; 0: no number
      if (it < items) {
        const float* const qr[2] = {q_s + r0 * kDim, q_s + r1 * kDim};
        float x[2];
        exact_dots<IK, 2>(qr, stage + key * kRowBytes, key, x);
        if (x[0] == x[0] && blk < (s_pos[r0 / H] >> bs_shift)) v0 = order_key(x[0]);  // the reference skips NaN
        if (x[1] == x[1] && blk < (s_pos[r1 / H] >> bs_shift)) v1 = order_key(x[1]);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        if (off < seg) {
          v0 = max(v0, __shfl_xor_sync(0xffffffffu, v0, off));
          v1 = max(v1, __shfl_xor_sync(0xffffffffu, v1, off));
        }
      }
      if (it < items && (lane & (seg - 1)) == 0) {
        atomicMax(&max_s[r0], v0);
        atomicMax(&max_s[r1], v1);
      }
    }
    __syncthreads();  // the block's maxima are complete
    if (bi == 0) M3_TL_MARK(indexer, blockIdx.x == 0 ? int(blockIdx.y) : -1, 6);
    if (tid < P) {
      if (blk < (s_pos[tid / H] >> bs_shift)) {
        a.scores[(int64_t(t0 - a.tok_begin) * H + tid) * a.max_blocks + blk] = max(max_s[tid], msa::kKeyMinusInf);
      }
      max_s[tid] = 0u;
    }
  }
  cp_async_wait<0>();
}

}  // namespace m3::cuda::msa_index
