// Device-side math shared by every kernel of the cuda backend (cluster path, rows path,
// backward): the per-element formulas, op by op as eager PyTorch rounds them, so all paths agree
// with each other and with the reference. No torch types; included by the .cu files only.
#pragma once

#include <cuda_runtime.h>

namespace fastelbo {

constexpr int kThreads = 256;  // threads per block of every kernel in this backend
constexpr int kWarps = kThreads / 32;

// std::max(a, b) as PyTorch's kernels use it: returns a when a is NaN (fmaxf would drop it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a < b) ? b : a; }
__device__ __forceinline__ float relu(float v) { return nan_max(v, 0.0f); }

__host__ __device__ __forceinline__ int round4(int v) { return (v + 3) & ~3; }

// The per-element math, shared by both paths (op by op as eager PyTorch rounds it).
// z = mu + exp(0.5 logvar) * eps, separate roundings.
__device__ __forceinline__ float reparam(float mu, float lv, float ep) {
  return __fadd_rn(mu, __fmul_rn(expf(__fmul_rn(0.5f, lv)), ep));
}
// One term of the KL sum: 1 + logvar - mu^2 - exp(logvar).
__device__ __forceinline__ float kl_term(float mu, float lv) {
  return __fsub_rn(__fsub_rn(__fadd_rn(1.0f, lv), __fmul_rn(mu, mu)), expf(lv));
}
// sigmoid as PyTorch's CUDA kernel: 1 / (1 + exp(-a)).
__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }
// The value check's predicate (torch_ref.invalid_rows, validation.py): x outside [0, 1], or NaN.
__device__ __forceinline__ bool outside_unit(float v) { return !(v >= 0.0f && v <= 1.0f); }
// BCE as PyTorch: (x - 1) * max(log1p(-p), -100) - x * max(log(p), -100), p = sigmoid(a);
// x outside [0, 1] or NaN -> NaN and *bad set.
__device__ __forceinline__ float bce_term(float a, float xv, bool* bad) {
  const float pr = sigmoid(a);
  const float lp = nan_max(logf(pr), -100.0f), l1p = nan_max(log1pf(-pr), -100.0f);
  const bool ok = !outside_unit(xv);
  *bad |= !ok;
  return ok ? __fsub_rn(__fmul_rn(xv - 1.0f, l1p), __fmul_rn(xv, lp))
            : __int_as_float(0x7fc00000);
}
// ---- backward (autograd's formulas, as torch_ref.backward spells them out) ----
// binary_cross_entropy_backward: g * (p - x) / max((1 - p) * p, 1e-12) (fmaxf as PyTorch's max).
__device__ __forceinline__ float bce_backward(float g, float p, float xv) {
  return __fdiv_rn(__fmul_rn(g, __fsub_rn(p, xv)),
                   fmaxf(__fmul_rn(__fsub_rn(1.0f, p), p), 1e-12f));
}
// sigmoid_backward(g, y) = g * (1 - y) * y.
__device__ __forceinline__ float sigmoid_backward(float g, float y) {
  return __fmul_rn(__fmul_rn(g, __fsub_rn(1.0f, y)), y);
}
// torch.logit(p) without eps: log(p / (1 - p)).
__device__ __forceinline__ float logit(float p) { return logf(__fdiv_rn(p, __fsub_rn(1.0f, p))); }

__host__ __device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

}  // namespace fastelbo
