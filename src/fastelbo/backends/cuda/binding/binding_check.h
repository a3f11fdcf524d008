// The binding's one input check. Every entry that takes the VAE's tensors (forward, backward,
// iwae_partials, checked_start) fills a CheckCall and calls check_inputs, which never throws:
// it returns the first rule broken as a code and a field, and the entry launches nothing.
// Python turns the pair into fastelbo.contract's message (backends/cuda/status.py, which names
// the codes and fields in this order). The rules are the contract's, narrowed to what the
// kernels take: dense float32 tensors, contiguous, on x's device of `device_type`, the shapes
// the dims read off x (B, D), enc_w (H, D) and mu_w (L, H) give, every dim >= 1 and within
// int32. Host code reading tensor metadata only (ATen, no CUDA call): tests/test_cuda_status.py
// builds it for the CPU and checks it against the contract there.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <cstdint>
#include <vector>

namespace fastelbo::binding {

// What was broken (status.py CODES).
enum CheckCode : int64_t {
  kCheckOk = 0,
  kCheckCount = 1,       // params is not the ten tensors (field: enc_w)
  kCheckMissing = 2,     // no tensor where one is needed (None from Python)
  kCheckLayout = 3,      // not a dense (strided) tensor
  kCheckDtype = 4,       // not float32 (image: not int64)
  kCheckDeviceType = 5,  // not on a device of the wanted type
  kCheckDevice = 6,      // not on x's device
  kCheckContiguous = 7,
  kCheckRank = 8,        // x, enc_w or mu_w not 2-D (the dims are read off them)
  kCheckEmpty = 9,       // x holds no row, or a dim is < 1
  kCheckInt32 = 10,      // a size beyond int32
  kCheckShape = 11,      // a shape other than the dims give
  kCheckValue = 12,      // the value check on x (forward's ForwardOptions::awaits) failed
  kCheckStream = 13,     // checked_start could not ask whether the stream captures a graph
};

// Which tensor (status.py FIELDS): x, eps, the ten parameters in VAEParams order, the
// backward's three output gradients, the IWAE's encoder outputs and image indices.
enum CheckField : int64_t {
  kFieldX = 0,
  kFieldEps = 1,
  kFieldParams = 2,  // + the index in VAEParams order: enc_w = 2, ..., dec_b2 = 11
  kFieldGrads = 12,  // g_elbo, g_recon, g_kl
  kFieldMu = 15,
  kFieldLogvar = 16,
  kFieldImage = 17,
};
constexpr int64_t kParamCount = 10;
constexpr int64_t kFieldCount = 18;

struct CheckStatus {
  int64_t code = kCheckOk;
  int64_t field = kFieldX;
  bool ok() const { return code == kCheckOk; }
  // One int for Python: 0 when ok, else -(code * kFieldCount + field) (status.py decodes it).
  int64_t packed() const { return ok() ? 0 : -(code * kFieldCount + field); }
};

// One call's tensors. Absent ones are nullptr; a required one absent (or undefined) is
// kCheckMissing.
struct CheckCall {
  const at::Tensor* x = nullptr;
  const std::vector<at::Tensor>* params = nullptr;
  const at::Tensor* eps = nullptr;
  bool eps_required = true;     // false: eps may be absent (the ops' draw)
  int64_t samples = 0;          // > 0: eps is (samples, B, L), the IWAE's; else (B, L)
  const at::Tensor* grads[3] = {nullptr, nullptr, nullptr};  // the backward's, (B,) each
  const at::Tensor* mu = nullptr;      // the IWAE's encoder outputs, (B, L) each
  const at::Tensor* logvar = nullptr;
  const at::Tensor* image = nullptr;   // the IWAE's image indices, (B,) int64
  c10::DeviceType device_type = c10::DeviceType::CUDA;
};

CheckStatus check_inputs(const CheckCall& call) noexcept;

}  // namespace fastelbo::binding
