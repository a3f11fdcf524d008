// The fused backward's kernels (backward_fused.h says what each computes and which GEMM operand
// it writes). Every element is computed as backward.cu's kernels compute it (the shared
// elbo_math.cuh functions), every sum in a fixed order; what is new is where the values go: a
// row tile of 32 rows passes through shared memory in 32 x 32 tiles, so that the row-major
// result and its transpose are both written along rows (128-byte segments). No torch types;
// launches return cudaError_t.
#include <cstdint>

#include "backward_fused.h"
#include "cluster.cuh"
#include "elbo_math.cuh"

namespace fastelbo {
namespace {
namespace fused {  // own names: the export inlines every source into one translation unit

constexpr int kT = kFusedTile;
using Tile = float[kT][kT + 1];  // +1: a column of the tile hits 32 different banks

// Element i of a job's destination: v's TF32 halves (tf32_split_inf, as tc_split_t_kernel),
// or v itself where lo is nullptr.
__device__ __forceinline__ void put(float* hi, float* lo, size_t i, float v) {
  if (lo == nullptr) {
    hi[i] = v;
    return;
  }
  uint32_t h, l;
  tf32_split_inf(v, &h, &l);
  hi[i] = __uint_as_float(h);
  lo[i] = __uint_as_float(l);
}

// Tile tb (row-major over the source's 32 x 32 tiles) of job j, by the whole block.
__device__ void tile_job(const TileJob& j, int tb, Tile& tile) {
  const int tiles_c = cdiv(j.cols, kT);
  const int r0 = (tb / tiles_c) * kT, c0 = (tb % tiles_c) * kT;
  const int tx = static_cast<int>(threadIdx.x) & 31, ty = static_cast<int>(threadIdx.x) >> 5;
  for (int y = ty; y < kT; y += kWarps) {
    const int r = r0 + y, c = c0 + tx;
    const bool in = r < j.rows && c < j.cols;
    const float v = in ? __ldg(j.src + static_cast<size_t>(r) * j.lds + c) : 0.0f;
    if (!j.trans) {
      if (in) put(j.hi, j.lo, static_cast<size_t>(r) * j.ldt + c, v);
    } else {
      tile[y][tx] = v;
    }
  }
  if (!j.trans) return;  // the whole block
  __syncthreads();
  for (int y = ty; y < kT; y += kWarps) {  // destination row c0 + y, columns r0 + tx
    const int c = c0 + y, r = r0 + tx;
    if (c < j.cols && r < j.rows) put(j.hi, j.lo, static_cast<size_t>(c) * j.ldt + r, tile[tx][y]);
  }
}

// Side tile b (counted from the launch's first side block).
__device__ void side_tile(const TileJobs& s, int b, Tile& tile) {
  int t = 0;
  while (t + 1 < s.count && b >= s.first_block[t + 1]) ++t;
  tile_job(s.job[t], b - s.first_block[t], tile);
}

// Main block b of a row-tile kernel: rows [r0, r0 + 32), column tiles [ct0, ct1); `first`: the
// block of its row tile that writes the per-row outputs.
struct RowTile {
  int r0, ct0, ct1;
  bool first;
};
__device__ __forceinline__ RowTile row_tile(int b, int col_groups, int D) {
  const int rt = b / col_groups, cg = b - rt * col_groups, tiles = cdiv(D, kT);
  return {rt * kT, cg * tiles / col_groups, (cg + 1) * tiles / col_groups, cg == 0};
}

// prep_kernel's outputs (its row rule first, whole rows, a warp per row), then per column tile
// xc as it is and xc^T in TF32 halves.
__global__ void __launch_bounds__(kThreads) fused_prep_kernel(const __grid_constant__ FusedPrepParams p) {
  __shared__ Tile tile;
  __shared__ int bad_row[kT];
  const PrepParams& q = p.prep;
  const int b = static_cast<int>(blockIdx.x), main = cdiv(q.n, kT) * p.col_groups;
  if (b >= main) {
    side_tile(p.side, b - main, tile);
    return;
  }
  const RowTile rt = row_tile(b, p.col_groups, q.D);
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  for (int y = warp; y < kT; y += kWarps) {
    const int row = rt.r0 + y;
    bool bad = false;
    if (row < q.n)
      for (int c = lane; c < q.D; c += 32)
        bad |= outside_unit(__ldg(q.x + static_cast<size_t>(row) * q.D + c));
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) bad_row[y] = bad ? 1 : 0;
    if (lane == 0 && rt.first && row < q.n) {
      q.keep[row] = bad ? 0.0f : 1.0f;
      if (q.rec_out != nullptr) q.rec_out[row] = branch_grad(q.g_recon, q.g_elbo, row, bad);
      if (q.kl_out != nullptr) q.kl_out[row] = branch_grad(q.g_kl, q.g_elbo, row, bad);
    }
  }
  __syncthreads();
  for (int ct = rt.ct0; ct < rt.ct1; ++ct) {
    const int c0 = ct * kT;
    for (int y = warp; y < kT; y += kWarps) {
      const int r = rt.r0 + y, c = c0 + lane;
      float v = 0.0f;
      if (r < q.n && c < q.D) {
        const size_t i = static_cast<size_t>(r) * q.D + c;
        v = bad_row[y] ? 0.0f : __ldg(q.x + i);
        q.xc[i] = v;
      }
      tile[y][lane] = v;
    }
    __syncthreads();
    for (int y = warp; y < kT; y += kWarps) {  // xc^T row c0 + y, columns r0 + lane
      const int c = c0 + y, r = rt.r0 + lane;
      if (c < q.D && r < q.n)
        put(p.xt_hi, p.xt_lo, static_cast<size_t>(c) * p.ldt + r, tile[lane][y]);
    }
    __syncthreads();
  }
}

// bce_grad_kernel's logit gradient (its NaN-row rule first: whole rows, a warp per row; a logit
// is NaN exactly where its sigmoid is, 1 / (1 + expf(-a)) being NaN only for a NaN a), gx where
// wanted, then per column tile ga^T as a plain copy. Out of place: the other blocks of a row
// tile read the row's logits whole while this one writes its columns' gradients.
__global__ void __launch_bounds__(kThreads) fused_bce_grad_kernel(const __grid_constant__ FusedBceGradParams p) {
  __shared__ Tile tile;
  __shared__ int nan_row[kT];
  __shared__ float g_row[kT];
  __shared__ int keep_row[kT];
  const BceGradParams& q = p.bce;
  const int b = static_cast<int>(blockIdx.x), main = cdiv(q.n, kT) * p.col_groups;
  if (b >= main) {
    side_tile(p.side, b - main, tile);
    return;
  }
  const RowTile rt = row_tile(b, p.col_groups, q.D);
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  for (int y = warp; y < kT; y += kWarps) {
    const int row = rt.r0 + y;
    bool nan = false;
    if (row < q.n)
      for (int c = lane; c < q.D; c += 32)
        nan |= isnan(__ldg(p.logits + static_cast<size_t>(row) * q.D + c));
    nan = __any_sync(0xffffffffu, nan);
    if (lane == 0) {
      nan_row[y] = nan ? 1 : 0;
      g_row[y] = row < q.n ? __ldg(q.g_rec + row) : 0.0f;
      keep_row[y] = row < q.n && __ldg(q.keep + row) != 0.0f ? 1 : 0;
    }
  }
  __syncthreads();
  for (int ct = rt.ct0; ct < rt.ct1; ++ct) {
    const int c0 = ct * kT;
    for (int y = warp; y < kT; y += kWarps) {
      const int r = rt.r0 + y, c = c0 + lane;
      float v = 0.0f;
      if (r < q.n && c < q.D) {
        const size_t i = static_cast<size_t>(r) * q.D + c;
        const float a = __ldg(p.logits + i);
        v = bce_grad_elem(a, __ldg(q.x + i), g_row[y], nan_row[y] != 0);
        q.ga[i] = v;
        if (q.gx != nullptr) q.gx[i] = bce_grad_x(a, g_row[y], nan_row[y] != 0, keep_row[y] != 0);
      }
      tile[y][lane] = v;
    }
    __syncthreads();
    if (p.gat != nullptr)
      for (int y = warp; y < kT; y += kWarps) {  // ga^T row c0 + y, columns r0 + lane
        const int c = c0 + y, r = rt.r0 + lane;
        if (c < q.D && r < q.n) p.gat[static_cast<size_t>(c) * p.ldt + r] = tile[lane][y];
      }
    __syncthreads();
  }
}

// Shared memory of fused_latent_kernel<R>: g_d's R rows (with recon), then g_mu's and g_lv's.
int latent_smem(int R, int H, int L, bool rec) { return 4 * R * ((rec ? H : 0) + 2 * L); }

// One block per R rows (backward_fused.h FusedLatentParams: the sums and their order).
template <int R>
__global__ void __launch_bounds__(kThreads) fused_latent_kernel(const __grid_constant__ FusedLatentParams p) {
  extern __shared__ float sm[];
  const bool rec = p.g_d != nullptr, kl = p.g_kl != nullptr;
  const int H = p.H, L = p.L, tid = static_cast<int>(threadIdx.x);
  const int r0 = static_cast<int>(blockIdx.x) * R, rows = min(R, p.n - r0);
  float* sgd = sm;
  float* sgm = sm + (rec ? R * H : 0);
  float* sgl = sgm + R * L;
  if (rec) {  // the block's rows of g_d: contiguous in (n, H)
    const float* src = p.g_d + static_cast<size_t>(r0) * H;
    for (int i = tid; i < rows * H; i += kThreads) sgd[i] = __ldg(src + i);
    __syncthreads();
  }
  for (int i = tid; i < R * L; i += kThreads) {  // (row, l); rows past n: zeros
    const int r = i / L, l = i - r * L, row = r0 + r;
    float gm = 0.0f, gl = 0.0f, ge = 0.0f;
    if (r < rows) {
      const size_t e = static_cast<size_t>(row) * L + l;
      float gz = 0.0f;
      if (rec) {
        const float* gd = sgd + r * H;
        for (int j = 0; j < H; ++j)
          gz = fmaf(gd[j], __ldg(p.wd1 + static_cast<size_t>(j) * L + l), gz);
      }
      latent_grads(rec, gz, rec ? __ldg(p.eps + e) : 0.0f, kl, kl ? __ldg(p.g_kl + row) : 0.0f,
                   kl ? __ldg(p.mu + e) : 0.0f, __ldg(p.lv + e), &gm, &gl, &ge);
      p.g_mu[e] = gm;
      p.g_lv[e] = gl;
      if (p.g_eps != nullptr) p.g_eps[e] = ge;
    }
    sgm[i] = gm;
    sgl[i] = gl;
  }
  __syncthreads();
  for (int j = tid; j < H; j += kThreads) {  // column j of g_a1, the block's R rows
    float am[R], al[R];
#pragma unroll
    for (int r = 0; r < R; ++r) am[r] = al[r] = 0.0f;
    for (int l = 0; l < L; ++l) {
      const float wm = __ldg(p.wmu + static_cast<size_t>(l) * H + j);
      const float wl = __ldg(p.wlv + static_cast<size_t>(l) * H + j);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        am[r] = fmaf(sgm[r * L + l], wm, am[r]);
        al[r] = fmaf(sgl[r * L + l], wl, al[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {  // threshold_backward(., h, 0): 0 where h <= 0 (NaN h passes)
      const size_t e = static_cast<size_t>(r0 + r) * H + j;
      am[r] = r < rows && __ldg(p.h + e) <= 0.0f ? 0.0f : am[r] + al[r];
      if (r < rows) p.g_a1[e] = am[r];
    }
    float* t = p.g_a1t + static_cast<size_t>(j) * p.ldt + r0;  // R consecutive floats
    if (rows == R) {  // r0, R and ldt multiples of 4: 16-byte stores
#pragma unroll
      for (int r = 0; r < R; r += 4)
        *reinterpret_cast<float4*>(t + r) = make_float4(am[r], am[r + 1], am[r + 2], am[r + 3]);
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r < rows) t[r] = am[r];
    }
  }
}

// Job t's output tile tb over rows [r_begin, r_end), into out (P x Q).
__device__ void wgrad_product(const FusedWgradParams& p, int t, int tb, int r_begin, int r_end,
                              float* out) {
  __shared__ Tile sg, sa;
  const float *g = p.g[t], *a = p.a[t];
  const int P = p.P[t], Q = p.Q[t], tiles_q = cdiv(Q, kT);
  const int p0 = (tb / tiles_q) * kT, q0 = (tb % tiles_q) * kT;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  constexpr int kPer = kT / kWarps;  // outputs per thread: (p0 + warp + 8 i, q0 + lane)
  float acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) acc[i] = 0.0f;
  for (int rr = r_begin; rr < r_end; rr += kT) {
    for (int y = warp; y < kT; y += kWarps) {
      const int r = rr + y;
      const bool in = r < r_end;
      sg[y][lane] = in && p0 + lane < P ? __ldg(g + static_cast<size_t>(r) * p.ldg[t] + p0 + lane)
                                        : 0.0f;
      sa[y][lane] = in && q0 + lane < Q ? __ldg(a + static_cast<size_t>(r) * p.lda[t] + q0 + lane)
                                        : 0.0f;
    }
    __syncthreads();
    const int nr = min(kT, r_end - rr);
    for (int k = 0; k < nr; ++k) {  // rows in ascending order
      const float av = sa[k][lane];
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[i] = fmaf(sg[k][warp + kWarps * i], av, acc[i]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int pp = p0 + warp + kWarps * i, qq = q0 + lane;
    if (pp < P && qq < Q) out[static_cast<size_t>(pp) * Q + qq] = acc[i];
  }
}

__global__ void __launch_bounds__(kThreads) fused_wgrad_kernel(const __grid_constant__ FusedWgradParams p) {
  const int b = static_cast<int>(blockIdx.x), y = static_cast<int>(blockIdx.y);
  int t = 0;
  while (t + 1 < p.count && b >= p.first_block[t + 1]) ++t;
  const int tb = b - p.first_block[t];
  const int r_begin = y * kWgradRows, r_end = min(p.n, r_begin + kWgradRows);
  float* out = gridDim.y == 1 ? p.dst[t]
                              : p.ws + static_cast<size_t>(y) * p.ws_cols + p.first_col[t];
  if (p.g[t] != nullptr) {  // uniform per block
    wgrad_product(p, t, tb, r_begin, r_end, out);
    return;
  }
  const int q = tb * kThreads + static_cast<int>(threadIdx.x);  // a column sum: rows in order
  if (q >= p.Q[t]) return;
  const float* a = p.a[t] + q;
  float s = 0.0f;
  for (int r = r_begin; r < r_end; ++r) s += __ldg(a + static_cast<size_t>(r) * p.lda[t]);
  out[q] = s;
}

// dst[t][j] = the chunks' partial sums in chunk order (a thread per output of all jobs).
__global__ void __launch_bounds__(kThreads) fused_wgrad_finish_kernel(const __grid_constant__ FusedWgradParams p) {
  const int j = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (j >= p.ws_cols) return;
  int t = 0;
  while (t + 1 < p.count && j >= p.first_col[t + 1]) ++t;
  const int chunks = cdiv(p.n, kWgradRows);
  float s = 0.0f;
  for (int y = 0; y < chunks; ++y) s += p.ws[static_cast<size_t>(y) * p.ws_cols + j];
  p.dst[t][j - p.first_col[t]] = s;
}

// The side jobs' tiles, first_block filled; -1 where a job is malformed.
long long side_tiles(TileJobs& s) {
  if (s.count < 0 || s.count > kTileJobsMax) return -1;
  long long blocks = 0;
  for (int t = 0; t < s.count; ++t) {
    const TileJob& j = s.job[t];
    if (j.rows < 1 || j.cols < 1 || j.src == nullptr || j.hi == nullptr) return -1;
    s.first_block[t] = static_cast<int>(blocks);
    blocks += static_cast<long long>(cdiv(j.rows, kT)) * cdiv(j.cols, kT);
  }
  s.first_block[s.count] = static_cast<int>(blocks);
  return blocks;
}

// Row tiles x col_groups, then the side tiles: the grid, or 0 where it cannot be launched.
int row_tile_blocks(int n, int D, int col_groups, TileJobs& side) {
  const long long sides = side_tiles(side);
  if (n < 1 || D < 1 || col_groups < 1 || col_groups > cdiv(D, kT) || sides < 0) return 0;
  const long long blocks = static_cast<long long>(cdiv(n, kT)) * col_groups + sides;
  return blocks > 0x7FFFFFFF ? 0 : static_cast<int>(blocks);
}

// first_block / first_col / ws_cols from the jobs; false where one is malformed.
bool wgrad_layout(FusedWgradParams& p, int* blocks) {
  if (p.count < 1 || p.count > kWgradMax || p.n < 1) return false;
  long long b = 0, cols = 0;
  for (int t = 0; t < p.count; ++t) {
    const bool sum = p.g[t] == nullptr;
    if (sum) p.P[t] = 1;
    if (p.P[t] < 1 || p.Q[t] < 1 || p.a[t] == nullptr || p.dst[t] == nullptr) return false;
    p.first_block[t] = static_cast<int>(b);
    p.first_col[t] = static_cast<int>(cols);
    b += sum ? cdiv(p.Q[t], kThreads) : static_cast<long long>(cdiv(p.P[t], kT)) * cdiv(p.Q[t], kT);
    cols += static_cast<long long>(p.P[t]) * p.Q[t];
    if (b > 0x7FFFFFFF || cols > 0x7FFFFFFF) return false;
  }
  p.first_block[p.count] = static_cast<int>(b);
  p.first_col[p.count] = static_cast<int>(cols);
  p.ws_cols = static_cast<int>(cols);
  *blocks = static_cast<int>(b);
  return true;
}

template <int R>
cudaError_t latent_attr(int smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(fused_latent_kernel<R>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
}

}  // namespace fused
}  // namespace

using namespace fused;

int fused_col_groups(int n, int D, int sms) noexcept {
  const int tiles = cdiv(D, kT), groups = cdiv(sms, cdiv(n, kT));
  return groups < 1 ? 1 : (groups > tiles ? tiles : groups);
}

cudaError_t fused_prep_launch(FusedPrepParams& p, cudaStream_t stream) noexcept {
  const int blocks = row_tile_blocks(p.prep.n, p.prep.D, p.col_groups, p.side);
  if (blocks == 0 || p.xt_hi == nullptr || p.xt_lo == nullptr || p.ldt < p.prep.n)
    return cudaErrorInvalidValue;
  fused_prep_kernel<<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t fused_bce_grad_launch(FusedBceGradParams& p, cudaStream_t stream) noexcept {
  const int blocks = row_tile_blocks(p.bce.n, p.bce.D, p.col_groups, p.side);
  if (blocks == 0 || (p.gat != nullptr && p.ldt < p.bce.n)) return cudaErrorInvalidValue;
  fused_bce_grad_kernel<<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

ElboStatus fused_latent_plan(FusedLatentParams& p, int device, cudaError_t* cuda_err) noexcept {
  *cuda_err = cudaSuccess;
  if (p.n < 1 || p.H < 1 || p.L < 1 || p.ldt < p.n || p.ldt % 4 != 0) {
    *cuda_err = cudaErrorInvalidValue;
    return kElboCudaError;
  }
  ClusterDevice dev;
  const cudaError_t e = cluster_device(device, &dev);
  if (e != cudaSuccess) {
    *cuda_err = e;
    return kElboCudaError;
  }
  const bool rec = p.g_d != nullptr;
  p.R = p.n >= kFusedWideRows && latent_smem(32, p.H, p.L, rec) <= dev.smem_optin ? 32 : 8;
  p.smem_bytes = latent_smem(p.R, p.H, p.L, rec);
  if (p.smem_bytes > dev.smem_optin) return kElboTooLarge;
  const cudaError_t a = p.R == 32 ? latent_attr<32>(p.smem_bytes) : latent_attr<8>(p.smem_bytes);
  if (a != cudaSuccess) {
    *cuda_err = a;
    return kElboCudaError;
  }
  return kElboOk;
}

cudaError_t fused_latent_launch(const FusedLatentParams& p, cudaStream_t stream) noexcept {
  if (p.R != 8 && p.R != 32) return cudaErrorInvalidValue;  // fused_latent_plan's
  const int blocks = cdiv(p.n, p.R);
  if (p.R == 32)
    fused_latent_kernel<32><<<blocks, kThreads, p.smem_bytes, stream>>>(p);
  else
    fused_latent_kernel<8><<<blocks, kThreads, p.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

int fused_wgrad_workspace(const FusedWgradParams& p) noexcept {
  if (p.n <= kWgradRows) return 0;
  long long cols = 0;
  for (int t = 0; t < p.count && t < kWgradMax; ++t)
    cols += static_cast<long long>(p.g[t] == nullptr ? 1 : p.P[t]) * p.Q[t];
  const long long total = cols * cdiv(p.n, kWgradRows);
  return total > 0x7FFFFFFF ? -1 : static_cast<int>(total);
}

cudaError_t fused_wgrad_launch(FusedWgradParams& p, cudaStream_t stream) noexcept {
  int blocks = 0;
  const int chunks = cdiv(p.n, kWgradRows);
  if (!wgrad_layout(p, &blocks) || chunks > 65535 || (chunks > 1 && p.ws == nullptr))
    return cudaErrorInvalidValue;
  fused_wgrad_kernel<<<dim3(blocks, chunks), kThreads, 0, stream>>>(p);
  if (chunks == 1) return cudaGetLastError();
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  fused_wgrad_finish_kernel<<<cdiv(p.ws_cols, kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fastelbo
