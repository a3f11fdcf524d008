// float32-accurate GEMMs on Hopper tensor cores (wgmma, tf32x3) for the rows path at large B and
// for the backward's large GEMMs:
//   C[M, N] = A[M, K] x W[N, K]^T   (nn.Linear layout), then an epilogue:
//   kTcStore: out = C + bias, relu'd where act, zeroed where mask <= 0 (the encoder's hidden
//            layer; the backward's logits, hidden-layer gradient and weight gradients)
//   kTcBce:  per row and column tile, the sum of the clamped BCE of sigmoid(C + bias)
//            against x (elbo_math.cuh bce_bits: hardware log2, PyTorch's p where it decides
//            a clamp), and whether any x there was outside [0, 1] (the decoder's output layer:
//            the logits never reach memory; tc_bce_finish_launch sums the tiles)
//   relu_a:  A is read as relu(A) (the decoder's hidden layer, ReLU not yet applied)
//
// Block: a producer warpgroup (one thread issues the TMA loads of A, W's hi half and W's lo
// half per K stage of 32 floats) and one or two consumer warpgroups, each owning 64 rows of the
// output tile (TcShape: 128 rows by 128 columns, or 112 for kTcBce where that pads N less; one
// block per SM). A reaches the MMAs from registers: per stage a consumer thread loads its
// fragments (ldmatrix) and splits them into TF32 hi and lo there, one stage ahead of the MMAs,
// then issues 12 wgmma m64nNk8 (A from registers, W from shared memory): lo*hi and hi*lo
// first, hi*hi last, into an accumulator that starts from zero every stage and joins the
// running sum (which starts at the bias) through a float32 round-to-nearest add. A tensor core
// truncates as it accumulates, so one accumulator carried over a long K drifts toward zero and
// drowns the small terms (triton/common.py _encode_hidden: that failed the saturated-weights
// regime); per-stage sums fix it. With A in registers the MMAs read only W from shared memory
// (A from there too, split in place, cost 288 vs 238 us for the encoder per 65536 rows). Where
// kTcStore's tiles leave SMs idle (small M, or a weight gradient's 784 x 256), K is split
// across blocks (tc_gemm_splits; tc_splitk_kernel sums the partials in split order).
//
// Operands: K-major tiles with the 128-byte swizzle, as TMA writes them; wgmma reads W through
// descriptors (start address, SBO = 1024 bytes between 8-row groups; a k8 step is +32 bytes
// inside the swizzle atom), ldmatrix reads A (row r's 16-byte chunk c sits at chunk c ^ r % 8).
// W's halves come pre-split (tc_split_t_launch: hi exact in TF32, lo = W - hi; binding_tc.cpp
// splits them per forward, a few us) with tf32_split_inf, so that an infinite factor (an
// overflowed hidden unit; a saturated backward's gradient) gives float32's +-inf, not the NaN of
// inf - inf or inf * 0 in the small terms. A is split the same way, or, where the caller says W
// is finite (p.w_finite: weights, in the forward and in the backward's logits and hidden-layer
// gradient), by the cheaper tf32_split_act (an infinite A still gives +-inf; an exact A's lo = 0
// only ever meets finite W): it saves 6-17% of these kernels' time at M = 1024 to 65536 on an
// H200 (kWFinite, a template parameter, so the loop carries one of the two).
// No torch types; launches return cudaError_t.
#include <cstdint>

#include "cluster.cuh"
#include "deferred.cuh"
#include "elbo.h"
#include "elbo_math.cuh"
#include "wgmma.cuh"

