// The fast cluster path: the whole forward in ONE launch, the noise draw included when asked
// (FastParams.draw: torch.randn's numbers from philox.cuh, see noise.py), for dims that
// are multiples of 4 (float4 rows) and H a multiple of 4 * C. Role: the lowest latency for
// 80 < B <= 384 (binding_forward.cpp; one wave of 7 clusters of 16 blocks holds 140 rows on an
// H200); elbo.cu's cluster kernel is the general path for small B and every other shape.
//
// Why a second kernel (phase trace of benchmarks/experiments/cuda_trace.cu, H200, B=128):
// elbo.cu's kernel spends 56K cycles, of which 26K in two 2x2-tile FFMA loops that are
// shared-memory-bound (4 LDS.128 per 16 FMA), 7K issuing the cp.async staging of 165 KB per
// block (x tile + weight slices), ~10K in small phases waiting on global loads (biases, eps, x)
// and 4-byte DSMEM stores. Here (v4: ~43K cycles, 23.7 us per launch at B=128; v6: 36K, 19.7):
//   * the encoder is split over the input dimension: block k owns ~D/4C float4 columns of x and
//     of w1 and computes PARTIAL sums for all H hidden units of its <= 20 rows; the cluster then
//     reduces them through DSMEM. x is read once per cluster, not once per block.
//   * every GEMM uses 5-row x 4/7-column register tiles laid out so each LDS.128 is one
//     conflict-free wavefront (rows rt + 4i, columns ct + 64j / ct + 8j; row strides with an odd
//     number of float4), with the next column's operands loaded while the FMAs issue.
//   * everything a phase reads is staged up front by the TMA unit, on four mbarriers in the
//     order the layers need it: seven tensor-map tiles (x and w1 slices first) and the padded
//     rows of wd2. The trace shows what is left: staging runs at ~20 B/cycle per SM whatever
//     issues it, and each DSMEM exchange costs ~4K cycles (the cost is per request).
//
// Phases. Each exchange is one bulk copy per destination block (cp.async.bulk from this
// block's shared memory into the receiver's, completing on the receiver's mbarrier 4-7: one
// instruction per chunk instead of ~1280 DSMEM requests per block and a cluster barrier per
// exchange); a block's own chunk is a plain copy (see send()). Cluster barriers: the split one
// around L1 (every block's mbarriers exist before anyone sends) and S at the end.
//   L1  partial h (20 x H) over this block's x columns -> p1s, sent by destination   -> r1
//   RS1 h for this block's H/C columns = relu(b1 + sum_q r1_q) -> hk
//   L2  partial (mu | logvar) (20 x 2L) over those H/C columns -> p2s, sent           -> r2
//   RS2 mu, logvar for this block's latent indices = bias + sum_q r2_q; z -> zl, sent to all
//       -> rz; KL partial -> rank 0 (DSMEM store)
//   L3  all of z; d for this block's H/C columns -> dk, sent to all                   -> rd
//   L4  all of d laid out in ds; logits for this block's D/C columns (warps split H, reduced
//       in smem), BCE against x, per-row sums and the bad-x flag -> rank 0            S
//   rank 0 writes elbo, recon, kl (cluster.cuh write_rows); every block waits until its bulk
//   sends have read their sources before it exits.
// Measured (H200): 19.7 us per launch at B=128 (graph of 100; 36K cycles per block:
// staging 6.7K, L4 + BCE 7.7K, L1 4.5K, the four exchanges 1-1.6K each); the CUDA tests pass
// and compute-sanitizer memcheck and racecheck are clean (v5's bulk copies to the sending
// block itself are what memcheck rejected: its own chunk is now a plain copy).
// Numerics as elbo.cu and PyTorch op by op (fp32 FMA dot products, no TF32, no fast math);
// only the order of the dot products' additions differs from cuBLAS, as it does there.
#include "elbo.h"
#include "cluster.cuh"
#include "deferred.cuh"
#include "elbo_math.cuh"
#include "philox.cuh"

#include <cooperative_groups.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <climits>

namespace cg = cooperative_groups;

