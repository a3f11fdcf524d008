// Where the cluster kernel's time goes: per-phase cycle counts, no torch, no profiler.
//
// Builds elbo.cu with -DFASTELBO_TRACE (thread 0 of every block stamps clock64() at each
// barrier and layer boundary), launches the kernel on random inputs, and prints, per phase,
// the median and max over blocks of the cycles spent, plus the launch's device time from
// a CUDA graph of many launches (as `fastelbo bench` times a forward).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 \
//        -I src/fastelbo/backends/cuda/kernels -o /tmp/cuda_trace benchmarks/experiments/cuda_trace.cu
//   /tmp/cuda_trace fast|cluster [B] [rows] [cluster] [staged]   (0 / -1: the planner's choice)
#define FASTELBO_TRACE
#include "elbo.cu"
#include "elbo_fast.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_check.h"

namespace {

unsigned long long g_lcg = 12345;
float uniform() {  // [0, 1)
  g_lcg = g_lcg * 6364136223846793005ULL + 1442695040888963407ULL;
  return static_cast<float>((g_lcg >> 40) & 0xFFFFFF) / 16777216.0f;
}

float* device_random(size_t n, float lo, float hi) {
  std::vector<float> h(n);
  for (auto& v : h) v = lo + (hi - lo) * uniform();
  float* d = nullptr;
  CK(cudaMalloc(&d, n * sizeof(float)));
  CK(cudaMemcpy(d, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

const char* kClusterPhase[] = {"stage issue",   "S0 (wait x,w1)", "L1 compute", "S1",
                               "L2+reparam+KL", "S2",             "L3 compute", "S3",
                               "L4 compute",    "BCE",            "S4",         "final (rank 0)"};
const char* kFastPhase[] = {"stage issue",     "wait G0",       "L1 partial",
                            "cl.wait + send h", "RS1 (+G1)",    "L2 + send",
                            "wait mu|lv",      "RS2+send z+KL", "wait z (+G2)",
                            "L3 + send d",     "wait d (+G3)",  "L4 + BCE",
                            "row sums",        "S",             "final (rank 0)"};

}  // namespace

int main(int argc, char** argv) {
  using namespace fastelbo;
  const bool fast = argc > 1 && std::string(argv[1]) == "fast";
  const int B = argc > 2 ? std::atoi(argv[2]) : 128;
  const int rows = argc > 3 ? std::atoi(argv[3]) : 0;
  const int cluster = argc > 4 ? std::atoi(argv[4]) : 0;
  const int staged = argc > 5 ? std::atoi(argv[5]) : -1;
  const int D = 784, H = 256, L = 32;
  ElboParams p{};
  p.B = B; p.D = D; p.H = H; p.L = L;
  const float s1 = 1.0f / std::sqrt(static_cast<float>(D)), s2 = 1.0f / 16.0f,
              s3 = 1.0f / std::sqrt(static_cast<float>(L));
  p.x = device_random(static_cast<size_t>(B) * D, 0.0f, 1.0f);
  p.eps = device_random(static_cast<size_t>(B) * L, -2.0f, 2.0f);
  p.w1 = device_random(static_cast<size_t>(H) * D, -s1, s1);
  p.b1 = device_random(H, -s1, s1);
  p.wmu = device_random(static_cast<size_t>(L) * H, -s2, s2);
  p.bmu = device_random(L, -s2, s2);
  p.wlv = device_random(static_cast<size_t>(L) * H, -s2, s2);
  p.blv = device_random(L, -s2, s2);
  p.wd1 = device_random(static_cast<size_t>(H) * L, -s3, s3);
  p.bd1 = device_random(H, -s3, s3);
  p.wd2 = device_random(static_cast<size_t>(D) * H, -s2, s2);
  p.bd2 = device_random(D, -s2, s2);
  float* out = nullptr;
  CK(cudaMalloc(&out, 3 * static_cast<size_t>(B) * sizeof(float)));
  p.elbo = out; p.recon = out + B; p.kl = out + 2 * B;
  p.vec = 0xF;
  FastParams f{};
  f.x = p.x; f.eps = p.eps; f.w1 = p.w1; f.b1 = p.b1; f.wmu = p.wmu; f.bmu = p.bmu;
  f.wlv = p.wlv; f.blv = p.blv; f.wd1 = p.wd1; f.bd1 = p.bd1; f.wd2 = p.wd2; f.bd2 = p.bd2;
  f.elbo = p.elbo; f.recon = p.recon; f.kl = p.kl;
  f.B = B; f.D = D; f.H = H; f.L = L;
  cudaError_t err = cudaSuccess;
  const ElboStatus st = fast ? elbo_fast_plan(f, 0, cluster, false, &err)
                             : elbo_plan(p, 0, rows, cluster, staged, &err);
  if (st != kElboOk) { std::fprintf(stderr, "plan: status %d (%s)\n", st, cudaGetErrorString(err)); return 1; }
  const int blocks = fast ? cdiv(B, f.R) * f.C : cdiv(B, p.R) * p.C;
  if (fast)
    std::printf("fast B=%d plan: R=%d C=%d smem=%d B blocks=%d\n", B, f.R, f.C, f.smem_bytes, blocks);
  else
    std::printf("cluster B=%d plan: R=%d C=%d staged=%d variant=%d smem=%d B blocks=%d\n", B, p.R,
                p.C, p.staged, p.variant, p.smem_bytes, blocks);
  auto launch = [&](cudaStream_t s) { return fast ? elbo_fast_launch(f, s) : elbo_launch(p, s); };
  const char** phase = fast ? kFastPhase : kClusterPhase;
  const int points = fast ? 16 : 13;

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < 20; ++i) CK(launch(s));
  CK(cudaStreamSynchronize(s));

  // Device time per launch: one graph of kReps launches, median of 5 replays.
  constexpr int kReps = 100;
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kReps; ++i) CK(launch(s));
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < 5; ++r) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  int clock_khz = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  std::printf("graph replay: %.2f us per launch (median of 5 replays of %d)\n",
              ms[2] * 1e3f / kReps, kReps);

