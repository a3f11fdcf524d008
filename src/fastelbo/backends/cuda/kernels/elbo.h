// Plain parameter structs and host entry points of the cuda backend's kernels (no torch types).
//
// Role of the cuda backend: lowest latency, and never slower than eager PyTorch. Three paths:
//   cluster paths (small batches): the whole forward after the noise draw is ONE launch of
//     elbo_kernel (any dims; elbo.cu) or elbo_fast_kernel (dims multiples of 4, 80 < B <= 384;
//     elbo_fast.cu), thread-block clusters + DSMEM.
//   rows path (large batches): binding_forward.cpp runs every GEMM with cuBLAS (ATen, as
//     F.linear does) and the two ReLUs in place, and two small kernels of rows.cu do the rest:
//     reparam_kl_kernel (reparameterisation, KL) and bce_kernel (sigmoid, clamped BCE, row
//     sums, NaN-row rule, elbo). Its tensor-core variant (binding_tc.cpp, tc_gemm.cu; sm_90,
//     wherever it applies) runs the encoder and output layers on wgmma (tf32x3) with ReLU and
//     BCE fused.
//   backward (any batch; backward.cu): the same recomputation, cuBLAS for every GEMM and four
//     fused elementwise kernels for everything else.
// Only the binding files (binding_*.cpp) see torch. Every host function here is noexcept:
// failures come back as an ElboStatus / cudaError_t, which the binding turns into a Python
// exception.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

