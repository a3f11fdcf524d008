// The only torch-facing file of the cuda backend: checks device, dtype, shape and contiguity,
// fills the plain ElboParams struct, picks the launch plan and launches on PyTorch's current
// stream, turning every CUDA error into an exception. elbo.cu never sees a torch type.
//
// fastelbo/export.py inlines this file (with FASTELBO_INLINE defined and elbo.h pasted in) into
// a load_inline source, where torch generates the Python binding itself.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "elbo.h"

#define FE_CHECK(cond, ...) TORCH_CHECK(cond, "fastelbo cuda backend: ", __VA_ARGS__)
#define FE_CHECK_TENSOR(t, name, dev)                                                        \
  do {                                                                                       \
    FE_CHECK((t).defined(), name, " is undefined");                                          \
    FE_CHECK((t).is_cuda(), name, " must be a CUDA tensor, got one on ", (t).device());      \
    FE_CHECK((t).scalar_type() == at::kFloat, name, " must be float32, got ",               \
             (t).scalar_type());                                                             \
    FE_CHECK((t).is_contiguous(), name, " must be contiguous");                              \
    FE_CHECK((t).device() == (dev), name, " is on ", (t).device(), " but x is on ", (dev));  \
  } while (0)
#define FE_CHECK_SHAPE(t, name, ...)                                                         \
  FE_CHECK((t).sizes() == at::IntArrayRef({__VA_ARGS__}), name, " must have shape ",         \
           at::IntArrayRef({__VA_ARGS__}), ", got ", (t).sizes())

namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

}  // namespace

