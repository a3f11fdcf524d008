// How fast one SM's shared memory fills from L2 by the ways the fast cluster kernel could stage
// a 53 KB weight slice (elbo_fast.cu stages w1's 256 rows x 52 columns as one tensor-map box;
// run 61's trace put that at ~8K cycles, ~7 B/cycle, even with a single cluster). Standalone:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I src/fastelbo/backends/cuda \
//        -o /tmp/tma_ingest benchmarks/tma_ingest.cu && /tmp/tma_ingest
// Modes (each block: thread 0 arms one mbarrier for the slice's bytes; cycles from before the
// first copy is issued until the barrier completes, per block; the data is L2-resident after the
// first of three rounds, which is dropped):
//   box R      the slice as 256 / R tensor-map boxes of R rows x 52 columns (R = 256: as now)
//   rows       256 bulk copies of one 208-byte row each, issued by 256 threads
//   contiguous one bulk copy of the same 53,248 bytes laid out contiguously
//   pieces P   the contiguous bytes as bulk copies of P bytes each, issued by as many threads
// Blocks read the 16 different column slices of a 256 x 784 matrix (block b: slice b % 16), as
// a cluster's blocks do; 1, 16, 112 and 132 blocks, one per SM (120 KB of shared memory each).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <vector>

#include "cluster.cuh"

namespace {

constexpr int kRows = 256, kCols = 52, kLd = 784, kSlices = 16, kThreads = 256;
constexpr unsigned kBytes = kRows * kCols * 4;
constexpr int kSmem = 120 * 1024;

enum Mode { kBox = 0, kRowCopies = 1, kContiguous = 2, kPieces = 3 };

__global__ void __launch_bounds__(kThreads) ingest(const __grid_constant__ CUtensorMap map,
                                                   const float* matrix, const float* packed,
                                                   int mode, int arg, long long* cycles) {
  extern __shared__ __align__(128) float sm[];
  __shared__ alignas(8) unsigned long long bar;
  const int tid = static_cast<int>(threadIdx.x), slice = static_cast<int>(blockIdx.x) % kSlices;
  if (tid == 0) {
    fastelbo::mbar_init(&bar, 1);
    fastelbo::mbar_fence_init();
  }
  __syncthreads();
  const long long t0 = clock64();
  if (tid == 0) {
    fastelbo::mbar_arrive_expect(&bar, kBytes);
    if (mode == kBox)
      for (int r = 0; r < kRows; r += arg)
        fastelbo::tma_load_2d(sm + r * kCols, &map, slice * kCols, r, &bar);
    if (mode == kContiguous)
      fastelbo::bulk_copy(sm, packed + static_cast<size_t>(slice) * kRows * kCols, kBytes, &bar);
  }
  if (mode == kRowCopies)
    for (int r = tid; r < kRows; r += kThreads)
      fastelbo::bulk_copy(sm + r * kCols, matrix + r * kLd + slice * kCols, kCols * 4, &bar);
  if (mode == kPieces) {
    const float* src = packed + static_cast<size_t>(slice) * kRows * kCols;
    const int floats = arg / 4, n = (kRows * kCols + floats - 1) / floats;
    for (int i = tid; i < n; i += kThreads) {
      const int len = min(floats, kRows * kCols - i * floats);
      fastelbo::bulk_copy(sm + i * floats, src + i * floats, 4u * len, &bar);
    }
  }
  fastelbo::mbar_wait(&bar, 0);
  const long long t1 = clock64();
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e_));                  \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

bool encode(CUtensorMap* map, const float* base, int box_rows) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                       &q) != cudaSuccess || q != cudaDriverEntryPointSuccess)
    return false;
  const cuuint64_t dims[2] = {kLd, kRows};
  const cuuint64_t strides[1] = {kLd * 4};
  const cuuint32_t box[2] = {kCols, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t step[2] = {1, 1};
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f)(
             map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base), dims, strides,
             box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
             CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
         CUDA_SUCCESS;
}

}  // namespace

int main() {
  float *matrix = nullptr, *packed = nullptr;
  long long* cycles = nullptr;
  CHECK(cudaMalloc(&matrix, sizeof(float) * kRows * kLd));
  CHECK(cudaMalloc(&packed, sizeof(float) * kSlices * kRows * kCols));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * 1024));
  CHECK(cudaMemset(matrix, 0, sizeof(float) * kRows * kLd));
  CHECK(cudaMemset(packed, 0, sizeof(float) * kSlices * kRows * kCols));
  CHECK(cudaFuncSetAttribute(ingest, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  struct Case { const char* name; int mode, arg; };
  const Case cases[] = {{"box 256", kBox, 256}, {"box 64", kBox, 64}, {"box 16", kBox, 16},
                        {"rows", kRowCopies, 0}, {"contiguous", kContiguous, 0},
                        {"pieces 16384", kPieces, 16384}, {"pieces 4096", kPieces, 4096},
                        {"pieces 1024", kPieces, 1024}};
  std::printf("%d x %d floats (%u bytes) per block; cycles from issue to landed\n", kRows, kCols,
              kBytes);
  std::printf("%-14s %7s %10s %10s %10s\n", "mode", "blocks", "median", "max", "B/cycle");
  for (const Case& c : cases) {
    CUtensorMap map{};
    if (c.mode == kBox && !encode(&map, matrix, c.arg)) {
      std::printf("%-14s tensor map encoding failed\n", c.name);
      continue;
    }
    for (int blocks : {1, 16, 112, 132}) {
      std::vector<long long> h(blocks);
      for (int round = 0; round < 3; ++round) {  // round 0 warms L2 and is dropped
        ingest<<<blocks, kThreads, kSmem>>>(map, matrix, packed, c.mode, c.arg, cycles);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
      }
      CHECK(cudaMemcpy(h.data(), cycles, sizeof(long long) * blocks, cudaMemcpyDeviceToHost));
      std::sort(h.begin(), h.end());
      const long long med = h[blocks / 2];
      std::printf("%-14s %7d %10lld %10lld %10.1f\n", c.name, blocks, med, h.back(),
                  static_cast<double>(kBytes) / static_cast<double>(med));
    }
  }
  return 0;
}
