// The latent block fused (issue #56 item 2): between the rows / tc paths' encoder and output
// layers, ONE launch per forward chunk does what they do with two or three cuBLAS GEMMs, a cat
// of the biases and reparam_kl_kernel (13 us at B = 1024 on an H100, PERF.md's profile):
//   mu | logvar = h [wmu; wlv]^T + [bmu; blv]   (R x 2L, K = H)
//   z = mu + exp(0.5 logvar) eps, kl = -0.5 sum_j (1 + logvar - mu^2 - exp(logvar))
//   d = z wd1^T + bd1, relu'd where p.relu       (R x H, K = L), written over h's rows
// Off the default path until a GPU run accepts it (binding_forward.cpp: ForwardOptions::latent,
// or FASTELBO_FUSED_LATENT=1 for `auto`).
//
// One block per tile of R rows (small-M tiles: R = 8 where 16-row tiles leave SMs idle, else 16;
// no split-K sum). The block stages its rows of h in shared memory (cp.async; also what makes
// writing d over h safe), then runs the two GEMMs with tile_gemm.cuh's register tiles, weights
// streamed from L1/L2 (96 KB at the reference dims, L2-resident, the same for every block),
// mu | logvar, z and d never leaving the block. Per row: 2 H 2L + 2 L H FLOPs (49 K at the
// reference dims): the kernel is bound by its loads, not its FMAs.
// Numerics as the unfused path op by op (fp32 FMA dot products in K order within a lane's share,
// elbo_math.cuh's reparam and kl_term, the KL sum lane-strided then a butterfly as
// reparam_kl_kernel's); only the GEMMs' order of additions differs from cuBLAS, as it does in the
// cluster kernels. benchmarks/latent_block.py and tests/test_cuda_latent.py check it; the
// latter's CPU half models this schedule (tiles, shares, masks) against the spec.
#include "elbo.h"
#include "cluster.cuh"
#include "elbo_math.cuh"
#include "tile_gemm.cuh"

#include <algorithm>

namespace fastelbo {
namespace {

constexpr int kLatentThreads = rowtile::kTileThreads;
constexpr int kLatentWarps = kLatentThreads / 32;

__global__ void __launch_bounds__(kLatentThreads, 2)
    latent_kernel(const __grid_constant__ LatentParams p) {
  extern __shared__ float4 smem4[];
  float* hs = reinterpret_cast<float*>(smem4);  // R x ldw: this tile's rows of h
  float* ms = hs + p.off_m;                     // R x ldm: mu (columns < L), logvar (after)
  float* zs = hs + p.off_z;                     // R x ldz: z
  const int H = p.H, L = p.L, tid = static_cast<int>(threadIdx.x);
  const int row0 = static_cast<int>(blockIdx.x) * p.R, R = min(p.R, p.n - row0);
  const int ldw = p.ldw, ldm = p.ldm, ldz = p.ldz;
  const bool vh = p.vec_h != 0, vl = p.vec_l != 0;
  if (p.zero != nullptr && blockIdx.x == 0 && tid == 0) *p.zero = 0;

  rowtile::stage_rows(hs, ldw, [&](int r) { return p.h + static_cast<size_t>(row0 + r) * p.ldh; },
                      R, H, vh);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // mu | logvar: 4 x 2 register tiles over the 2L columns (mu's then logvar's weight rows).
  rowtile::layer<4, 2, false, true>(
      vh, R, 2 * L, H, [&](int r) { return static_cast<const float*>(hs) + r * ldw; },
      [&](int c) { return c < L ? p.wmu + static_cast<size_t>(c) * H
                                : p.wlv + static_cast<size_t>(c - L) * H; },
      [&](int r, int c, float v, int kk, int) {
        if (kk == 0) ms[r * ldm + c] = v + __ldg(c < L ? p.bmu + c : p.blv + (c - L));
      });
  __syncthreads();

  // z for every (row, latent index); the KL row sums, one warp per row.
  for (int e = tid; e < R * L; e += kLatentThreads) {
    const int r = e / L, j = e - r * L;
    zs[r * ldz + j] = reparam(ms[r * ldm + j], ms[r * ldm + L + j],
                              __ldg(p.eps + static_cast<size_t>(row0 + r) * L + j));
  }
  const int warp = tid >> 5, lane = tid & 31;
  for (int r = warp; r < R; r += kLatentWarps) {
    float s = 0.0f;
    for (int j = lane; j < L; j += 32) s += kl_term(ms[r * ldm + j], ms[r * ldm + L + j]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) p.kl[row0 + r] = -0.5f * s;
  }
  __syncthreads();

  // d = z wd1^T + bd1: 4 x 4 register tiles over the H columns, straight to global memory (this
  // block's rows of h were all staged above, so d may overwrite them).
  rowtile::layer<4, 4, false, true>(
      vl, R, H, L, [&](int r) { return static_cast<const float*>(zs) + r * ldz; },
      [&](int c) { return p.wd1 + static_cast<size_t>(c) * L; },
      [&](int r, int c, float v, int kk, int) {
        if (kk != 0) return;
        const float dv = v + __ldg(p.bd1 + c);
        p.d[static_cast<size_t>(row0 + r) * p.ldh + c] = p.relu ? relu(dv) : dv;
      });
}

}  // namespace

ElboStatus latent_plan(LatentParams& p, int device, cudaError_t* cuda_err) noexcept {
  *cuda_err = cudaSuccess;
  ClusterDevice dev;
  const cudaError_t e = cluster_device(device, &dev);
  if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
  const auto aligned16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  p.vec_h = (p.H % 4 == 0 && p.ldh % 4 == 0 && aligned16(p.h) && aligned16(p.wmu) &&
             aligned16(p.wlv)) ? 1 : 0;
  p.vec_l = (p.L % 4 == 0 && aligned16(p.wd1)) ? 1 : 0;
  p.ldw = round4(p.H) + 4;  // +4 floats: rows start in different banks
  p.ldm = 2 * p.L + 1;
  p.ldz = round4(p.L) + 4;
  // Small-M tiles: 16 rows, or 8 where 16-row tiles would leave SMs idle.
  int R = cdiv(p.n, 16) < dev.sms ? 8 : 16;
  for (; R >= 1; R /= 2) {
    p.off_m = R * p.ldw;
    p.off_z = p.off_m + round4(R * p.ldm);
    const long long bytes = 4LL * (p.off_z + R * p.ldz);
    if (bytes <= dev.smem_optin) { p.smem_bytes = static_cast<int>(bytes); break; }
  }
  if (R < 1) return kElboTooLarge;
  p.R = R;
  const void* kernel = reinterpret_cast<const void*>(latent_kernel);
  if (p.smem_bytes > 48 * 1024) {
    const cudaError_t a = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               p.smem_bytes);
    if (a != cudaSuccess) { *cuda_err = a; return kElboCudaError; }
  }
  return kElboOk;
}

cudaError_t latent_launch(const LatentParams& p, cudaStream_t stream) noexcept {
  latent_kernel<<<cdiv(p.n, p.R), kLatentThreads, p.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fastelbo
