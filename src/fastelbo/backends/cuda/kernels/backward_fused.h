// The fused backward's kernels (backward_fused.cu): plain parameter structs and host entry
// points, no torch types. binding_backward_fused.cpp runs them around the four large GEMMs on
// tc_gemm.cu's tensor-core kernel (tf32x3) at every batch size (gemm="fused"; auto under
// FASTELBO_TC_TRAIN=1 until a GPU run accepts it). Each GEMM operand is written, split into TF32
// halves and in the layout the GEMM reads, by the kernel that produces its values, so no split
// or transpose runs on its own:
//   fused_prep_kernel      prep_kernel's outputs, and xc^T split (the enc_w gradient's W); in
//                          the same launch dec_w2's halves as it is (the logits' W) and
//                          transposed (the decoder gradient's W)
//   fused_bce_grad_kernel  bce_grad_kernel's logit gradient ga (the decoder gradient's A; out of
//                          place), ga^T (the dec_w2 gradient's A); in the same launch d^T split
//                          (its W)
//   fused_latent_kernel    from g_d: g_z = g_d dec_w1, latent_bwd_kernel's g_mu, g_lv, g_eps,
//                          and g_a1 = threshold_backward(g_mu mu_w + g_lv lv_w, h, 0) with g_a1^T
//                          (the enc_w gradient's A): a block per R rows, all in shared memory
//   fused_wgrad_kernel     the small weight gradients (g_mu^T h, g_lv^T h, g_d^T z) and the five
//                          bias column sums in one launch (two above kWgradRows rows)
// The operands' layout is TcSplits::add's: (rows, ld) with ld = cols rounded up to 4 (TMA's
// 16-byte row strides), the halves tf32_split_inf's, so the GEMMs see what the unfused tc
// engine's split kernel would have written (its dec_w2 gradient is bit-identical).
#pragma once

#include <cuda_runtime.h>

#include "elbo.h"

namespace fastelbo {

constexpr int kFusedTile = 32;  // a row tile's rows and a column tile's columns

// A copy of src (rows x cols, row stride lds) in 32 x 32 tiles, one per block, into hi / lo (row
// stride ldt): TF32 halves (tf32_split_inf), or with lo == nullptr a plain copy into hi;
// transposed (cols x rows) where trans. A producer's launch carries these after its own blocks.
struct TileJob {
  const float* src;
  float* hi;
  float* lo;
  int rows, cols, lds, ldt, trans;
};
constexpr int kTileJobsMax = 2;
struct TileJobs {
  TileJob job[kTileJobsMax];
  int count;
  int first_block[kTileJobsMax + 1];  // filled by the launch
};

// A row-tile kernel's grid: cdiv(n, kFusedTile) row tiles x col_groups blocks (each takes a share
// of the cdiv(D, kFusedTile) column tiles, reading its rows whole for the row-wide rule), then
// the side jobs' tiles.
struct FusedPrepParams {
  PrepParams prep;       // prep_kernel's (every field read and written as there)
  float* xt_hi;          // xc^T (D, ldt) in TF32 halves
  float* xt_lo;
  int ldt;
  int col_groups;
  TileJobs side;         // dec_w2's halves (as it is, transposed); count 0 without recon
};
struct FusedBceGradParams {
  BceGradParams bce;     // bce_grad_kernel's, but ga is written only (gx where wanted)
  const float* logits;   // (n, D): what bce_grad_kernel reads from ga
  float* gat;            // ga^T (D, ldt), a plain copy
  int ldt;
  int col_groups;
  TileJobs side;         // d^T's halves
};
// The blocks per row tile for n rows of D columns on `sms` multiprocessors: about one wave, at
// most one per column tile.
int fused_col_groups(int n, int D, int sms) noexcept;
cudaError_t fused_prep_launch(FusedPrepParams& p, cudaStream_t stream) noexcept;
cudaError_t fused_bce_grad_launch(FusedBceGradParams& p, cudaStream_t stream) noexcept;

// fused_latent_kernel: a block per R rows (R = 8, or 32 from kFusedWideRows rows: fewer blocks
// reading the weights), g_d's rows staged in shared memory. Per (row, l) in block order: g_z =
// sum_j g_d[row][j] wd1[j][l] (j ascending, one FMA chain), then latent_grads. Per (row, j):
// g_a1 = (h <= 0 ? 0 : (sum_l g_mu wmu[l][j]) + (sum_l g_lv wlv[l][j])), l ascending, one chain
// each: torch_ref's threshold_backward(g_mu @ mu_w + g_lv @ lv_w, h, 0).
constexpr int kFusedWideRows = 2048;
struct FusedLatentParams {
  const float* g_d;    // (n, H) or nullptr: the recon branch is unused (g_z = 0)
  const float* wd1;    // dec_w1 (H, L)
  const float* mu;     // (n, L)
  const float* lv;
  const float* eps;
  const float* g_kl;   // (n,) or nullptr: the kl branch is unused
  const float* wmu;    // mu_w (L, H)
  const float* wlv;    // lv_w (L, H)
  const float* h;      // (n, H): the encoder's hidden layer, its ReLU mask
  float* g_mu;         // (n, L)
  float* g_lv;
  float* g_eps;        // (n, L) or nullptr
  float* g_a1;         // (n, H)
  float* g_a1t;        // (H, ldt): g_a1^T
  int n, H, L, ldt;
  int R, smem_bytes;   // filled by fused_latent_plan
};
// kElboOk, or kElboTooLarge where R rows do not fit a block's shared memory even at R = 8 (the
// caller keeps the unfused engine), kElboCudaError. Host only.
ElboStatus fused_latent_plan(FusedLatentParams& p, int device, cudaError_t* cuda_err) noexcept;
cudaError_t fused_latent_launch(const FusedLatentParams& p, cudaStream_t stream) noexcept;

// fused_wgrad_kernel: dst[t] (P x Q, row-major) = g[t]^T a[t] over the n rows, or with g[t] ==
// nullptr the column sums of a[t] (P = 1). Block (b, y): an output tile of job t (32 x 32 for a
// product, kThreads columns for a sum) over rows [y kWgradRows, (y + 1) kWgradRows), rows in
// ascending order per output; into dst where one chunk covers n, else into ws's row y, which
// fused_wgrad_finish_kernel adds up in chunk order: deterministic.
constexpr int kWgradMax = 8;
constexpr int kWgradRows = 256;
struct FusedWgradParams {
  const float* g[kWgradMax];  // (n, P), row stride ldg, or nullptr: a column sum
  const float* a[kWgradMax];  // (n, Q), row stride lda
  float* dst[kWgradMax];      // (P, Q)
  int P[kWgradMax], Q[kWgradMax], ldg[kWgradMax], lda[kWgradMax];
  int first_block[kWgradMax + 1], first_col[kWgradMax + 1];  // filled by the launch
  int count, n, ws_cols;
  float* ws;                  // (chunks, ws_cols) where n > kWgradRows
};
int fused_wgrad_workspace(const FusedWgradParams& p) noexcept;  // floats of ws (0: none)
cudaError_t fused_wgrad_launch(FusedWgradParams& p, cudaStream_t stream) noexcept;

}  // namespace fastelbo
