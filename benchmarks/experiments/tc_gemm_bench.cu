// The tensor-core GEMMs of the cuda backend's rows path (tc_gemm.cu) alone: correctness
// against a float64 host reference, then device time per launch at the forward's shapes.
// No torch: for the open question of the output layer's epilogue (benchmarks/PERF.md).
//
// Checks (both epilogues; ragged M, N and K; a row with an x outside [0, 1]; saturated
// weights): sampled rows' outputs within 1e-4 abs + rel of float64, or within 2^-20 of the
// sum of |terms| (float32's own bound where terms cancel); outputs poisoned first, so an
// unwritten one fails. Then cudaEvent time of 20 launches per shape: encoder (M x 256 x 784,
// ReLU) and output layer (M x 784 x 256, BCE) at M = 1024 ... 65536.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
//        -I src/fastelbo/backends/cuda/kernels -o /tmp/tc_gemm_bench benchmarks/experiments/tc_gemm_bench.cu
//   /tmp/tc_gemm_bench [quick|profile]   (quick: the small checks only, for compute-sanitizer;
//                                          profile: one launch of each GEMM at M = 65536)
#include "elbo.cu"
#include "elbo_fast.cu"
#include "tc_gemm.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_check.h"

using fastelbo::kTcBce;
using fastelbo::kTcStore;

namespace {

struct Case {
  int mode, M, N, K;
  float wscale;  // weights ~ N(0, wscale^2)
  bool binary;   // A in {0, 1} (else uniform [0, 1), minus 0.3 for the BCE mode's relu_a)
  bool timed;
};

float* to_device(const std::vector<float>& h) {
  float* d = nullptr;
  CK(cudaMalloc(&d, h.size() * 4));
  CK(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

std::vector<float> to_host(const float* d, size_t n) {
  std::vector<float> h(n);
  CK(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost));
  return h;
}

double bce64(double a, double x) {  // PyTorch's clamped BCE of sigmoid(a), in float64
  const double p = 1.0 / (1.0 + std::exp(-a));
  return (x - 1) * std::max(std::log1p(-p), -100.0) - x * std::max(std::log(p), -100.0);
}

int run(const Case& cs, unsigned seed) {
  const int M = cs.M, N = cs.N, K = cs.K;
  const bool bce = cs.mode == kTcBce;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(0, 1);
  std::normal_distribution<float> gauss(0, 1);
  std::vector<float> a(size_t(M) * K), w(size_t(N) * K), b(N), x;
  for (float& v : a) v = cs.binary ? float(uni(rng) < 0.5f) : uni(rng) - (bce ? 0.3f : 0.0f);
  for (float& v : w) v = gauss(rng) * cs.wscale;
  for (float& v : b) v = gauss(rng) * 0.1f;
  float *da = to_device(a), *dw = to_device(w), *db = to_device(b), *dhi, *dlo;
  CK(cudaMalloc(&dhi, w.size() * 4));
  CK(cudaMalloc(&dlo, w.size() * 4));
  fastelbo::TcSplitParams sp{};  // W's halves, as they are
  sp.src[0] = dw;
  sp.hi[0] = dhi;
  sp.lo[0] = dlo;
  sp.rows[0] = N;
  sp.cols[0] = sp.lds[0] = sp.ldt[0] = K;
  sp.count = 1;
  CK(fastelbo::tc_split_t_launch(sp, 0));
  fastelbo::TcGemmParams p{};
  p.bias = db;
  p.M = M;
  p.N = N;
  p.K = K;
  p.mode = cs.mode;
  p.relu_a = bce;
  p.w_finite = 1;  // finite weights: the forward's A split (tf32_split_act)
  p.act = !bce;  // the encoder's ReLU
  const int tiles = fastelbo::tc_gemm_tiles_n(N);
  const int bad_row = M > 78 ? 77 : -1;  // its x holds a 1.5: its outputs must be NaN
  float *dout = nullptr, *dx = nullptr, *dpart = nullptr, *delbo = nullptr, *drec = nullptr,
        *dkl = nullptr, *dws = nullptr;
  unsigned char* dbad = nullptr;
  if (bce) {
    x.resize(size_t(M) * N);
    for (float& v : x) v = uni(rng);
    if (bad_row >= 0) x[size_t(bad_row) * N + N - 1] = 1.5f;
    dx = to_device(x);
    p.x = dx;
    p.ldx = N;
    CK(cudaMalloc(&dpart, size_t(M) * tiles * 4));
    CK(cudaMemset(dpart, 0xFF, size_t(M) * tiles * 4));
    CK(cudaMalloc(&dbad, size_t(M) * tiles));
    CK(cudaMemset(dbad, 0x7, size_t(M) * tiles));
    p.partial = dpart;
    p.partial_bad = dbad;
    CK(cudaMalloc(&delbo, M * 4));
    CK(cudaMalloc(&drec, M * 4));
    CK(cudaMalloc(&dkl, M * 4));
    CK(cudaMemset(dkl, 0, M * 4));
  } else {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    p.splits = fastelbo::tc_gemm_splits(M, N, K, sms);
    if (p.splits > 1) CK(cudaMalloc(&dws, size_t(p.splits) * M * N * 4));
    p.ws = dws;
    CK(cudaMalloc(&dout, size_t(M) * N * 4));
    CK(cudaMemset(dout, 0xFF, size_t(M) * N * 4));  // NaN: an unwritten output fails
    p.out = dout;
    p.ldo = N;
  }
  CK(fastelbo::tc_gemm_launch(p, da, K, dhi, dlo, 0));
  if (bce) {
    const fastelbo::TcFinishParams f{dpart, dbad, delbo, drec, dkl, M, tiles};
    CK(fastelbo::tc_bce_finish_launch(f, 0));
  }
  CK(cudaDeviceSynchronize());

  std::vector<int> rows;  // the first and last 64, and 128 random ones
  for (int r = 0; r < std::min(M, 64); ++r) rows.push_back(r);
  for (int r = std::max(0, M - 64); r < M; ++r) rows.push_back(r);
  for (int i = 0; i < 128; ++i) rows.push_back(static_cast<int>(rng() % M));
  auto dot = [&](int r, int n, double* mag) {
    double s = 0, m = 0;
    for (int k = 0; k < K; ++k) {
      const double av = bce ? std::max(double(a[size_t(r) * K + k]), 0.0) : a[size_t(r) * K + k];
      s += av * w[size_t(n) * K + k];
      m += std::fabs(av * w[size_t(n) * K + k]);
    }
    *mag = m + std::fabs(b[n]);
    return s + b[n];
  };
  int fails = 0;
  double worst = 0;
  if (bce) {
    const std::vector<float> rec = to_host(drec, M);
    size_t nans = 0;
    for (float v : rec) nans += v != v;
    if (nans != (bad_row >= 0 ? 1u : 0u) || (bad_row >= 0 && rec[bad_row] == rec[bad_row]))
      ++fails;
    for (int r : rows) {
      if (r == bad_row) continue;
      double s = 0, mag;
      for (int n = 0; n < N; ++n) s += bce64(dot(r, n, &mag), x[size_t(r) * N + n]);
      const double err = std::fabs(rec[r] - s);
      worst = std::max(worst, err / (std::fabs(s) + 1e-30));
      if (!(err <= 1e-4 + 1e-4 * std::fabs(s))) ++fails;
    }
    std::printf("bce  M=%d N=%d K=%d: %d failure(s), NaN rows %zu, worst relative error %.3g\n",
                M, N, K, fails, nans, worst);
  } else {
    const std::vector<float> out = to_host(dout, size_t(M) * N);
    for (float v : out) fails += v != v;
    for (int r : rows) {
      for (int n = 0; n < N; ++n) {
        double mag;
        const double ref = std::max(dot(r, n, &mag), 0.0);
        const double err = std::fabs(out[size_t(r) * N + n] - ref);
        worst = std::max(worst, err / (mag + 1e-30));
        if (!(err <= 1e-4 + 1e-4 * std::fabs(ref) || err <= 0x1p-20 * mag)) ++fails;
      }
    }
    std::printf("relu M=%d N=%d K=%d wscale=%g binary=%d splits=%d: %d failure(s), worst error / "
                "sum|terms| %.3g\n", M, N, K, cs.wscale, int(cs.binary), p.splits, fails, worst);
  }
  if (cs.timed) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) CK(fastelbo::tc_gemm_launch(p, da, K, dhi, dlo, 0));
    const int iters = 20;
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) CK(fastelbo::tc_gemm_launch(p, da, K, dhi, dlo, 0));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    const double us = ms * 1000 / iters, flop = 2.0 * M * N * K;
    std::printf("  time: %.1f us per launch, %.1f TFLOP/s float32-effective (%.1f of TF32)\n", us,
                flop / us * 1e-6, 3 * flop / us * 1e-6);
  }
  for (void* q : {static_cast<void*>(da), static_cast<void*>(dw), static_cast<void*>(db),
                  static_cast<void*>(dhi), static_cast<void*>(dlo), static_cast<void*>(dout),
                  static_cast<void*>(dx), static_cast<void*>(dpart), static_cast<void*>(dbad),
                  static_cast<void*>(delbo), static_cast<void*>(drec), static_cast<void*>(dkl),
                  static_cast<void*>(dws)})
    if (q != nullptr) CK(cudaFree(q));
  return fails;
}

}  // namespace

