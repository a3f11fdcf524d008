// The fast cluster path: the whole forward after the noise draw in ONE launch, for dims that
// are multiples of 4 (float4 rows) and H a multiple of 4 * C. Role: the lowest latency at small
// batches (B <= kFastRows * co-resident clusters: 140 on an H200); elbo.cu's cluster kernel is
// the general path for every other shape.
//
// Why a second kernel (benchmarks/cuda_trace.cu, H200, B=128): elbo.cu's kernel spends 56K
// cycles, of which 26K in two 2x2-tile FFMA loops that are shared-memory-bound (4 LDS.128 per
// 16 FMA), 7K issuing the staging copies of 165 KB per block (x tile + weight slices: 18.6 MB
// of L2 -> SM traffic per forward, ~5.4 TB/s), ~10K in small phases waiting on global loads
// (biases, eps, x) and 4-byte DSMEM stores. Here:
//   * the encoder is split over the input dimension: block k owns ~D/4C float4 columns of x and
//     of w1 and computes PARTIAL sums for all H hidden units of its <= 20 rows; the cluster then
//     reduces them through DSMEM (each block pulls its H/C columns from every block). x is read
//     once per cluster (not once per block): ~12 MB of L2 traffic per forward instead of 18.6.
//   * every GEMM uses 5-row x 4/7-column register tiles laid out so each LDS.128 is one
//     conflict-free wavefront (rows rt + 4i, columns ct + 64j / ct + 8j; row strides with an odd
//     number of float4): ~10 FFMA per shared-memory wavefront instead of ~2.
//   * everything a phase reads (biases, eps, x for BCE) is staged with cp.async up front, in
//     four commit groups in the order the layers need them; DSMEM traffic moves in float4.
//
// Phases (S = cluster barrier; every buffer written remotely is not read or rewritten by its
// owner until the barrier after the last remote access):
//   G0 x/w1 slices landed (own copies), __syncthreads
//   L1  partial h (20 x H) over this block's x columns -> p1                      S1
//   RS1 h for this block's H/C columns = relu(b1 + sum_q p1_q) (pulled, float4) -> hk
//   L2  partial (mu | logvar) (20 x 2L) over those H/C columns -> p2              S2
//   RS2 mu, logvar for this block's latent indices = bias + sum_q p2_q (pulled);
//       z = reparameterised -> pushed into every block's zs; KL partial -> rank 0  S3
//   L3  d for this block's H/C columns = relu(z wd1^T + bd1) -> pushed (float4) into every
//       block's ds (ds aliases p1, whose last remote reader finished before S2)     S4
//   L4  logits for this block's D/C columns (warps split H, reduced in smem), BCE against x,
//       per-row sums and the bad-x flag -> rank 0                                    S5
//   rank 0 writes elbo, recon, kl.
// Numerics as elbo.cu and PyTorch op by op (fp32 FMA dot products, no TF32, no fast math);
// only the order of the dot products' additions differs from cuBLAS, as it does there.
#include "elbo.h"
#include "cluster.cuh"
#include "elbo_math.cuh"

#include <cooperative_groups.h>

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

