// The cuda backend's torch-facing API: every entry point the Python module binds
// (binding_module.cpp) and the option structs they take, defined in binding_forward.cpp,
// binding_backward.cpp and binding_iwae.cpp. Python calls these through backends/cuda/launch.py
// only (one keyword-only wrapper per entry), which fastelbo/export.py carries too.
//
// One signature: every entry takes the VAE's ten parameters as one list in VAEParams order
// (`params`), read by name through VaeTensors once its check has passed. Every entry that takes
// them checks its inputs with check_inputs (binding_check.h), which never throws: where a rule
// is broken the entry launches nothing and returns an empty list (iwae_partials: None), and
// last_status() says which rule and tensor, for Python to raise fastelbo.contract's message
// (backends/cuda/status.py). No input check throws: on the H200 image a C++ exception whose
// message streamed a number killed the process.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace fastelbo::binding {

// The forward's path (ForwardOptions::path); launch.py's PATHS names them.
enum Path : int64_t { kPathAuto = 0, kPathCluster = 1, kPathRows = 2, kPathFast = 3, kPathTc = 4 };

// The rows and tc paths' latent block (ForwardOptions::latent): auto (fused where
// FASTELBO_FUSED_LATENT=1, until a GPU run accepts it), fused (latent.cu, one launch), cublas.
enum Latent : int64_t { kLatentAuto = 0, kLatentFused = 1, kLatentCublas = 2 };

// The tc path's output layer (ForwardOptions::output): auto (pingpong where FASTELBO_PINGPONG=1,
// until a GPU run accepts it), pingpong (pingpong.cu, one persistent launch writing the rows),
// tc (tc_gemm.cu's tiles and the finish kernel). Without the deferred check only.
enum Output : int64_t { kOutputAuto = 0, kOutputPingpong = 1, kOutputTc = 2 };

// How one forward launches. The defaults are the product's call; launch.py pre-builds the four
// default objects (draw, awaits) once per extension, so the hot path parses no options.
struct ForwardOptions {
  int64_t rows = 0;      // > 0 forces the cluster plan's rows per cluster (1..64; tuning)
  int64_t cluster = 0;   // > 0 forces blocks per cluster (1..16; tuning)
  int64_t staged = -1;   // 0 / 1 forces the staged variant off / on (-1: the planner's choice)
  bool poison = false;   // fill the outputs with NaN first (tests: every element is written)
  int64_t path = kPathAuto;
  bool draw = false;     // overwrite eps with one torch.randn(B, L) draw and compute with it
  bool awaits = false;   // this thread's value check on x is in flight: wait for it first
                         // (if it failed: nothing launched, [] back, last_status kCheckValue)
  bool deferred = false; // the value check on x done by the forward's own kernels, no wait:
                         // a bad x makes every output NaN and is noted in the device's
                         // record (elbo.h DeferredRecord), which take_deferred reads
  int64_t latent = kLatentAuto;  // the rows / tc paths' latent block (Latent)
  int64_t output = kOutputAuto;  // the tc path's output layer (Output)
};

// The ten parameters by name, as views of the list every entry takes (VAEParams order). Only
// built from a list check_inputs has passed (ten tensors).
struct VaeTensors {
  explicit VaeTensors(const std::vector<at::Tensor>& p)
      : enc_w(p[0]), enc_b(p[1]), mu_w(p[2]), mu_b(p[3]), lv_w(p[4]), lv_b(p[5]), dec_w1(p[6]),
        dec_b1(p[7]), dec_w2(p[8]), dec_b2(p[9]) {}
  const at::Tensor &enc_w, &enc_b, &mu_w, &mu_b, &lv_w, &lv_b, &dec_w1, &dec_b1, &dec_w2, &dec_b2;
};

// The backward's large GEMMs: cuBLAS in float32, or tensor cores in tf32x3 (tc_gemm.cu), their
// operands split and transposed by a launch of their own (tc) or written so by the kernels that
// produce them, the latent side fused (fused: binding_backward_fused.cpp; auto takes it where
// FASTELBO_TC_TRAIN=1, until a GPU run accepts it).
enum Gemm : int64_t { kGemmAuto = 0, kGemmCublas = 1, kGemmTc = 2, kGemmFused = 3 };

