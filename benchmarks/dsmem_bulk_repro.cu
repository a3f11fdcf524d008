// Does compute-sanitizer memcheck accept block-to-block bulk copies? A minimal repro for the
// finding of benchmarks/NOTES.md runs 24-25: a cluster of 2 blocks, each sends a 1280-byte
// chunk of its shared memory into the other's, completing on the receiver's mbarrier, by
//   mode 0: cp.async.bulk.shared::cluster.shared::cta (one instruction per chunk)
//   mode 1: st.async.shared::cluster.mbarrier::complete_tx (one 16-byte store per thread)
//   mode 2: as mode 0, but the chunks live in ~160 KB of DYNAMIC shared memory (destination at
//           150 KB) and the cluster comes from cudaLaunchKernelEx, as in elbo_fast.cu's v5
//   modes 3-6: v5's all-to-all exchange (every block sends one chunk to every block of the
//           cluster, thread q to rank q, into slot k of the receiver; 160 KB dynamic smem, cluster
//           from cudaLaunchKernelEx): 3 = 16 blocks (non-portable size) with the send to itself,
//           as v5 does; 4 = 16 blocks without it; 5 = 2 blocks with it; 6 = 8 blocks with it.
//           Which of these memcheck rejects separates "self-send" from "cluster of 16" as the
//           cause of v5's report (modes 0-2 are clean: run 26, run 35).
// then checks the values. Run 26: modes 0 and 1 are exact and memcheck-clean; run 35: mode 2.
//   nvcc -O3 -gencode=arch=compute_90,code=sm_90 -o /tmp/repro benchmarks/dsmem_bulk_repro.cu
//   && compute-sanitizer --tool memcheck /tmp/repro MODE
#include <cooperative_groups.h>
#include <cstdio>
#include <cstdlib>

namespace cg = cooperative_groups;
constexpr int kFloats = 320;  // 1280 bytes

__device__ unsigned saddr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ unsigned remote(const void* p, int rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(saddr(p)), "r"(rank));
  return r;
}

// One arrival (this block's thread 0) expecting `bytes` of copies; then the proxy fence every
// writer of a chunk runs before the cluster barrier that precedes its send.
__device__ void bar_init(unsigned long long* bar, int bytes) {
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(bar)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(bar)),
                 "r"(bytes) : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ void bar_wait(unsigned long long* bar) {
  asm volatile(
      "{\n .reg .pred done;\nW:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      " @!done bra W;\n}" ::"r"(saddr(bar)) : "memory");
}
// src (this block) -> dst in block `rank`, completing on that block's `bar`.
__device__ void bulk_send(float* dst, const float* src, int bytes, unsigned long long* bar,
                          int rank) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(remote(dst, rank)), "r"(saddr(src)), "r"(bytes), "r"(remote(bar, rank)) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

__global__ void __cluster_dims__(2, 1, 1) kernel(int mode, int* bad) {
  __shared__ alignas(128) float src[kFloats];
  __shared__ alignas(128) float dst[kFloats];
  __shared__ alignas(8) unsigned long long bar;
  cg::cluster_group cluster = cg::this_cluster();
  const int k = static_cast<int>(cluster.block_rank()), peer = 1 - k, t = threadIdx.x;
  for (int i = t; i < kFloats; i += blockDim.x) src[i] = 1000.0f * k + i;
  bar_init(&bar, kFloats * 4);
  cluster.sync();  // barriers exist, chunks written
  if (mode == 0) {
    if (t == 0) bulk_send(dst, src, kFloats * 4, &bar, peer);
  } else {
    for (int i = t; i < kFloats / 4; i += blockDim.x) {
      const float4 v = reinterpret_cast<const float4*>(src)[i];
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
          ::"r"(remote(dst + 4 * i, peer)), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w),
          "r"(remote(&bar, peer)) : "memory");
    }
  }
  bar_wait(&bar);
  for (int i = t; i < kFloats; i += blockDim.x)
    if (dst[i] != 1000.0f * peer + i) atomicAdd(bad, 1);
  cluster.sync();  // no block exits while its peer may still touch its shared memory
}