__global__ void __launch_bounds__(kFastThreads, 1)
    elbo_fast_kernel(const __grid_constant__ FastParams p) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  float* xk = sm + p.off_xk;     // 20 x ldk: this block's x columns (float4 quads qa..qb)
  float* w1k = sm + p.off_w1k;   // H x ldk: the same columns of w1
  float* b1k = sm + p.off_b1;    // hs
  float* p1 = sm + p.off_p1;     // 20 x ldp: partial h; later ds (20 x ldd): all of d
  float* hk = sm + p.off_hk;     // 20 x hs: h for this block's hidden columns
  float* wl = sm + p.off_wl;     // 2L x hs: wmu | wlv, this block's hidden columns
  float* p2 = sm + p.off_p2;     // 20 x 2L: partial mu | logvar
  float* bl = sm + p.off_bl;     // 2 x ns_l: bmu, blv of this block's latent indices
  float* epk = sm + p.off_eps;   // 20 x ns_l
  float* ml = sm + p.off_ml;     // 20 x 2 ns_l: mu, logvar of this block's latent indices
  float* zs = sm + p.off_zs;     // 20 x L: all of z (pushed by every block)
  float* wd1s = sm + p.off_wd1;  // hs x L
  float* bd1k = sm + p.off_bd1;  // hs
  float* wd2s = sm + p.off_wd2;  // ns_d x ldd
  float* bd2k = sm + p.off_bd2;  // ns_d
  float* xd = sm + p.off_xd;     // 20 x ns_d: x at this block's output columns
  float* bce = sm + p.off_bce;   // 20 x ns_d: BCE terms
  float* pull = sm + p.off_pull; // scratch over w1k once L1 is done: pulled partials, L4 sums
  float* rec_part = sm + p.off_rec;  // C x 20 (rank 0): BCE row sums per block
  float* kl_part = sm + p.off_kl;    // C x 20 (rank 0): KL row sums per block
  float* bad_part = sm + p.off_bad;  // C x 20 (rank 0): 1 where a block saw bad x
  float* ds = p1;

  cg::cluster_group cluster = cg::this_cluster();
  const int C = p.C, R = p.R, B = p.B, D = p.D, H = p.H, L = p.L;
  const int k = static_cast<int>(cluster.block_rank());
  const int row0 = static_cast<int>(blockIdx.x / C) * R;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int ldk = p.ldk, ldp = p.ldp, ldd = p.ldd, hs = p.hs, ns_l = p.ns_l, ns_d = p.ns_d;
  const int nq = D / 4, qa = k * nq / C, nqk = (k + 1) * nq / C - qa;
  const int h0 = k * hs;
  const int j0 = k * ns_l, lcnt = max(0, min(ns_l, L - j0));
  const int n0d = k * ns_d, ncd = max(0, min(ns_d, D - n0d));
  auto grow = [&](int r) { return static_cast<size_t>(min(row0 + r, B - 1)); };
  FE_TRACE(0);

  // Staging, one commit group per phase that needs it (groups committed even when empty).
  for (int i = tid; i < kFastRows * nqk; i += kFastThreads) {
    const int r = i / nqk, q = i - r * nqk;
    cp_async16(xk + r * ldk + 4 * q, p.x + grow(r) * D + 4 * (qa + q));
  }
  for (int i = tid; i < H * nqk; i += kFastThreads) {
    const int n = i / nqk, q = i - n * nqk;
    cp_async16(w1k + n * ldk + 4 * q, p.w1 + static_cast<size_t>(n) * D + 4 * (qa + q));
  }
  for (int i = tid; i < hs / 4; i += kFastThreads) cp_async16(b1k + 4 * i, p.b1 + h0 + 4 * i);
  cp_async_commit();
  const int g4 = hs / 4;
  for (int i = tid; i < 2 * L * g4; i += kFastThreads) {
    const int c = i / g4, q = i - c * g4;
    const float* src = c < L ? p.wmu + static_cast<size_t>(c) * H : p.wlv + static_cast<size_t>(c - L) * H;
    cp_async16(wl + c * hs + 4 * q, src + h0 + 4 * q);
  }
  for (int i = tid; i < lcnt; i += kFastThreads) {
    cp_async4(bl + i, p.bmu + j0 + i);
    cp_async4(bl + ns_l + i, p.blv + j0 + i);
  }
  for (int i = tid; i < kFastRows * lcnt; i += kFastThreads) {
    const int r = i / lcnt, j = i - r * lcnt;
    cp_async4(epk + r * ns_l + j, p.eps + grow(r) * L + j0 + j);
  }
  cp_async_commit();
  const int l4 = L / 4;
  for (int i = tid; i < hs * l4; i += kFastThreads) {
    const int c = i / l4, q = i - c * l4;
    cp_async16(wd1s + c * L + 4 * q, p.wd1 + static_cast<size_t>(h0 + c) * L + 4 * q);
  }
  for (int i = tid; i < hs / 4; i += kFastThreads) cp_async16(bd1k + 4 * i, p.bd1 + h0 + 4 * i);
  cp_async_commit();
  const int hq = H / 4;
  for (int i = tid; i < ncd * hq; i += kFastThreads) {
    const int c = i / hq, q = i - c * hq;
    cp_async16(wd2s + c * ldd + 4 * q, p.wd2 + static_cast<size_t>(n0d + c) * H + 4 * q);
  }
  for (int i = tid; i < ncd; i += kFastThreads) cp_async4(bd2k + i, p.bd2 + n0d + i);
  for (int i = tid; i < kFastRows * ncd; i += kFastThreads) {
    const int r = i / ncd, c = i - r * ncd;
    cp_async4(xd + r * ns_d + c, p.x + grow(r) * D + n0d + c);
  }
  cp_async_commit();
  FE_TRACE(1);
  cp_async_wait<3>();
  __syncthreads();
  FE_TRACE(2);

  // L1: partial h over this block's x columns, 5 x 4 register tiles.
  {
    const int rt = tid % kRowLanes, ct = tid / kRowLanes;
    for (int n0 = 0; n0 < H; n0 += kL1Pass) {
      float acc[kRowsPerThread][kL1Cols];
      const float* a[kRowsPerThread];
      const float* w[kL1Cols];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        a[i] = xk + (rt + kRowLanes * i) * ldk;
#pragma unroll
        for (int j = 0; j < kL1Cols; ++j) acc[i][j] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kL1Cols; ++j) w[j] = w1k + min(n0 + ct + kL1ColLanes * j, H - 1) * ldk;
#pragma unroll 2
      for (int q = 0; q < nqk; ++q) {
        float4 av[kRowsPerThread], wv[kL1Cols];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) av[i] = ld4(a[i] + 4 * q);
#pragma unroll
        for (int j = 0; j < kL1Cols; ++j) wv[j] = ld4(w[j] + 4 * q);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
          for (int j = 0; j < kL1Cols; ++j) acc[i][j] = dot4(av[i], wv[j], acc[i][j]);
      }
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
  cp_async_wait<2>();  // G1 (latent weights, biases, eps) too: L2 reads wl before S2
  cluster.sync();      // S1
  FE_TRACE(4);

  // RS1: pull this block's hidden columns of every block's partials, then sum in rank order.
  for (int i = tid; i < C * kFastRows * g4; i += kFastThreads) {
    const int q = i / (kFastRows * g4), e = i - q * (kFastRows * g4);
    const int r = e / g4, c = 4 * (e - r * g4);
    st4(pull + (q * kFastRows + r) * hs + c, ld4(cluster.map_shared_rank(p1, q) + r * ldp + h0 + c));
  }
  __syncthreads();
  for (int i = tid; i < kFastRows * hs; i += kFastThreads) {
    const int r = i / hs, c = i - r * hs;
    float s = 0.0f;
    for (int q = 0; q < C; ++q) s += pull[(q * kFastRows + r) * hs + c];
    hk[r * hs + c] = relu(s + b1k[c]);
  }
  __syncthreads();
  FE_TRACE(5);

  // L2: partial mu | logvar over this block's hidden columns.
  for (int o = tid; o < kFastRows * 2 * L; o += kFastThreads) {
    const int r = o / (2 * L), c = o - r * (2 * L);
    float acc = 0.0f;
    for (int kk = 0; kk < hs; kk += 4) acc = dot4(ld4(hk + r * hs + kk), ld4(wl + c * hs + kk), acc);
    p2[r * 2 * L + c] = acc;
  }
  FE_TRACE(6);
  cluster.sync();  // S2
  FE_TRACE(7);

  // RS2: this block's latent indices, summed over blocks; z to every block, KL to rank 0.
  const int m2 = 2 * ns_l;
  for (int i = tid; i < C * kFastRows * 2 * lcnt; i += kFastThreads) {
    const int q = i / (kFastRows * 2 * lcnt), e = i - q * (kFastRows * 2 * lcnt);
    const int r = e / (2 * lcnt), m = e - r * (2 * lcnt);
    const int col = m < lcnt ? j0 + m : L + j0 + (m - lcnt);
    pull[(q * kFastRows + r) * m2 + m] = cluster.map_shared_rank(p2, q)[r * 2 * L + col];
  }
  __syncthreads();
  for (int i = tid; i < kFastRows * lcnt; i += kFastThreads) {
    const int r = i / lcnt, j = i - r * lcnt;
    float mu = 0.0f, lv = 0.0f;
    for (int q = 0; q < C; ++q) {
      mu += pull[(q * kFastRows + r) * m2 + j];
      lv += pull[(q * kFastRows + r) * m2 + lcnt + j];
    }
    mu += bl[j];
    lv += bl[ns_l + j];
    ml[r * m2 + j] = mu;
    ml[r * m2 + ns_l + j] = lv;
    const float z = reparam(mu, lv, epk[r * ns_l + j]);
    for (int q = 0; q < C; ++q) cluster.map_shared_rank(zs, q)[r * L + j0 + j] = z;
  }
  __syncthreads();
  for (int r = tid; r < kFastRows; r += kFastThreads) {
    float s = 0.0f;
    for (int j = 0; j < lcnt; ++j) s += kl_term(ml[r * m2 + j], ml[r * m2 + ns_l + j]);
    cluster.map_shared_rank(kl_part, 0)[k * kFastRows + r] = s;
  }
  FE_TRACE(8);
  cp_async_wait<1>();
  cluster.sync();  // S3
  FE_TRACE(9);

  // L3: d for this block's hidden columns, four per thread, pushed as float4 to every block.
  for (int i = tid; i < kFastRows * g4; i += kFastThreads) {
    const int r = i / g4, c = 4 * (i - r * g4);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int kk = 0; kk < L; kk += 4) {
      const float4 zv = ld4(zs + r * L + kk);
#pragma unroll
      for (int m = 0; m < 4; ++m) acc[m] = dot4(zv, ld4(wd1s + (c + m) * L + kk), acc[m]);
    }
    const float4 d = make_float4(relu(acc[0] + bd1k[c]), relu(acc[1] + bd1k[c + 1]),
                                 relu(acc[2] + bd1k[c + 2]), relu(acc[3] + bd1k[c + 3]));
    for (int q = 0; q < C; ++q) st4(cluster.map_shared_rank(ds, q) + r * ldd + h0 + c, d);
  }
  FE_TRACE(10);
  cp_async_wait<0>();
  cluster.sync();  // S4
  FE_TRACE(11);

  // L4: logits for this block's output columns; warps split H, sums reduced through smem in
  // warp order; then BCE against x.
  {
    const int rt = lane % kRowLanes, ct = lane / kRowLanes;
    const int qw0 = warp * hq / kFastWarps, qw1 = (warp + 1) * hq / kFastWarps;
    float* red = pull + warp * kFastRows * kL4Pass;
    for (int n0 = 0; n0 < ncd; n0 += kL4Pass) {  // uniform over the block
      float acc[kRowsPerThread][kL4Cols];
      const float* a[kRowsPerThread];
      const float* w[kL4Cols];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        a[i] = ds + (rt + kRowLanes * i) * ldd;
#pragma unroll
        for (int j = 0; j < kL4Cols; ++j) acc[i][j] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kL4Cols; ++j) w[j] = wd2s + min(n0 + ct + kL4ColLanes * j, ncd - 1) * ldd;
#pragma unroll 2
      for (int q = qw0; q < qw1; ++q) {
        float4 av[kRowsPerThread], wv[kL4Cols];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) av[i] = ld4(a[i] + 4 * q);
#pragma unroll
        for (int j = 0; j < kL4Cols; ++j) wv[j] = ld4(w[j] + 4 * q);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
          for (int j = 0; j < kL4Cols; ++j) acc[i][j] = dot4(av[i], wv[j], acc[i][j]);
      }
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < kL4Cols; ++j)
          red[(rt + kRowLanes * i) * kL4Pass + ct + kL4ColLanes * j] = acc[i][j];
      __syncthreads();
      const int ncp = min(kL4Pass, ncd - n0);
      for (int o = tid; o < kFastRows * ncp; o += kFastThreads) {
        const int r = o / ncp, c = o - r * ncp;
        float s = 0.0f;
#pragma unroll
        for (int w8 = 0; w8 < kFastWarps; ++w8) s += pull[(w8 * kFastRows + r) * kL4Pass + c];
        bool bad = false;  // the row flag is taken from xd below
        bce[r * ns_d + n0 + c] = bce_term(s + bd2k[n0 + c], xd[r * ns_d + n0 + c], &bad);
      }
      __syncthreads();
    }
  }
  FE_TRACE(12);
  // Per-row BCE sums (one warp per row, fixed order: deterministic) and bad-x flags -> rank 0.
  for (int r = warp; r < kFastRows; r += kFastWarps) {
    float s = 0.0f;
    bool bad = false;
    for (int c = lane; c < ncd; c += 32) {
      s += bce[r * ns_d + c];
      const float xv = xd[r * ns_d + c];
      bad |= !(xv >= 0.0f && xv <= 1.0f);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) {
      cluster.map_shared_rank(rec_part, 0)[k * kFastRows + r] = s;
      cluster.map_shared_rank(bad_part, 0)[k * kFastRows + r] = bad ? 1.0f : 0.0f;
    }
  }
  FE_TRACE(13);
  cluster.sync();  // S5
  FE_TRACE(14);

  if (k == 0) {
    for (int r = tid; r < R; r += kFastThreads) {
      const int gr = row0 + r;
      if (gr >= B) break;
      float rs = 0.0f, ks = 0.0f;
      bool bad = false;
      for (int q = 0; q < C; ++q) {
        rs += rec_part[q * kFastRows + r];
        ks += kl_part[q * kFastRows + r];
        bad |= bad_part[q * kFastRows + r] != 0.0f;
      }
      const float kl = -0.5f * ks;
      const float nan = __int_as_float(0x7fc00000);
      p.recon[gr] = bad ? nan : rs;
      p.kl[gr] = bad ? nan : kl;
      p.elbo[gr] = bad ? nan : -(rs + kl);
    }
  }
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
  p.ldk = odd_quads(p.qmax);
  p.ldp = (H + 31) / 32 * 32 + 8;  // tile stores rt * ldp + ct: rows 8 banks apart
  p.ldd = odd_quads(H / 4);
  long long off = 0;
  auto take = [&](long long n) {
    const long long at = off;
    off += (n + 3) & ~3LL;  // every buffer 16-byte aligned
    return static_cast<int>(at);
  };
  const long long scratch = std::max<long long>(
      {static_cast<long long>(H) * p.ldk, static_cast<long long>(kFastWarps) * F * kL4Pass,
       static_cast<long long>(C) * F * p.hs, static_cast<long long>(C) * F * 2 * p.ns_l});
  p.off_xk = take(static_cast<long long>(F) * p.ldk);
  p.off_w1k = take(scratch);
  p.off_pull = p.off_w1k;
  p.off_b1 = take(p.hs);
  p.off_p1 = take(static_cast<long long>(F) * std::max(p.ldp, p.ldd));
  p.off_hk = take(static_cast<long long>(F) * p.hs);
  p.off_wl = take(2LL * L * p.hs);
  p.off_p2 = take(2LL * F * L);
  p.off_bl = take(2LL * p.ns_l);
  p.off_eps = take(static_cast<long long>(F) * p.ns_l);
  p.off_ml = take(2LL * F * p.ns_l);
  p.off_zs = take(static_cast<long long>(F) * L);
  p.off_wd1 = take(static_cast<long long>(p.hs) * L);
  p.off_bd1 = take(p.hs);
  p.off_wd2 = take(static_cast<long long>(p.ns_d) * p.ldd);
  p.off_bd2 = take(p.ns_d);
  p.off_xd = take(static_cast<long long>(F) * p.ns_d);
  p.off_bce = take(static_cast<long long>(F) * p.ns_d);
  p.off_rec = take(static_cast<long long>(C) * F);
  p.off_kl = take(static_cast<long long>(C) * F);
  p.off_bad = take(static_cast<long long>(C) * F);
  if (off * 4 > INT_MAX) return false;
  p.smem_bytes = static_cast<int>(off * 4);
  return true;
}

bool aligned16(const void* ptr) { return reinterpret_cast<size_t>(ptr) % 16 == 0; }

}  // namespace

ElboStatus elbo_fast_plan(FastParams& p, int device, int cluster, bool one_wave,
                          cudaError_t* cuda_err) noexcept {
  *cuda_err = cudaSuccess;
  ClusterDevice dev;
  cudaError_t e = cluster_device(device, &dev);
  if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
  if (dev.major < 9) return kElboBadArch;
  const bool ptrs = aligned16(p.x) && aligned16(p.w1) && aligned16(p.b1) && aligned16(p.wmu) &&
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
    if (!fast_layout(p, C) || p.smem_bytes > dev.smem_optin) continue;
    any_smem = true;
    int active = 0;
    e = cluster_fit(reinterpret_cast<const void*>(elbo_fast_kernel), device, C, kFastThreads,
                    p.smem_bytes, &active);
    if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
    if (active == 0 || (one_wave && nclu > active)) continue;
    if (static_cast<long long>(nclu) * C > INT_MAX) continue;
    p.R = cdiv(p.B, nclu);
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
