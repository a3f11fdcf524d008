// Fused VAE ELBO forward: encoder, latent heads, reparameterisation, decoder, BCE and KL in ONE
// kernel launch, no intermediate tensor in global memory. Role: the lowest-latency backend.
//
// Which path runs (binding_forward.cpp decides; `path` forces one for tests and tuning):
//   B <= kClusterMaxBatch (binding_forward.cpp; elbo_fast.cu's kernel takes over above it where the
//     dims allow): the cluster path below, ONE launch per forward. At
//     small B the forward is latency-bound (launches, barriers, L2 round trips), and one launch
//     beats eager's ~20.
//   larger B, or dims whose activations do not fit a block's shared memory: the rows path at
//     the end of this file, around two cuBLAS GEMMs. The FFMA-only cluster kernel cannot match
//     cuBLAS on the two big GEMMs (52 GFLOP at B=65536), so the rows path uses cuBLAS for them
//     and fuses every other op, saving eager's ~15 elementwise passes over (B, D) tensors.
//
// Cluster design: a thread-block cluster of C blocks (C = 16 non-portable where the GPU
// schedules it, else 8, 4, ...) owns a tile of R batch rows. In each layer, block k of the
// cluster computes its slice of output columns for all R rows (so each weight is read once per
// cluster, not once per row) and pushes its slice into every cluster block's shared memory
// through distributed shared memory (DSMEM); one cluster barrier per layer publishes the whole
// activation. (A pull variant -- own slice written locally, remote slices fetched with 16-byte
// DSMEM loads after the barrier -- gave wrong results for C >= 2 on an H200 and was reverted
// to this push scheme, which passed every forced-plan test.) The latent layer gives each block
// whole latent indices j (mu_j and logvar_j together), so reparameterisation and the KL term
// stay local. The last layer's slice computes sigmoid + BCE against x for its columns; per-row
// partial sums go to the rank-0 block through DSMEM, which writes elbo, recon and kl.
//
// Cost at the reference size (B=128, D=784, H=256, L=32) on an H200 (132 SMs):
//   weights 4*(784*256*2 + 256*32*3) B = 1.7 MB, x 0.4 MB: ~2.1 MB / 4.3 TB/s  = 0.5 us floor;
//   FLOPs 2*128*(784*256*2 + 256*32*3) = 109 MFLOP / ~60 TFLOP/s fp32 FFMA    = 1.8 us floor.
//   With R=16 rows per cluster and C=16: 8 clusters x 16 blocks = 128 blocks, each streaming a
//   1/16 slice of every weight matrix (~110 KB, L2-resident across the 8 clusters).
// At B=65536 the work is 56 GFLOP (0.9 ms at fp32 peak), so large batches use R=64 rows per
// cluster and 4x4 register tiles to keep the FFMA pipes, not L1, the limit.
//
// Numerics follow PyTorch op by op (fp32 FMA in the dot products, no TF32, no fast math):
// sigmoid = 1/(1+expf(-a)); logs clamped at -100 with a NaN-propagating max as std::max does;
// ReLU propagates NaN; a row whose x holds a value outside [0, 1] or NaN gives NaN in elbo,
// recon and kl (checked here, since the Python-side validation may be off).
//
// Latency at small B: each block's weight slices (and its x tile) are staged into shared
// memory with cp.async at kernel start, one commit group per layer, all in flight at once
// (~185 KB per block at the reference size with C=16, R=16); the K loops then read shared
// memory. Where they do not fit (large R at large B, huge dims) the same loops read global
// memory (L1/L2) instead: p.staged picks the path, both always correct.
//
// Barrier discipline (each reused buffer: last read, barrier, next write):
//   staged copies: cp.async.wait_group(3 - layer) in every thread before the barrier that
//   precedes the layer (S0..S3), so the barrier publishes every thread's copies.
//   S0 cluster.sync   every block started before any DSMEM store
//   L1  read x, w1         -> push h into hs of all blocks               S1 cluster.sync
//   L2  read hs, wmu, wlv  -> ml (local); __syncthreads;
//       read ml, eps        -> push z into zs of all, KL partial to rank 0  S2 cluster.sync
//   L3  read zs, wd1        -> push d into hs of all (hs reads of L2 all precede S2)  S3
//   L4  read hs, wd2        -> ob (local); __syncthreads;
//       read ob, x          -> BCE partial + bad-row flag to rank 0       S4 cluster.sync
//   rank 0 reads the partials and writes the outputs; no block touches another's smem after S4.
#include "elbo.h"
#include "cluster.cuh"
#include "deferred.cuh"
#include "elbo_math.cuh"
#include "philox.cuh"
#include "tile_gemm.cuh"

