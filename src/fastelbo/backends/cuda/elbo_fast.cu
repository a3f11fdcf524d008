// The fast cluster path: the whole forward after the noise draw in ONE launch, for dims that
// are multiples of 4 (float4 rows) and H a multiple of 4 * C. Role: the lowest latency for
// 80 < B <= 384 (binding.cpp; one wave of 7 clusters of 16 blocks holds 140 rows on an H200);
// elbo.cu's cluster kernel is the general path for small B and every other shape.
//
// Why a second kernel (benchmarks/cuda_trace.cu, H200, B=128; benchmarks/NOTES.md runs 17-21):
// elbo.cu's kernel spends 56K cycles, of which 26K in two 2x2-tile FFMA loops that are
// shared-memory-bound (4 LDS.128 per 16 FMA), 7K issuing the cp.async staging of 165 KB per
// block (x tile + weight slices), ~10K in small phases waiting on global loads (biases, eps, x)
// and 4-byte DSMEM stores. Here (~43K cycles, 23.7 us per launch at B=128):
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
// Phases (S = cluster barrier; a buffer another block reads is not rewritten by its owner, and
// the owner does not exit, before the barrier after the last remote read):
//   L1  partial h (20 x H) over this block's x columns -> p1                      S1
//   RS1 h for this block's H/C columns = relu(b1 + sum_q p1_q), pulled in float4 -> hk
//   L2  partial (mu | logvar) (20 x 2L) over those H/C columns -> p2              S2
//   RS2 mu, logvar for this block's latent indices = bias + sum_q p2_q (pulled);
//       z -> zl (own), KL partial -> rank 0                                        S3
//   L3  all of z pulled from its owners; d for this block's H/C columns -> dk      S4
//   L4  all of d pulled into ds (over p1, last read remotely before S2); logits for this
//       block's D/C columns (warps split H, reduced in smem), BCE against x, per-row sums and
//       the bad-x flag -> rank 0                                                   S5
//   rank 0 writes elbo, recon, kl.
// Numerics as elbo.cu and PyTorch op by op (fp32 FMA dot products, no TF32, no fast math);
// only the order of the dot products' additions differs from cuBLAS, as it does there.
#include "elbo.h"
#include "cluster.cuh"
#include "elbo_math.cuh"

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

// dst(i, src(i)) for i < n, kBatch loads in flight per thread before any store (the loads are
// DSMEM reads of other blocks, hundreds of cycles each).
template <int kBatch, class T, class Src, class Dst>
__device__ __forceinline__ void gather(int n, Src src, Dst dst) {
  for (int base = static_cast<int>(threadIdx.x); base < n; base += kBatch * kFastThreads) {
    T v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (base + u * kFastThreads < n) v[u] = src(base + u * kFastThreads);
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (base + u * kFastThreads < n) dst(base + u * kFastThreads, v[u]);
  }
}