namespace fastelbo {
namespace {

constexpr int kFastThreads = 256;
constexpr int kFastWarps = kFastThreads / 32;
constexpr int kRowLanes = 4, kRowsPerThread = 5;  // rows rt + 4 i: kFastRows = 20
static_assert(kRowLanes * kRowsPerThread == kFastRows, "row tiling");
constexpr int kL1ColLanes = kFastThreads / kRowLanes, kL1Cols = 4;  // columns ct + 64 j
constexpr int kL1Pass = kL1ColLanes * kL1Cols;                      // 256 hidden units
constexpr int kL4ColLanes = 32 / kRowLanes, kL4Cols = 7;            // columns ct + 8 j
constexpr int kL4Pass = kL4ColLanes * kL4Cols;                      // 56 output columns

__device__ __forceinline__ float4 ld4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float dot4(float4 a, float4 w, float acc) {
  acc = fmaf(a.x, w.x, acc);
  acc = fmaf(a.y, w.y, acc);
  acc = fmaf(a.z, w.z, acc);
  return fmaf(a.w, w.w, acc);
}
__device__ __forceinline__ int floor4(int v) { return v & ~3; }

// acc[i][j] += sum over float4 columns q in [q0, q1) of a[i][4q..] . w[j][4q..], each
// accumulator in column order. The next column's operands load while this one's FMAs issue.
template <int TR, int TC>
__device__ __forceinline__ void tile_dot(const float* const (&a)[TR], const float* const (&w)[TC],
                                         int q0, int q1, float (&acc)[TR][TC]) {
  if (q0 >= q1) return;
  float4 av[TR], wv[TC];
#pragma unroll
  for (int i = 0; i < TR; ++i) av[i] = ld4(a[i] + 4 * q0);
#pragma unroll
  for (int j = 0; j < TC; ++j) wv[j] = ld4(w[j] + 4 * q0);
#pragma unroll 2
  for (int q = q0; q < q1; ++q) {
    const int qn = 4 * min(q + 1, q1 - 1);  // the last round reloads its own column
    float4 an[TR], wn[TC];
#pragma unroll
    for (int i = 0; i < TR; ++i) an[i] = ld4(a[i] + qn);
#pragma unroll
    for (int j = 0; j < TC; ++j) wn[j] = ld4(w[j] + qn);
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) acc[i][j] = dot4(av[i], wv[j], acc[i][j]);
#pragma unroll
    for (int i = 0; i < TR; ++i) av[i] = an[i];
#pragma unroll
    for (int j = 0; j < TC; ++j) wv[j] = wn[j];
  }
}

// One pass of L1's 5 x 4 register tiles (L1 itself and local d): acc[i][j] += sum over float4
// columns q < nq of row rt + 4 i of a (stride lda) . row min(n0 + ct + 64 j, H - 1) of w
// (stride ldw); columns at and past H repeat the last row (the caller skips them).
__device__ __forceinline__ void l1_pass(const float* a, int lda, const float* w, int ldw, int n0,
                                        int H, int nq, int rt, int ct,
                                        float (&acc)[kRowsPerThread][kL1Cols]) {
  const float* ap[kRowsPerThread];
  const float* wp[kL1Cols];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) ap[i] = a + (rt + kRowLanes * i) * lda;
#pragma unroll
  for (int j = 0; j < kL1Cols; ++j) wp[j] = w + min(n0 + ct + kL1ColLanes * j, H - 1) * ldw;
  tile_dot(ap, wp, 0, nq, acc);
}