namespace fastelbo {
namespace {
namespace tc {  // own names: the export inlines every source into one translation unit

constexpr int kBK = 32;
// Per mode: kTcStore pipelines 4 K stages; kTcBce 3, and its block also holds its tile of x
// (swizzled 32-column boxes), which TMA lands while the GEMM runs (the epilogue's x reads were
// dependent DRAM round trips: 734 vs 285 us per 65536 rows for the same MMA work). Tiles of 128
// rows (two consumer warpgroups), one block per SM. 64-row output-layer tiles at two blocks
// per SM, for one block's epilogue to overlap the other's MMAs, tied (355 vs 353 us per 65536
// rows; 11 vs 14 us at 1024) and were dropped. BN: the tile's columns (kTcStore 128; kTcBce 128
// or 112, whichever pads N less: D = 784 is 7 x 112, where 128 spent 1/8 of the MMAs on padding).
template <int Mode, int BN = kTcTileN> struct TcShape {
  static constexpr int kBN = BN;
  static constexpr int kBM = 128;
  static constexpr int kCons = kBM / 64;            // consumer warpgroups
  static constexpr int kBlock = 128 * (1 + kCons);  // + the producer warpgroup
  static constexpr int kStages = Mode == kTcBce ? 3 : 4;
  static constexpr int kXBoxes = Mode == kTcBce ? (BN + kBK - 1) / kBK : 1;  // 1: unused
  static constexpr int kStageTx = (kBM + 2 * kBN) * kBK * 4;  // bytes per stage (A, W hi, W lo)
  // setmaxnreg: the producer gives up what the consumers take, within the launch's 168.
  static constexpr int kProducerRegs = 40;
};
template <int Mode, int BN> struct TcSmem {
  using S = TcShape<Mode, BN>;
  float a[S::kStages][S::kBM * kBK];  // each tile a multiple of 1024 bytes (8-row swizzle atoms)
  float w[S::kStages][BN * kBK];
  float wlo[S::kStages][BN * kBK];
  float x[S::kXBoxes][S::kBM * kBK];  // kTcBce: the targets
  unsigned long long full[S::kStages], empty[S::kStages], xbar;
};
template <int Mode, int BN>
constexpr int kTcSmemBytes = sizeof(TcSmem<Mode, BN>) + 1024;  // + alignment slack

// kTcStore's epilogue: relu where act; threshold_backward(v, mask, 0) where a mask is given.
__device__ __forceinline__ float store_value(float v, int act, const float* mask, int ldm, int r,
                                             int c) {
  if (act) v = relu(v);
  return mask != nullptr && __ldg(mask + static_cast<size_t>(r) * ldm + c) <= 0.0f ? 0.0f : v;
}

template <int Mode, int BN, bool kWFinite>
__global__ void __launch_bounds__(TcShape<Mode, BN>::kBlock, 1)
    tc_gemm_kernel(const __grid_constant__ TcGemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Shape = TcShape<Mode, BN>;
  constexpr int kStages = Shape::kStages, kBM = Shape::kBM, kBN = BN, kAcc = BN / 2;
  extern __shared__ unsigned char smem_raw[];
  TcSmem<Mode, BN>& s = *reinterpret_cast<TcSmem<Mode, BN>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int n0 = static_cast<int>(blockIdx.x) * kBN, m0 = static_cast<int>(blockIdx.y) * kBM;
  // K stages [kt0, kt0 + nk): all of K, or split blockIdx.z of p.splits (kTcStore at small M).
  const int nk_all = cdiv(p.K, kBK), splits = Mode == kTcStore ? p.splits : 1;
  const int z = static_cast<int>(blockIdx.z);
  const int kt0 = z * nk_all / splits, nk = (z + 1) * nk_all / splits - kt0;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 4 * Shape::kCons);  // one arrival per consumer warp
    }
    mbar_init(&s.xbar, 1);
    mbar_fence_init();
  }
  __syncthreads();
  if (wg == 0) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Shape::kProducerRegs));
    if (threadIdx.x == 0) {
      if (Mode == kTcBce) {
        mbar_arrive_expect(&s.xbar, Shape::kXBoxes * kBM * kBK * 4);
        for (int b = 0; b < Shape::kXBoxes; ++b)
          tma_load_2d(s.x[b], &p.x_map, n0 + b * kBK, m0, &s.xbar);
      }
      for (int kt = 0; kt < nk; ++kt) {
        const int st = kt % kStages;
        if (kt >= kStages) mbar_wait(&s.empty[st], ((kt / kStages) & 1) ^ 1);
        mbar_arrive_expect(&s.full[st], Shape::kStageTx);
        const int k = (kt0 + kt) * kBK;
        tma_load_2d(s.a[st], &p.a_map, k, m0, &s.full[st]);
        tma_load_2d(s.w[st], &p.w_map, k, n0, &s.full[st]);
        tma_load_2d(s.wlo[st], &p.wlo_map, k, n0, &s.full[st]);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1, tid = static_cast<int>(threadIdx.x) - 128 * wg;
  // Accumulator layout (m64nNk8, f32): warp w of the warpgroup holds rows 16w + g and
  // 16w + g + 8 (g = lane / 4); n8 block j holds columns 8j + 2t and 8j + 2t + 1 (t = lane % 4).
  const int lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r0 = m0 + 64 * c + 16 * (tid >> 5) + g;
  const int jn = min(kBN / 8, cdiv(p.N - n0, 8));  // n8 blocks with a column inside N
  float run[kAcc], acc[kAcc];
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j) {  // the sums start at the bias (0 beyond N; in split 0 only)
    const int col = n0 + 8 * j + 2 * t;
    const bool biased = z == 0 && p.bias != nullptr;
    const float b0 = biased && col < p.N ? __ldg(p.bias + col) : 0.0f;
    const float b1 = biased && col + 1 < p.N ? __ldg(p.bias + col + 1) : 0.0f;
    run[4 * j] = b0;
    run[4 * j + 1] = b1;
    run[4 * j + 2] = b0;
    run[4 * j + 3] = b1;
  }
  // ldmatrix: lane l gives row 16 warp + 8 ((l / 8) % 2) + l % 8 of this warpgroup's 64, at
  // 16-byte chunk 2 k + l / 16 of k8 step k (XOR the row's l % 8: the swizzle).
  const int lr = lane & 7;
  const unsigned a_row = 4u * ((64 * c + 16 * (tid >> 5) + 8 * ((lane >> 3) & 1) + lr) * kBK);
  const int a_chunk = lane >> 4;
  // Stage kt's A fragments of this thread, split: hi[k], lo[k] for k8 step k.
  using Frag = uint32_t[kBK / 8][4];
  auto load_stage = [&](int kt, Frag& hi, Frag& lo) {
    const int st = kt % kStages;
    mbar_wait(&s.full[st], (kt / kStages) & 1);
    const unsigned base = smem_addr(s.a[st]) + a_row;
#pragma unroll
    for (int k = 0; k < kBK / 8; ++k) {
      uint32_t r[4];
      ldsm_x4(r, base + 16u * ((2 * k + a_chunk) ^ lr));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v = __uint_as_float(r[i]);
        if (p.relu_a) v = relu(v);
        if (kWFinite)
          tf32_split_act(v, &hi[k][i], &lo[k][i]);
        else
          tf32_split_inf(v, &hi[k][i], &lo[k][i]);
      }
    }
  };
  // Stage kt's MMAs from (hi, lo); the next stage's fragments load into (nhi, nlo) meanwhile.
  auto mma_stage = [&](int kt, const Frag& hi, const Frag& lo, Frag& nhi, Frag& nlo) {
    const int st = kt % kStages;
    const float* w = s.w[st];
    const float* wlo = s.wlo[st];
    wgmma_fence();
    fence_regs(acc);
#pragma unroll
    for (int k = 0; k < kBK / 8; ++k)
      wgmma_k8(acc, lo[k], desc_sw128(w + 8 * k), k > 0);
#pragma unroll
    for (int k = 0; k < kBK / 8; ++k)
      wgmma_k8(acc, hi[k], desc_sw128(wlo + 8 * k), 1);
#pragma unroll
    for (int k = 0; k < kBK / 8; ++k)
      wgmma_k8(acc, hi[k], desc_sw128(w + 8 * k), 1);
    wgmma_commit();
    if (kt + 1 < nk) load_stage(kt + 1, nhi, nlo);  // overlaps this stage's MMAs
    wgmma_wait0();
    fence_regs(acc);
    if (lane == 0) mbar_arrive(&s.empty[st]);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) run[i] = __fadd_rn(run[i], acc[i]);
  };
  Frag hi0, lo0, hi1, lo1;
  load_stage(0, hi0, lo0);
  for (int kt = 0; kt < nk; kt += 2) {  // two stages per trip: the fragment buffers alternate
    mma_stage(kt, hi0, lo0, hi1, lo1);
    if (kt + 1 < nk) mma_stage(kt + 1, hi1, lo1, hi0, lo0);
  }
  // Epilogue (the accumulator layout above).
  if (Mode == kTcStore) {  // C + bias as store_value says, or split z's partial sums
    float* out = splits == 1 ? p.out : p.ws + static_cast<size_t>(z) * p.M * p.N;
    const int ld = splits == 1 ? p.ldo : p.N;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) {
      if (j >= jn) break;  // the whole block: n8 blocks beyond N
      const int col = n0 + 8 * j + 2 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = r0 + 8 * (e >> 1), cc = col + (e & 1);
        if (r < p.M && cc < p.N)
          out[static_cast<size_t>(r) * ld + cc] =
              splits == 1 ? store_value(run[4 * j + e], p.act, p.mask, p.ldm, r, cc)
                          : run[4 * j + e];
      }
    }
    return;
  }
  float sum[2] = {0.0f, 0.0f};
  bool bad[2] = {false, false};
  mbar_wait(&s.xbar, 0);
  const int rl = 64 * c + 16 * (tid >> 5) + g;  // the block's row of r0
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j) {
    if (j >= jn) break;  // the whole block: n8 blocks beyond N
    // Columns n0 + cb and + 1 (both inside N or neither: N % 4 == 0): one 8-byte load of x from
    // its box (32 columns), 16-byte chunk (cb % 32) / 4 of row ro, XOR ro % 8.
    const int cb = 8 * j + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (r0 + 8 * h < p.M && n0 + cb < p.N) {
        const int ro = rl + 8 * h;
        const float2 xv = *reinterpret_cast<const float2*>(
            &s.x[cb >> 5][ro * kBK + ((((cb & 31) >> 2) ^ (ro & 7)) << 2) + (cb & 3)]);
        bad[h] |= outside_unit(xv.x) || outside_unit(xv.y);
        sum[h] += bce_bits(run[4 * j + 2 * h], xv.x - 1.0f, xv.x);
        sum[h] += bce_bits(run[4 * j + 2 * h + 1], xv.y - 1.0f, xv.y);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], off);
      bad[h] = (__shfl_xor_sync(0xffffffffu, static_cast<int>(bad[h]), off) != 0) || bad[h];
    }
    const int r = r0 + 8 * h;
    if (t == 0 && r < p.M) {
      const size_t i = static_cast<size_t>(r) * gridDim.x + blockIdx.x;
      p.partial[i] = sum[h] * kLn2;  // bits to nats
      p.partial_bad[i] = bad[h] ? 1 : 0;
      if (bad[h] && p.any_bad != nullptr) *p.any_bad = 1;  // the deferred check's call flag
    }
  }
