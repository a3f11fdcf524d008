// Philox4x32-10 (Salmon et al. 2011; the rounds and constants of Random123, curand and Triton)
// and the two noise streams built on it here. No torch types; the integer parts are
// host-callable too, for tests/test_cuda_compile.py.
//   * Triton's tl.randn(seed, offset) (philox2, philox_randn): the IWAE kernels' noise.
//     randint4x's counter (offset lo, offset hi, 0, 0), key (seed lo, seed hi), the same
//     int -> uniform map and Box-Muller's first output; normals within a few ulp of Triton's
//     (IEEE logf and cospif here; Triton's lowering may approximate).
//   * torch.randn's on CUDA (torch_randn_*): element i of one torch.randn(n) float32 draw, as
//     PyTorch's normal_ kernel (ATen/native/cuda/DistributionTemplates.h,
//     distribution_elementwise_grid_stride_kernel with curand_normal4) writes it. Thread t of
//     that launch (T threads in all) runs curand_init(seed, t, offset) and then one
//     curand_normal4 per grid-stride round; element i is component (i / T) % 4 of round
//     i / (4 T) of thread i % T. curand's Philox state at round c has the counter
//     (offset / 4 + c in words 0-1, t in words 2-3) and hands out its words from offset % 4 on
//     (curand4); curand_normal4 is _curand_box_muller on words (0, 1) and (2, 3). The float
//     steps are curand's own expressions (curand_normal.h), so a build with the same CUDA math
//     library gives the same bits; fastelbo.backends.cuda checks that against torch.randn on
//     first use and otherwise draws with torch.randn before the launch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "elbo.h"

namespace fastelbo {

__host__ __device__ __forceinline__ uint32_t mulhi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// Philox4x32-10 of counter c under key (k0, k1), in place.
__host__ __device__ __forceinline__ void philox4x32_10(uint32_t (&c)[4], uint32_t k0,
                                                       uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t a0 = c[0], a2 = c[2];
    c[0] = mulhi32(0xCD9E8D57u, a2) ^ c[1] ^ k0;
    c[2] = mulhi32(0xD2511F53u, a0) ^ c[3] ^ k1;
    c[1] = 0xCD9E8D57u * a2;
    c[3] = 0xD2511F53u * a0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// ---- Triton's stream ----
// tl.randint4x(seed, offset)'s first two words.
__host__ __device__ __forceinline__ void philox2(uint64_t seed, uint64_t offset, uint32_t* r0,
                                                 uint32_t* r1) {
  uint32_t c[4] = {static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32), 0, 0};
  philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  *r0 = c[0];
  *r1 = c[1];
}

// tl.uint_to_uniform_float for 32 bits: [0, 1).
__host__ __device__ __forceinline__ float philox_uniform(uint32_t u) {
  int v = static_cast<int>(u);
  v = v < 0 ? -v - 1 : v;
  return static_cast<float>(v) * 4.6566127342e-10f;
}

// tl.randn(seed, offset). cospif(2 u2) is cos(2 pi u2) without rounding 2 pi u2 first (and
// without cosf's large-argument path, which would give the kernel a stack frame).
__device__ __forceinline__ float philox_randn(uint64_t seed, uint64_t offset) {
  uint32_t i1, i2;
  philox2(seed, offset, &i1, &i2);
  const float u1 = fmaxf(1.0e-7f, philox_uniform(i1)), u2 = philox_uniform(i2);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

// ---- torch.randn's stream (see the top of this file) ----
// The two curand words that element i's Box-Muller pair reads, and whether it takes the sine
// (even component) or the cosine.
__host__ __device__ __forceinline__ void torch_randn_words(uint64_t seed, uint64_t offset,
                                                           uint64_t threads, uint64_t i,
                                                           uint32_t* w0, uint32_t* w1,
                                                           bool* sine) {
  const uint64_t t = i % threads, k = i / threads;
  const uint64_t round = k / 4;
  const int comp = static_cast<int>(k % 4), first = static_cast<int>(offset % 4);
  // Counter (offset / 4 + round, t) as a 128-bit sum, words low to high; curand4 reads words
  // first .. first + 3 of this block followed by the next one (selected with constant indices,
  // so the words stay in registers).
  const uint64_t base = offset / 4, lo = base + round;
  const uint64_t hi = t + (lo < base ? 1u : 0u);
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  uint32_t a[4] = {static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                   static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32)};
  philox4x32_10(a, k0, k1);
  uint32_t b[4] = {a[0], a[1], a[2], a[3]};
  if (first != 0) {  // the next block too
    const uint64_t l = lo + 1, h = hi + (l == 0 ? 1u : 0u);
    b[0] = static_cast<uint32_t>(l);
    b[1] = static_cast<uint32_t>(l >> 32);
    b[2] = static_cast<uint32_t>(h);
    b[3] = static_cast<uint32_t>(h >> 32);
    philox4x32_10(b, k0, k1);
  }
  const int pair = first + 2 * (comp / 2);  // 0 .. 5
  uint32_t x = a[0], y = a[1];
#pragma unroll
  for (int q = 1; q < 7; ++q) {
    if (q == pair) {
      x = q < 4 ? a[q & 3] : b[q & 3];
      y = q + 1 < 4 ? a[(q + 1) & 3] : b[(q + 1) & 3];
    }
  }
  *w0 = x;
  *w1 = y;
  *sine = comp % 2 == 0;
}

// The draw's seed and offset: plain values, or read from the generator's device-side state
// when the launch was captured in a CUDA graph (as PyTorch's philox::unpack reads them).
__device__ __forceinline__ void torch_randn_seeds(const TorchRandn& r, uint64_t* seed,
                                                  uint64_t* offset) {
  if (r.captured) {
    *seed = static_cast<uint64_t>(*r.seed_ptr);
    *offset = static_cast<uint64_t>(*r.offset_ptr) + r.offset_intragraph;
  } else {
    *seed = r.seed;
    *offset = r.offset;
  }
}

// Element i of the draw: curand's _curand_box_muller (curand_normal.h) for that pair, then
// normal_'s transform rand * std + mean with std 1 and mean 0 (+ 0.0f: -0 becomes +0 there).
__device__ __forceinline__ float torch_randn_at(uint64_t seed, uint64_t offset, uint64_t threads,
                                                uint64_t i) {
  uint32_t x, y;
  bool sine;
  torch_randn_words(seed, offset, threads, i, &x, &y, &sine);
  constexpr float kInv = 2.3283064e-10f;                 // CURAND_2POW32_INV
  constexpr float kInv2Pi = 2.3283064e-10f * 6.2831855f;  // CURAND_2POW32_INV_2PI
  const float u = fmaf(static_cast<float>(x), kInv, kInv / 2);
  const float v = fmaf(static_cast<float>(y), kInv2Pi, kInv2Pi / 2);
  const float s = sqrtf(-2.0f * logf(u));
  float sn, cs;
  __sincosf(v, &sn, &cs);
  return (sine ? sn * s : cs * s) + 0.0f;
}

}  // namespace fastelbo