// Mode 2: the layout of the fast kernel's v5 (branch fast-bulk-exchange): dynamic shared memory,
// destination far from the start, cluster dimension given at launch.
constexpr int kDynBytes = 160 * 1024, kDstOffset = 150 * 1024;
__global__ void dyn_kernel(int* bad) {
  extern __shared__ __align__(128) unsigned char dyn[];
  __shared__ alignas(8) unsigned long long bar;
  float* src = reinterpret_cast<float*>(dyn);
  float* dst = reinterpret_cast<float*>(dyn + kDstOffset);
  cg::cluster_group cluster = cg::this_cluster();
  const int k = static_cast<int>(cluster.block_rank()), peer = 1 - k, t = threadIdx.x;
  for (int i = t; i < kFloats; i += blockDim.x) src[i] = 1000.0f * k + i;
  bar_init(&bar, kFloats * 4);
  cluster.sync();
  if (t == 0) bulk_send(dst, src, kFloats * 4, &bar, peer);
  bar_wait(&bar);
  for (int i = t; i < kFloats; i += blockDim.x)
    if (dst[i] != 1000.0f * peer + i) atomicAdd(bad, 1);
  cluster.sync();
}

cudaError_t launch_dyn(int* bad) {
  cudaError_t e = cudaFuncSetAttribute(dyn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kDynBytes);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(2);
  cfg.blockDim = dim3(64);
  cfg.dynamicSmemBytes = kDynBytes;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, dyn_kernel, bad);
}

// Modes 3-6: C blocks per cluster, all to all; chunk q of block k holds k * 10000 + q * 1000 + i.
constexpr int kMaxRanks = 16, kAllDst = 128 * 1024;
__global__ void all_kernel(int self, int* bad) {
  extern __shared__ __align__(128) unsigned char dyn[];
  __shared__ alignas(8) unsigned long long bar;
  float* src = reinterpret_cast<float*>(dyn);                // C chunks, by destination
  float* dst = reinterpret_cast<float*>(dyn + kAllDst);      // C slots, by sender
  cg::cluster_group cluster = cg::this_cluster();
  const int C = static_cast<int>(cluster.num_blocks()), k = static_cast<int>(cluster.block_rank());
  const int t = threadIdx.x;
  for (int i = t; i < C * kFloats; i += blockDim.x)
    src[i] = 10000.0f * k + 1000.0f * (i / kFloats) + i % kFloats;
  bar_init(&bar, (self ? C : C - 1) * kFloats * 4);
  cluster.sync();
  if (t < C && (self || t != k))
    bulk_send(dst + k * kFloats, src + t * kFloats, kFloats * 4, &bar, t);
  bar_wait(&bar);
  for (int i = t; i < C * kFloats; i += blockDim.x) {
    const int j = i / kFloats;
    if ((self || j != k) && dst[i] != 10000.0f * j + 1000.0f * k + i % kFloats) atomicAdd(bad, 1);
  }
  cluster.sync();
}

cudaError_t launch_all(int ranks, int self, int* bad) {
  cudaError_t e = cudaFuncSetAttribute(all_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kDynBytes);
  if (e == cudaSuccess && ranks > 8)
    e = cudaFuncSetAttribute(all_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(2 * ranks);  // two clusters
  cfg.blockDim = dim3(64);
  cfg.dynamicSmemBytes = kDynBytes;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = ranks;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, all_kernel, self, bad);
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  int* bad = nullptr;
  cudaMalloc(&bad, sizeof(int));
  cudaMemset(bad, 0, sizeof(int));
  cudaError_t e = cudaSuccess;
  static_assert(kAllDst + kMaxRanks * kFloats * 4 <= kDynBytes, "slots past the allocation");
  static_assert(kMaxRanks * kFloats * 4 <= kAllDst, "chunks overlap the slots");
  const int ranks[] = {16, 16, 2, 8}, self[] = {1, 0, 1, 1};
  if (mode == 2) {
    e = launch_dyn(bad);
  } else if (mode >= 3 && mode <= 6) {
    e = launch_all(ranks[mode - 3], self[mode - 3], bad);
  } else {
    kernel<<<2, 64>>>(mode, bad);
  }
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  int h = -1;
  cudaMemcpy(&h, bad, sizeof(int), cudaMemcpyDeviceToHost);
  const char* what[] = {"cp.async.bulk smem->dsmem", "st.async", "cp.async.bulk, 160 KB dynamic smem",
                        "all to all, 16 blocks, self-send", "all to all, 16 blocks, no self-send",
                        "all to all, 2 blocks, self-send", "all to all, 8 blocks, self-send"};
  std::printf("mode %d (%s): %s, %d wrong values\n", mode, mode >= 0 && mode <= 6 ? what[mode] : "?",
              cudaGetErrorString(e), h);
  return e == cudaSuccess && h == 0 ? 0 : 1;
}