#else
  __trap();  // sm_90a only: the binding dispatches here on compute capability 9.0 alone
#endif
}

// recon = the row's tile sums in tile order; a bad x anywhere in the row makes all three NaN.
// With the deferred check (p.err): a bad row's values are noted, and where the call's flag is
// set every row of this chunk and the p.prior rows before it are NaN (elbo.h TcFinishParams).
__global__ void __launch_bounds__(kThreads) tc_bce_finish_kernel(const __grid_constant__ TcFinishParams p) {
  const int row = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  const bool call_bad = p.err != nullptr && *p.flag != 0;
  if (call_bad) {  // the earlier chunks' rows, grid-stride (none of them is this kernel's)
    const float nan = __int_as_float(0x7fc00000);
    for (int i = row; i < p.prior; i += static_cast<int>(gridDim.x) * kThreads) {
      p.elbo[i - p.prior] = nan;
      p.recon[i - p.prior] = nan;
      p.kl[i - p.prior] = nan;
    }
  }
  if (row >= p.n) return;
  float s = 0.0f;
  bool bad = false;
  for (int i = 0; i < p.tiles; ++i) {
    s += p.partial[static_cast<size_t>(row) * p.tiles + i];
    bad |= p.partial_bad[static_cast<size_t>(row) * p.tiles + i] != 0;
  }
  write_row(p.recon, p.kl, p.elbo, row, s, bad || call_bad);
  if (bad && p.err != nullptr)  // the slow path: this row's bad values
    deferred_note_row(p.err, p.x + static_cast<size_t>(row) * p.D, p.D,
                      static_cast<long long>(p.row0) + row);
}

