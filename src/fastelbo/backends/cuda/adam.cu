// Adam's update for fastelbo train's optimizer (fastelbo/training/adam.py), one launch for all
// parameter tensors. torch.optim.Adam(fused=True) gives each 65536-element chunk of each
// tensor one block: at this model's 427K parameters that is ~16 blocks, 33 us on an H200, more
// than the whole fused backward. Here every block takes kAdamPerBlock elements of one tensor,
// so the step spreads over the GPU. The arithmetic is torch's fused Adam (ADAM_MODE::ORIGINAL,
// no amsgrad): bias corrections in double from the step count, the update in float.
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
  const double step = static_cast<double>(*p.step[t]);
  const double bc1 = 1.0 - pow(p.beta1, step);
  const double bc2_sqrt = sqrt(1.0 - pow(p.beta2, step));
  const float step_size = static_cast<float>(p.lr / bc1);
  const float b1 = static_cast<float>(p.beta1), b2 = static_cast<float>(p.beta2);
  const float eps = static_cast<float>(p.eps), wd = static_cast<float>(p.weight_decay);
  const float bc2s = static_cast<float>(bc2_sqrt);
  const long long base = static_cast<long long>(b - p.first_block[t]) * kAdamPerBlock;
#pragma unroll
  for (int k = 0; k < kAdamPerThread; ++k) {
    const long long i = base + k * kThreads + threadIdx.x;
    if (i >= p.numel[t]) break;
    float param = p.param[t][i], grad = p.grad[t][i];
    if (wd != 0.0f) grad = __fadd_rn(grad, __fmul_rn(param, wd));
    const float m = __fadd_rn(__fmul_rn(b1, p.exp_avg[t][i]), __fmul_rn(1.0f - b1, grad));
    const float v = __fadd_rn(__fmul_rn(b2, p.exp_avg_sq[t][i]),
                              __fmul_rn(__fmul_rn(1.0f - b2, grad), grad));
    const float denom = __fadd_rn(__fdiv_rn(sqrtf(v), bc2s), eps);
    param = __fsub_rn(param, __fdiv_rn(__fmul_rn(step_size, m), denom));
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
