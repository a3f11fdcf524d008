// The rows path's kernels (large batches): what runs between binding_forward.cpp's cuBLAS
// GEMMs.
//
// Per row the work outside the GEMMs is small and memory- or special-function-bound, so both
// kernels are one warp per row, lanes over the row's columns in a fixed order and a butterfly
// sum: deterministic, no atomics. (A first version also did the latent GEMMs here with FFMA
// register tiles; on an H200 it took 543 us at B = 65536 where cuBLAS takes ~130 us, so every
// GEMM is cuBLAS's now.)
// Also here, two small kernels outside the forward: randn_fill_kernel, torch.randn(n) from
// philox.cuh's reproduction of it, which fastelbo.backends.cuda compares with torch.randn before
// the fast kernel may draw its noise; range_flags_kernel, the value check on x
// (fastelbo.ops.checks) in one launch. And the deferred value check's record (elbo.h
// DeferredRecord): the device's one copy, its take and the rows path's poison kernel.
#include "deferred.cuh"
#include "elbo.h"
#include "elbo_math.cuh"
#include "philox.cuh"

#include <algorithm>

namespace fastelbo {
namespace {

__global__ void __launch_bounds__(kThreads) reparam_kl_kernel(const __grid_constant__ ReparamParams p) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  if (p.zero != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *p.zero = 0;
  const int row = static_cast<int>(blockIdx.x) * kWarps + warp;
  if (row >= p.n) return;  // whole warp: the shuffles below stay full-warp
  const size_t base = static_cast<size_t>(row) * p.L, in = static_cast<size_t>(row) * p.ld;
  float s = 0.0f;
  for (int c = lane; c < p.L; c += 32) {
    const float mu = __ldg(p.mu + in + c), lv = __ldg(p.lv + in + c);
    p.z[base + c] = reparam(mu, lv, __ldg(p.eps + base + c));
    s += kl_term(mu, lv);
  }
  if (p.kl == nullptr) return;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) p.kl[row] = -0.5f * s;
}

__global__ void __launch_bounds__(kThreads) bce_kernel(const __grid_constant__ BceParams p) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int row = static_cast<int>(blockIdx.x) * kWarps + warp;
  if (row >= p.n) return;  // whole warp: the shuffles below stay full-warp
  const int D = p.D;
  const float* a = p.logits + static_cast<size_t>(row) * D;
  const float* xr = p.x + static_cast<size_t>(row) * D;
  float s = 0.0f;
  bool bad = false;
  if (p.vec) {
    const int d4 = D / 4;
#pragma unroll 4
    for (int c = lane; c < d4; c += 32) {
      const float4 av = __ldg(reinterpret_cast<const float4*>(a) + c);
      const float4 xv = __ldg(reinterpret_cast<const float4*>(xr) + c);
      s += bce_term(av.x, xv.x, &bad);
      s += bce_term(av.y, xv.y, &bad);
      s += bce_term(av.z, xv.z, &bad);
      s += bce_term(av.w, xv.w, &bad);
    }
  } else {
#pragma unroll 4
    for (int c = lane; c < D; c += 32) s += bce_term(__ldg(a + c), __ldg(xr + c), &bad);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  bad = __any_sync(0xffffffffu, bad);
  if (lane == 0) write_row(p.recon, p.kl, p.elbo, row, s, bad);
  if (bad && p.err != nullptr && lane == 0) {  // the deferred check's slow path
    *p.flag = 1;
    deferred_note_row(p.err, xr, D, static_cast<long long>(p.row0) + row);
  }
}

// out[i] = element i of the draw r describes (philox.cuh), grid-stride.
__global__ void __launch_bounds__(kThreads) randn_fill_kernel(float* out, long long n,
                                                              const TorchRandn r) {
  uint64_t seed, offset;
  torch_randn_seeds(r, &seed, &offset);
  const long long step = static_cast<long long>(gridDim.x) * kThreads;
  for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += step)
    out[i] = torch_randn_at(seed, offset, r.threads, static_cast<uint64_t>(i));
}

// flags[block] = 1 where the block saw an element outside [0, 1] or NaN, else 0 (every block
// writes its flag: no zero-fill launch). vec: x 16-byte aligned (float4 loads, then the tail).

