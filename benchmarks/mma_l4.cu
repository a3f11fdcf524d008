// Is the fast kernel's last layer cheaper on tensor cores? (benchmarks/NOTES.md, "Next, from the
// ninth session's evidence": L4 + BCE is the largest phase, ~7.8K cycles per block at B=128.)
// One block computes what elbo_fast.cu's L4 computes: logits (R = 20 rows x N = 49 columns) =
// d (R x K) . wd2_slice^T (N x K), K = 256, both operands already in shared memory, by
//   fma     FP32 fmaf, 2 x 2 register tiles per thread (250 threads), float4 reads along K
//           (elbo_fast.cu's L4 uses larger tiles: compare with its trace too)
//   tf32x3  mma.sync m16n8k8 TF32: hi/lo halves (cvt.rna), lo*hi + hi*lo + hi*hi per k step,
//           split while loading fragments; rows padded to 32, columns to 56 (2 x 7 tiles)
//   tf32x3p the same with both operands pre-split into hi and lo arrays in shared memory
//   tf32    one TF32 MMA per k step (speed reference; not accurate enough for the contract)
// Cycles from clock64 around the computation (after a __syncthreads, until the next one), per
// block; median and max over 1 and 112 blocks (one per SM). Accuracy: the largest |error| over
// all outputs against a double-precision reference, divided by sum_k |d w| of that output.
// Standalone:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o /tmp/mma_l4 benchmarks/mma_l4.cu
//   /tmp/mma_l4
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

constexpr int kR = 20, kN = 49, kK = 256, kThreads = 256, kWarps = kThreads / 32;
constexpr int kRp = 32, kNp = 56;     // padded to whole m16 / n8 tiles
constexpr int kLd = kK + 4;           // smem row stride (floats): conflict-free fragment loads
constexpr int kTilesM = kRp / 16, kTilesN = kNp / 8, kTiles = kTilesM * kTilesN;

enum Mode { kFma = 0, kTf32x3 = 1, kTf32x3Pre = 2, kTf32 = 3 };
const char* const kModeNames[] = {"fma", "tf32x3", "tf32x3p", "tf32"};

__device__ __forceinline__ unsigned to_tf32(float v) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}

