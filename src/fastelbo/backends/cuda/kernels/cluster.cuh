// Device helpers shared by the two cluster kernels (elbo.cu, elbo_fast.cu): Ampere-style
// asynchronous global -> shared copies, and the phase stamps of
// benchmarks/experiments/cuda_trace.cu. No torch types; included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "elbo.h"

namespace fastelbo {

// cp.async: a block's slices are all in flight at once, so the layers read shared memory
// instead of waiting on L2 round trips. 16-byte copies need 16-byte aligned src and dst.
__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d),
               "l"(__cvta_generic_to_global(src)) : "memory");
}
__device__ __forceinline__ void cp_async4(float* dst, const float* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d),
               "l"(__cvta_generic_to_global(src)) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's commit groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Bulk (TMA) copies, global -> this block's shared memory, completing on an mbarrier: one
// instruction moves a whole row (16-byte aligned, a multiple of 16 bytes), where cp.async
// needs one instruction per 16 bytes per thread and issues at ~19 B/cycle/SM (cuda_trace).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
// Makes initialised mbarriers visible to the async proxy (the bulk copies) and the cluster.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// The barrier's one arrival, announcing `bytes` of bulk copies that complete on it.
__device__ __forceinline__ void mbar_arrive_expect(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes) : "memory");
}
// A plain arrival (no bytes announced): a consumer releasing what it has read.
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(float* dst, const float* src, unsigned bytes,
                                          unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// A 2-D box of a tensor map (cuTensorMapEncodeTiled) at element coordinates (c0 inner, c1 row):
// one instruction for a whole tile, elements outside the tensor read as zero. dst: 128-byte
// aligned; the box is stored densely (row stride = the box's inner size).
__device__ __forceinline__ void tma_load_2d(float* dst, const void* map, int c0, int c1,
                                            unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// Four 8x8 b16 matrices = four 8x4 fp32 blocks at shared address addr (lane l gives the row
// address of block l / 8) and receives (row l / 4, column l % 4) of every block: an m16k8 tf32
// A fragment (iwae.cu's mma.sync, tc_gemm.cu's register-A wgmma) or two k8n8 B fragments.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The address of `local` in block `rank`'s shared memory (the cluster window).
__device__ __forceinline__ unsigned cluster_addr(const void* local, int rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr(local)),
               "r"(rank));
  return r;
}

// Block-to-block bulk copies (TMA, shared::cta -> another block's shared memory), completing
// on the receiver's mbarrier: one instruction per chunk where ld/st.shared::cluster need one
// per 16 bytes per thread, and DSMEM costs ~4K cycles per 1280 requests (cuda_trace).
// Writers of a chunk run fence_proxy_async() before the barrier that precedes the send.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_send(unsigned dst_cluster, const float* src, unsigned bytes,
                                          unsigned bar_cluster) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, "
      "[%3];\n" ::"r"(dst_cluster), "r"(smem_addr(src)), "r"(bytes), "r"(bar_cluster)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until this thread's bulk sends have read their sources (before the block may exit).
__device__ __forceinline__ void bulk_wait_sent() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// The two halves of a cluster barrier (all threads, converged).
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Programmatic dependent launch (ForwardArgs::pdl; binding_forward.cpp pdl_launch_allowed): wait
// until the previous grid on the stream has completed and its writes are visible, and only then let
// the next forward launch (its blocks take SMs as ours leave and stage their weights while we
// finish). So at most one of our grids runs ahead of another, and the binding's check against the
// previous launch's outputs covers every overlap. Without pdl: nothing (the launch waited).
__device__ __forceinline__ void pdl_wait(const ForwardArgs& p) {
  if (p.pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
}

// Block 0's last step in both cluster kernels: block q of the cluster left row r's partial BCE
// and KL sums and a bad-row flag at [q * stride + r] of these arrays (block 0's shared memory);
// rows row0 + r < B of the tile get their recon, kl and elbo (NaN for a bad row).
__device__ __forceinline__ void write_rows(const ForwardArgs& p, int row0, int R, int C,
                                           int stride, const float* rec_part,
                                           const float* kl_part, const float* bad_part) {
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    const int gr = row0 + r;
    if (gr >= p.B) break;
    float rs = 0.0f, ks = 0.0f;
    bool bad = false;
    for (int q = 0; q < C; ++q) {
      rs += rec_part[q * stride + r];
      ks += kl_part[q * stride + r];
      bad |= bad_part[q * stride + r] != 0.0f;
    }
    const float kl = -0.5f * ks;
    const float nan = __int_as_float(0x7fc00000);
    p.recon[gr] = bad ? nan : rs;
    p.kl[gr] = bad ? nan : kl;
    p.elbo[gr] = bad ? nan : -(rs + kl);
  }
}

}  // namespace fastelbo

// Phase timestamps for benchmarks/experiments/cuda_trace.cu (built with -DFASTELBO_TRACE only):
// thread 0 of each block records clock64() at FE_TRACE(i); the package build compiles none of it.
#ifdef FASTELBO_TRACE
constexpr int kTracePoints = 24;
constexpr int kTraceBlocks = 1024;
static __device__ long long g_elbo_trace[kTraceBlocks * kTracePoints];
#define FE_TRACE(i)                                                \
  do {                                                             \
    if (threadIdx.x == 0 && blockIdx.x < kTraceBlocks)             \
      g_elbo_trace[blockIdx.x * kTracePoints + (i)] = clock64();   \
  } while (0)
#else
#define FE_TRACE(i) \
  do {              \
  } while (0)
#endif
