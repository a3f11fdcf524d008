// Adam's update for fastelbo train's optimizer (fastelbo/training/adam.py), one launch for all
// parameter tensors. torch.optim.Adam(fused=True) gives each 65536-element chunk of each
// tensor one block: at this model's 427K parameters that is ~16 blocks, 33 us on an H200, more
// than the whole fused backward. Here every block takes kAdamPerBlock elements of one tensor,
// so the step spreads over the GPU. The arithmetic is torch's fused Adam (ADAM_MODE::ORIGINAL,
// no amsgrad), in float as there.
#include "elbo.h"
#include "elbo_math.cuh"

namespace fastelbo {
namespace {

constexpr int kAdamPerThread = 4;
constexpr int kAdamPerBlock = kThreads * kAdamPerThread;

__global__ void __launch_bounds__(kThreads) adam_kernel(const __grid_constant__ AdamParams p) {
  const int b = static_cast<int>(blockIdx.x);
  int t = 0;
  while (t + 1 < p.count && b >= p.first_block[t + 1]) ++t;
  // As torch's FusedAdamMathFunctor: every hyperparameter cast to float first, the bias
  // corrections from powf of the float betas (float(0.999) is not 0.999: computing them in
  // double drifts from torch by ~1e-5 relative in the first steps).
  const float step = *p.step[t];
  const float lr = static_cast<float>(p.lr), b1 = static_cast<float>(p.beta1),
              b2 = static_cast<float>(p.beta2), eps = static_cast<float>(p.eps),
              wd = static_cast<float>(p.weight_decay);
  const float bc1 = 1.0f - powf(b1, step);
  const float bc2s = sqrtf(1.0f - powf(b2, step));
  const float step_size = lr / bc1;
  const long long base = static_cast<long long>(b - p.first_block[t]) * kAdamPerBlock;
#pragma unroll
  for (int k = 0; k < kAdamPerThread; ++k) {
    const long long i = base + k * kThreads + threadIdx.x;
    if (i >= p.numel[t]) break;
    float param = p.param[t][i], grad = p.grad[t][i];
    // torch's expressions, contracted to FMAs as nvcc contracts them there by default.
    if (wd != 0.0f) grad = fmaf(param, wd, grad);
    const float m = fmaf(b1, p.exp_avg[t][i], (1.0f - b1) * grad);
    const float v = fmaf(b2, p.exp_avg_sq[t][i], (1.0f - b2) * grad * grad);
    const float denom = sqrtf(v) / bc2s + eps;
    param -= step_size * m / denom;
    p.exp_avg[t][i] = m;
    p.exp_avg_sq[t][i] = v;
    p.param[t][i] = param;
  }
}

}  // namespace

cudaError_t adam_launch(AdamParams& p, cudaStream_t stream) noexcept {
  long long blocks = 0;
  for (int t = 0; t < p.count; ++t) {
    p.first_block[t] = static_cast<int>(blocks);
    blocks += (p.numel[t] + kAdamPerBlock - 1) / kAdamPerBlock;
  }
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  adam_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fastelbo