__global__ void __launch_bounds__(kFastThreads, 1)
    elbo_fast_kernel(const __grid_constant__ FastParams p) {
  extern __shared__ __align__(128) float4 smem4[];
  __shared__ alignas(8) unsigned long long bar[4];  // one mbarrier per staging group
  float* sm = reinterpret_cast<float*>(smem4);
  float* xk = sm + p.off_xk;     // 20 x ldk: this block's x columns (float4 quads qa..)
  float* w1k = sm + p.off_w1k;   // H x ldk: the same columns of w1
  float* b1k = sm + p.off_b1;    // hs
  float* p1 = sm + p.off_p1;     // 20 x ldp: partial h; later ds (20 x ldd): all of d
  float* hk = sm + p.off_hk;     // 20 x ldq: h for this block's hidden columns
  float* wmus = sm + p.off_wmu;  // L x hs: wmu at this block's hidden columns
  float* wlvs = sm + p.off_wlv;  // L x hs: wlv, same columns
  float* p2 = sm + p.off_p2;     // 20 x 2L: partial mu | logvar
  float* bl = sm + p.off_bl;     // 2 x lds_l: bmu, blv around this block's latent indices
  float* epk = sm + p.off_eps;   // 20 x lds_l: eps, same columns
  float* ml = sm + p.off_ml;     // 20 x 2 ns_l: mu, logvar of this block's latent indices
  float* zs = sm + p.off_zs;     // 20 x L: all of z (pulled from every block)
  float* zl = sm + p.off_zl;     // 20 x ns_l: z for this block's latent indices
  float* wd1s = sm + p.off_wd1;  // hs x L
  float* bd1k = sm + p.off_bd1;  // hs
  float* dk = sm + p.off_dk;     // 20 x hs: d for this block's hidden columns (pulled by all)
  float* wd2s = sm + p.off_wd2;  // ns_d x ldd
  float* bd2k = sm + p.off_bd2;  // lds_d: bd2 around this block's output columns
  float* xd = sm + p.off_xd;     // 20 x lds_d: x, same columns
  float* pull = sm + p.off_pull; // scratch over w1k once L1 is done: pulled partials, L4 sums
  float* rec_part = sm + p.off_rec;  // C x 20 (rank 0): BCE row sums per block
  float* kl_part = sm + p.off_kl;    // C x 20 (rank 0): KL row sums per block
  float* bad_part = sm + p.off_bad;  // C x 20 (rank 0): 1 where a block saw bad x
  float* ds = p1;

  cg::cluster_group cluster = cg::this_cluster();
  const int C = p.C, R = p.R, D = p.D, H = p.H, L = p.L;
  const int k = static_cast<int>(cluster.block_rank());
  const int row0 = static_cast<int>(blockIdx.x / C) * R;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int ldk = p.ldk, ldp = p.ldp, ldd = p.ldd, ldq = p.ldq, hs = p.hs, ns_l = p.ns_l;
  const int lds_l = p.lds_l, lds_d = p.lds_d;
  const int nq = D / 4, qa = k * nq / C, nqk = (k + 1) * nq / C - qa;
  const int h0 = k * hs, g4 = hs / 4, hq = H / 4;
  const int j0 = k * ns_l, lcnt = max(0, min(ns_l, L - j0));
  const int n0d = k * p.ns_d, ncd = max(0, min(p.ns_d, D - n0d));
  // 16-byte aligned windows around this block's latent indices and output columns.
  const int sl0 = floor4(j0), nsl = lcnt > 0 ? round4(j0 + lcnt) - sl0 : 0, shl = j0 - sl0;
  const int sd0 = floor4(n0d), nsd = ncd > 0 ? round4(n0d + ncd) - sd0 : 0, shd = n0d - sd0;
  FE_TRACE(0);

  // Staging: four groups of TMA copies, one mbarrier each, in the order the layers need them.
  // Thread 0 issues the tensor-map tiles (x and w1 slices first: L1 waits for them); the rows
  // of wd2 (padded rows, conflict-free for L4) are row copies from all threads, issued last:
  // the TMA unit takes ~20 cycles per copy (cuda_trace).
  const int nbox = cdiv(H, p.w1_box);
  if (tid == 0) {
#pragma unroll
    for (int g = 0; g < 4; ++g) mbar_init(&bar[g], 1);
    mbar_fence_init();
    mbar_arrive_expect(&bar[0], 4u * ldk * (kFastRows + nbox * p.w1_box) + 4u * hs);
    mbar_arrive_expect(&bar[1], 4u * (2 * L * hs + 2 * nsl + kFastRows * lds_l));
    mbar_arrive_expect(&bar[2], 4u * (hs * L + hs));
    mbar_arrive_expect(&bar[3], 4u * (ncd * H + nsd + kFastRows * lds_d));
    tma_load_2d(xk, &p.tm_x, 4 * qa, row0, &bar[0]);
    for (int b = 0; b < nbox; ++b)
      tma_load_2d(w1k + b * p.w1_box * ldk, &p.tm_w1, 4 * qa, b * p.w1_box, &bar[0]);
    bulk_copy(b1k, p.b1 + h0, 4u * hs, &bar[0]);
    tma_load_2d(wmus, &p.tm_wmu, h0, 0, &bar[1]);
    tma_load_2d(wlvs, &p.tm_wlv, h0, 0, &bar[1]);
    tma_load_2d(epk, &p.tm_eps, sl0, row0, &bar[1]);
    if (nsl > 0) {
      bulk_copy(bl, p.bmu + sl0, 4u * nsl, &bar[1]);
      bulk_copy(bl + lds_l, p.blv + sl0, 4u * nsl, &bar[1]);
    }
    tma_load_2d(wd1s, &p.tm_wd1, 0, h0, &bar[2]);
    bulk_copy(bd1k, p.bd1 + h0, 4u * hs, &bar[2]);
    tma_load_2d(xd, &p.tm_xd, sd0, row0, &bar[3]);
    if (nsd > 0) bulk_copy(bd2k, p.bd2 + sd0, 4u * nsd, &bar[3]);
  }
  __syncthreads();  // barriers initialised (and the tiles queued) before the row copies
  for (int i = tid; i < ncd; i += kFastThreads)
    bulk_copy(wd2s + i * ldd, p.wd2 + static_cast<size_t>(n0d + i) * H, 4u * H, &bar[3]);
  FE_TRACE(1);
  mbar_wait(&bar[0], 0);
  FE_TRACE(2);

  // L1: partial h over this block's x columns, 5 x 4 register tiles.
  {
    const int rt = tid % kRowLanes, ct = tid / kRowLanes;
    for (int n0 = 0; n0 < H; n0 += kL1Pass) {
      float acc[kRowsPerThread][kL1Cols] = {};
      const float* a[kRowsPerThread];
      const float* w[kL1Cols];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) a[i] = xk + (rt + kRowLanes * i) * ldk;
#pragma unroll
      for (int j = 0; j < kL1Cols; ++j) w[j] = w1k + min(n0 + ct + kL1ColLanes * j, H - 1) * ldk;
      tile_dot(a, w, 0, nqk, acc);
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < kL1Cols; ++j) {
          const int n = n0 + ct + kL1ColLanes * j;
          if (n < H) p1[(rt + kRowLanes * i) * ldp + n] = acc[i][j];
        }
    }
  }
  FE_TRACE(3);
  cluster.sync();  // S1
  FE_TRACE(4);

  // RS1: pull this block's hidden columns of every block's partials, then sum in rank order.
  gather<8, float4>(C * kFastRows * g4,
      [&](int i) {
        const int q = i / (kFastRows * g4), e = i - q * (kFastRows * g4), r = e / g4;
        return ld_cluster4(cluster_addr(p1 + r * ldp + h0 + 4 * (e - r * g4), q));
      },
      [&](int i, float4 v) { st4(pull + 4 * i, v); });  // pull: C x 20 x hs
  __syncthreads();
  for (int i = tid; i < kFastRows * hs; i += kFastThreads) {
    const int r = i / hs, c = i - r * hs;
    float s = 0.0f;
#pragma unroll 16
    for (int q = 0; q < C; ++q) s += pull[(q * kFastRows + r) * hs + c];
    hk[r * ldq + c] = relu(s + b1k[c]);
  }
  mbar_wait(&bar[1], 0);
  __syncthreads();
  FE_TRACE(5);

  // L2: partial mu | logvar over this block's hidden columns, 5 x 1 register tiles.
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
      if (c0 + ct < 2 * L)
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) p2[(rt + kRowLanes * i) * 2 * L + c0 + ct] = acc[i][0];
    }
  }
  FE_TRACE(6);
  cluster.sync();  // S2
  FE_TRACE(7);

  // RS2: this block's latent indices, summed over blocks: z kept for the others to pull, KL
  // to rank 0.
  const int m2 = 2 * ns_l;
  {
    const int per = kFastRows * 2 * lcnt;  // pulled values per block
    for (int base = tid; base < C * per; base += 8 * kFastThreads) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = base + u * kFastThreads;
        if (i < C * per) {
          const int q = i / per, e = i - q * per, r = e / (2 * lcnt), m = e - r * (2 * lcnt);
          const int col = m < lcnt ? j0 + m : L + j0 + (m - lcnt);
          v[u] = ld_cluster(cluster_addr(p2 + r * 2 * L + col, q));
        }
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = base + u * kFastThreads;
        if (i < C * per) {
          const int q = i / per, e = i - q * per, r = e / (2 * lcnt), m = e - r * (2 * lcnt);
          pull[(q * kFastRows + r) * m2 + m] = v[u];
        }
      }
    }
  }
  __syncthreads();
  FE_TRACE(8);
  for (int i = tid; i < kFastRows * lcnt; i += kFastThreads) {
    const int r = i / lcnt, j = i - r * lcnt;
    float mu = 0.0f, lv = 0.0f;
#pragma unroll 16
    for (int q = 0; q < C; ++q) {
      mu += pull[(q * kFastRows + r) * m2 + j];
      lv += pull[(q * kFastRows + r) * m2 + lcnt + j];
    }
    mu += bl[shl + j];
    lv += bl[lds_l + shl + j];
    ml[r * m2 + j] = mu;
    ml[r * m2 + ns_l + j] = lv;
    zl[r * ns_l + j] = reparam(mu, lv, epk[r * lds_l + shl + j]);
  }
  __syncthreads();
  for (int r = tid; r < kFastRows; r += kFastThreads) {
    float s = 0.0f;
    for (int j = 0; j < lcnt; ++j) s += kl_term(ml[r * m2 + j], ml[r * m2 + ns_l + j]);
    cluster.map_shared_rank(kl_part, 0)[k * kFastRows + r] = s;
  }
  FE_TRACE(9);
  cluster.sync();  // S3
  FE_TRACE(10);

  // All of z, pulled from its owners; then d for this block's hidden columns (four per
  // thread), kept for the others to pull.
  gather<8, float>(C * kFastRows * ns_l,
      [&](int i) {
        const int q = i / (kFastRows * ns_l), e = i - q * (kFastRows * ns_l);
        return q * ns_l + e % ns_l < L ? ld_cluster(cluster_addr(zl + e, q)) : 0.0f;
      },
      [&](int i, float v) {
        const int q = i / (kFastRows * ns_l), e = i - q * (kFastRows * ns_l);
        const int r = e / ns_l, j = q * ns_l + (e - r * ns_l);
        if (j < L) zs[r * L + j] = v;
      });
  mbar_wait(&bar[2], 0);
  __syncthreads();
  for (int i = tid; i < kFastRows * g4; i += kFastThreads) {
    const int r = i / g4, c = 4 * (i - r * g4);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int kk = 0; kk < L; kk += 4) {
      const float4 zv = ld4(zs + r * L + kk);
#pragma unroll
      for (int m = 0; m < 4; ++m) acc[m] = dot4(zv, ld4(wd1s + (c + m) * L + kk), acc[m]);
    }
    st4(dk + r * hs + c, make_float4(relu(acc[0] + bd1k[c]), relu(acc[1] + bd1k[c + 1]),
                                     relu(acc[2] + bd1k[c + 2]), relu(acc[3] + bd1k[c + 3])));
  }
  FE_TRACE(11);
  cluster.sync();  // S4
  FE_TRACE(12);

  // All of d into ds (ds aliases p1, whose last remote reader finished before S2).
  gather<8, float4>(C * kFastRows * g4,
      [&](int i) {
        const int q = i / (kFastRows * g4), e = i - q * (kFastRows * g4);
        return ld_cluster4(cluster_addr(dk + 4 * e, q));
      },
      [&](int i, float4 v) {
        const int q = i / (kFastRows * g4), e = i - q * (kFastRows * g4), r = e / g4;
        st4(ds + r * ldd + q * hs + 4 * (e - r * g4), v);
      });
  mbar_wait(&bar[3], 0);
  __syncthreads();
  FE_TRACE(13);

  // L4: logits for this block's output columns (warps split H; partial sums reduced through
  // smem in warp order), then BCE against x and the per-row sums: warp w owns rows w + 8m.
  constexpr int kRowsPerWarp = (kFastRows + kFastWarps - 1) / kFastWarps;
  float rsum[kRowsPerWarp] = {};
  bool rbad[kRowsPerWarp] = {};
  {
    const int rt = lane % kRowLanes, ct = lane / kRowLanes;
    const int qw0 = warp * hq / kFastWarps, qw1 = (warp + 1) * hq / kFastWarps;
    float* red = pull + warp * kFastRows * kL4Pass;
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
          red[(rt + kRowLanes * i) * kL4Pass + ct + kL4ColLanes * j] = acc[i][j];
      FE_TRACE(14);
      __syncthreads();
      const int ncp = min(kL4Pass, ncd - n0);
      // Every (row, column) term of this warp at once (independent exp/log chains).
      float term[kRowsPerWarp][2];
#pragma unroll
      for (int m = 0; m < kRowsPerWarp; ++m)
#pragma unroll
        for (int u = 0; u < 2; ++u) {  // kL4Pass <= 64: two columns per lane
          const int r = warp + kFastWarps * m, c = lane + 32 * u;
          term[m][u] = 0.0f;
          if (r < kFastRows && c < ncp) {
            float s = 0.0f;
#pragma unroll
            for (int w8 = 0; w8 < kFastWarps; ++w8) s += pull[(w8 * kFastRows + r) * kL4Pass + c];
            term[m][u] = bce_term(s + bd2k[shd + n0 + c], xd[r * lds_d + shd + n0 + c], &rbad[m]);
          }
        }
#pragma unroll
      for (int m = 0; m < kRowsPerWarp; ++m) rsum[m] += term[m][0] + term[m][1];
      __syncthreads();
    }
  }