#include <cooperative_groups.h>

#include <climits>
#include <map>
#include <mutex>
#include <tuple>

namespace cg = cooperative_groups;

namespace fastelbo {
namespace {

// Threads per block of the cluster kernel. Its blocks are 1 per SM (shared memory), so more
// threads is more warps to hide latency with; 512 / kClusterThreads blocks of <= 128
// registers per thread then fit the register file.
constexpr int kClusterThreads = rowtile::kTileThreads;  // tile_gemm.cuh's layers assume it
constexpr int kClusterWarps = kClusterThreads / 32;
constexpr int kMaxRows = 64;   // rows per cluster; more gives little extra weight reuse



// One layer whose weight slice (and, for layer 1, A) is either staged in shared memory or read
// from global memory: staged ? layer<smem A, smem W> : layer<A as given, global W>.
template <int TR, int TC, bool kAGlobalUnstaged, class ARowS, class ARowG, class WRowS,
          class WRowG, class Epi>
__device__ __forceinline__ void staged_layer(bool staged, bool vec, int R, int ncols, int K,
                                             ARowS arow_s, ARowG arow_g, WRowS wrow_s,
                                             WRowG wrow_g, Epi epi) {
  if (staged) rowtile::layer<TR, TC, false, false>(vec, R, ncols, K, arow_s, wrow_s, epi);
  else rowtile::layer<TR, TC, kAGlobalUnstaged, true>(vec, R, ncols, K, arow_g, wrow_g, epi);
}

template <int TR, int TC>
__global__ void __launch_bounds__(kClusterThreads, 512 / kClusterThreads) elbo_kernel(const __grid_constant__ ElboParams p) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* hs = smem;                  // R x ldh: h (after L1), then d (after L3)
  float* zs = smem + p.off_zs;       // R x ldl: z
  float* ml = smem + p.off_ml;       // R x ldm: this block's mu (cols < lcnt), logvar (after)
  float* ob = smem + p.off_ob;       // R x ldo: this block's decoder logits
  float* rec_part = smem + p.off_rec;  // C x R, used on rank 0: BCE row sums per block
  float* kl_part = smem + p.off_kl;    // C x R, used on rank 0: KL row sums per block
  float* bad_part = smem + p.off_bad;  // C x R, used on rank 0: 1 where a block saw bad x
  // Staged copies (p.staged only), written once by cp.async, read-only afterwards:
  float* xs = smem + p.off_xs;       // R x ldx: this tile's x rows
  float* w1s = smem + p.off_w1;      // ncol_h x ldx: w1 slice
  float* wms = smem + p.off_wm;      // lcnt x ldh: wmu slice
  float* wls = smem + p.off_wl;      // lcnt x ldh: wlv slice
  float* wd1s = smem + p.off_wd1;    // ncol_h x ldl: wd1 slice
  float* wd2s = smem + p.off_wd2;    // ncol_d x ldh: wd2 slice

  cg::cluster_group cluster = cg::this_cluster();
  const int C = p.C, R = p.R, B = p.B, D = p.D, H = p.H, L = p.L;
  const int rank = static_cast<int>(cluster.block_rank());
  const int row0 = static_cast<int>(blockIdx.x / C) * R;
  const int tid = static_cast<int>(threadIdx.x);
  const bool staged = p.staged != 0;
  auto grow = [&](int r) { return min(row0 + r, B - 1); };  // tail rows: valid memory, unused

  const int n0h = rank * p.ns_h, ncol_h = max(0, min(p.ns_h, H - n0h));
  const int j0 = rank * p.ns_l, lcnt = max(0, min(p.ns_l, L - j0));
  const int n0d = rank * p.ns_d, ncol_d = max(0, min(p.ns_d, D - n0d));
  const int ldh = p.ldh, ldl = p.ldl, ldm = p.ldm, ldo = p.ldo, ldx = p.ldx;
  const bool v1 = p.vec & 1u, v2 = (p.vec >> 1) & 1u, v3 = (p.vec >> 2) & 1u,
             v4 = (p.vec >> 3) & 1u;
  FE_TRACE(0);

