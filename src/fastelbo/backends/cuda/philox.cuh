// Triton's tl.randn(seed, offset) in CUDA C++: the same Philox4x32-10 counters, key and
// constants as triton/language/random.py (randint4x: counter (offset lo, offset hi, 0, 0), key
// (seed lo, seed hi)), the same int -> uniform map and Box-Muller's first output. So a kernel
// here draws the integers a Triton kernel draws for (seed, offset), and normals within a few ulp
// of Triton's (IEEE logf and cospif here; Triton's lowering may approximate). No torch types;
// philox2 is host-callable too, for tests/test_cuda_compile.py.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fastelbo {

__host__ __device__ __forceinline__ uint32_t mulhi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// tl.randint4x(seed, offset)'s first two words.
__host__ __device__ __forceinline__ void philox2(uint64_t seed, uint64_t offset, uint32_t* r0,
                                                 uint32_t* r1) {
  uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(offset >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t a0 = c0, a2 = c2;
    c0 = mulhi32(0xCD9E8D57u, a2) ^ c1 ^ k0;  // PHILOX_ROUND_B
    c2 = mulhi32(0xD2511F53u, a0) ^ c3 ^ k1;  // PHILOX_ROUND_A
    c1 = 0xCD9E8D57u * a2;
    c3 = 0xD2511F53u * a0;
    k0 += 0x9E3779B9u;  // PHILOX_KEY_A
    k1 += 0xBB67AE85u;  // PHILOX_KEY_B
  }
  *r0 = c0;
  *r1 = c1;
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

}  // namespace fastelbo