// Returns {elbo, recon, kl}, each (B,) float32. rows / cluster > 0 and staged >= 0 force the
// plan (tuning; -1 / 0 = automatic); poison = true fills the outputs with NaN before the launch
// (tests: every element is written).
std::vector<at::Tensor> elbo_forward(const at::Tensor& x, const at::Tensor& eps,
                                     const at::Tensor& enc_w, const at::Tensor& enc_b,
                                     const at::Tensor& mu_w, const at::Tensor& mu_b,
                                     const at::Tensor& lv_w, const at::Tensor& lv_b,
                                     const at::Tensor& dec_w1, const at::Tensor& dec_b1,
                                     const at::Tensor& dec_w2, const at::Tensor& dec_b2,
                                     int64_t rows, int64_t cluster, int64_t staged,
                                     bool poison) {
  FE_CHECK(x.defined(), "x is undefined");
  const auto dev = x.device();
  FE_CHECK_TENSOR(x, "x", dev);
  FE_CHECK_TENSOR(eps, "eps", dev);
  FE_CHECK_TENSOR(enc_w, "enc_w", dev);
  FE_CHECK_TENSOR(enc_b, "enc_b", dev);
  FE_CHECK_TENSOR(mu_w, "mu_w", dev);
  FE_CHECK_TENSOR(mu_b, "mu_b", dev);
  FE_CHECK_TENSOR(lv_w, "lv_w", dev);
  FE_CHECK_TENSOR(lv_b, "lv_b", dev);
  FE_CHECK_TENSOR(dec_w1, "dec_w1", dev);
  FE_CHECK_TENSOR(dec_b1, "dec_b1", dev);
  FE_CHECK_TENSOR(dec_w2, "dec_w2", dev);
  FE_CHECK_TENSOR(dec_b2, "dec_b2", dev);
  FE_CHECK(x.dim() == 2, "x must be 2-D (batch, input_dim), got shape ", x.sizes());
  FE_CHECK(enc_w.dim() == 2, "enc_w must be 2-D (hidden_dim, input_dim), got ", enc_w.sizes());
  FE_CHECK(mu_w.dim() == 2, "mu_w must be 2-D (latent_dim, hidden_dim), got ", mu_w.sizes());
  const int64_t B = x.size(0), D = x.size(1), H = enc_w.size(0), L = mu_w.size(0);
  FE_CHECK(B >= 1, "x must hold at least one row");
  FE_CHECK(D >= 1 && H >= 1 && L >= 1, "dims must be positive, got input_dim=", D,
           " hidden_dim=", H, " latent_dim=", L);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  FE_CHECK(B <= kIntMax && D <= kIntMax && H <= kIntMax && L <= kIntMax,
           "sizes must fit in int32, got B=", B, " D=", D, " H=", H, " L=", L);
  FE_CHECK_SHAPE(enc_w, "enc_w", H, D);
  FE_CHECK_SHAPE(enc_b, "enc_b", H);
  FE_CHECK_SHAPE(mu_w, "mu_w", L, H);
  FE_CHECK_SHAPE(mu_b, "mu_b", L);
  FE_CHECK_SHAPE(lv_w, "lv_w", L, H);
  FE_CHECK_SHAPE(lv_b, "lv_b", L);
  FE_CHECK_SHAPE(dec_w1, "dec_w1", H, L);
  FE_CHECK_SHAPE(dec_b1, "dec_b1", H);
  FE_CHECK_SHAPE(dec_w2, "dec_w2", D, H);
  FE_CHECK_SHAPE(dec_b2, "dec_b2", D);
  FE_CHECK_SHAPE(eps, "eps", B, L);
  FE_CHECK(rows >= 0 && rows <= 64, "rows must be 0 (auto) or 1..64, got ", rows);
  FE_CHECK(cluster >= 0 && cluster <= 16, "cluster must be 0 (auto) or 1..16, got ", cluster);
  FE_CHECK(staged >= -1 && staged <= 1, "staged must be -1 (auto), 0 or 1, got ", staged);

  const c10::cuda::CUDAGuard guard(dev);
  fastelbo::ElboParams p{};
  p.x = x.data_ptr<float>();
  p.eps = eps.data_ptr<float>();
  p.w1 = enc_w.data_ptr<float>();
  p.b1 = enc_b.data_ptr<float>();
  p.wmu = mu_w.data_ptr<float>();
  p.bmu = mu_b.data_ptr<float>();
  p.wlv = lv_w.data_ptr<float>();
  p.blv = lv_b.data_ptr<float>();
  p.wd1 = dec_w1.data_ptr<float>();
  p.bd1 = dec_b1.data_ptr<float>();
  p.wd2 = dec_w2.data_ptr<float>();
  p.bd2 = dec_b2.data_ptr<float>();
  p.B = static_cast<int>(B);
  p.D = static_cast<int>(D);
  p.H = static_cast<int>(H);
  p.L = static_cast<int>(L);
  p.vec = ((D % 4 == 0 && aligned16(p.x) && aligned16(p.w1)) ? 1u : 0u) |
          ((H % 4 == 0 && aligned16(p.wmu) && aligned16(p.wlv)) ? 2u : 0u) |
          ((L % 4 == 0 && aligned16(p.wd1)) ? 4u : 0u) |
          ((H % 4 == 0 && aligned16(p.wd2)) ? 8u : 0u);

  cudaError_t err = cudaSuccess;
  const fastelbo::ElboStatus st =
      fastelbo::elbo_plan(p, dev.index(), static_cast<int>(rows), static_cast<int>(cluster),
                          static_cast<int>(staged), &err);
  FE_CHECK(st != fastelbo::kElboBadArch,
           "needs compute capability 9.0+ (thread-block clusters); use backend='torch' or "
           "backend='triton'");
  FE_CHECK(st != fastelbo::kElboTooLarge, "input_dim=", D, " hidden_dim=", H, " latent_dim=", L,
           " need ", fastelbo::elbo_smem_bytes(p.D, p.H, p.L, 1, 16, false),
           " bytes of shared memory per block even at one row per cluster, more than this GPU "
           "allows; use backend='torch' or backend='triton'");
  FE_CHECK(st != fastelbo::kElboNoCluster,
           "no thread-block cluster size fits on this GPU for these dims (rows=", rows,
           ", cluster=", cluster, "); use backend='torch' or backend='triton'");
  FE_CHECK(st == fastelbo::kElboOk, "planning the launch failed: ", cudaGetErrorString(err));

  const auto opts = x.options();
  std::vector<at::Tensor> out;
  for (int i = 0; i < 3; ++i)
    out.push_back(poison ? at::full({B}, std::nanf(""), opts) : at::empty({B}, opts));
  p.elbo = out[0].data_ptr<float>();
  p.recon = out[1].data_ptr<float>();
  p.kl = out[2].data_ptr<float>();

  err = fastelbo::elbo_launch(p, c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  FE_CHECK(err == cudaSuccess, "kernel launch failed (R=", p.R, ", C=", p.C, ", smem=",
           p.smem_bytes, " B, staged=", p.staged, "): ", cudaGetErrorString(err));
  return out;
}

// The launch plan the kernel would use: {R, C, smem_bytes, variant, staged}, or
// {-status, 0, 0, 0, 0} when there is none; for tests and benchmarks.
std::vector<int64_t> elbo_plan_info(int64_t device, int64_t B, int64_t D, int64_t H, int64_t L,
                                    int64_t rows, int64_t cluster, int64_t staged) {
  fastelbo::ElboParams p{};
  p.B = static_cast<int>(B);
  p.D = static_cast<int>(D);
  p.H = static_cast<int>(H);
  p.L = static_cast<int>(L);
  cudaError_t err = cudaSuccess;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const auto st = fastelbo::elbo_plan(p, static_cast<int>(device), static_cast<int>(rows),
                                      static_cast<int>(cluster), static_cast<int>(staged), &err);
  if (st != fastelbo::kElboOk) return {-static_cast<int64_t>(st), 0, 0, 0, 0};
  return {p.R, p.C, p.smem_bytes, p.variant, p.staged};
}

#ifndef FASTELBO_INLINE
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastelbo fused ELBO forward (CUDA, thread-block clusters)";
  m.def("forward", &elbo_forward, "(elbo, recon, kl) of the VAE; see fastelbo/backends/cuda",
        pybind11::arg("x"), pybind11::arg("eps"), pybind11::arg("enc_w"), pybind11::arg("enc_b"),
        pybind11::arg("mu_w"), pybind11::arg("mu_b"), pybind11::arg("lv_w"),
        pybind11::arg("lv_b"), pybind11::arg("dec_w1"), pybind11::arg("dec_b1"),
        pybind11::arg("dec_w2"), pybind11::arg("dec_b2"), pybind11::arg("rows") = 0,
        pybind11::arg("cluster") = 0, pybind11::arg("staged") = -1,
        pybind11::arg("poison") = false);
  m.def("plan", &elbo_plan_info,
        "launch plan {R, C, smem_bytes, variant, staged} or {-status, 0, 0, 0, 0}",
        pybind11::arg("device"), pybind11::arg("B"), pybind11::arg("D"), pybind11::arg("H"),
        pybind11::arg("L"), pybind11::arg("rows") = 0, pybind11::arg("cluster") = 0,
        pybind11::arg("staged") = -1);
}
#endif