// out = store_value(the splits' partial sums, in split order), elementwise over M x N.
__global__ void __launch_bounds__(kThreads) tc_splitk_kernel(const __grid_constant__ TcGemmParams p) {
  const long long n = static_cast<long long>(p.M) * p.N;  // also the stride between splits
  for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    float v = p.ws[i];
    for (int z = 1; z < p.splits; ++z) v += p.ws[i + z * n];
    const int r = static_cast<int>(i / p.N), c = static_cast<int>(i % p.N);
    p.out[static_cast<size_t>(r) * p.ldo + c] = store_value(v, p.act, p.mask, p.ldm, r, c);
  }
}

// TcSplitParams' jobs in 32 x 32 tiles, one per block (block b: job t's tile b - first_block[t],
// row-major over the source's tiles); transposed jobs go through shared memory, so that reads
// and writes are both along rows.
__global__ void __launch_bounds__(kThreads) tc_split_t_kernel(const __grid_constant__ TcSplitParams p) {
  __shared__ float tile[32][33];
  const int b = static_cast<int>(blockIdx.x);
  int t = 0;
  while (t + 1 < p.count && b >= p.first_block[t + 1]) ++t;
  const int tiles_c = cdiv(p.cols[t], 32), tb = b - p.first_block[t];
  const int r0 = (tb / tiles_c) * 32, c0 = (tb % tiles_c) * 32;
  const int tx = static_cast<int>(threadIdx.x) & 31, ty = static_cast<int>(threadIdx.x) >> 5;
  const float* src = p.src[t];
  float *hi = p.hi[t], *lo = p.lo[t];
  const int rows = p.rows[t], cols = p.cols[t], ldt = p.ldt[t];
  auto put = [&](size_t i, float v) {
    if (lo == nullptr) {
      hi[i] = v;
      return;
    }
    uint32_t h, l;
    tf32_split_inf(v, &h, &l);
    hi[i] = __uint_as_float(h);
    lo[i] = __uint_as_float(l);
  };
  for (int y = ty; y < 32; y += kWarps) {
    const int r = r0 + y, c = c0 + tx;
    const float v = r < rows && c < cols ? __ldg(src + static_cast<size_t>(r) * p.lds[t] + c)
                                         : 0.0f;
    if (!p.trans[t]) {
      if (r < rows && c < cols) put(static_cast<size_t>(r) * ldt + c, v);
    } else {
      tile[y][tx] = v;
    }
  }
  if (!p.trans[t]) return;  // the whole block
  __syncthreads();
  for (int y = ty; y < 32; y += kWarps) {  // output row c0 + y, column r0 + tx
    const int c = c0 + y, r = r0 + tx;
    if (c < cols && r < rows) put(static_cast<size_t>(c) * ldt + r, tile[tx][y]);
  }
}

