// Standalone timing of iwae.cu (no torch): B images x K samples at 784/256/32, Philox noise, for
// A/B builds: put an experiment behind a -D switch in iwae.cu, build each variant and compare
// time and partials (benchmarks/device_run.sh iwae-variants, IWAE_VARIANTS="base X Y+Z"; the
// switches tried and their results are in benchmarks/NOTES.md, runs 27-33):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I src/fastelbo/backends/cuda \
//        [-DFE_IWAE_...] -o /tmp/iv benchmarks/iwae_variants.cu
//   /tmp/iv [B=1320] [K=5000] [partials.bin]
// Prints ms per call and the extrapolation to 10,000 images, and a checksum of the partials.
#include "elbo.cu"
#include "iwae.cu"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

using fastelbo::IwaeParams;

static float* upload(const std::vector<float>& h) {
  float* d = nullptr;
  cudaMalloc(&d, h.size() * sizeof(float));
  cudaMemcpy(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice);
  return d;
}

int main(int argc, char** argv) {
  const int B = argc > 1 ? std::atoi(argv[1]) : 1320;
  const long long K = argc > 2 ? std::atoll(argv[2]) : 5000;
  const int D = 784, H = 256, L = 32;
  srand(1);
  auto uni = [](float a) { return a * (2.0f * rand() / RAND_MAX - 1.0f); };
  std::vector<float> x(static_cast<size_t>(B) * D), mu(B * L), lv(B * L), w1(H * L), b1(H),
      w2(D * H), b2(D);
  for (auto& v : x) v = rand() % 2;
  for (auto& v : mu) v = uni(1.0f);
  for (auto& v : lv) v = uni(1.0f) - 1.0f;
  for (auto& v : w1) v = uni(1.0f / std::sqrt(L));
  for (auto& v : b1) v = uni(1.0f / std::sqrt(L));
  for (auto& v : w2) v = uni(1.0f / std::sqrt(H));
  for (auto& v : b2) v = uni(1.0f / std::sqrt(H));
  IwaeParams p{};
  p.x = upload(x); p.mu = upload(mu); p.lv = upload(lv);
  p.w1 = upload(w1); p.b1 = upload(b1); p.w2 = upload(w2); p.b2 = upload(b2);
  p.B = B; p.D = D; p.H = H; p.L = L; p.K = K; p.seed = 0; p.vec = 1;
  cudaError_t err = cudaSuccess;
  if (fastelbo::iwae_plan(p, 0, &err) != fastelbo::kElboOk) { std::printf("plan failed\n"); return 1; }
  const long long tile = 32LL * p.mt, tiles = (K + tile - 1) / tile;
  const long long want = std::min(32LL, (tiles + 3) / 4);
  p.k_per_split = (tiles + want - 1) / want * tile;
  p.splits = static_cast<int>((K + p.k_per_split - 1) / p.k_per_split);
  cudaMalloc(&p.part, sizeof(float) * B * p.splits);
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  fastelbo::iwae_launch(p, 0);
  cudaDeviceSynchronize();
  float best = 1e30f;
  for (int r = 0; r < 3; ++r) {
    cudaEventRecord(a);
    fastelbo::iwae_launch(p, 0);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = std::min(best, ms);
  }
  std::vector<float> part(static_cast<size_t>(B) * p.splits);
  cudaMemcpy(part.data(), p.part, part.size() * sizeof(float), cudaMemcpyDeviceToHost);
  double sum = 0;
  for (float v : part) sum += v;
  if (argc > 3) {  // dump the partials for a comparison across builds
    FILE* f = std::fopen(argv[3], "wb");
    std::fwrite(part.data(), sizeof(float), part.size(), f);
    std::fclose(f);
  }
  std::printf("B=%d K=%lld tile=%lld splits=%d smem=%d: %.3f ms, %.4f s per 10,000 images; "
              "checksum %.6f (%s)\n", B, K, tile, p.splits, p.smem_bytes, best,
              best * 1e-3 * 10000.0 / B, sum, cudaGetErrorString(cudaGetLastError()));
  return 0;
}