  // Issue every staged copy now, one commit group per layer (groups are committed even when
  // empty, so the wait counts below hold either way).
  // With p.pdl only the w1 slice is read before pdl_wait (the previous grid may still run);
  // x joins its commit group after it, and nothing else before.
  if (staged)
    rowtile::stage_rows(w1s, ldx, [&](int c) { return p.w1 + static_cast<size_t>(n0h + c) * D; },
               ncol_h, D, v1);
  pdl_wait(p);
  if (staged)
    rowtile::stage_rows(xs, ldx, [&](int r) { return p.x + static_cast<size_t>(grow(r)) * D; }, R, D, v1);
  cp_async_commit();
  if (staged) {
    rowtile::stage_rows(wms, ldh, [&](int c) { return p.wmu + static_cast<size_t>(j0 + c) * H; },
               lcnt, H, v2);
    rowtile::stage_rows(wls, ldh, [&](int c) { return p.wlv + static_cast<size_t>(j0 + c) * H; },
               lcnt, H, v2);
  }
  cp_async_commit();
  if (staged)
    rowtile::stage_rows(wd1s, ldl, [&](int c) { return p.wd1 + static_cast<size_t>(n0h + c) * L; },
               ncol_h, L, v3);
  cp_async_commit();
  if (staged)
    rowtile::stage_rows(wd2s, ldh, [&](int c) { return p.wd2 + static_cast<size_t>(n0d + c) * H; },
               ncol_d, H, v4);
  cp_async_commit();
  // The deferred value check (p.err): this block's share of ALL of x, while the copies fly;
  // folded into every row's bad flag at the BCE, so a bad value anywhere NaNs the whole call.
  const long long nx = static_cast<long long>(B) * D;
  const bool x_bad = p.err != nullptr && deferred_scan(p.x, nx, rank, C);
  FE_TRACE(1);

  cp_async_wait<3>();  // own copies of group 0 landed; the barrier publishes everyone's
  cluster.sync();      // S0
  FE_TRACE(2);

  // L1: h = relu(x w1^T + b1), this block's columns, pushed to every block's hs.
  auto put_h = [&](int r, int c, float v, int kk, int ks) {
    const int n = n0h + c;
    const float h = relu(v + __ldg(p.b1 + n));
    for (int q = kk; q < C; q += ks) cluster.map_shared_rank(hs, q)[r * ldh + n] = h;
  };
  staged_layer<TR, TC, true>(staged, v1, R, ncol_h, D,
      [&](int r) { return static_cast<const float*>(xs) + r * ldx; },
      [&](int r) { return p.x + static_cast<size_t>(grow(r)) * D; },
      [&](int c) { return static_cast<const float*>(w1s) + c * ldx; },
      [&](int c) { return p.w1 + static_cast<size_t>(n0h + c) * D; }, put_h);
  FE_TRACE(3);
  cp_async_wait<2>();
  cluster.sync();  // S1
  FE_TRACE(4);

  // L2: mu and logvar for latent indices [j0, j0 + lcnt), kept local.
  auto hrow = [&](int r) { return static_cast<const float*>(hs) + r * ldh; };
  staged_layer<TR, TC, false>(staged, v2, R, 2 * lcnt, H, hrow, hrow,
      [&](int c) {
        return c < lcnt ? static_cast<const float*>(wms) + c * ldh
                        : static_cast<const float*>(wls) + (c - lcnt) * ldh;
      },
      [&](int c) {
        return c < lcnt ? p.wmu + static_cast<size_t>(j0 + c) * H
                        : p.wlv + static_cast<size_t>(j0 + c - lcnt) * H;
      },
      [&](int r, int c, float v, int kk, int) {
        if (kk == 0) ml[r * ldm + c] = v + __ldg(c < lcnt ? p.bmu + j0 + c : p.blv + j0 + c - lcnt);
      });
  __syncthreads();
  // z = mu + exp(0.5 logvar) * eps for this block's latent indices, pushed to every block.
  if (p.draw) {
    // The noise in the kernel: this block's elements of torch.randn(B, L) (philox.cuh), each
    // drawn once and written to eps_out by this block only (tail rows: 0, not written).
    uint64_t seed, offset;
    torch_randn_seeds(p.rng, &seed, &offset);
    for (int e = tid; e < R * lcnt; e += kClusterThreads) {
      const int r = e / lcnt, c = e - r * lcnt, row = row0 + r;
      float ep = 0.0f;
      if (row < B) {
        const uint64_t idx = static_cast<uint64_t>(row) * L + j0 + c;
        ep = torch_randn_at(seed, offset, p.rng.threads, idx);
        p.eps_out[idx] = ep;
      }
      const float z = reparam(ml[r * ldm + c], ml[r * ldm + lcnt + c], ep);
      for (int q = 0; q < C; ++q) cluster.map_shared_rank(zs, q)[r * ldl + j0 + c] = z;
    }
  } else {
    for (int i = tid; i < R * lcnt * C; i += kClusterThreads) {
      const int q = i % C, e = i / C, r = e / lcnt, c = e - r * lcnt;
      const float ep = __ldg(p.eps + static_cast<size_t>(grow(r)) * L + j0 + c);
      cluster.map_shared_rank(zs, q)[r * ldl + j0 + c] =
          reparam(ml[r * ldm + c], ml[r * ldm + lcnt + c], ep);
    }
  }
  // KL partial: sum_j (1 + logvar - mu^2 - exp(logvar)) over this block's j, to rank 0.
  for (int r = tid; r < R; r += kClusterThreads) {
    float s = 0.0f;
    for (int c = 0; c < lcnt; ++c) s += kl_term(ml[r * ldm + c], ml[r * ldm + lcnt + c]);
    cluster.map_shared_rank(kl_part, 0)[rank * R + r] = s;
  }
  FE_TRACE(5);
  cp_async_wait<1>();
  cluster.sync();  // S2
  FE_TRACE(6);