// A row-major (rows x cols, row stride ld floats) float32 matrix in 128-byte-swizzled boxes of
// kBK x box_rows; elements outside it read as zero.
bool encode_sw128(CUtensorMap* map, const float* base, int cols, int rows, int ld, int box_rows) {
  return encode_tensor_map_2d(map, base, cols, rows, ld, kBK, box_rows,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

// kTcBce's tile width: 112 where it pads N less than 128 does (tc_gemm_tiles_n follows it).
int bce_bn(int N) { return cdiv(N, 112) * 112 < cdiv(N, 128) * 128 ? 112 : 128; }

template <int Mode, int BN, bool kWFinite>
cudaError_t launch(TcGemmParams& p, const float* a, int lda, const float* w_hi, const float* w_lo,
                   cudaStream_t stream) {
  using Shape = TcShape<Mode, BN>;
  constexpr int bm = Shape::kBM;
  if (cdiv(p.M, bm) > 65535) return cudaErrorInvalidValue;
  if (!encode_sw128(&p.a_map, a, p.K, p.M, lda, bm) ||
      !encode_sw128(&p.w_map, w_hi, p.K, p.N, p.ldw, BN) ||
      !encode_sw128(&p.wlo_map, w_lo, p.K, p.N, p.ldw, BN))
    return cudaErrorInvalidValue;
  if (Mode == kTcBce && (p.ldx % 4 != 0 || !encode_sw128(&p.x_map, p.x, p.N, p.M, p.ldx, bm)))
    return cudaErrorInvalidValue;
  constexpr int smem = kTcSmemBytes<Mode, BN>;
  // Per device: set at every launch (cheap).
  const cudaError_t attr = cudaFuncSetAttribute(tc_gemm_kernel<Mode, BN, kWFinite>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  const int splits = Mode == kTcStore ? p.splits : 1;
  const dim3 grid(cdiv(p.N, BN), cdiv(p.M, bm), splits);
  tc_gemm_kernel<Mode, BN, kWFinite><<<grid, Shape::kBlock, smem, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || splits == 1) return e;
  const long long blocks = (static_cast<long long>(p.M) * p.N + kThreads - 1) / kThreads;
  tc_splitk_kernel<<<static_cast<int>(blocks < 4096 ? blocks : 4096), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace tc
}  // namespace

using namespace tc;

int tc_gemm_tiles_n(int N) noexcept { return cdiv(N, bce_bn(N)); }

int tc_gemm_splits(int M, int N, int K, int sms) noexcept {
  const int blocks = cdiv(M, TcShape<kTcStore>::kBM) * cdiv(N, kTcTileN);
  const int most = cdiv(K, kBK) / 2;  // at least two K stages per split
  const int want = sms / blocks;
  return want < 2 || most < 2 ? 1 : (want < most ? want : most);
}

cudaError_t tc_gemm_launch(TcGemmParams& p, const float* a, int lda, const float* w_hi,
                           const float* w_lo, cudaStream_t stream) noexcept {
  if (p.ldw == 0) p.ldw = p.K;
  if (p.M < 1 || p.N < 1 || p.K < 1 || lda % 4 != 0 || p.ldw % 4 != 0 || p.ldw < p.K ||
      (p.mode == kTcBce && (p.N % 4 != 0 || p.w_finite != 1)) ||
      (p.mode == kTcStore && (p.splits < 1 || p.splits > cdiv(p.K, kBK) ||
                             (p.splits > 1 && p.ws == nullptr))))
    return cudaErrorInvalidValue;
  if (p.mode == kTcStore)
    return p.w_finite ? launch<kTcStore, kTcTileN, true>(p, a, lda, w_hi, w_lo, stream)
                      : launch<kTcStore, kTcTileN, false>(p, a, lda, w_hi, w_lo, stream);
  return bce_bn(p.N) == 112 ? launch<kTcBce, 112, true>(p, a, lda, w_hi, w_lo, stream)
                            : launch<kTcBce, 128, true>(p, a, lda, w_hi, w_lo, stream);
}

cudaError_t tc_bce_finish_launch(const TcFinishParams& p, cudaStream_t stream) noexcept {
  if (p.n < 1) return cudaSuccess;
  tc_bce_finish_kernel<<<cdiv(p.n, kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t tc_split_t_launch(TcSplitParams& p, cudaStream_t stream) noexcept {
  if (p.count < 1 || p.count > kTcSplitMax) return cudaErrorInvalidValue;
  long long blocks = 0;
  for (int t = 0; t < p.count; ++t) {
    if (p.rows[t] < 1 || p.cols[t] < 1) return cudaErrorInvalidValue;
    p.first_block[t] = static_cast<int>(blocks);
    blocks += static_cast<long long>(cdiv(p.rows[t], 32)) * cdiv(p.cols[t], 32);
  }
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  p.first_block[p.count] = static_cast<int>(blocks);
  tc_split_t_kernel<<<static_cast<int>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fastelbo
