// Register-tiled FFMA GEMMs over rows held in shared memory or global memory, for blocks of
// kTileThreads threads: elbo.cu's cluster kernel (every layer) and latent.cu's fused latent
// block. Each thread owns a TR x TC output tile and a 1/ks share of K (the ks lanes of a tile
// sit in one warp and all-reduce with a butterfly). Also the cp.async staging of row slices.
// In namespace rowtile: the exported file compiles every source as one unit, where iwae.cu has
// a tile_gemm of its own in the same unnamed namespace. No torch types.
#pragma once

#include <cuda_runtime.h>

#include "cluster.cuh"
#include "elbo_math.cuh"

namespace fastelbo {
namespace rowtile {

constexpr int kTileThreads = 256;

template <bool kGlobal>
__device__ __forceinline__ float4 load4(const float* p) {
  if constexpr (kGlobal) return __ldg(reinterpret_cast<const float4*>(p));
  else return *reinterpret_cast<const float4*>(p);
}
template <bool kGlobal>
__device__ __forceinline__ float load1(const float* p) {
  if constexpr (kGlobal) return __ldg(p);
  else return *p;
}

// Copies rows [0, nrows) of K floats, row r starting at src(r), to dst + r * ld (ld % 4 == 0).
// vec: 16-byte copies (K % 4 == 0 and 16-byte aligned rows), else 4-byte copies.
template <class Src>
__device__ __forceinline__ void stage_rows(float* dst, int ld, Src src, int nrows, int K,
                                           bool vec) {
  if (vec) {
    const int k4 = K / 4;
    for (int i = static_cast<int>(threadIdx.x); i < nrows * k4; i += kTileThreads) {
      const int r = i / k4, c = (i - r * k4) * 4;
      cp_async16(dst + r * ld + c, src(r) + c);
    }
  } else {
    for (int i = static_cast<int>(threadIdx.x); i < nrows * K; i += kTileThreads) {
      const int r = i / K, c = i - r * K;
      cp_async4(dst + r * ld + c, src(r) + c);
    }
  }
}

// out[r][c] = sum_k A[r][k] * W_c[k] for r < R, c < ncols, handed to epi(r, c, value, kk, ks).
// Each thread owns a TR x TC register tile and a 1/ks share of K (ks lanes, a power of two, sit
// in one warp and all-reduce with a butterfly, so all ks lanes hold the sum: kk = lane in group).
// Tiles are ordered column-fastest, so a quarter-warp mostly reads one A row (smem broadcast).
// arow(r) / wrow(c) return row pointers; K % VK == 0 and 16-byte rows when VK == 4.
template <int TR, int TC, int VK, bool kAGlobal, bool kWGlobal, class ARow, class WRow,
          class Epi>
__device__ __forceinline__ void tile_gemm(int R, int ncols, int K, ARow arow, WRow wrow,
                                          Epi epi) {
  const int nrt = cdiv(R, TR), nct = cdiv(ncols, TC);
  const int ntiles = nrt * nct;
  if (ntiles == 0) return;  // uniform over the block
  const int kvec = K / VK;
  int ks = 1, ks_log = 0;
  while (ks < 32 && ntiles * ks * 2 <= kTileThreads && ks * 2 <= kvec) { ks *= 2; ++ks_log; }
  const int total = ntiles * ks;
  for (int base = 0; base < total; base += kTileThreads) {  // uniform trip count: shuffles are safe
    const int t = base + static_cast<int>(threadIdx.x);
    const int tile = t >> ks_log, kk = t & (ks - 1);
    const bool active = tile < ntiles;
    const int rt = active ? tile / nct : 0, ct = active ? tile - (tile / nct) * nct : 0;
    float acc[TR][TC];
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) acc[i][j] = 0.0f;
    if (active) {
      const float* a[TR];
      const float* w[TC];
#pragma unroll
      for (int i = 0; i < TR; ++i) a[i] = arow(min(rt * TR + i, R - 1));
#pragma unroll
      for (int j = 0; j < TC; ++j) w[j] = wrow(min(ct * TC + j, ncols - 1));
      if constexpr (VK == 4) {
#pragma unroll 2
        for (int k = kk * 4; k < K; k += ks * 4) {
          float4 av[TR], wv[TC];
#pragma unroll
          for (int i = 0; i < TR; ++i) av[i] = load4<kAGlobal>(a[i] + k);
#pragma unroll
          for (int j = 0; j < TC; ++j) wv[j] = load4<kWGlobal>(w[j] + k);
#pragma unroll
          for (int i = 0; i < TR; ++i)
#pragma unroll
            for (int j = 0; j < TC; ++j) {
              acc[i][j] = fmaf(av[i].x, wv[j].x, acc[i][j]);
              acc[i][j] = fmaf(av[i].y, wv[j].y, acc[i][j]);
              acc[i][j] = fmaf(av[i].z, wv[j].z, acc[i][j]);
              acc[i][j] = fmaf(av[i].w, wv[j].w, acc[i][j]);
            }
        }
      } else {
#pragma unroll 4
        for (int k = kk; k < K; k += ks) {
          float av[TR], wv[TC];
#pragma unroll
          for (int i = 0; i < TR; ++i) av[i] = load1<kAGlobal>(a[i] + k);
#pragma unroll
          for (int j = 0; j < TC; ++j) wv[j] = load1<kWGlobal>(w[j] + k);
#pragma unroll
          for (int i = 0; i < TR; ++i)
#pragma unroll
            for (int j = 0; j < TC; ++j) acc[i][j] = fmaf(av[i], wv[j], acc[i][j]);
        }
      }
    }
    for (int off = ks >> 1; off > 0; off >>= 1)
#pragma unroll
      for (int i = 0; i < TR; ++i)
#pragma unroll
        for (int j = 0; j < TC; ++j) acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], off);
    if (active) {
#pragma unroll
      for (int i = 0; i < TR; ++i)
#pragma unroll
        for (int j = 0; j < TC; ++j) {
          const int r = rt * TR + i, c = ct * TC + j;
          if (r < R && c < ncols) epi(r, c, acc[i][j], kk, ks);
        }
    }
  }
}

// The runtime float4 switch of one layer: both instantiations exist, the branch is uniform.
template <int TR, int TC, bool kAGlobal, bool kWGlobal, class ARow, class WRow, class Epi>
__device__ __forceinline__ void layer(bool vec, int R, int ncols, int K, ARow arow, WRow wrow,
                                      Epi epi) {
  if (vec) tile_gemm<TR, TC, 4, kAGlobal, kWGlobal>(R, ncols, K, arow, wrow, epi);
  else tile_gemm<TR, TC, 1, kAGlobal, kWGlobal>(R, ncols, K, arow, wrow, epi);
}

}  // namespace rowtile
}  // namespace fastelbo