__global__ void __launch_bounds__(kFastThreads, 1)
    elbo_fast_kernel(const __grid_constant__ FastParams p) {
  extern __shared__ __align__(128) float4 smem4[];
  // mbarriers: 0-3 the staging groups, 4-7 the exchanges received (h, mu | logvar, z, d).
  __shared__ alignas(8) unsigned long long bar[8];
  float* sm = reinterpret_cast<float*>(smem4);
  constexpr int F = kFastRows;
  float* xk = sm + p.off_xk;     // F x ldk: this block's x columns (float4 quads qa..)
  float* w1k = sm + p.off_w1k;   // H x ldk: the same columns of w1
  float* b1k = sm + p.off_b1;    // hs
  float* hk = sm + p.off_hk;     // F x ldq: h for this block's hidden columns
  float* wmus = sm + p.off_wmu;  // L x hs: wmu at this block's hidden columns
  float* wlvs = sm + p.off_wlv;  // L x hs: wlv, same columns
  float* bl = sm + p.off_bl;     // 2 x lds_l: bmu, blv around this block's latent indices
  float* epk = sm + p.off_eps;   // F x lds_l: eps, same columns
  float* ml = sm + p.off_ml;     // F x 2 ns_l: mu, logvar of this block's latent indices
  float* zs = sm + p.off_zs;     // F x ldz: all of z
  float* wd1f = sm + p.off_wd1f; // local_d: H x ldw, all of wd1 (over w1k, staged after L1)
  float* bd1f = sm + p.off_bd1f; // local_d: H, all of bd1
  float* wd1s = sm + p.off_wd1;  // hs x L
  float* bd1k = sm + p.off_bd1;  // hs
  float* ds = sm + p.off_ds;     // F x ldd: all of d (over p1s, sent and read by then)
  float* wd2s = sm + p.off_wd2;  // ns_d x ldd
  float* bd2k = sm + p.off_bd2;  // lds_d: bd2 around this block's output columns
  float* xd = sm + p.off_xd;     // F x lds_d: x, same columns
  float* red = sm + p.off_red;   // over w1k once L1 is done: L4's per-warp partial sums
  float* bce = sm + p.off_bce;   // F x ns_d: BCE terms (over w1k, after red)
  // Exchanges: sent chunks are destination-major, received ones source-major (C chunks).
  float* p1s = sm + p.off_p1s;   // C x F x hs: partial h, by destination block's columns
  float* r1 = sm + p.off_r1;     // C x F x hs: partial h of this block's columns, by source
  float* p2s = sm + p.off_p2s;   // C x F x 2 ns_l: partial mu | logvar, by destination
  float* r2 = sm + p.off_r2;     // C x F x 2 ns_l: by source
  float* zl = sm + p.off_zl;     // F x ns_l: z for this block's latent indices
  float* rz = sm + p.off_rz;     // C x F x ns_l: every block's z
  float* dk = sm + p.off_dk;     // F x hs: d for this block's hidden columns
  float* rd = sm + p.off_rd;     // C x F x hs: every block's d (over r1, read by then)
  float* rec_part = sm + p.off_rec;  // C x F (rank 0): BCE row sums per block
  float* kl_part = sm + p.off_kl;    // C x F (rank 0): KL row sums per block
  float* bad_part = sm + p.off_bad;  // C x F (rank 0): 1 where a block saw bad x

  cg::cluster_group cluster = cg::this_cluster();
  const int C = p.C, R = p.R, D = p.D, H = p.H, L = p.L;
  const int k = static_cast<int>(cluster.block_rank());
  const int row0 = static_cast<int>(blockIdx.x / C) * R;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int ldk = p.ldk, ldd = p.ldd, ldq = p.ldq, hs = p.hs, ns_l = p.ns_l;
  const int lds_l = p.lds_l, lds_d = p.lds_d, ns_d = p.ns_d, ldz = p.ldz;
  const bool local_d = p.local_d != 0;
  const int nbox_d = local_d ? cdiv(H, p.wd1f_box) : 0;
  const int nq = D / 4, qa = k * nq / C, nqk = (k + 1) * nq / C - qa;
  const int h0 = k * hs, g4 = hs / 4, hq = H / 4;
  const int j0 = k * ns_l, lcnt = max(0, min(ns_l, L - j0));
  const int n0d = k * ns_d, ncd = max(0, min(ns_d, D - n0d));
  // 16-byte aligned windows around this block's latent indices and output columns.
  const int sl0 = floor4(j0), nsl = lcnt > 0 ? round4(j0 + lcnt) - sl0 : 0, shl = j0 - sl0;
  const int sd0 = floor4(n0d), nsd = ncd > 0 ? round4(n0d + ncd) - sd0 : 0, shd = n0d - sd0;
  // Exchange chunk sizes (floats; all multiples of 4).
  const int ch1 = F * hs, ch2 = F * 2 * ns_l, ch3 = F * ns_l;
  FE_TRACE(0);

  // Staging: four groups of TMA copies, one mbarrier each, in the order the layers need them.
  // Thread 0 issues the tensor-map tiles (x and w1 slices first: L1 waits for them); the rows
  // of wd2 (padded rows, conflict-free for L4) are row copies from all threads, issued last:
  // the TMA unit takes ~20 cycles per copy (cuda_trace). The exchange barriers expect one
  // chunk from every block of the cluster.
  const int nbox = cdiv(H, p.w1_box);
  if (tid == 0) {
#pragma unroll
    for (int g = 0; g < 8; ++g) mbar_init(&bar[g], 1);
    mbar_fence_init();
    mbar_arrive_expect(&bar[0], 4u * ldk * (F + nbox * p.w1_box) + 4u * hs);
    mbar_arrive_expect(&bar[1], 4u * (2 * L * hs + 2 * nsl + (p.draw ? 0 : F * lds_l)));
    mbar_arrive_expect(&bar[2], local_d ? 4u * (nbox_d * p.wd1f_box * p.ldw + H)
                                        : 4u * (hs * L + hs));
    mbar_arrive_expect(&bar[3], 4u * (ncd * H + nsd + F * lds_d));
    mbar_arrive_expect(&bar[4], 4u * (C - 1) * ch1);  // the own chunk is a plain copy (send)
    mbar_arrive_expect(&bar[5], 4u * (C - 1) * ch2);
    mbar_arrive_expect(&bar[6], 4u * (C - 1) * ch3);
    if (!local_d) mbar_arrive_expect(&bar[7], 4u * (C - 1) * ch1);
    if (!p.pdl) tma_load_2d(xk, &p.tm_x, 4 * qa, row0, &bar[0]);
    for (int b = 0; b < nbox; ++b)
      tma_load_2d(w1k + b * p.w1_box * ldk, &p.tm_w1, 4 * qa, b * p.w1_box, &bar[0]);
    bulk_copy(b1k, p.b1 + h0, 4u * hs, &bar[0]);
    tma_load_2d(wmus, &p.tm_wmu, h0, 0, &bar[1]);
    tma_load_2d(wlvs, &p.tm_wlv, h0, 0, &bar[1]);
    if (!p.draw && !p.pdl) tma_load_2d(epk, &p.tm_eps, sl0, row0, &bar[1]);
    if (nsl > 0) {
      bulk_copy(bl, p.bmu + sl0, 4u * nsl, &bar[1]);
      bulk_copy(bl + lds_l, p.blv + sl0, 4u * nsl, &bar[1]);
    }
    if (!local_d) {  // else all of wd1 and bd1, once L1 is done with w1k (below)
      tma_load_2d(wd1s, &p.tm_wd1, 0, h0, &bar[2]);
      bulk_copy(bd1k, p.bd1 + h0, 4u * hs, &bar[2]);
    }
    if (!p.pdl) tma_load_2d(xd, &p.tm_xd, sd0, row0, &bar[3]);
    if (nsd > 0) bulk_copy(bd2k, p.bd2 + sd0, 4u * nsd, &bar[3]);
  }
  __syncthreads();  // barriers initialised (and the tiles queued) before the row copies
  for (int i = tid; i < ncd; i += kFastThreads)
    bulk_copy(wd2s + i * ldd, p.wd2 + static_cast<size_t>(n0d + i) * H, 4u * H, &bar[3]);
  // PDL (p.pdl): until here only weights and biases were read; x and eps after pdl_wait.
  pdl_wait(p);
  if (p.pdl && tid == 0) {
    tma_load_2d(xk, &p.tm_x, 4 * qa, row0, &bar[0]);
    if (!p.draw) tma_load_2d(epk, &p.tm_eps, sl0, row0, &bar[1]);
    tma_load_2d(xd, &p.tm_xd, sd0, row0, &bar[3]);
  }
  cluster_arrive();  // this block's barriers exist: others may send once everyone arrived
  if (p.draw) {
    // The noise in the kernel: this block's window of torch.randn(B, L) (rows and columns
    // the tile load would have brought, 0 outside eps as the tile load fills), read by RS2
    // after several __syncthreads; the block's own latent indices also go to eps_out, so each
    // element of eps_out is written by exactly one block.
    uint64_t seed, offset;
    torch_randn_seeds(p.rng, &seed, &offset);
    for (int i = tid; i < F * nsl; i += kFastThreads) {
      const int r = i / nsl, c = i - r * nsl, row = row0 + r, col = sl0 + c;
      float v = 0.0f;
      if (r < R && row < p.B && col < L) {
        const uint64_t e = static_cast<uint64_t>(row) * L + col;
        v = torch_randn_at(seed, offset, p.rng.threads, e);
        if (c >= shl && c < shl + lcnt) p.eps_out[e] = v;
      }
      epk[r * lds_l + c] = v;
    }
  }
  // The deferred value check (p.err): this block's share of ALL of x while the staging flies;
  // folded into every row's bad flag before L4, so a bad value anywhere NaNs the whole call.
  const long long nx = static_cast<long long>(p.B) * D;
  const bool x_bad = p.err != nullptr && deferred_scan(p.x, nx, k, C);
  FE_TRACE(1);

  // Sends this block's chunk(s) to every other block q: src + q * src_step floats (src_step 0:
  // the same chunk to all) into q's dst + k * chunk, completing on q's barrier `b`; every
  // writer of the chunk ran fence_proxy_async() before the __syncthreads that precedes this.
  // The block's own chunk is copied with plain float4 loads and stores instead: a bulk copy to
  // its own CTA runs correctly, but compute-sanitizer's memcheck rejects it ("not located in
  // remote CTA", also in a standalone reproduction), so each exchange barrier expects C - 1
  // chunks. Called by all threads (the copy ends in __syncthreads).
  auto send = [&](const float* src, int src_step, float* dst, int chunk, int b) {
    if (tid < C && tid != k)
      bulk_send(cluster_addr(dst + k * chunk, tid), src + tid * src_step, 4u * chunk,
                cluster_addr(&bar[b], tid));
    const float4* own = reinterpret_cast<const float4*>(src + k * src_step);
    float4* to = reinterpret_cast<float4*>(dst + k * chunk);
    for (int i = tid; i < chunk / 4; i += kFastThreads) to[i] = own[i];
    __syncthreads();
  };

  mbar_wait(&bar[0], 0);
  FE_TRACE(2);
  // L1: partial h over this block's x columns, 5 x 4 register tiles, stored by destination.
  {
    const int rt = tid % kRowLanes, ct = tid / kRowLanes;
    for (int n0 = 0; n0 < H; n0 += kL1Pass) {
      float acc[kRowsPerThread][kL1Cols] = {};
      l1_pass(xk, ldk, w1k, ldk, n0, H, nqk, rt, ct, acc);
#pragma unroll
      for (int j = 0; j < kL1Cols; ++j) {
        const int n = n0 + ct + kL1ColLanes * j;
        if (n >= H) continue;
        const int q = n / hs;
        float* dst = p1s + q * ch1 + (n - q * hs);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) dst[(rt + kRowLanes * i) * hs] = acc[i][j];
      }
    }
  }
  fence_proxy_async();
  __syncthreads();
  FE_TRACE(3);
  cluster_wait();  // every block's exchange barriers are initialised
  send(p1s, ch1, r1, ch1, 4);
  if (local_d && tid == 0) {
    // All of wd1 and bd1 over w1k's space: every thread's L1 reads of w1k came before send's
    // closing __syncthreads; the fence orders them before these async-proxy writes.
    fence_proxy_async();
    for (int b = 0; b < nbox_d; ++b)
      tma_load_2d(wd1f + b * p.wd1f_box * p.ldw, &p.tm_wd1f, 0, b * p.wd1f_box, &bar[2]);
    bulk_copy(bd1f, p.bd1, 4u * H, &bar[2]);
  }
  FE_TRACE(4);

  // RS1: h for this block's hidden columns = relu(b1 + sum over blocks, in rank order).
  mbar_wait(&bar[4], 0);
  for (int i = tid; i < F * hs; i += kFastThreads) {
    const int r = i / hs, c = i - r * hs;
    float s = 0.0f;
#pragma unroll 16
    for (int q = 0; q < C; ++q) s += r1[q * ch1 + r * hs + c];
    hk[r * ldq + c] = relu(s + b1k[c]);
  }
  mbar_wait(&bar[1], 0);
  __syncthreads();
  FE_TRACE(5);

  // L2: partial mu | logvar over this block's hidden columns, 5 x 1 register tiles, stored by
  // the destination block that owns each latent index.
  {
    const int rt = tid % kRowLanes, ct = tid / kRowLanes;
    for (int c0 = 0; c0 < 2 * L; c0 += kL1ColLanes) {
      float acc[kRowsPerThread][1] = {};
      const float* a[kRowsPerThread];
      const int c = min(c0 + ct, 2 * L - 1);
      const float* w[1] = {c < L ? wmus + c * hs : wlvs + (c - L) * hs};
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) a[i] = hk + (rt + kRowLanes * i) * ldq;
      tile_dot(a, w, 0, g4, acc);
      if (c0 + ct < 2 * L) {
        const int j = c < L ? c : c - L, q = j / ns_l;
        float* dst = p2s + q * ch2 + (c < L ? 0 : ns_l) + (j - q * ns_l);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) dst[(rt + kRowLanes * i) * 2 * ns_l] = acc[i][0];
      }
    }
  }
  fence_proxy_async();
  __syncthreads();
  send(p2s, ch2, r2, ch2, 5);
  FE_TRACE(6);

  // RS2: mu, logvar of this block's latent indices (bias + sum over blocks); z for the others,
  // the KL partial to rank 0.
  mbar_wait(&bar[5], 0);
  FE_TRACE(7);
  const int m2 = 2 * ns_l;
  for (int i = tid; i < F * lcnt; i += kFastThreads) {
    const int r = i / lcnt, j = i - r * lcnt;
    float mu = 0.0f, lv = 0.0f;
#pragma unroll 16
    for (int q = 0; q < C; ++q) {
      mu += r2[q * ch2 + r * m2 + j];
      lv += r2[q * ch2 + r * m2 + ns_l + j];
    }
    mu += bl[shl + j];
    lv += bl[lds_l + shl + j];
    ml[r * m2 + j] = mu;
    ml[r * m2 + ns_l + j] = lv;
    zl[r * ns_l + j] = reparam(mu, lv, epk[r * lds_l + shl + j]);
  }
  fence_proxy_async();
  __syncthreads();
  send(zl, 0, rz, ch3, 6);
  for (int r = tid; r < F; r += kFastThreads) {
    float s = 0.0f;
    for (int j = 0; j < lcnt; ++j) s += kl_term(ml[r * m2 + j], ml[r * m2 + ns_l + j]);
    cluster.map_shared_rank(kl_part, 0)[k * F + r] = s;
  }
  FE_TRACE(8);

  // All of z; then d for this block's hidden columns (four per thread), sent to every block.
  mbar_wait(&bar[6], 0);
  for (int i = tid; i < C * ch3; i += kFastThreads) {
    const int q = i / ch3, e = i - q * ch3, r = e / ns_l, j = q * ns_l + (e - r * ns_l);
    if (j < L) zs[r * ldz + j] = rz[i];
  }
  mbar_wait(&bar[2], 0);
  __syncthreads();
  FE_TRACE(9);
  if (local_d) {
    // All of d, straight into L4's layout, with L1's 5 x 4 register tiles (the same fmaf order
    // per element as the exchange path's loop below, so the same bits). ds lies over p1s:
    // every block's z arrived above, and each block sent its z only after receiving (so after
    // this block's bulk copies read) this block's p1s chunk.
    const int rt = tid % kRowLanes, ct = tid / kRowLanes;
    for (int n0 = 0; n0 < H; n0 += kL1Pass) {
      float acc[kRowsPerThread][kL1Cols] = {};
      l1_pass(zs, ldz, wd1f, p.ldw, n0, H, L / 4, rt, ct, acc);
#pragma unroll
      for (int j = 0; j < kL1Cols; ++j) {
        const int n = n0 + ct + kL1ColLanes * j;
        if (n >= H) continue;
        const float b = bd1f[n];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
          ds[(rt + kRowLanes * i) * ldd + n] = relu(acc[i][j] + b);
      }
    }
    FE_TRACE(10);
  } else {
    for (int i = tid; i < F * g4; i += kFastThreads) {
      const int r = i / g4, c = 4 * (i - r * g4);
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int kk = 0; kk < L; kk += 4) {
        const float4 zv = ld4(zs + r * ldz + kk);
#pragma unroll
        for (int m = 0; m < 4; ++m) acc[m] = dot4(zv, ld4(wd1s + (c + m) * L + kk), acc[m]);
      }
      st4(dk + r * hs + c, make_float4(relu(acc[0] + bd1k[c]), relu(acc[1] + bd1k[c + 1]),
                                       relu(acc[2] + bd1k[c + 2]), relu(acc[3] + bd1k[c + 3])));
    }
    fence_proxy_async();
    __syncthreads();
    send(dk, 0, rd, ch1, 7);
    FE_TRACE(10);

    // All of d, rows laid out for L4's tiles.
    mbar_wait(&bar[7], 0);
    for (int i = tid; i < C * F * g4; i += kFastThreads) {
      const int q = i / (F * g4), e = i - q * (F * g4), r = e / g4, c = 4 * (e - r * g4);
      st4(ds + r * ldd + q * hs + c, ld4(rd + q * ch1 + r * hs + c));
    }
  }
  mbar_wait(&bar[3], 0);
  const bool call_bad = deferred_block_or(p.err != nullptr, x_bad);  // and a __syncthreads
  FE_TRACE(11);

  // L4: logits for this block's output columns (warps split H; partial sums reduced through
  // smem in warp order), then the BCE terms, every (row, column) over all threads.
  {
    const int rt = lane % kRowLanes, ct = lane / kRowLanes;
    const int qw0 = warp * hq / kFastWarps, qw1 = (warp + 1) * hq / kFastWarps;
    float* wred = red + warp * F * kL4Pass;
    for (int n0 = 0; n0 < ncd; n0 += kL4Pass) {  // uniform over the block
      float acc[kRowsPerThread][kL4Cols] = {};
      const float* a[kRowsPerThread];
      const float* w[kL4Cols];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) a[i] = ds + (rt + kRowLanes * i) * ldd;
#pragma unroll
      for (int j = 0; j < kL4Cols; ++j) w[j] = wd2s + min(n0 + ct + kL4ColLanes * j, ncd - 1) * ldd;
      tile_dot(a, w, qw0, qw1, acc);
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < kL4Cols; ++j)
          wred[(rt + kRowLanes * i) * kL4Pass + ct + kL4ColLanes * j] = acc[i][j];
      __syncthreads();
      const int ncp = min(kL4Pass, ncd - n0);
      constexpr int kTerms = (F * kL4Pass + kFastThreads - 1) / kFastThreads;