int main(int argc, char** argv) {
  const char mode = argc > 1 ? argv[1][0] : 'a';
  std::vector<Case> cases;
  if (mode == 'p') {  // one launch of each GEMM at B = 65536, e.g. for ncu
    cases = {{kTcStore, 65536, 256, 784, 0.05f, false, false},
             {kTcBce, 65536, 784, 256, 0.05f, false, false}};
  } else {  // ragged M, N (a partial n8 block) and K (an odd count of K stages)
    cases = {{kTcStore, 300, 256, 784, 0.05f, false, false},
             {kTcStore, 129, 200, 36, 0.05f, false, false},
             {kTcBce, 300, 784, 256, 0.05f, false, false},
             {kTcBce, 130, 100, 72, 0.05f, false, false},
             {kTcBce, 77, 12, 20, 0.05f, false, false},
             {kTcBce, 200, 256, 40, 0.05f, false, false}};  // 128-column tiles (else 112)
  }
  if (mode == 'a') {
    cases.push_back({kTcStore, 4096, 256, 784, 1000.0f, true, false});
    for (int m : {1024, 4096, 16384, 32768, 65536}) {
      cases.push_back({kTcStore, m, 256, 784, 0.05f, false, true});
      cases.push_back({kTcBce, m, 784, 256, 0.05f, false, true});
    }
  }
  int fails = 0;
  unsigned seed = 1;
  for (const Case& c : cases) fails += run(c, seed++);
  std::printf("%d failure(s) in all\n", fails);
  return fails != 0;
}