  // L3: d = relu(z wd1^T + bd1), own columns into own hs (all hs reads, local and remote, of
  // L1's h happened before S2).
  auto put_d = [&](int r, int c, float v, int kk, int ks) {
    const int n = n0h + c;
    const float d = relu(v + __ldg(p.bd1 + n));
    for (int q = kk; q < C; q += ks) cluster.map_shared_rank(hs, q)[r * ldh + n] = d;
  };
  auto zrow = [&](int r) { return static_cast<const float*>(zs) + r * ldl; };
  staged_layer<TR, TC, false>(staged, v3, R, ncol_h, L, zrow, zrow,
      [&](int c) { return static_cast<const float*>(wd1s) + c * ldl; },
      [&](int c) { return p.wd1 + static_cast<size_t>(n0h + c) * L; }, put_d);
  FE_TRACE(7);
  cp_async_wait<0>();
  cluster.sync();  // S3
  FE_TRACE(8);

  // L4: logits a = d wd2^T + bd2 for this block's columns of x, kept local.
  staged_layer<TR, TC, false>(staged, v4, R, ncol_d, H, hrow, hrow,
      [&](int c) { return static_cast<const float*>(wd2s) + c * ldh; },
      [&](int c) { return p.wd2 + static_cast<size_t>(n0d + c) * H; },
      [&](int r, int c, float v, int kk, int) {
        if (kk == 0) ob[r * ldo + c] = v + __ldg(p.bd2 + n0d + c);
      });
  FE_TRACE(9);
  const bool call_bad = deferred_block_or(p.err != nullptr, x_bad);  // and a __syncthreads
  // BCE (bce_term), one warp per row, fixed order: deterministic. Bad x -> NaN + row flag.
  const int warp = tid >> 5, lane = tid & 31;
  for (int r = warp; r < R; r += kClusterWarps) {
    const float* xr = p.x + static_cast<size_t>(grow(r)) * D + n0d;
    float s = 0.0f;
    bool bad = false;
    for (int c = lane; c < ncol_d; c += 32) s += bce_term(ob[r * ldo + c], __ldg(xr + c), &bad);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    bad = __any_sync(0xffffffffu, bad) || call_bad;
    if (lane == 0) {
      cluster.map_shared_rank(rec_part, 0)[rank * R + r] = s;
      cluster.map_shared_rank(bad_part, 0)[rank * R + r] = bad ? 1.0f : 0.0f;
    }
  }
  FE_TRACE(10);
  cluster.sync();  // S4
  FE_TRACE(11);

