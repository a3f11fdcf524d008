// Exhaustive check of iwae.cu's rcp_den (reciprocal approximation + one FMA Newton step) against
// __frcp_rn, the correctly rounded reciprocal PyTorch's sigmoid gets from 1.0f / den: every
// float den in [1, 2^100) must give the same bits, and every den in [2^100, inf] the same
// 1 - p (= 1), the only use the BCE makes of p. (A NaN den keeps the term NaN through log2(den):
// tests/test_cuda_iwae.py's NaN-image tests.)
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I src/fastelbo/backends/cuda \
//        -o /tmp/rcp_check benchmarks/rcp_check.cu && /tmp/rcp_check
#include "elbo.cu"
#include "iwae.cu"

#include <cstdio>

__global__ void check(unsigned lo, unsigned hi, unsigned long long* mismatch,
                      unsigned long long* one_minus_p) {
  const unsigned stride = gridDim.x * blockDim.x;
  for (unsigned u = lo + blockIdx.x * blockDim.x + threadIdx.x; u < hi && u >= lo; u += stride) {
    const float den = __uint_as_float(u), mine = fastelbo::rcp_den(den), ref = __frcp_rn(den);
    if (__float_as_uint(mine) != __float_as_uint(ref)) atomicAdd(mismatch, 1ULL);
    if (1.0f - mine != 1.0f - ref) atomicAdd(one_minus_p, 1ULL);
  }
}

int main() {
  unsigned long long* c = nullptr;
  cudaMalloc(&c, 4 * sizeof(unsigned long long));
  cudaMemset(c, 0, 4 * sizeof(unsigned long long));
  const unsigned one = 0x3f800000u, two100 = 0x71800000u, inf = 0x7f800000u;
  check<<<1320, 256>>>(one, two100, c, c + 1);
  check<<<1320, 256>>>(two100, inf + 1, c + 2, c + 3);
  unsigned long long h[4];
  cudaMemcpy(h, c, sizeof(h), cudaMemcpyDeviceToHost);
  const cudaError_t e = cudaGetLastError();
  std::printf("[1, 2^100): %u floats, %llu bit mismatches, %llu 1-p mismatches\n", two100 - one,
              h[0], h[1]);
  std::printf("[2^100, inf]: %u floats, %llu 1-p mismatches (bits differ: %llu)\n",
              inf + 1 - two100, h[3], h[2]);
  const bool pass = e == cudaSuccess && h[0] == 0 && h[1] == 0 && h[3] == 0;
  std::printf("%s: %s\n", cudaGetErrorString(e), pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}