// Which gradients one backward computes, and how.
struct BackwardOptions {
  bool use_elbo = true;   // a gradient reaches elbo (else g_elbo is not read)
  bool use_recon = true;  // ... recon
  bool use_kl = true;     // ... kl
  bool need_x = true;     // compute g_x (else an empty tensor in its place)
  bool need_eps = true;   // compute g_eps (likewise)
  int64_t gemm = kGemmAuto;  // the large GEMMs' engine (binding_backward.cpp; launch.py GEMMS)
};

// ---- forward, the value check, the noise (binding_forward.cpp) ----
// {elbo, recon, kl}, or [] where a check failed (last_status).
std::vector<at::Tensor> elbo_forward(const at::Tensor& x, const std::optional<at::Tensor>& eps,
                                     const std::vector<at::Tensor>& params,
                                     const ForwardOptions& opt);
std::vector<int64_t> elbo_plan_info(int64_t device, int64_t B, int64_t D, int64_t H, int64_t L,
                                    int64_t rows, int64_t cluster, int64_t staged);
std::vector<int64_t> elbo_fast_plan_info(int64_t device, int64_t B, int64_t D, int64_t H,
                                         int64_t L, bool one_wave);
int64_t checked_start(const at::Tensor& x, const std::optional<at::Tensor>& eps,
                      const std::vector<at::Tensor>& params, bool validate);
// The input checks for a forward that will take the deferred check: 2 = passed, 3 = passed and
// the current stream is capturing a graph, < 0 the packed status (as checked_start's).
int64_t checked_start_deferred(const at::Tensor& x, const std::optional<at::Tensor>& eps,
                               const std::vector<at::Tensor>& params);
// The deferred check's record of `device`, moved out: {count, row, col, value bits} of the bad
// x values forwards met since the last take ({0, 0, 0, 0}: none). Waits for all work on the
// device first, unless no deferred forward ran there since the last take (none captured in a
// graph either): then it returns at once.
std::vector<int64_t> take_deferred(int64_t device);
// The packed status (CheckStatus::packed) of this thread's last check by an entry: 0 if it
// passed.
int64_t last_status();
void range_check_start(const at::Tensor& x);
bool range_check_finish(int64_t device);
bool x_in_unit_range(const at::Tensor& x);
at::Tensor draw_randn(int64_t n, int64_t device);
long long pdl_launches();

// ---- backward and the optimizer (binding_backward.cpp) ----
// {g_x, g_eps, 10 parameter grads} of <grads, (elbo, recon, kl)>, or [] where a check failed.
std::vector<at::Tensor> elbo_backward(const at::Tensor& x, const std::optional<at::Tensor>& eps,
                                      const std::vector<at::Tensor>& params,
                                      const std::vector<at::Tensor>& grads,
                                      const BackwardOptions& opt);
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
               double eps, double weight_decay);

// ---- the importance-weighted bound (binding_iwae.cpp) ----
// (B, splits) partial logsumexps, or an undefined tensor (None) where a check failed.
at::Tensor iwae_partials(const at::Tensor& x, const at::Tensor& mu, const at::Tensor& lv,
                         const std::optional<at::Tensor>& eps,
                         const std::optional<at::Tensor>& image,
                         const std::vector<at::Tensor>& params, int64_t samples,
                         int64_t k_per_split, int64_t splits, int64_t seed);
std::vector<int64_t> iwae_plan_info(int64_t device, int64_t D, int64_t H, int64_t L);
// The same from iwae_wgmma.cu (off the default path; its plan: {128, smem bytes, 0} or
// {0, 0, status}).
at::Tensor iwae_wgmma_partials(const at::Tensor& x, const at::Tensor& mu, const at::Tensor& lv,
                               const std::optional<at::Tensor>& eps,
                               const std::optional<at::Tensor>& image,
                               const std::vector<at::Tensor>& params, int64_t samples,
                               int64_t k_per_split, int64_t splits, int64_t seed);
std::vector<int64_t> iwae_wgmma_plan_info(int64_t device, int64_t D, int64_t H, int64_t L);

}  // namespace fastelbo::binding
