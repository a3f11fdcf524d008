// The importance-weighted bound's torch-facing half (declared in binding.h): iwae.cu's launch
// plan and its partial logsumexps, on PyTorch's current stream. The encoder (float64) and the
// final logsumexp run in Python (backends/cuda/iwae_kernel.py).
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

// IWAE partial logsumexps (B, splits) for backends/cuda/iwae_kernel.py, or an undefined tensor
// (None) with nothing launched where check_inputs finds a rule broken (last_status says which).
// eps (K, B, L) and image (B,) int64 are optional; mu / lv come from the float64 encoder; of
// the parameters only the decoder's are read.
at::Tensor iwae_partials(const at::Tensor& x, const at::Tensor& mu, const at::Tensor& lv,
                         const std::optional<at::Tensor>& eps,
                         const std::optional<at::Tensor>& image,
                         const std::vector<at::Tensor>& params, int64_t samples,
                         int64_t k_per_split, int64_t splits, int64_t seed) {
  CheckCall call = vae_call(x, eps, params);
  call.eps_required = false;
  call.samples = samples;
  call.mu = &mu;
  call.logvar = &lv;
  call.image = image.has_value() ? &*image : nullptr;
  if (!passes(call)) return {};
  const VaeTensors w(params);
  const at::Tensor &dec_w1 = w.dec_w1, &dec_b1 = w.dec_b1, &dec_w2 = w.dec_w2, &dec_b2 = w.dec_b2;
  const auto dev = x.device();
  const int64_t B = x.size(0), D = x.size(1), H = dec_w1.size(0), L = dec_w1.size(1);
  // The options (iwae_kernel.py computes them: a second line).
  FE_CHECK(samples >= 1 && k_per_split >= 1 && splits >= 1 && seed >= 0, "bad iwae options");
  FE_CHECK(B * splits <= std::numeric_limits<int32_t>::max(), "too many blocks");
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  at::Tensor part = at::empty({B, splits}, x.options());
  fastelbo::IwaeParams p{};
  p.x = x.data_ptr<float>();
  p.mu = mu.data_ptr<float>();
  p.lv = lv.data_ptr<float>();
  p.eps = eps.has_value() ? eps->data_ptr<float>() : nullptr;
  p.image = image.has_value() ? reinterpret_cast<const long long*>(image->data_ptr<int64_t>())
                              : nullptr;
  p.w1 = dec_w1.data_ptr<float>();
  p.b1 = dec_b1.data_ptr<float>();
  p.w2 = dec_w2.data_ptr<float>();
  p.b2 = dec_b2.data_ptr<float>();
  p.part = part.data_ptr<float>();
  p.seed = static_cast<unsigned long long>(seed);
  p.K = samples;
  p.k_per_split = k_per_split;
  p.splits = static_cast<int>(splits);
  p.B = static_cast<int>(B);
  p.D = static_cast<int>(D);
  p.H = static_cast<int>(H);
  p.L = static_cast<int>(L);
  p.vec = L % 4 == 0 && H % 4 == 0 && aligned16(p.w1) && aligned16(p.w2);
  cudaError_t err = cudaSuccess;
  const auto st = fastelbo::iwae_plan(p, static_cast<int>(dev.index()), &err);
  FE_CHECK(st != fastelbo::kElboCudaError, "planning the iwae launch failed: ",
           cudaGetErrorString(err));
  FE_CHECK(st == fastelbo::kElboOk, "the iwae kernel does not apply here (status ",
           static_cast<int>(st), ")");
  check_launch(fastelbo::iwae_launch(p, stream), "iwae kernel");
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

}  // namespace fastelbo::binding