#pragma unroll
      for (int u = 0; u < kTerms; ++u) {  // independent exp/log chains per thread
        const int o = tid + u * kFastThreads;
        if (o < F * ncp) {
          const int r = o / ncp, c = o - r * ncp;
          float s = 0.0f;
#pragma unroll
          for (int w8 = 0; w8 < kFastWarps; ++w8) s += red[(w8 * F + r) * kL4Pass + c];
          bool unused = false;  // the row flag is taken from xd below
          bce[r * ns_d + n0 + c] = bce_term(s + bd2k[shd + n0 + c], xd[r * lds_d + shd + n0 + c],
                                            &unused);
        }
      }
      __syncthreads();
    }
  }
  FE_TRACE(12);
  // Per-row sums (one warp per row, fixed order: deterministic) and bad-x flags -> rank 0.
  for (int r = warp; r < F; r += kFastWarps) {
    float s = 0.0f;
    bool bad = false;
    for (int c = lane; c < ncd; c += 32) {
      s += bce[r * ns_d + c];
      const float xv = xd[r * lds_d + shd + c];
      bad |= outside_unit(xv);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    bad = __any_sync(0xffffffffu, bad) || call_bad;
    if (lane == 0) {
      cluster.map_shared_rank(rec_part, 0)[k * F + r] = s;
      cluster.map_shared_rank(bad_part, 0)[k * F + r] = bad ? 1.0f : 0.0f;
    }
  }
  if (tid < C) bulk_wait_sent();  // this block's chunks are read before it may exit
  FE_TRACE(13);
  cluster.sync();  // S: the partials reached rank 0
  FE_TRACE(14);

  if (k == 0) write_rows(p, row0, R, C, F, rec_part, kl_part, bad_part);
  // The deferred check's slow path: cluster 0's blocks, whose shares cover x once, note it.
  if (call_bad && blockIdx.x < static_cast<unsigned>(C))
    deferred_note_share(p.err, p.x, nx, D, k, C);
  FE_TRACE(15);
}