// acc (16 x 8 tile, this thread's 4 elements) += a (16 x 8) . b (8 x 8), TF32 operands.
__device__ __forceinline__ void mma_tf32(float acc[4], const unsigned a[4], const unsigned b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int MODE>
__global__ void __launch_bounds__(kThreads) l4(const float* d, const float* w, float* out,
                                               long long* cycles) {
  extern __shared__ __align__(16) float sm[];
  float* ds = sm;                       // kRp x kLd (rows >= kR zero)
  float* ws = ds + kRp * kLd;           // kNp x kLd (rows >= kN zero)
  float* dl = ws + kNp * kLd;           // pre-split lo halves (kTf32x3Pre), same layouts
  float* wl = dl + kRp * kLd;
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < kRp * kLd; i += kThreads) {
    const int r = i / kLd, k = i % kLd;
    ds[i] = (r < kR && k < kK) ? d[r * kK + k] : 0.0f;
  }
  for (int i = tid; i < kNp * kLd; i += kThreads) {
    const int n = i / kLd, k = i % kLd;
    ws[i] = (n < kN && k < kK) ? w[n * kK + k] : 0.0f;
  }
  __syncthreads();
  const long long t0 = clock64();
  if (MODE == kTf32x3Pre) {  // the split, as a producer layer would store its output
    for (int i = tid; i < kRp * kLd; i += kThreads) {
      const float hi = __uint_as_float(to_tf32(ds[i]));
      dl[i] = __uint_as_float(to_tf32(ds[i] - hi));
      ds[i] = hi;
    }
    for (int i = tid; i < kNp * kLd; i += kThreads) {
      const float hi = __uint_as_float(to_tf32(ws[i]));
      wl[i] = __uint_as_float(to_tf32(ws[i] - hi));
      ws[i] = hi;
    }
    __syncthreads();
  }
  if (MODE == kFma) {  // 2 x 2 register tiles: 10 x 25 of them (column 49 padding, unwritten)
    for (int tile = tid; tile < (kR / 2) * ((kN + 1) / 2); tile += kThreads) {
      const int r = 2 * (tile / ((kN + 1) / 2)), n = 2 * (tile % ((kN + 1) / 2));
      const float4* a0 = reinterpret_cast<const float4*>(ds + r * kLd);
      const float4* a1 = reinterpret_cast<const float4*>(ds + (r + 1) * kLd);
      const float4* b0 = reinterpret_cast<const float4*>(ws + n * kLd);
      const float4* b1 = reinterpret_cast<const float4*>(ws + (n + 1) * kLd);
      float c00 = 0.0f, c01 = 0.0f, c10 = 0.0f, c11 = 0.0f;
#pragma unroll 4
      for (int q = 0; q < kK / 4; ++q) {
        const float4 x0 = a0[q], x1 = a1[q], y0 = b0[q], y1 = b1[q];
        c00 = fmaf(x0.x, y0.x, c00); c01 = fmaf(x0.x, y1.x, c01);
        c10 = fmaf(x1.x, y0.x, c10); c11 = fmaf(x1.x, y1.x, c11);
        c00 = fmaf(x0.y, y0.y, c00); c01 = fmaf(x0.y, y1.y, c01);
        c10 = fmaf(x1.y, y0.y, c10); c11 = fmaf(x1.y, y1.y, c11);
        c00 = fmaf(x0.z, y0.z, c00); c01 = fmaf(x0.z, y1.z, c01);
        c10 = fmaf(x1.z, y0.z, c10); c11 = fmaf(x1.z, y1.z, c11);
        c00 = fmaf(x0.w, y0.w, c00); c01 = fmaf(x0.w, y1.w, c01);
        c10 = fmaf(x1.w, y0.w, c10); c11 = fmaf(x1.w, y1.w, c11);
      }
      float* o = out + blockIdx.x * kR * kN;
      o[r * kN + n] = c00;
      o[(r + 1) * kN + n] = c10;
      if (n + 1 < kN) {
        o[r * kN + n + 1] = c01;
        o[(r + 1) * kN + n + 1] = c11;
      }
    }
  } else {
    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    for (int tile = warp; tile < kTiles; tile += kWarps) {
      const int m0 = (tile / kTilesN) * 16, n0 = (tile % kTilesN) * 8;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      float big[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      // Fragment elements (PTX ISA, mma.m16n8k8 .tf32): a0 (g, t), a1 (g + 8, t),
      // a2 (g, t + 4), a3 (g + 8, t + 4); b0 (k = t, n = g), b1 (k = t + 4, n = g);
      // c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
      const float* a_row0 = ds + (m0 + g) * kLd;  // this thread's two rows of the A tile
      const float* a_row8 = ds + (m0 + g + 8) * kLd;
      const float* b_row = ws + (n0 + g) * kLd;
      for (int k0 = 0; k0 < kK; k0 += 8) {
        const float av[4] = {a_row0[k0 + t], a_row8[k0 + t], a_row0[k0 + t + 4],
                             a_row8[k0 + t + 4]};
        const float bv[2] = {b_row[k0 + t], b_row[k0 + t + 4]};
        unsigned ah[4], bh[2];
#pragma unroll
        for (int i = 0; i < 4; ++i) ah[i] = to_tf32(av[i]);
#pragma unroll
        for (int i = 0; i < 2; ++i) bh[i] = to_tf32(bv[i]);
        if (MODE == kTf32) {
          mma_tf32(acc, ah, bh);
          continue;
        }
        unsigned al[4], bl[2];
        if (MODE == kTf32x3Pre) {
          const float* l0 = dl + (m0 + g) * kLd;
          const float* l8 = dl + (m0 + g + 8) * kLd;
          const float* lb = wl + (n0 + g) * kLd;
          al[0] = __float_as_uint(l0[k0 + t]);
          al[1] = __float_as_uint(l8[k0 + t]);
          al[2] = __float_as_uint(l0[k0 + t + 4]);
          al[3] = __float_as_uint(l8[k0 + t + 4]);
          bl[0] = __float_as_uint(lb[k0 + t]);
          bl[1] = __float_as_uint(lb[k0 + t + 4]);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) al[i] = to_tf32(av[i] - __uint_as_float(ah[i]));
#pragma unroll
          for (int i = 0; i < 2; ++i) bl[i] = to_tf32(bv[i] - __uint_as_float(bh[i]));
        }
        mma_tf32(acc, al, bh);  // the small terms first, in their own accumulator
        mma_tf32(acc, ah, bl);
        mma_tf32(big, ah, bh);
      }
      const int rows[4] = {m0 + g, m0 + g, m0 + g + 8, m0 + g + 8};
      const int cols[4] = {n0 + 2 * t, n0 + 2 * t + 1, n0 + 2 * t, n0 + 2 * t + 1};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (rows[i] < kR && cols[i] < kN)
          out[blockIdx.x * kR * kN + rows[i] * kN + cols[i]] = big[i] + acc[i];
    }
  }
  __syncthreads();
  if (tid == 0) cycles[blockIdx.x] = clock64() - t0;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <int MODE>
void run(const float* d, const float* w, const std::vector<double>& ref,
         const std::vector<double>& mag, int blocks) {
  const size_t smem = sizeof(float) * 2 * (kRp + kNp) * kLd;
  check(cudaFuncSetAttribute(l4<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)), "smem attribute");
  float* out = nullptr;
  long long* cyc = nullptr;
  check(cudaMalloc(&out, sizeof(float) * blocks * kR * kN), "malloc out");
  check(cudaMalloc(&cyc, sizeof(long long) * blocks), "malloc cycles");
  check(cudaMemset(out, 0xff, sizeof(float) * blocks * kR * kN), "poison");  // NaN
  std::vector<long long> c(blocks);
  std::vector<long long> med;
  for (int round = 0; round < 5; ++round) {
    l4<MODE><<<blocks, kThreads, smem>>>(d, w, out, cyc);
    check(cudaGetLastError(), "launch");
    check(cudaDeviceSynchronize(), "run");
    check(cudaMemcpy(c.data(), cyc, sizeof(long long) * blocks, cudaMemcpyDeviceToHost), "copy");
    std::sort(c.begin(), c.end());
    med.push_back(c[blocks / 2]);
  }
  std::sort(med.begin(), med.end());
  std::vector<float> h(static_cast<size_t>(blocks) * kR * kN);
  check(cudaMemcpy(h.data(), out, sizeof(float) * h.size(), cudaMemcpyDeviceToHost), "copy out");
  double worst = 0.0;
  for (size_t i = 0; i < h.size(); ++i) {
    const size_t o = i % (kR * kN);
    const double err = std::isfinite(h[i]) ? std::fabs(h[i] - ref[o]) / mag[o] : INFINITY;
    worst = std::max(worst, err);
  }
  std::printf("%-8s %6d %10lld %10lld   %.2e\n", kModeNames[MODE], blocks, med[2], c.back(),
              worst);
  check(cudaFree(out), "free");
  check(cudaFree(cyc), "free");
}

}  // namespace

