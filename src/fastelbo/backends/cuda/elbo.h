// Plain parameter structs and host entry points of the cuda backend's kernels (no torch types).
//
// Role of the cuda backend: lowest latency, and never slower than eager PyTorch. Two paths:
//   cluster path (small batches): the whole forward after the noise draw is ONE launch of
//     elbo_kernel (thread-block clusters + DSMEM); see elbo.cu.
//   rows path (large batches): binding.cpp runs the two big GEMMs with cuBLAS (ATen addmm, the
//     same call F.linear makes) in row chunks, and two fused kernels of elbo.cu do everything
//     else: latent_kernel (relu, mu/logvar, reparam, KL, decoder hidden layer) and bce_kernel
//     (sigmoid, clamped BCE, row sums, NaN-row rule, elbo).
// binding.cpp is the only file that sees torch. Every host function here is noexcept: failures
// come back as an ElboStatus / cudaError_t, which binding.cpp turns into a Python exception.
#pragma once

#include <cuda_runtime.h>

namespace fastelbo {

// Shapes (nn.Linear layout, out x in), all row-major contiguous float32:
//   x (B, D), eps (B, L), w1 (H, D), wmu/wlv (L, H), wd1 (H, L), wd2 (D, H); biases (out).
struct ElboParams {
  const float* x;
  const float* eps;
  const float* w1;
  const float* b1;
  const float* wmu;
  const float* bmu;
  const float* wlv;
  const float* blv;
  const float* wd1;
  const float* bd1;
  const float* wd2;
  const float* bd2;
  float* elbo;
  float* recon;
  float* kl;
  int B, D, H, L;
  // Filled by elbo_plan():
  int R;                  // batch rows per cluster (one row tile)
  int C;                  // blocks per cluster (the launch's cluster dimension)
  int ns_h, ns_l, ns_d;   // output columns per block in the H-, L- and D-wide layers
  int ldh, ldl, ldm, ldo; // shared-memory row strides (floats) of hs, zs, ml, ob
  int ldx;                // row stride of the staged x tile and w1 slice
  int off_zs, off_ml, off_ob, off_rec, off_kl, off_bad;  // float offsets into shared memory
  int off_xs, off_w1, off_wm, off_wl, off_wd1, off_wd2;  // staged copies (when staged)
  int staged;             // 1: x tile and all weight slices are copied to smem at the start
  int smem_bytes;
  unsigned vec;           // bit i set: layer i (0 enc, 1 latent, 2 dec1, 3 dec2) may use float4
  int variant;            // register tile: 0 -> 2x2 outputs per thread, 1 -> 4x4
};

enum ElboStatus : int {
  kElboOk = 0,
  kElboTooLarge = 1,   // even one row per cluster does not fit in shared memory
  kElboCudaError = 2,  // a CUDA runtime call failed: see *cuda_err
  kElboBadArch = 3,    // device below compute capability 9.0 (no thread-block clusters)
  kElboNoCluster = 4,  // no cluster size (16, 8, 4, 2, 1) is schedulable with this shared memory
};

// Chooses R, C, staging and the variant for this device and these dims (rows / cluster > 0
// force a value, staged >= 0 forces staging on/off; for tuning), fills the layout fields of p and sets the kernel's attributes.
// Host-only, no stream work, no allocation: safe during CUDA graph capture.
ElboStatus elbo_plan(ElboParams& p, int device, int rows, int cluster, int staged,
                     cudaError_t* cuda_err) noexcept;

// Launches the kernel on `stream` (cudaLaunchKernelEx with a cluster dimension); returns the
// launch's error code (cudaGetLastError folded in).
cudaError_t elbo_launch(const ElboParams& p, cudaStream_t stream) noexcept;

// Shared-memory bytes the kernel needs for R rows per cluster, cluster size C, with or
// without the staged copies of x and the weight slices.
long long elbo_smem_bytes(int D, int H, int L, int R, int C, bool staged) noexcept;

// ---- rows path (large batches) ----
// latent_kernel: for n rows, h (n, H) = x w1^T + b1 BEFORE the relu (stage_h = 1: the kernel
// applies it while staging h in shared memory; stage_h = 0, only for dims whose h rows do not
// fit: binding.cpp applies relu_ to h first and the kernel reads h from global memory).
// Writes d (n, H) = relu(z wd1^T + bd1) and kl (n,) = -0.5 sum_j(1 + lv - mu^2 - exp(lv)).
struct LatentParams {
  const float* h;
  const float* eps;   // (n, L)
  const float* wmu;
  const float* bmu;
  const float* wlv;
  const float* blv;
  const float* wd1;
  const float* bd1;
  float* d;           // (n, H)
  float* kl;          // (n,)
  int n, H, L;
  // Filled by latent_plan():
  int rows;           // rows per block
  int stage_h;        // 1: relu(h) tile in shared memory
  int ldh, ldl, ldm;  // shared-memory row strides (floats) of hs, zs, ml
  int off_zs, off_ml;
  int smem_bytes;
  unsigned vec;       // bit 0: K=H layer may use float4 (h, wmu, wlv); bit 1: K=L layer (wd1)
};

// bce_kernel: recon = sum_c BCE(sigmoid(logits), x), elbo = -(recon + kl); rows whose x holds a
// value outside [0, 1] or NaN get NaN in all three (kl is read, and overwritten only then).
struct BceParams {
  const float* logits;  // (n, D) = d wd2^T + bd2
  const float* x;       // (n, D)
  float* elbo;
  float* recon;
  float* kl;            // in: from latent_kernel; out: NaN on bad rows
  int n, D;
  int vec;              // 1: D % 4 == 0 and logits, x 16-byte aligned
};

// Picks rows per block / staging for these dims on `device`, sets the kernel attributes.
// kElboTooLarge: not even one row's latent activations fit in shared memory.
ElboStatus latent_plan(LatentParams& p, int device, cudaError_t* cuda_err) noexcept;
cudaError_t latent_launch(const LatentParams& p, cudaStream_t stream) noexcept;
cudaError_t bce_launch(const BceParams& p, cudaStream_t stream) noexcept;

}  // namespace fastelbo