#pragma unroll
  for (int m = 0; m < kRowsPerWarp; ++m) {
    const int r = warp + kFastWarps * m;
    if (r >= kFastRows) break;
    float s = rsum[m];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    const bool bad = __any_sync(0xffffffffu, rbad[m]);
    if (lane == 0) {
      cluster.map_shared_rank(rec_part, 0)[k * kFastRows + r] = s;
      cluster.map_shared_rank(bad_part, 0)[k * kFastRows + r] = bad ? 1.0f : 0.0f;
    }
  }
  FE_TRACE(15);
  cluster.sync();  // S5
  FE_TRACE(16);

  if (k == 0) write_rows(p, row0, R, C, kFastRows, rec_part, kl_part, bad_part);
  FE_TRACE(17);
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
  p.ldp = (H + 31) / 32 * 32 + 8;  // tile stores rt * ldp + ct: rows 8 banks apart
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
  const long long scratch = std::max<long long>(
      {static_cast<long long>(cdiv(H, p.w1_box)) * p.w1_box * p.ldk, static_cast<long long>(kFastWarps) * F * kL4Pass,
       static_cast<long long>(C) * F * p.hs, static_cast<long long>(C) * F * 2 * p.ns_l});
  p.off_xk = take(static_cast<long long>(F) * p.ldk);
  p.off_w1k = take(scratch);
  p.off_pull = p.off_w1k;
  p.off_b1 = take(p.hs);
  p.off_p1 = take(static_cast<long long>(F) * std::max(p.ldp, p.ldd));
  p.off_hk = take(static_cast<long long>(F) * p.ldq);
  p.off_wmu = take(static_cast<long long>(L) * p.hs);
  p.off_wlv = take(static_cast<long long>(L) * p.hs);
  p.off_p2 = take(2LL * F * L);
  p.off_bl = take(2LL * p.lds_l);
  p.off_eps = take(static_cast<long long>(F) * p.lds_l);
  p.off_ml = take(2LL * F * p.ns_l);
  p.off_zs = take(static_cast<long long>(F) * L);
  p.off_zl = take(static_cast<long long>(F) * p.ns_l);
  p.off_wd1 = take(static_cast<long long>(p.hs) * L);
  p.off_bd1 = take(p.hs);
  p.off_dk = take(static_cast<long long>(F) * p.hs);
  p.off_wd2 = take(static_cast<long long>(p.ns_d) * p.ldd);
  p.off_bd2 = take(p.lds_d);
  p.off_xd = take(static_cast<long long>(F) * p.lds_d);
  p.off_rec = take(static_cast<long long>(C) * F);
  p.off_kl = take(static_cast<long long>(C) * F);
  p.off_bad = take(static_cast<long long>(C) * F);
  if (off * 4 > INT_MAX) return false;
  p.smem_bytes = static_cast<int>(off * 4);
  return true;
}