__global__ void __launch_bounds__(kThreads) range_flags_kernel(const float* x, long long n,
                                                               int vec, int* flags) {
  const long long step = static_cast<long long>(gridDim.x) * kThreads;
  const long long i0 = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  bool bad = false;
  long long done = 0;
  if (vec) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    done = n / 4 * 4;
    for (long long i = i0; i < n / 4; i += step) {
      const float4 v = __ldg(x4 + i);
      bad |= outside_unit(v.x) | outside_unit(v.y) | outside_unit(v.z) | outside_unit(v.w);
    }
  }
  for (long long i = done + i0; i < n; i += step) bad |= outside_unit(__ldg(x + i));
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) flags[blockIdx.x] = bad ? 1 : 0;
}

// The deferred check's record of this device (module global: zero at load) and where a take
// moves it (read back by the host).
__device__ DeferredRecord g_deferred_record;
__device__ DeferredRecord g_deferred_taken;

// One thread: the record into g_deferred_taken, each field moved atomically (a kernel noting
// at the same time lands either in this take or in the next).
__global__ void deferred_take_kernel(DeferredRecord* rec, DeferredRecord* out) {
  out->count = atomicExch(&rec->count, 0ULL);
  DeferredFirst cur = rec->first;
  const DeferredFirst zero = {0ULL, 0ULL};
  for (;;) {
    const DeferredFirst old = atomicCAS(&rec->first, cur, zero);
    if (old.key == cur.key && old.value == cur.value) break;
    cur = old;
  }
  out->first = cur;
}

// elbo, recon and kl [0, n) NaN where *flag != 0 (grid-stride; nothing to do otherwise).
__global__ void __launch_bounds__(kThreads) deferred_poison_kernel(const int* flag, float* elbo,
                                                                   float* recon, float* kl,
                                                                   int n) {
  if (*flag == 0) return;
  const float nan = __int_as_float(0x7fc00000);
  for (int i = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x) * kThreads) {
    elbo[i] = nan;
    recon[i] = nan;
    kl[i] = nan;
  }
}

}  // namespace

cudaError_t deferred_record(DeferredRecord** out) noexcept {
  void* p = nullptr;
  const cudaError_t e = cudaGetSymbolAddress(&p, g_deferred_record);
  *out = static_cast<DeferredRecord*>(p);
  return e;
}

cudaError_t deferred_take(DeferredRecord* host, cudaStream_t stream) noexcept {
  DeferredRecord* rec = nullptr;
  void* taken = nullptr;
  cudaError_t e = deferred_record(&rec);
  if (e == cudaSuccess) e = cudaGetSymbolAddress(&taken, g_deferred_taken);
  if (e != cudaSuccess) return e;
  deferred_take_kernel<<<1, 1, 0, stream>>>(rec, static_cast<DeferredRecord*>(taken));
  e = cudaGetLastError();
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(host, taken, sizeof(DeferredRecord), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  return e;
}

cudaError_t deferred_poison_launch(const int* flag, float* elbo, float* recon, float* kl, int n,
                                   cudaStream_t stream) noexcept {
  const int blocks = std::min(cdiv(n, kThreads), 64);
  deferred_poison_kernel<<<blocks, kThreads, 0, stream>>>(flag, elbo, recon, kl, n);
  return cudaGetLastError();
}

int range_flags_blocks(long long n) noexcept {
  return static_cast<int>(std::min<long long>((n + 8LL * kThreads - 1) / (8LL * kThreads),
                                                      kRangeFlagsMax));
}

cudaError_t range_flags_launch(const float* x, long long n, int* flags, cudaStream_t stream) noexcept {
  const int vec = reinterpret_cast<uintptr_t>(x) % 16 == 0 ? 1 : 0;
  range_flags_kernel<<<range_flags_blocks(n), kThreads, 0, stream>>>(x, n, vec, flags);
  return cudaGetLastError();
}

cudaError_t randn_fill_launch(float* out, long long n, const TorchRandn& r,
                              cudaStream_t stream) noexcept {
  const long long blocks = std::min<long long>((n + kThreads - 1) / kThreads, 4096);
  randn_fill_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(out, n, r);
  return cudaGetLastError();
}

cudaError_t reparam_launch(const ReparamParams& p, cudaStream_t stream) noexcept {
  reparam_kl_kernel<<<cdiv(p.n, kWarps), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t bce_launch(const BceParams& p, cudaStream_t stream) noexcept {
  bce_kernel<<<cdiv(p.n, kWarps), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fastelbo
