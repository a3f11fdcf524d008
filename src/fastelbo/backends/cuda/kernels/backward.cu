// The backward's elementwise kernels. binding_backward.cpp's elbo_backward recomputes the
// activations (cuBLAS GEMMs + reparam_kl_kernel) and runs every GEMM of the gradient with
// cuBLAS; these four kernels fuse everything else, which eager autograd (and
// torch_ref.backward, the spec they follow op by op) spreads over ~60 small kernels:
//   prep_kernel        invalid-row mask, x with invalid rows zeroed, the incoming gradients
//                      folded into one per branch (elbo = -(recon + kl))
//   bce_grad_kernel    sigmoid, the NaN-row rule, BCE's and sigmoid's backward, in place over
//                      the logits; BCE's gradient with respect to x when x needs one
//   latent_bwd_kernel  reparameterisation and KL backward: g_mu, g_lv, g_eps
//   colsum_kernel      the five bias gradients (column sums), one launch (two from 257 rows:
//                      colsum_finish_kernel adds the row chunks' partial sums)
// A warp or a block per row where a row-wide decision is needed (prep, bce_grad); every sum in
// a fixed order.
#include "elbo.h"
#include "elbo_math.cuh"

namespace fastelbo {
namespace {

__global__ void __launch_bounds__(kThreads) prep_kernel(const __grid_constant__ PrepParams p) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int row = static_cast<int>(blockIdx.x) * kWarps + warp;
  if (row >= p.n) return;  // whole warp
  const size_t base = static_cast<size_t>(row) * p.D;
  bool bad = false;
  for (int c = lane; c < p.D; c += 32) {
    const float v = __ldg(p.x + base + c);
    bad |= outside_unit(v);
  }
  bad = __any_sync(0xffffffffu, bad);
  for (int c = lane; c < p.D; c += 32) p.xc[base + c] = bad ? 0.0f : __ldg(p.x + base + c);
  if (lane != 0) return;
  p.keep[row] = bad ? 0.0f : 1.0f;
  if (p.rec_out != nullptr) p.rec_out[row] = branch_grad(p.g_recon, p.g_elbo, row, bad);
  if (p.kl_out != nullptr) p.kl_out[row] = branch_grad(p.g_kl, p.g_elbo, row, bad);
}

// One block per row: at training batch sizes (~128 rows) a warp per row would leave most SMs
// idle (15 us at B = 128 on an H200 against ~3 us for a block per row).
__global__ void __launch_bounds__(kThreads) bce_grad_kernel(const __grid_constant__ BceGradParams p) {
  const int row = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x);
  const size_t base = static_cast<size_t>(row) * p.D;
  float* ga = p.ga + base;
  const float* xr = p.x + base;
  // torch_ref: nan_rows = isnan(prob).any(-1); there g_out = 0 and prob -> 0.5 (safe).
  int nan_here = 0;
  for (int c = tid; c < p.D; c += kThreads) nan_here |= isnan(sigmoid(ga[c])) ? 1 : 0;
  const bool row_nan = __syncthreads_or(nan_here) != 0;
  const float g = __ldg(p.g_rec + row);
  const bool keep = __ldg(p.keep + row) != 0.0f;
  for (int c = tid; c < p.D; c += kThreads) {
    const float a = ga[c];
    ga[c] = bce_grad_elem(a, __ldg(xr + c), g, row_nan);
    if (p.gx != nullptr) p.gx[base + c] = bce_grad_x(a, g, row_nan, keep);
  }
}