bool aligned16(const void* ptr) { return reinterpret_cast<size_t>(ptr) % 16 == 0; }

// The driver's tensor-map encoder, through the runtime (no -lcuda at link time).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
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

// A row-major float32 (rows x cols) matrix read in boxes of box_rows x box_cols.
bool encode_2d(CUtensorMap* map, const float* base, int cols, int rows, int box_cols,
               int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 4};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t step[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base), dims,
                strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
         CUDA_SUCCESS;
}

}  // namespace

ElboStatus elbo_fast_plan(FastParams& p, int device, int cluster, bool one_wave,
                          cudaError_t* cuda_err) noexcept {
  *cuda_err = cudaSuccess;
  ClusterDevice dev;
  cudaError_t e = cluster_device(device, &dev);
  if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
  if (dev.major < 9) return kElboBadArch;
  const bool ptrs = aligned16(p.x) && aligned16(p.eps) && aligned16(p.w1) && aligned16(p.b1) && aligned16(p.wmu) &&
                    aligned16(p.wlv) && aligned16(p.wd1) && aligned16(p.bd1) && aligned16(p.wd2);
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
          encode_2d(&p.tm_wd1, p.wd1, p.L, p.H, p.L, p.hs)))
      return kElboNotAligned;
    return kElboOk;
  }
  return !any_aligned ? kElboNotAligned : !any_smem ? kElboTooLarge : kElboNoCluster;
}

cudaError_t elbo_fast_launch(const FastParams& p, cudaStream_t stream) noexcept {
  void* args[] = {const_cast<FastParams*>(&p)};
  return cluster_launch(reinterpret_cast<const void*>(elbo_fast_kernel), cdiv(p.B, p.R) * p.C,
                        p.C, kFastThreads, p.smem_bytes, args, stream);
}

}  // namespace fastelbo