  if (rank == 0) write_rows(p, row0, R, C, R, rec_part, kl_part, bad_part);
  // The deferred check's slow path: cluster 0's blocks, whose shares cover x once, note it.
  if (call_bad && blockIdx.x < static_cast<unsigned>(C))
    deferred_note_share(p.err, p.x, nx, D, rank, C);
  FE_TRACE(12);
}

using Kernel = void (*)(ElboParams);
Kernel kernel_for(int variant) {
  return variant == 1 ? elbo_kernel<4, 4> : elbo_kernel<2, 2>;
}

struct Layout {
  int ns_h, ns_l, ns_d, ldh, ldl, ldm, ldo, ldx;
  int off_zs, off_ml, off_ob, off_rec, off_kl, off_bad;
  int off_xs, off_w1, off_wm, off_wl, off_wd1, off_wd2;
  long long floats;
};

Layout make_layout(int D, int H, int L, int R, int C, bool staged) {
  Layout l{};
  l.ns_h = cdiv(H, C);
  l.ns_l = cdiv(L, C);
  l.ns_d = cdiv(D, C);
  l.ldh = round4(H) + 4;      // +4 floats: rows start in different banks
  l.ldl = round4(L) + 4;
  l.ldx = round4(D) + 4;
  l.ldm = 2 * l.ns_l;
  l.ldo = l.ns_d + 1;
  long long off = 0;
  auto take = [&](long long n) {
    const long long at = off;
    off += (n + 3) & ~3LL;    // every buffer 16-byte aligned
    return static_cast<int>(at);
  };
  take(static_cast<long long>(R) * l.ldh);  // hs at 0
  l.off_zs = take(static_cast<long long>(R) * l.ldl);
  l.off_ml = take(static_cast<long long>(R) * l.ldm);
  l.off_ob = take(static_cast<long long>(R) * l.ldo);
  l.off_rec = take(static_cast<long long>(C) * R);
  l.off_kl = take(static_cast<long long>(C) * R);
  l.off_bad = take(static_cast<long long>(C) * R);
  if (staged) {
    l.off_xs = take(static_cast<long long>(R) * l.ldx);
    l.off_w1 = take(static_cast<long long>(l.ns_h) * l.ldx);
    l.off_wm = take(static_cast<long long>(l.ns_l) * l.ldh);
    l.off_wl = take(static_cast<long long>(l.ns_l) * l.ldh);
    l.off_wd1 = take(static_cast<long long>(l.ns_h) * l.ldl);
    l.off_wd2 = take(static_cast<long long>(l.ns_d) * l.ldh);
  }
  l.floats = off;
  return l;
}

}  // namespace

namespace {
std::mutex g_mutex;  // guards the caches below (plans may be made from several threads)
std::map<int, ClusterDevice> g_devices;
// (kernel, device) -> dynamic smem limit already set; (kernel, device, C, threads, smem) -> fits.
std::map<std::tuple<const void*, int>, int> g_smem_set;
std::map<std::tuple<const void*, int, int, int, int>, int> g_fits;
}  // namespace

cudaError_t cluster_device(int device, ClusterDevice* out) noexcept {
  try {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_devices.find(device);
    if (it != g_devices.end()) { *out = it->second; return cudaSuccess; }
    ClusterDevice d;
    cudaError_t e = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (e != cudaSuccess) return e;
    g_devices[device] = d;
    *out = d;
    return cudaSuccess;
  } catch (...) {  // std::map allocation / mutex: no exception leaves this file
    return cudaErrorMemoryAllocation;
  }
}

cudaError_t cluster_fit(const void* kernel, int device, int C, int threads, int smem,
                        int* clusters) noexcept {
  try {
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto key = std::make_tuple(kernel, device, C, threads, smem);
    auto it = g_fits.find(key);
    if (it != g_fits.end()) { *clusters = it->second; return cudaSuccess; }
    auto& set = g_smem_set[std::make_tuple(kernel, device)];
    cudaError_t e = cudaSuccess;
    if (smem > set) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return e;
      set = smem;
    }
    if (C > 8) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (e != cudaSuccess) { cudaGetLastError(); *clusters = 0; g_fits[key] = 0; return cudaSuccess; }
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(C);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n = 0;
    e = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
    if (e != cudaSuccess) { cudaGetLastError(); n = 0; }  // e.g. C too large here
    *clusters = n;
    g_fits[key] = n;
    return cudaSuccess;
  } catch (...) {
    return cudaErrorMemoryAllocation;
  }
}

cudaError_t cluster_launch(const void* kernel, int blocks, int C, int threads, int smem,
                           void** args, cudaStream_t stream, bool pdl) noexcept {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(C);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  const cudaError_t e = cudaLaunchKernelExC(&cfg, kernel, args);
  const cudaError_t last = cudaGetLastError();
  return e != cudaSuccess ? e : last;
}

long long elbo_smem_bytes(int D, int H, int L, int R, int C, bool staged) noexcept {
  return make_layout(D, H, L, R, C, staged).floats * 4;
}