int main() {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::normal_distribution<float> nrm(0.0f, 0.0625f);
  std::vector<float> d(kR * kK), w(kN * kK);
  for (float& v : d) v = uni(gen) < 0.5f ? 0.0f : uni(gen);  // post-ReLU: half zeros
  for (float& v : w) v = nrm(gen);
  std::vector<double> ref(kR * kN), mag(kR * kN);
  for (int r = 0; r < kR; ++r)
    for (int n = 0; n < kN; ++n) {
      double s = 0.0, m = 0.0;
      for (int k = 0; k < kK; ++k) {
        s += static_cast<double>(d[r * kK + k]) * w[n * kK + k];
        m += std::fabs(static_cast<double>(d[r * kK + k]) * w[n * kK + k]);
      }
      ref[r * kN + n] = s;
      mag[r * kN + n] = std::max(m, 1e-30);
    }
  float *dd = nullptr, *dw = nullptr;
  check(cudaMalloc(&dd, sizeof(float) * d.size()), "malloc d");
  check(cudaMalloc(&dw, sizeof(float) * w.size()), "malloc w");
  check(cudaMemcpy(dd, d.data(), sizeof(float) * d.size(), cudaMemcpyHostToDevice), "copy d");
  check(cudaMemcpy(dw, w.data(), sizeof(float) * w.size(), cudaMemcpyHostToDevice), "copy w");
  std::printf("L4 of the fast kernel: %d x %d outputs, K = %d, %d threads per block\n", kR, kN,
              kK, kThreads);
  std::printf("%-8s %6s %10s %10s   %s\n", "mode", "blocks", "median", "max", "max err / sum|dw|");
  for (int blocks : {1, 112}) {
    run<kFma>(dd, dw, ref, mag, blocks);
    run<kTf32x3>(dd, dw, ref, mag, blocks);
    run<kTf32x3Pre>(dd, dw, ref, mag, blocks);
    run<kTf32>(dd, dw, ref, mag, blocks);
  }
  return 0;
}