// Rows of `q` float4 with an odd count of float4 per row: 4 or 8 consecutive rows then start in
// distinct 16-byte bank groups, so the tiles' LDS.128 are conflict-free.
int odd_quads(int q) { return 4 * (q | 1); }

bool fast_layout(FastParams& p, int C) {
  const int D = p.D, H = p.H, L = p.L, F = kFastRows;
  p.C = C;
  p.qmax = cdiv(D / 4, C);
  p.hs = H / C;
  p.ns_l = cdiv(L, C);
  p.ns_d = cdiv(D, C);
  p.ldk = odd_quads(p.qmax);  // also the tensor-map box width of the x and w1 slices
  p.w1_box = std::min(H, 256);
  p.ldd = odd_quads(H / 4);
  p.ldq = odd_quads(p.hs / 4);
  p.lds_l = round4(p.ns_l + 6);    // a 16-byte aligned window around ns_l columns
  p.lds_d = round4(p.ns_d + 6);
  long long off = 0;
  auto take = [&](long long n) {
    const long long at = off;
    off += (n + 31) & ~31LL;  // every buffer 128-byte aligned (tensor-map destinations)
    return static_cast<int>(at);
  };
  const long long ch1 = static_cast<long long>(F) * p.hs, ch2 = 2LL * F * p.ns_l;
  const long long ch3 = static_cast<long long>(F) * p.ns_l;
  p.off_xk = take(static_cast<long long>(F) * p.ldk);
  // After L1, w1k's space holds L4's per-warp sums and the BCE terms.
  const long long red = static_cast<long long>(kFastWarps) * F * kL4Pass;
  p.off_w1k = take(std::max<long long>(static_cast<long long>(cdiv(H, p.w1_box)) * p.w1_box *
                                           p.ldk,
                                       red + static_cast<long long>(F) * p.ns_d));
  p.off_red = p.off_w1k;
  p.off_bce = p.off_w1k + static_cast<int>(red);
  // All of wd1 (rows padded to ldw, like z's) and bd1 over the same space, where they fit and
  // a tensor-map box can hold an ldw-wide row.
  p.ldz = odd_quads(L / 4);
  p.ldw = p.ldz;
  p.wd1f_box = std::min(H, 256);
  const long long wd1f = static_cast<long long>(cdiv(H, p.wd1f_box)) * p.wd1f_box * p.ldw;
  const long long w1k_space = std::max<long long>(
      static_cast<long long>(cdiv(H, p.w1_box)) * p.w1_box * p.ldk,
      red + static_cast<long long>(F) * p.ns_d);
  p.local_d = (p.ldw <= 256 && wd1f + H <= w1k_space) ? 1 : 0;
  p.off_wd1f = p.off_w1k;
  p.off_bd1f = p.off_w1k + static_cast<int>(wd1f);
  p.off_b1 = take(p.hs);
  p.off_hk = take(static_cast<long long>(F) * p.ldq);
  p.off_wmu = take(static_cast<long long>(L) * p.hs);
  p.off_wlv = take(static_cast<long long>(L) * p.hs);
  p.off_bl = take(2LL * p.lds_l);
  p.off_eps = take(static_cast<long long>(F) * p.lds_l);
  p.off_ml = take(2LL * F * p.ns_l);
  p.off_zs = take(static_cast<long long>(F) * p.ldz);
  p.off_wd1 = take(static_cast<long long>(p.hs) * L);
  p.off_bd1 = take(p.hs);
  p.off_wd2 = take(static_cast<long long>(p.ns_d) * p.ldd);
  p.off_bd2 = take(p.lds_d);
  p.off_xd = take(static_cast<long long>(F) * p.lds_d);
  // ds over p1s: d arrives only after every block has received (so read) this block's p1s.
  p.off_p1s = take(std::max<long long>(C * ch1, static_cast<long long>(F) * p.ldd));
  p.off_ds = p.off_p1s;
  p.off_r1 = take(C * ch1);
  p.off_p2s = take(C * ch2);
  p.off_r2 = take(C * ch2);
  p.off_zl = take(ch3);
  p.off_rz = take(C * ch3);
  p.off_dk = take(ch1);
  // d arrives over r1: a block sends d only after every block sent its z, i.e. after every
  // block has read its r1 (RS1 precedes RS2 in each block).
  p.off_rd = p.off_r1;
  p.off_rec = take(static_cast<long long>(C) * F);
  p.off_kl = take(static_cast<long long>(C) * F);
  p.off_bad = take(static_cast<long long>(C) * F);
  if (off * 4 > INT_MAX) return false;
  p.smem_bytes = static_cast<int>(off * 4);
  return true;
}