namespace fastelbo {

// One torch.randn(n) float32 draw from a CUDA generator, for a kernel that reproduces it
// (philox.cuh, torch_randn_*): binding_forward.cpp fills it from PyTorch's PhiloxCudaState after
// reserving the draw's counter range exactly as PyTorch's normal_ does.
struct TorchRandn {
  unsigned long long seed, offset;         // captured == 0
  const long long* seed_ptr;               // captured != 0 (CUDA graph capture): read at run
  const long long* offset_ptr;             //   time, offset = *offset_ptr + offset_intragraph
  unsigned long long offset_intragraph;
  unsigned long long threads;              // threads of PyTorch's normal_ launch for n
  int captured;
};

// ---- the deferred value check (binding ForwardOptions::deferred) ----
// Per device, one record of the x values outside [0, 1] (or NaN) that forwards launched with the
// deferred check met: how many, and the earliest position (row-major over each call's x) with
// its value. A module global of rows.cu, zero when the module loads: kernels get its address in
// their params (`err`), note into it only where they found a bad value (deferred.cuh), and the
// binding moves it out when Python asks (fastelbo.check_errors; deferred_take).
struct __align__(16) DeferredFirst {
  unsigned long long key;    // ~(row << 32 | col): the largest key is the earliest; 0: none
  unsigned long long value;  // that element's float bits
};
struct __align__(16) DeferredRecord {
  DeferredFirst first;       // updated by a 16-byte atomicCAS (sm_90)
  unsigned long long count;  // bad values noted
  unsigned long long unused;
};
// This device's record (the caller's current device): its address, for the kernels' params.
cudaError_t deferred_record(DeferredRecord** out) noexcept;
// Moves this device's record into *host and zeroes it (one kernel on `stream`, each field
// atomically, then a copy), waiting for both.
cudaError_t deferred_take(DeferredRecord* host, cudaStream_t stream) noexcept;
// The rows path's last step with the deferred check: where *flag != 0 (a bad x anywhere in the
// call), elbo, recon and kl [0, n) become NaN. One small launch.
cudaError_t deferred_poison_launch(const int* flag, float* elbo, float* recon, float* kl, int n,
                                   cudaStream_t stream) noexcept;

// One forward's tensors and dims, the common part of both cluster kernels' params (the binding
// fills it once). Shapes (nn.Linear layout, out x in), all row-major contiguous float32:
//   x (B, D), eps (B, L), w1 (H, D), wmu/wlv (L, H), wd1 (H, L), wd2 (D, H); biases (out).
struct ForwardArgs {
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
  // draw != 0: eps is not read; each block draws its own elements of torch.randn(B, L) from
  // rng instead (philox.cuh) and writes them to eps_out (B x L). The cluster kernels only.
  int draw;
  TorchRandn rng;
  float* eps_out;
  // pdl != 0: launched as a programmatic dependent of the previous kernel on the stream (set
  // by binding_forward.cpp pdl_launch_allowed; the two cluster kernels only). Before
  // griddepcontrol.wait the kernel reads only weights and biases; x, eps, the RNG state and
  // every global write come after it, and so does its griddepcontrol.launch_dependents
  // (cluster.cuh pdl_wait: the only early trigger of any kernel here).
  int pdl;
  // err != nullptr: the deferred value check. Every cluster also scans all of x (a 1/C share
  // per block, deferred.cuh deferred_scan), so that a bad value anywhere makes every row of the
  // call NaN; cluster 0 notes the bad values in *err.
  DeferredRecord* err;
};

struct ElboParams : ForwardArgs {
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
  kElboNotAligned = 5, // fast path only: dims or pointers not float4-friendly
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

// ---- fast cluster path (elbo_fast.cu): the same one-launch forward for float4-friendly dims ----
// Clusters of C blocks own up to kFastRows batch rows. The encoder is split over the input
// dimension (block k multiplies its slice of x's columns by the same slice of w1: x is read
// once per cluster) and reduced through distributed shared memory; the decoder's last layer is
// split over output columns (block k: its columns of the logits, its columns of x for BCE).
constexpr int kFastRows = 20;  // rows per cluster: 4 row lanes x 5 rows per thread
struct FastParams : ForwardArgs {
  // Tensor maps (TMA descriptors, 64-byte aligned by their type), encoded by elbo_fast_plan
  // for these pointers: x and w1 slices (encoder), x at the output columns, eps, wmu, wlv, wd1.
  CUtensorMap tm_x, tm_w1, tm_xd, tm_eps, tm_wmu, tm_wlv, tm_wd1;
  CUtensorMap tm_wd1f;   // local_d: all of wd1 in boxes of wd1f_box rows, ldw wide
  // Filled by elbo_fast_plan():
  int R, C;              // batch rows per cluster (<= kFastRows), blocks per cluster
  int qmax;              // most float4 columns of x any block owns (D / 4 split over C)
  int hs, ns_l, ns_d;    // per block: hidden columns (H / C), latent indices, output columns
  int ldk, ldd;          // smem row strides (floats): x / w1 slices, d / wd2
  int ldq, lds_l, lds_d; // strides: hk rows, latent-index rows (bl, eps), x rows at the outputs
  int w1_box;            // rows of w1 per tensor-map box (<= 256)
  int off_xk, off_w1k, off_b1, off_hk, off_wmu, off_wlv, off_bl, off_eps, off_ml;
  int off_wd1, off_bd1, off_wd2, off_bd2, off_xd, off_red, off_bce, off_zs, off_ds;
  // Exchanged between blocks (bulk copies): what this block sends (destination-major) and
  // receives (source-major): partial h, partial mu | logvar, z, d.
  int off_p1s, off_r1, off_p2s, off_r2, off_zl, off_rz, off_dk, off_rd;
  int off_rec, off_kl, off_bad;
  // local_d != 0: every block computes all of d itself from all of wd1 (staged after L1 over
  // w1k's space) instead of its hidden columns and the d exchange; where that space holds it.
  int local_d, ldz, ldw, wd1f_box, off_wd1f, off_bd1f;
  int smem_bytes;
};

// Plans the fast path for this device (cluster > 0 forces C; one_wave: only if all clusters are
// co-resident, as `auto` wants). kElboOk, or why not: kElboTooLarge (smem), kElboBadArch,
// kElboNoCluster, kElboNotAligned (dims or pointers not float4-friendly), kElboCudaError.
// Host-only, no stream work: safe during CUDA graph capture.
ElboStatus elbo_fast_plan(FastParams& p, int device, int cluster, bool one_wave,
                          cudaError_t* cuda_err) noexcept;
cudaError_t elbo_fast_launch(const FastParams& p, cudaStream_t stream) noexcept;

// ---- cluster launch helpers shared by both cluster kernels (elbo.cu) ----
struct ClusterDevice {
  int major = 0, sms = 0, smem_optin = 0;
};
// Cached per device.
cudaError_t cluster_device(int device, ClusterDevice* out) noexcept;
// How many clusters of C blocks (threads each, smem bytes of dynamic shared memory) can be
// resident at once (0: not launchable here); raises the kernel's smem limit as needed. Cached.
cudaError_t cluster_fit(const void* kernel, int device, int C, int threads, int smem,
                        int* clusters) noexcept;
// cudaLaunchKernelEx with a cluster dimension of C; the launch's error (cudaGetLastError folded in).
// pdl: also cudaLaunchAttributeProgrammaticStreamSerialization (the kernel must then call
// griddepcontrol.wait before touching anything the previous kernel may write).
cudaError_t cluster_launch(const void* kernel, int blocks, int C, int threads, int smem,
                           void** args, cudaStream_t stream, bool pdl = false) noexcept;

// ---- rows path (large batches; rows.cu): cuBLAS GEMMs in binding_forward.cpp, these in between
// reparam_kl_kernel: z = mu + exp(0.5 lv) * eps (n, L) and, when kl != nullptr,
// kl = -0.5 sum_j (1 + lv - mu^2 - exp(lv)) (n,). One warp per row.
struct ReparamParams {
  const float* mu;    // (n, L), row stride ld
  const float* lv;    // (n, L), row stride ld
  const float* eps;   // (n, L)
  float* z;           // (n, L)
  float* kl;          // (n,) or nullptr
  int n, L, ld;
  int* zero;          // or nullptr: set to 0 first (the deferred check's per-call flag)
};

// bce_kernel: recon = sum_c BCE(sigmoid(logits), x), elbo = -(recon + kl); rows whose x holds a
// value outside [0, 1] or NaN get NaN in all three (kl is read, and overwritten only then).
struct BceParams {
  const float* logits;  // (n, D) = d wd2^T + bd2
  const float* x;       // (n, D)
  float* elbo;
  float* recon;
  float* kl;            // in: from reparam_kl_kernel; out: NaN on bad rows
  int n, D;
  int vec;              // 1: D % 4 == 0 and logits, x 16-byte aligned
  // The deferred check (err != nullptr): a bad row sets *flag (deferred_poison_launch then
  // poisons the call) and notes its bad values in *err, at row row0 + its row.
  DeferredRecord* err;
  int* flag;
  int row0;
};

// ---- the latent block fused (latent.cu; off the default path: binding ForwardOptions::latent) --
// Between the rows / tc paths' encoder and output layers, per tile of R rows, one block:
//   mu | logvar = h [wmu; wlv]^T + [bmu; blv],  z = mu + exp(0.5 logvar) eps,
//   kl = -0.5 sum_j (1 + logvar - mu^2 - exp(logvar)),  d = z wd1^T + bd1 (relu'd where relu)
// where the unfused path runs two cuBLAS GEMMs (or one on the stacked weights and a cat of the
// biases), reparam_kl_kernel and a third GEMM. d may be written over h (each block stages its
// rows of h before it writes any d).
struct LatentParams {
  const float* h;     // (n, H), row stride ldh: the encoder's hidden layer (relu'd)
  const float* wmu;   // (L, H)
  const float* bmu;   // (L)
  const float* wlv;   // (L, H)
  const float* blv;   // (L)
  const float* eps;   // (n, L)
  const float* wd1;   // (H, L)
  const float* bd1;   // (H)
  float* d;           // (n, H), row stride ldh
  float* kl;          // (n,)
  int* zero;          // or nullptr: set to 0 first (ReparamParams::zero)
  int n, H, L, ldh;
  int relu;           // 1: d = relu(...) (rows path); 0: before its ReLU (tc's output layer)
  // Filled by latent_plan():
  int R;              // rows per block
  int vec_h, vec_l;   // float4 over H (h, wmu, wlv rows) / over L (wd1 rows)
  int ldw, ldm, ldz;  // shared-memory row strides (floats): h rows, mu | logvar rows, z rows
  int off_m, off_z, smem_bytes;
};
// Plans a launch for this device: kElboOk, or kElboTooLarge where even one row of h does not
// fit a block's shared memory (the caller keeps the unfused path), kElboCudaError. Host only.
ElboStatus latent_plan(LatentParams& p, int device, cudaError_t* cuda_err) noexcept;
cudaError_t latent_launch(const LatentParams& p, cudaStream_t stream) noexcept;

cudaError_t reparam_launch(const ReparamParams& p, cudaStream_t stream) noexcept;
cudaError_t bce_launch(const BceParams& p, cudaStream_t stream) noexcept;
// The value check on x (n > 0 floats): flags[b] = 1 if block b of range_flags_blocks(n) saw a
// value outside [0, 1] or NaN, else 0. One launch; the caller ORs the flags (at most
// kRangeFlagsMax of them; flags may be mapped host memory).
constexpr int kRangeFlagsMax = 1024;
int range_flags_blocks(long long n) noexcept;
cudaError_t range_flags_launch(const float* x, long long n, int* flags,
                               cudaStream_t stream) noexcept;
// out[0, n) = the torch.randn(n) draw r describes, reproduced (philox.cuh); one launch.
cudaError_t randn_fill_launch(float* out, long long n, const TorchRandn& r,
                              cudaStream_t stream) noexcept;

// ---- backward (backward.cu): the gradient of <g, (elbo, recon, kl)>, as torch_ref.backward ----
// prep_kernel, one warp per row: keep = x row inside [0, 1] and not NaN; xc = keep ? x : 0;
// g_rec = keep ? g_recon - g_elbo : 0 and g_kl = keep ? g_kl - g_elbo : 0, where a missing
// (nullptr) incoming gradient counts as absent, as autograd's None. Outputs whose pointer is
// nullptr are not written (the branch no gradient reaches).
struct PrepParams {
  const float* x;        // (n, D)
  const float* g_elbo;   // (n,) or nullptr
  const float* g_recon;  // (n,) or nullptr
  const float* g_kl;     // (n,) or nullptr
  float* xc;             // (n, D)
  float* keep;           // (n,) 1 or 0
  float* rec_out;        // (n,) or nullptr: recon branch unused
  float* kl_out;         // (n,) or nullptr: kl branch unused
  int n, D;
};

// bce_grad_kernel, one block per row, in place over the logits: p = sigmoid(a); a row holding a
// NaN p has its BCE gradient zeroed (torch_ref's nan_rows); ga = sigmoid_backward(bce_backward(
// g_rec, p, x), p). When gx != nullptr also gx = keep ? -logit(p) * g_rec : 0 (p -> 0.5 on NaN
// rows), BCE's gradient with respect to its target.
struct BceGradParams {
  float* ga;             // (n, D): in logits, out the gradient at the logits
  const float* x;        // (n, D): xc
  const float* g_rec;    // (n,)
  const float* keep;     // (n,)
  float* gx;             // (n, D) or nullptr
  int n, D;
};

// latent_bwd_kernel, elementwise over (n, L): from g_z (nullptr: recon branch unused) and g_kl
// (nullptr: kl branch unused), g_mu and g_lv; g_eps = g_z * exp(0.5 lv) (0 without g_z) when
// g_eps != nullptr.
struct LatentBwdParams {
  const float* g_z;      // (n, L) or nullptr
  const float* mu;
  const float* lv;
  const float* eps;
  const float* g_kl;     // (n,) or nullptr
  float* g_mu;
  float* g_lv;
  float* g_eps;          // (n, L) or nullptr
  int n, L;
};

// colsum_kernel: dst[t][j] = sum_i src[t][i * cols[t] + j] for t < count, i < n, in chunks of
// kColSumRows rows whose partial sums go through ws (colsum_workspace floats; none up to
// kColSumRows rows).
constexpr int kColSumMax = 8;
constexpr int kColSumRows = 256;
struct ColSumParams {
  const float* src[kColSumMax];
  float* dst[kColSumMax];
  int cols[kColSumMax];
  int first_block[kColSumMax], first_col[kColSumMax + 1];  // filled by colsum_launch
  int count, n, ws_cols;
  float* ws;
};
int colsum_workspace(const ColSumParams& p) noexcept;

cudaError_t prep_launch(const PrepParams& p, cudaStream_t stream) noexcept;
cudaError_t colsum_launch(ColSumParams& p, cudaStream_t stream) noexcept;
cudaError_t bce_grad_launch(const BceGradParams& p, cudaStream_t stream) noexcept;
cudaError_t latent_bwd_launch(const LatentBwdParams& p, cudaStream_t stream) noexcept;

// ---- Adam (adam.cu): one update of up to kAdamMax float32 tensors, torch's fused formula ----
constexpr int kAdamMax = 16;
struct AdamParams {
  float* param[kAdamMax];
  const float* grad[kAdamMax];
  float* exp_avg[kAdamMax];
  float* exp_avg_sq[kAdamMax];
  const float* step[kAdamMax];  // device scalars, already incremented for this step
  long long numel[kAdamMax];
  int first_block[kAdamMax];    // filled by adam_launch
  int count;
  double lr, beta1, beta2, eps, weight_decay;
};

cudaError_t adam_launch(AdamParams& p, cudaStream_t stream) noexcept;

// ---- IWAE evaluation (iwae.cu): the decoder of K samples per image on tensor cores ----
// One block per (image b, K-split): samples [split * k_per_split, ...) in tiles of
// 32 * mt, each folded into a running logsumexp; part[b * splits + split] receives it (NaN when
// a weight is NaN, e.g. a target outside [0, 1]).
struct IwaeParams {
  const float* x;          // (B, D) targets
  const float* mu;         // (B, L) encoder means (float64-exact, rounded)
  const float* lv;         // (B, L) encoder log-variances
  const float* eps;        // (K, B, L) injected noise, or nullptr: Philox in the kernel
  const long long* image;  // (B,) image index per row (the noise key), or nullptr: the row
  const float* w1;         // dec_w1 (H, L)
  const float* b1;         // dec_b1 (H)
  const float* w2;         // dec_w2 (D, H)
  const float* b2;         // dec_b2 (D)
  float* part;             // (B, splits) partial logsumexps
  unsigned long long seed;
  long long K;             // samples per image
  long long k_per_split;   // a multiple of the tile (32 * mt)
  int splits;
  int B, D, H, L;
  int vec;                 // 1: w1 and w2 rows are 16-byte copyable (L, H % 4 == 0, aligned)
  // Filled by iwae_plan():
  int mt;                  // m16 tiles per warp: 4 (tiles of 128 samples) or 2 (64)
  int lp, hp;              // L, H rounded up to 8 (the MMA's k step)
  int ldz, ldd;            // shared-memory row strides of z and d (floats)
  int smem_bytes;
};
// Picks the tile (mt) from the dims and the device only, never from B or K, so that an
// image's estimate does not depend on the batch; kElboTooLarge: the dims do not fit (the
// Triton kernel takes any dims). Host-only, no stream work.
ElboStatus iwae_plan(IwaeParams& p, int device, cudaError_t* cuda_err) noexcept;
cudaError_t iwae_launch(const IwaeParams& p, cudaStream_t stream) noexcept;
// The same bound on wgmma (iwae_wgmma.cu, sm_90a; off the default path: FASTELBO_IWAE_WGMMA):
// the same blocks, tile (128 samples), noise, numerics and partials as iwae.cu; the decoder's
// weights come split (iwae_wgmma_split_launch: hi, lo = w - hi as iwae.cu's tf32_split) in
// (rows, ld) buffers, ld % 4 == 0. Applies where L <= kIwaeWgmmaMaxL, H <= kIwaeWgmmaMaxH and
// the shared memory holds the tile (iwae_wgmma_plan).
constexpr int kIwaeWgmmaMaxL = 32, kIwaeWgmmaMaxH = 256;
struct IwaeWgmmaParams {
  CUtensorMap w1hi_map, w1lo_map, w2hi_map, w2lo_map;  // encoded by iwae_wgmma_launch
  const float *x, *mu, *lv, *eps;  // as IwaeParams
  const long long* image;
  const float *b1, *b2;
  float* part;             // (B, splits)
  unsigned long long seed;
  long long K, k_per_split;
  int splits, B, D, H, L;
  int smem_bytes;          // filled by iwae_wgmma_plan()
};
ElboStatus iwae_wgmma_plan(IwaeWgmmaParams& p, int device, cudaError_t* cuda_err) noexcept;
cudaError_t iwae_wgmma_split_launch(const float* w, int rows, int cols, float* hi, float* lo,
                                    int ld, cudaStream_t stream) noexcept;
cudaError_t iwae_wgmma_launch(IwaeWgmmaParams& p, const float* w1_hi, const float* w1_lo,
                              int ldw1, const float* w2_hi, const float* w2_lo, int ldw2,
                              cudaStream_t stream) noexcept;

// The driver's cuTensorMapEncodeTiled through the runtime (no -lcuda at link time), or nullptr
// where the driver has none (elbo_fast.cu; tc_gemm.cu uses it too).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() noexcept;
// A 2-D float32 map of a (rows x cols, row stride ld floats) matrix in boxes of box_cols x
// box_rows, elements outside it read as zero; false where the encoder is missing or refuses.
bool encode_tensor_map_2d(CUtensorMap* map, const float* base, int cols, int rows, int ld,
                          int box_cols, int box_rows, CUtensorMapSwizzle swizzle,
                          CUtensorMapL2promotion promotion) noexcept;

// ---- tensor-core GEMMs at large B (tc_gemm.cu, sm_90a: wgmma, tf32x3) ----
// C = A (M, K) x W (N, K)^T to float32 accuracy, then kTcStore: out = C + bias, relu'd where act
// (the encoder's hidden layer, the backward's recomputed logits), zeroed where a mask is given
// and mask <= 0 (threshold_backward(C, mask, 0): a hidden layer's gradient), or kTcBce: per row
// and column tile (tc_gemm_tiles_n), the clamped-BCE sum of sigmoid(C + bias) against x (and
// whether an x there was outside [0, 1]) into partial / partial_bad ((M, tiles) row-major).
// W comes split (tc_split_t_launch). Needs lda % 4 == 0, ldw % 4 == 0 (W's row
// stride; 0 means K), 16-byte aligned rows, and for kTcBce N % 4 == 0 and ldx % 4 == 0. K is any
// length: TMA reads zeros beyond it.
constexpr int kTcStore = 0, kTcBce = 1;
constexpr int kTcTileN = 128;
struct TcGemmParams {
  CUtensorMap a_map, w_map, wlo_map, x_map;  // encoded by tc_gemm_launch
  const float* bias;                  // (N), or nullptr: none
  float* out;                         // kTcStore: (M, ldo)
  const float* mask;                  // kTcStore: (M, ldm) or nullptr
  const float* x;                     // kTcBce: targets (M, ldx)
  float* partial;                     // kTcBce: (M, tiles)
  unsigned char* partial_bad;         // kTcBce: (M, tiles)
  int M, N, K, ldo, ldx, ldm, ldw, mode;
  int act;                            // kTcStore: 1: relu (NaN kept)
  int relu_a;                         // 1: read A as relu(A) (NaN kept)
  int w_finite;                       // 1: W's elements are finite (weights): A's split is
                                      // tf32_split_act, else tf32_split_inf; kTcBce needs 1
  int splits;                         // kTcStore: K split this many ways (tc_gemm_splits)
  float* ws;                          // kTcStore, splits > 1: (splits, M, N) partial sums
  int* any_bad;                       // kTcBce: set to 1 where a tile saw a bad x (or nullptr)
};
int tc_gemm_tiles_n(int N) noexcept;  // the kTcBce partials' tiles per row
// kTcStore's K split for a GPU of `sms` multiprocessors: enough blocks for about one wave where
// the tiles alone leave SMs idle (small M, or the weight gradients' small M x N), each split
// at least two K stages; 1 otherwise.
int tc_gemm_splits(int M, int N, int K, int sms) noexcept;
cudaError_t tc_gemm_launch(TcGemmParams& p, const float* a, int lda, const float* w_hi,
                           const float* w_lo, cudaStream_t stream) noexcept;
// ---- the output layer as one persistent ping-pong kernel (pingpong.cu, sm_90a; off the default
// path: binding ForwardOptions::output) ----
// recon = the clamped-BCE row sums of sigmoid(relu(A) W^T + bias) against x, elbo = -(recon +
// kl), NaN rows (all three) where x holds a value outside [0, 1]: A (M, K) the decoder's hidden
// layer before its ReLU, W (N, K) split as tc_split_t_launch does. Needs pingpong_fits(N, K),
// lda, ldw % 4 == 0 with 16-byte aligned rows, ldx even and x 8-byte aligned. No deferred check.
constexpr int kPingpongTileN = 112;  // columns per tile (784 = 7 x 112)
constexpr int kPingpongMaxK = 256;   // a unit's rows of A stay in shared memory
struct PingpongParams {
  CUtensorMap a_map, w_map, wlo_map;  // encoded by pingpong_launch
  const float* bias;                  // (N)
  const float* x;                     // (M, ldx) targets
  float *elbo, *recon, *kl;           // (M); kl: in (the latent block's) and out (NaN rows)
  int M, N, K, ldx, ldw;              // ldw: W's row stride (0: K)
  int sms;                            // multiprocessors: the persistent grid's bound
};
bool pingpong_fits(int N, int K) noexcept;
int pingpong_blocks(int M, int sms) noexcept;  // min(sms, pairs of 64-row units)
cudaError_t pingpong_launch(PingpongParams& p, const float* a, int lda, const float* w_hi,
                            const float* w_lo, cudaStream_t stream) noexcept;
// recon = sum of a row's partials (tile order), elbo = -(recon + kl); NaN rows where bad.
struct TcFinishParams {
  const float* partial;
  const unsigned char* partial_bad;
  float *elbo, *recon, *kl;  // kl: in (from reparam_kl_kernel) and out (NaN rows)
  int n, tiles;
  // The deferred check (err != nullptr): bad rows note their values of x (n rows of D, the
  // call's rows row0 + ...) in *err; where *flag != 0 (the output-layer kernels saw a bad x in
  // this chunk or an earlier one) every row is NaN, and so are the `prior` rows before elbo,
  // recon and kl (the call's earlier chunks: the last chunk's finish passes them).
  DeferredRecord* err;
  const int* flag;
  const float* x;
  int D, row0, prior;
};
cudaError_t tc_bce_finish_launch(const TcFinishParams& p, cudaStream_t stream) noexcept;
// Up to kTcSplitMax jobs in one launch: src (rows x cols, row stride lds) into hi / lo (hi =
// src's top 11 significant bits, exact in TF32; lo = src - hi) as they
// are (trans 0: rows x cols, row stride ldt) or transposed (trans 1: cols x rows, row stride
// ldt); lo nullptr: hi is a plain copy, not split. The backward's operands: weights transposed,
// activations transposed so that the batch is the weight gradients' K.
constexpr int kTcSplitMax = 4;
struct TcSplitParams {
  const float* src[kTcSplitMax];
  float* hi[kTcSplitMax];
  float* lo[kTcSplitMax];
  int rows[kTcSplitMax], cols[kTcSplitMax], lds[kTcSplitMax], ldt[kTcSplitMax];
  int trans[kTcSplitMax];
  int first_block[kTcSplitMax + 1];  // filled by tc_split_t_launch
  int count;
};
cudaError_t tc_split_t_launch(TcSplitParams& p, cudaStream_t stream) noexcept;

}  // namespace fastelbo
