// The importance-weighted bound's torch-facing half (declared in binding.h): iwae.cu's launch
// plan and its partial logsumexps, on PyTorch's current stream. The encoder (float64) and the
// final logsumexp run in Python (backends/cuda/iwae.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "binding.h"
#include "binding_common.h"
#include "elbo.h"

namespace fastelbo::binding {

// IWAE partial logsumexps (B, splits) for backends/cuda/iwae.py, which has already run every
// check below in Python (these are a second line: see binding.h).
// eps (K, B, L) and image (B,) int64 are optional; mu / lv come from the float64 encoder.
at::Tensor iwae_partials(const at::Tensor& x, const at::Tensor& mu, const at::Tensor& lv,
                         const std::optional<at::Tensor>& eps,
                         const std::optional<at::Tensor>& image, const at::Tensor& dec_w1,
                         const at::Tensor& dec_b1, const at::Tensor& dec_w2,
                         const at::Tensor& dec_b2, int64_t samples, int64_t k_per_split,
                         int64_t splits, int64_t seed) {
  FE_CHECK(x.defined(), "x is undefined");
  const auto dev = x.device();
  FE_CHECK_TENSOR(x, "x", dev);
  FE_CHECK_TENSOR(mu, "mu", dev);
  FE_CHECK_TENSOR(lv, "logvar", dev);
  FE_CHECK_TENSOR(dec_w1, "dec_w1", dev);
  FE_CHECK_TENSOR(dec_b1, "dec_b1", dev);
  FE_CHECK_TENSOR(dec_w2, "dec_w2", dev);
  FE_CHECK_TENSOR(dec_b2, "dec_b2", dev);
  FE_CHECK(x.dim() == 2 && dec_w1.dim() == 2, "x and dec_w1 must be 2-D");
  const int64_t B = x.size(0), D = x.size(1), H = dec_w1.size(0), L = dec_w1.size(1);
  FE_CHECK(B >= 1 && D >= 1 && H >= 1 && L >= 1, "empty x or weights");
  check_shape(mu, "mu", {B, L});
  check_shape(lv, "logvar", {B, L});
  check_shape(dec_b1, "dec_b1", {H});
  check_shape(dec_w2, "dec_w2", {D, H});
  check_shape(dec_b2, "dec_b2", {D});
  FE_CHECK(samples >= 1 && k_per_split >= 1 && splits >= 1 && seed >= 0, "bad iwae options");
  FE_CHECK(B * splits <= std::numeric_limits<int32_t>::max(), "too many blocks");
  if (eps.has_value()) {
    FE_CHECK_TENSOR(*eps, "eps", dev);
    check_shape(*eps, "eps", {samples, B, L});
  }
  if (image.has_value()) {
    FE_CHECK(image->is_cuda() && image->device() == dev && image->is_contiguous() &&
                 image->scalar_type() == at::kLong,
             "image indices must be a contiguous int64 tensor on x's device");
    check_shape(*image, "image indices", {B});
  }
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
// {0, 0, status} when it does not apply (backends/cuda/iwae.py reads it).
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