bool aligned16(const void* ptr) { return reinterpret_cast<size_t>(ptr) % 16 == 0; }

// A row-major float32 (rows x cols) matrix read in boxes of box_rows x box_cols.
bool encode_2d(CUtensorMap* map, const float* base, int cols, int rows, int box_cols,
               int box_rows) {
  return encode_tensor_map_2d(map, base, cols, rows, cols, box_cols, box_rows,
                              CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
}

}  // namespace

// elbo.h: the driver's tensor-map encoder.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() noexcept {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

bool encode_tensor_map_2d(CUtensorMap* map, const float* base, int cols, int rows, int ld,
                          int box_cols, int box_rows, CUtensorMapSwizzle swizzle,
                          CUtensorMapL2promotion promotion) noexcept {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 4};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t step[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base), dims,
                strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

ElboStatus elbo_fast_plan(FastParams& p, int device, int cluster, bool one_wave,
                          cudaError_t* cuda_err) noexcept {
  *cuda_err = cudaSuccess;
  ClusterDevice dev;
  cudaError_t e = cluster_device(device, &dev);
  if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
  if (dev.major < 9) return kElboBadArch;
  const bool ptrs = aligned16(p.x) && aligned16(p.eps) && aligned16(p.w1) && aligned16(p.b1) &&
                    aligned16(p.wmu) && aligned16(p.wlv) && aligned16(p.wd1) && aligned16(p.bd1) && aligned16(p.wd2);
  if (p.D % 4 != 0 || p.H % 4 != 0 || p.L % 4 != 0 || !ptrs) return kElboNotAligned;
  const int nclu = cdiv(p.B, kFastRows);
  static const int kAuto[] = {16, 8};
  const int forced[] = {cluster};
  const int* cands = cluster > 0 ? forced : kAuto;
  const int ncands = cluster > 0 ? 1 : 2;
  bool any_aligned = false, any_smem = false;
  for (int ci = 0; ci < ncands; ++ci) {
    const int C = cands[ci];
    if (p.H % (4 * C) != 0) continue;
    any_aligned = true;
    // Tensor-map boxes hold at most 256 elements per dimension.
    if (!fast_layout(p, C) || p.smem_bytes > dev.smem_optin || p.ldk > 256 || p.L > 256 ||
        p.hs > 256 || p.lds_d > 256)
      continue;
    any_smem = true;
    int active = 0;
    e = cluster_fit(reinterpret_cast<const void*>(elbo_fast_kernel), device, C, kFastThreads,
                    p.smem_bytes, &active);
    if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
    if (active == 0 || (one_wave && nclu > active)) continue;
    if (static_cast<long long>(nclu) * C > INT_MAX) continue;
    p.R = cdiv(p.B, nclu);
    if (p.x != nullptr &&  // pointers given (a launch, not a plan query): the tensor maps
        !(encode_2d(&p.tm_x, p.x, p.D, p.B, p.ldk, kFastRows) &&
          encode_2d(&p.tm_w1, p.w1, p.D, p.H, p.ldk, p.w1_box) &&
          encode_2d(&p.tm_xd, p.x, p.D, p.B, p.lds_d, kFastRows) &&
          encode_2d(&p.tm_eps, p.eps, p.L, p.B, p.lds_l, kFastRows) &&
          encode_2d(&p.tm_wmu, p.wmu, p.H, p.L, p.hs, p.L) &&
          encode_2d(&p.tm_wlv, p.wlv, p.H, p.L, p.hs, p.L) &&
          encode_2d(&p.tm_wd1, p.wd1, p.L, p.H, p.L, p.hs) &&
          (!p.local_d || encode_2d(&p.tm_wd1f, p.wd1, p.L, p.H, p.ldw, p.wd1f_box))))
      return kElboNotAligned;
    return kElboOk;
  }
  return !any_aligned ? kElboNotAligned : !any_smem ? kElboTooLarge : kElboNoCluster;
}

cudaError_t elbo_fast_launch(const FastParams& p, cudaStream_t stream) noexcept {
  void* args[] = {const_cast<FastParams*>(&p)};
  return cluster_launch(reinterpret_cast<const void*>(elbo_fast_kernel), cdiv(p.B, p.R) * p.C,
                        p.C, kFastThreads, p.smem_bytes, args, stream, p.pdl != 0);
}

}  // namespace fastelbo