ElboStatus elbo_plan(ElboParams& p, int device, int rows, int cluster, int staged,
                     cudaError_t* cuda_err) noexcept {
  *cuda_err = cudaSuccess;
  ClusterDevice dev;
  cudaError_t e = cluster_device(device, &dev);
  if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
  if (dev.major < 9) return kElboBadArch;
  static const int kAuto[] = {16, 8, 4, 2, 1};
  const int forced[] = {cluster};
  const int* cands = cluster > 0 ? forced : kAuto;
  const int ncands = cluster > 0 ? 1 : 5;
  bool any_fit_smem = false;
  for (int ci = 0; ci < ncands; ++ci) {
    const int C = cands[ci];
    int rcap = 0;  // most rows whose activations fit in this device's shared memory
    for (int r = kMaxRows; r >= 1; --r)
      if (elbo_smem_bytes(p.D, p.H, p.L, r, C, false) <= dev.smem_optin) { rcap = r; break; }
    if (rcap == 0) continue;
    any_fit_smem = true;
    // Small batches: one wave of clusters over the SMs; large: the most rows that fit.
    const int R0 = max(1, min(rows > 0 ? rows : cdiv(p.B, max(1, dev.sms / C)), rcap));
    // Staging (x tile + weight slices in smem) when it fits; else weights stream from L2.
    for (int st = 1; st >= 0; --st) {
      if (staged >= 0 && st != staged) continue;
      int R = R0, smem = 0, active = 0;
      // Up to two tries: if fewer clusters are co-resident than the tile count asks for (GPCs
      // smaller than C blocks at this smem), take more rows per cluster to stay in one wave.
      for (int attempt = 0; attempt < 2; ++attempt) {
        const long long bytes = elbo_smem_bytes(p.D, p.H, p.L, R, C, st != 0);
        if (bytes > dev.smem_optin) { active = 0; break; }
        smem = static_cast<int>(bytes);
        e = cluster_fit(reinterpret_cast<const void*>(kernel_for(R >= 32 ? 1 : 0)), device, C,
                        kClusterThreads, smem, &active);
        if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
        if (active == 0 || rows > 0 || cdiv(p.B, R) <= active) break;
        const int r1 = min(cdiv(p.B, active), rcap);
        if (r1 == R || attempt == 1) break;
        const long long b1 = elbo_smem_bytes(p.D, p.H, p.L, r1, C, st != 0);
        int a1 = 0;
        if (b1 <= dev.smem_optin) {
          e = cluster_fit(reinterpret_cast<const void*>(kernel_for(r1 >= 32 ? 1 : 0)), device, C,
                          kClusterThreads, static_cast<int>(b1), &a1);
          if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
        }
        if (a1 == 0 || cdiv(p.B, r1) > a1) break;  // keep R: two waves either way
        R = r1;
      }
      if (active == 0) continue;
      if (static_cast<long long>(cdiv(p.B, R)) * C > INT_MAX) continue;
      const int variant = R >= 32 ? 1 : 0;
      const Layout l = make_layout(p.D, p.H, p.L, R, C, st != 0);
      smem = static_cast<int>(l.floats * 4);
      p.R = R;
      p.C = C;
      p.variant = variant;
      p.staged = st;
      p.ns_h = l.ns_h; p.ns_l = l.ns_l; p.ns_d = l.ns_d;
      p.ldh = l.ldh; p.ldl = l.ldl; p.ldm = l.ldm; p.ldo = l.ldo; p.ldx = l.ldx;
      p.off_zs = l.off_zs; p.off_ml = l.off_ml; p.off_ob = l.off_ob;
      p.off_rec = l.off_rec; p.off_kl = l.off_kl; p.off_bad = l.off_bad;
      p.off_xs = l.off_xs; p.off_w1 = l.off_w1; p.off_wm = l.off_wm; p.off_wl = l.off_wl;
      p.off_wd1 = l.off_wd1; p.off_wd2 = l.off_wd2;
      p.smem_bytes = smem;
      return kElboOk;
    }
  }
  return any_fit_smem ? kElboNoCluster : kElboTooLarge;
}

cudaError_t elbo_launch(const ElboParams& p, cudaStream_t stream) noexcept {
  void* args[] = {const_cast<ElboParams*>(&p)};
  return cluster_launch(reinterpret_cast<const void*>(kernel_for(p.variant)),
                        cdiv(p.B, p.R) * p.C, p.C, kClusterThreads, p.smem_bytes, args, stream,
                        p.pdl != 0);
}

}  // namespace fastelbo
