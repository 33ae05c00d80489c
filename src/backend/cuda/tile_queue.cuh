// Work items taken in order by persistent warp-specialised CTAs (a producer warpgroup feeding
// consumer warpgroups through a shared-memory stage ring): the producer's thread 0 takes the next
// item from a per-launch counter (zeroed before the launch) and publishes it in a small ring of
// shared-memory slots, each with a "full" mbarrier (its one arrival) and an "empty" one (one
// arrival per consumer warp). Items are then taken as CTAs free up, so the items in flight are
// always about one grid's worth of consecutive ones; with a fixed item per CTA (blockIdx.x +
// k gridDim.x) CTAs of unequal speed drift apart, and neighbouring items that share operands in L2
// stop running together (docs/moe_kernels.md, fifty-sixth session). The ring covers a producer
// that runs up to kTileQueueRing - 1 items ahead (its stage ring bounds how far ahead it runs: at
// most one item per stage).
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/cuda/mma_operands.cuh"

namespace m3::cuda {

using mma_ops::mbar_arrive;
using mma_ops::mbar_init;
using mma_ops::mbar_wait;

constexpr int kTileQueueRing = 8;
constexpr size_t kTileQueueBytes = size_t(kTileQueueRing) * (8 + 8 + 4);  // 8-byte aligned
// The named barrier the producer warpgroup syncs on (0 is __syncthreads; kernels using the queue
// keep this id for it).
constexpr int kTileQueueBarrier = 2;

// The ring at one shared-memory address (one register; the parts at constant offsets).
struct TileQueue {
  uint32_t ring;
  __device__ explicit TileQueue(uint32_t ring_) : ring(ring_) {}
  __device__ __forceinline__ uint32_t full(int s) const { return ring + 8u * uint32_t(s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return ring + 8u * uint32_t(kTileQueueRing + s); }
  __device__ __forceinline__ uint32_t slot(int s) const { return ring + 16u * kTileQueueRing + 4u * uint32_t(s); }
  // By one thread, before the CTA's first barrier (and its mbarrier-init fence).
  __device__ __forceinline__ void init(uint32_t consumer_warps) const {
    for (int s = 0; s < kTileQueueRing; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), consumer_warps);
    }
  }
  __device__ __forceinline__ int read(int s) const {
    int v;
    // No memory clobber: the barrier before it orders the read (a clobber here cost the W8A16
    // wgmma kernel's consumers a register spill).
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(slot(s)));
    return v;
  }
};

// The producer warpgroup's side: every one of its 128 threads calls take() in step; it returns the
// next item, or -1 once `total` items are taken. The first item of a CTA is blockIdx.x (the grid's
// first wave is the first gridDim.x items, as with a fixed assignment: items that share an operand
// start together); each later one comes from the counter (+ gridDim.x) when the producer has
// issued the previous item's copies, a stage ring before the consumers finish it, so the atomic's
// round trip is hidden behind their last stages. (Claiming the next item when the current one
// starts scattered the first wave: 4-5 % slower on a linear four tiles wide, whose tiles share
// their token rows; the batch-invariant linear, measured with this queue, gained nothing and keeps
// its fixed assignment: docs/moe_kernels.md, fifty-sixth session.)
struct TileQueueProducer {
  TileQueue q;
  unsigned* ctr;
  int total;
  uint32_t n = 0;
  __device__ TileQueueProducer(TileQueue q_, unsigned* ctr_, int total_) : q(q_), ctr(ctr_), total(total_) {}
  __device__ __forceinline__ int take(int tid) {
    const int s = int(n % kTileQueueRing);
    const uint32_t parity = (n / kTileQueueRing) & 1u;
    if (tid == 0) {
      const unsigned i = n == 0 ? blockIdx.x : gridDim.x + atomicAdd(ctr, 1u);
      const int item = i < unsigned(total) ? int(i) : -1;
      mbar_wait(q.empty(s), parity ^ 1u);  // its previous item read by every consumer warp
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(q.slot(s)), "r"(item) : "memory");
      mbar_arrive(q.full(s));
    }
    ++n;
    asm volatile("bar.sync %0, 128;\n" ::"n"(kTileQueueBarrier) : "memory");
    return q.read(s);
  }
};

// A consumer warp's side: all its lanes call take() in step.
struct TileQueueConsumer {
  TileQueue q;
  uint32_t n = 0;
  __device__ explicit TileQueueConsumer(TileQueue q_) : q(q_) {}
  __device__ __forceinline__ int take(int lane) {
    const int s = int(n % kTileQueueRing);
    mbar_wait(q.full(s), (n / kTileQueueRing) & 1u);
    ++n;
    const int item = q.read(s);
    __syncwarp();
    if (lane == 0) mbar_arrive(q.empty(s));
    return item;
  }
};

}  // namespace m3::cuda