// Column sums of up to kColSumMax (rows x cols_t) matrices: the bias gradients. Block (b, y)
// owns 32 columns of one matrix and rows [y * kColSumRows, (y + 1) * kColSumRows); its 8 warps
// take every 8th row there, then warp 0 adds the 8 partials in order, into dst where one chunk
// covers the rows, else into ws (chunk y's row), which colsum_finish_kernel adds up in chunk
// order: deterministic. A chunk per block row keeps the grid ~ B / 256 times wider than one
// block per 32 columns, which left most SMs idle (66 us at B = 4096 on an H200).
__global__ void __launch_bounds__(kThreads) colsum_kernel(const __grid_constant__ ColSumParams p) {
  __shared__ float part[kWarps][33];
  const int b = static_cast<int>(blockIdx.x), y = static_cast<int>(blockIdx.y);
  int t = 0;
  while (t + 1 < p.count && b >= p.first_block[t + 1]) ++t;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int col = (b - p.first_block[t]) * 32 + lane, cols = p.cols[t];
  const float* src = p.src[t];
  const int r1 = min(p.n, (y + 1) * kColSumRows);
  float s = 0.0f;
  if (col < cols)
    for (int r = y * kColSumRows + warp; r < r1; r += kWarps)
      s += __ldg(src + static_cast<size_t>(r) * cols + col);
  part[warp][lane] = s;
  __syncthreads();
  if (warp != 0 || col >= cols) return;
  float total = part[0][lane];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) total += part[w][lane];
  if (gridDim.y == 1)
    p.dst[t][col] = total;
  else
    p.ws[static_cast<size_t>(y) * p.ws_cols + p.first_col[t] + col] = total;
}

// dst[t][col] = the chunks' partial sums in chunk order (thread per column of all matrices).
__global__ void __launch_bounds__(kThreads) colsum_finish_kernel(const __grid_constant__ ColSumParams p) {
  const int j = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (j >= p.ws_cols) return;
  int t = 0;
  while (t + 1 < p.count && j >= p.first_col[t + 1]) ++t;
  const int chunks = cdiv(p.n, kColSumRows);
  float s = 0.0f;
  for (int y = 0; y < chunks; ++y) s += p.ws[static_cast<size_t>(y) * p.ws_cols + j];
  p.dst[t][j - p.first_col[t]] = s;
}

__global__ void __launch_bounds__(kThreads) latent_bwd_kernel(const __grid_constant__ LatentBwdParams p) {
  const size_t total = static_cast<size_t>(p.n) * p.L;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * kThreads) {
    const int row = static_cast<int>(i / p.L);
    const bool rec = p.g_z != nullptr, kl = p.g_kl != nullptr;
    float g_mu, g_lv, g_eps;
    latent_grads(rec, rec ? __ldg(p.g_z + i) : 0.0f, rec ? __ldg(p.eps + i) : 0.0f, kl,
                 kl ? __ldg(p.g_kl + row) : 0.0f, kl ? __ldg(p.mu + i) : 0.0f, __ldg(p.lv + i),
                 &g_mu, &g_lv, &g_eps);
    p.g_mu[i] = g_mu;
    p.g_lv[i] = g_lv;
    if (p.g_eps != nullptr) p.g_eps[i] = g_eps;
  }
}

}  // namespace

cudaError_t prep_launch(const PrepParams& p, cudaStream_t stream) noexcept {
  prep_kernel<<<cdiv(p.n, kWarps), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t bce_grad_launch(const BceGradParams& p, cudaStream_t stream) noexcept {
  bce_grad_kernel<<<p.n, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

int colsum_workspace(const ColSumParams& p) noexcept {
  if (p.n <= kColSumRows) return 0;
  int cols = 0;
  for (int t = 0; t < p.count; ++t) cols += p.cols[t];
  return cdiv(p.n, kColSumRows) * cols;
}

cudaError_t colsum_launch(ColSumParams& p, cudaStream_t stream) noexcept {
  int blocks = 0, cols = 0;
  for (int t = 0; t < p.count; ++t) {
    p.first_block[t] = blocks;
    p.first_col[t] = cols;
    blocks += cdiv(p.cols[t], 32);
    cols += p.cols[t];
  }
  p.ws_cols = cols;
  const int chunks = cdiv(p.n, kColSumRows);
  if (p.n < 1 || chunks > 65535 || (chunks > 1 && p.ws == nullptr)) return cudaErrorInvalidValue;
  colsum_kernel<<<dim3(blocks, chunks), kThreads, 0, stream>>>(p);
  if (chunks == 1) return cudaGetLastError();
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  colsum_finish_kernel<<<cdiv(cols, kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t latent_bwd_launch(const LatentBwdParams& p, cudaStream_t stream) noexcept {
  const long long total = static_cast<long long>(p.n) * p.L;
  const long long want = (total + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 65535 ? want : 65535);
  latent_bwd_kernel<<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fastelbo