  // One traced launch alone.
  CK(launch(s));
  CK(cudaStreamSynchronize(s));
  const int nb = std::min(blocks, kTraceBlocks);
  std::vector<long long> tr(static_cast<size_t>(kTraceBlocks) * kTracePoints);
  CK(cudaMemcpyFromSymbol(tr.data(), g_elbo_trace, tr.size() * sizeof(long long)));
  std::printf("per phase, cycles over %d blocks (clock attr %d MHz): median  max\n", nb,
              clock_khz / 1000);
  long long total_med = 0;
  for (int ph = 0; ph + 1 < points; ++ph) {
    std::vector<long long> d(nb);
    for (int b = 0; b < nb; ++b)
      d[b] = tr[b * kTracePoints + ph + 1] - tr[b * kTracePoints + ph];
    std::sort(d.begin(), d.end());
    total_med += d[nb / 2];
    std::printf("  %-16s %8lld %8lld\n", phase[ph], d[nb / 2], d[nb - 1]);
  }
  std::vector<long long> tot(nb);
  for (int b = 0; b < nb; ++b)
    tot[b] = tr[b * kTracePoints + points - 1] - tr[b * kTracePoints];
  std::sort(tot.begin(), tot.end());
  std::printf("  %-16s %8lld %8lld  (sum of medians %lld)\n", "whole block", tot[nb / 2],
              tot[nb - 1], total_med);
  std::vector<float> h(3 * static_cast<size_t>(B));
  CK(cudaMemcpy(h.data(), out, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double sum = 0;
  for (float v : h) sum += v;
  std::printf("checksum %.6e (elbo[0]=%.6f)\n", sum, h[0]);
  return 0;
}
