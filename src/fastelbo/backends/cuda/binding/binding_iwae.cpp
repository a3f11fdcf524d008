// The importance-weighted bound's torch-facing half (declared in binding.h): the launch plans
// and partial logsumexps of iwae.cu and of iwae_wgmma.cu (off the default path), on PyTorch's
// current stream. The encoder (float64) and the final logsumexp run in Python
// (backends/cuda/iwae_kernel.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "binding.h"
#include "binding_common.h"
#include "../kernels/elbo.h"

namespace fastelbo::binding {

namespace {

// The input check of an IWAE call (each entry runs it, passes(call), before it reads a tensor):
// eps (K, B, L) and image (B,) int64 are optional; mu / lv come from the float64 encoder.
CheckCall iwae_check(const at::Tensor& x, const at::Tensor& mu, const at::Tensor& lv,
                     const std::optional<at::Tensor>& eps, const std::optional<at::Tensor>& image,
                     const std::vector<at::Tensor>& vae, int64_t samples) {
  CheckCall call = vae_call(x, eps, vae);
  call.eps_required = false;
  call.samples = samples;
  call.mu = &mu;
  call.logvar = &lv;
  call.image = image.has_value() ? &*image : nullptr;
  return call;
}

// The fields both kernels' params take (IwaeParams, IwaeWgmmaParams), after the check passed;
// of the parameters only the decoder's biases here (each kernel takes its weights its way).
// Returns the (B, splits) partials it allocated.
template <class P>
at::Tensor iwae_fields(P& p, const at::Tensor& x, const at::Tensor& mu, const at::Tensor& lv,
                       const std::optional<at::Tensor>& eps,
                       const std::optional<at::Tensor>& image, const VaeTensors& w,
                       int64_t samples, int64_t k_per_split, int64_t splits, int64_t seed) {
  const int64_t B = x.size(0), D = x.size(1), H = w.dec_w1.size(0), L = w.dec_w1.size(1);
  // The options (iwae_kernel.py computes them: a second line).
  FE_CHECK(samples >= 1 && k_per_split >= 1 && splits >= 1 && seed >= 0, "bad iwae options");
  FE_CHECK(B * splits <= std::numeric_limits<int32_t>::max(), "too many blocks");
  at::Tensor part = at::empty({B, splits}, x.options());
  p.x = x.data_ptr<float>();
  p.mu = mu.data_ptr<float>();
  p.lv = lv.data_ptr<float>();
  p.eps = eps.has_value() ? eps->data_ptr<float>() : nullptr;
  p.image = image.has_value() ? reinterpret_cast<const long long*>(image->data_ptr<int64_t>())
                              : nullptr;
  p.b1 = w.dec_b1.data_ptr<float>();
  p.b2 = w.dec_b2.data_ptr<float>();
  p.part = part.data_ptr<float>();
  p.seed = static_cast<unsigned long long>(seed);
  p.K = samples;
  p.k_per_split = k_per_split;
  p.splits = static_cast<int>(splits);
  p.B = static_cast<int>(B);
  p.D = static_cast<int>(D);
  p.H = static_cast<int>(H);
  p.L = static_cast<int>(L);
  return part;
}

void check_plan(fastelbo::ElboStatus st, cudaError_t err, const char* kernel) {
  FE_CHECK(st != fastelbo::kElboCudaError, "planning the ", kernel, " launch failed: ",
           cudaGetErrorString(err));
  FE_CHECK(st == fastelbo::kElboOk, "the ", kernel, " kernel does not apply here (status ",
           static_cast<int>(st), ")");
}

}  // namespace

// IWAE partial logsumexps (B, splits) for backends/cuda/iwae_kernel.py from iwae.cu, or an
// undefined tensor (None) with nothing launched where check_inputs finds a rule broken
// (last_status says which).
at::Tensor iwae_partials(const at::Tensor& x, const at::Tensor& mu, const at::Tensor& lv,
                         const std::optional<at::Tensor>& eps,
                         const std::optional<at::Tensor>& image,
                         const std::vector<at::Tensor>& params, int64_t samples,
                         int64_t k_per_split, int64_t splits, int64_t seed) {
  const CheckCall call = iwae_check(x, mu, lv, eps, image, params, samples);
  if (!passes(call)) return {};
  const VaeTensors w(params);
  fastelbo::IwaeParams p{};
  at::Tensor part = iwae_fields(p, x, mu, lv, eps, image, w, samples, k_per_split, splits, seed);
  p.w1 = w.dec_w1.data_ptr<float>();
  p.w2 = w.dec_w2.data_ptr<float>();
  p.vec = p.L % 4 == 0 && p.H % 4 == 0 && aligned16(p.w1) && aligned16(p.w2);
  const auto dev = x.device();
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  cudaError_t err = cudaSuccess;
  check_plan(fastelbo::iwae_plan(p, static_cast<int>(dev.index()), &err), err, "iwae");
  check_launch(fastelbo::iwae_launch(p, stream), "iwae kernel");
  return part;
}

// The same partials from iwae_wgmma.cu (issue #56 item 5; iwae_kernel.py picks it): the
// decoder's weights split per call (hi, lo = w - hi as iwae.cu's tf32_split) into (rows, ld)
// buffers, ld a multiple of 4 floats as TMA wants, then the kernel; all on the current stream.
at::Tensor iwae_wgmma_partials(const at::Tensor& x, const at::Tensor& mu, const at::Tensor& lv,
                               const std::optional<at::Tensor>& eps,
                               const std::optional<at::Tensor>& image,
                               const std::vector<at::Tensor>& params, int64_t samples,
                               int64_t k_per_split, int64_t splits, int64_t seed) {
  const CheckCall call = iwae_check(x, mu, lv, eps, image, params, samples);
  if (!passes(call)) return {};
  const VaeTensors w(params);
  fastelbo::IwaeWgmmaParams p{};
  at::Tensor part = iwae_fields(p, x, mu, lv, eps, image, w, samples, k_per_split, splits, seed);
  const auto dev = x.device();
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  cudaError_t err = cudaSuccess;
  check_plan(fastelbo::iwae_wgmma_plan(p, static_cast<int>(dev.index()), &err), err,
             "iwae wgmma");
  const int ldw1 = (p.L + 3) / 4 * 4, ldw2 = (p.H + 3) / 4 * 4;
  const at::Tensor w1s = at::empty({2, p.H, ldw1}, x.options());
  const at::Tensor w2s = at::empty({2, p.D, ldw2}, x.options());
  float *w1_hi = w1s[0].data_ptr<float>(), *w1_lo = w1s[1].data_ptr<float>();
  float *w2_hi = w2s[0].data_ptr<float>(), *w2_lo = w2s[1].data_ptr<float>();
  check_launch(fastelbo::iwae_wgmma_split_launch(w.dec_w1.data_ptr<float>(), p.H, p.L, w1_hi,
                                                 w1_lo, ldw1, stream), "iwae wgmma split");
  check_launch(fastelbo::iwae_wgmma_split_launch(w.dec_w2.data_ptr<float>(), p.D, p.H, w2_hi,
                                                 w2_lo, ldw2, stream), "iwae wgmma split");
  check_launch(fastelbo::iwae_wgmma_launch(p, w1_hi, w1_lo, ldw1, w2_hi, w2_lo, ldw2, stream),
               "iwae wgmma kernel");
  return part;
}

// The IWAE kernel's tile for these dims on this device: {samples per tile, smem bytes, 0} or
// {0, 0, status} when it does not apply (backends/cuda/iwae_kernel.py reads it).
std::vector<int64_t> iwae_plan_info(int64_t device, int64_t D, int64_t H, int64_t L) {
  fastelbo::IwaeParams p{};
  p.D = static_cast<int>(D);
  p.H = static_cast<int>(H);
  p.L = static_cast<int>(L);
  cudaError_t err = cudaSuccess;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const auto st = fastelbo::iwae_plan(p, static_cast<int>(device), &err);
  if (st != fastelbo::kElboOk) return {0, 0, static_cast<int64_t>(st)};
  return {32 * p.mt, p.smem_bytes, 0};
}

// iwae_wgmma.cu's tile for these dims on this device: {128, smem bytes, 0}, or {0, 0, status}.
std::vector<int64_t> iwae_wgmma_plan_info(int64_t device, int64_t D, int64_t H, int64_t L) {
  fastelbo::IwaeWgmmaParams p{};
  p.D = static_cast<int>(D);
  p.H = static_cast<int>(H);
  p.L = static_cast<int>(L);
  cudaError_t err = cudaSuccess;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const auto st = fastelbo::iwae_wgmma_plan(p, static_cast<int>(device), &err);
  if (st != fastelbo::kElboOk) return {0, 0, static_cast<int64_t>(st)};
  return {128, p.smem_bytes, 0};
}

}  // namespace fastelbo::binding
