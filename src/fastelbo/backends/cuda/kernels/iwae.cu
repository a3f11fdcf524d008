// The importance-weighted bound (IWAE) on tensor cores: one block per (image, K-split), the
// decoder of every sample tile in two tf32x3 GEMMs whose activations never leave the SM.
//
// Per tile of M samples (M = 128, or 64 where shared memory is short):
//   eps (Triton's Philox counters, or injected) -> z [M, L] and log p(z) - log q(z|x), in smem
//   z  --GEMM 1 (tf32x3), + b1, relu-->  d [M, H] kept whole in shared memory (fp32)
//   d  --GEMM 2 (tf32x3), per chunk of 128 output columns--> logits in registers
//   logits --+ b2, sigmoid, clamped BCE vs x (hardware-log2 logs)--> row sums -> log weights
//   log weights --> per-sample-lane running logsumexp (memory flat in K)
// The Triton kernel (backends/triton/iwae.py) rebuilds d for every column chunk of D (+50%
// MMA work at its tiles) because it has no shared memory to keep it in; here d is built once.
//
// GEMMs: C[M, N] = A[M, K] (smem, fp32) x B[N, K]^T (global weights, nn.Linear layout), with
// mma.sync m16n8k8 TF32: 8 warps as 2 (M) x 4 (N); a warp owns MT m16 tiles and 4 n8 tiles of
// each 128-column chunk, interleaved across warps (n8 tile nt * 4 + warp_n) so a ragged last
// chunk (D = 784: 16 columns) is shared out instead of idling three warps. B streams through
// shared memory in [128 x 64] stages (double-buffered cp.async). Both operands are split into
// TF32 hi + lo in registers (tf32_split): acc = hi*hi, corr = hi*lo + lo*hi, summed apart so
// that NaN from an infinite operand (lo = inf - inf) is dropped as Triton's tf32x3 does (see
// triton/common.py). Shared-memory strides are 4 mod 8 floats: the 8 rows of 16 bytes of every
// ldmatrix block hit distinct banks; fragments are addressed by 32-bit offsets into iwae_smem.
//
// BCE (bce_bits): PyTorch's float32 p = 1 / (1 + expf(-a)) where it decides anything (1 - p and
// which elements the -100 clamps hit); the two logs from the hardware log2, ~2^-22 per term.
//
// Where the time goes (H200, 10,000 images x K = 5000 = 400K tiles; A/B runs of kernel
// variants): issue-bound with 2 warps per
// scheduler, not tensor-bound, until the changes below; now more latency-bound (ncu: IPC 1.5,
// 0.54 eligible warps per scheduler, tensor pipe 46%). What paid, in order: hardware-log2 logs instead of IEEE logf +
// log1pf (0.71 -> 0.61 s with the one-LOP split below), 32-bit smem offsets (0.55), 64-wide
// double-buffered stages (0.53), ldmatrix fragments (-3%), no per-n8-tile liveness branches
// (-1%), and an epilogue of ~25 instructions per element instead of ~45: no out-of-line
// reciprocal slow path, one-instruction NaN-keeping clamps, logs in bits with one ln 2 per row,
// the NaN rule once per chunk (0.51 -> 0.45 s). Tried and slower: fragment prefetch one k step
// ahead, two blocks per SM at 64-sample tiles (registers capped at 128), 64x64 warp tiles.
//
// Arithmetic (784/256/32, M = 128): 77M tf32 MACs x 3 per tile, ~40 tiles per image at K = 5000.
// No torch types; plan/launch are noexcept and return codes (elbo.h).
#include <cstdint>

#include "cluster.cuh"
#include "elbo.h"
#include "elbo_math.cuh"
#include "philox.cuh"

namespace fastelbo {
namespace {

constexpr int kNT = 4;          // n8 tiles per warp per chunk
constexpr int kKC = 64;         // GEMM reduction per pipeline stage (8 k steps between barriers)
constexpr int kStages = 2;      // double-buffered: a stage lands while the other is consumed
constexpr int kLdw = kKC + 4;   // staged B row stride (4 mod 8 floats: conflict-free fragments)
constexpr int kWarpsN = 4;      // warps along N; kWarps / kWarpsN = 2 along M
constexpr int kNC = kWarpsN * kNT * 8;  // GEMM columns per chunk
constexpr int kStageFloats = kNC * kLdw;

// ---- tf32x3 tensor-core tiles ----
// Splits: tf32_split (elbo_math.cuh); measured against the cvt.rna split, estimates move by
// ~1e-5 nats at K = 5000.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ float combine(float acc, float corr) {
  return acc + (corr == corr ? corr : 0.0f);  // NaN in the small terms: dropped (see top)
}

// The clamped BCE term in bits: bce_bits (elbo_math.cuh), shared with tc_gemm.cu.

__device__ __forceinline__ void cp_async16_zfill(float* dst, const float* src, bool ok) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d),
               "l"(__cvta_generic_to_global(src)), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4_zfill(float* dst, const float* src, bool ok) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d),
               "l"(__cvta_generic_to_global(src)), "r"(ok ? 4 : 0) : "memory");
}

// Rows [n0, n0 + kNC) x columns [k0, k0 + kKC) of the row-major (N x K) matrix B into a stage;
// what lies outside B reads as zero (no global access).
__device__ __forceinline__ void load_stage(float* st, const float* B, int N, int K, int n0, int k0,
                                           bool vec) {
  if (vec) {
    for (int i = threadIdx.x; i < kNC * (kKC / 4); i += kThreads) {
      const int r = i / (kKC / 4), c = (i % (kKC / 4)) * 4;
      const bool ok = n0 + r < N && k0 + c < K;
      cp_async16_zfill(st + r * kLdw + c, ok ? B + static_cast<int64_t>(n0 + r) * K + k0 + c : B,
                       ok);
    }
  } else {
    for (int i = threadIdx.x; i < kNC * kKC; i += kThreads) {
      const int r = i / kKC, c = i % kKC;
      const bool ok = n0 + r < N && k0 + c < K;
      cp_async4_zfill(st + r * kLdw + c, ok ? B + static_cast<int64_t>(n0 + r) * K + k0 + c : B,
                      ok);
    }
  }
}

// The kernel's dynamic shared memory, at namespace scope so that the GEMM addresses it with
// 32-bit offsets (LDS [reg + imm]) instead of 64-bit generic pointers.
extern __shared__ __align__(16) float iwae_smem[];

// ldsm_x4 (cluster.cuh) at float offset off of iwae_smem.
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], int off) {
  ldsm_x4(r, smem_addr(iwae_smem) + 4u * off);
}
__device__ __forceinline__ void split_u(uint32_t v, uint32_t* hi, uint32_t* lo) {
  tf32_split(__uint_as_float(v), hi, lo);
}

// C = A (M x kp at float offset a_off of iwae_smem, row stride lda) x B^T (B: N x K in global,
// kp = K rounded up to 8), chunk by chunk of kNC columns through the kStages stages at float
// offset ws_off; epi(n0, acc, corr) gets each chunk's tiles. Rows from rows_live on are not
// needed (a ragged last tile): warps holding only such rows skip the MMAs. Block-wide.
template <int MT, class Epi>
__device__ __forceinline__ void tile_gemm(int a_off, int lda, int kp, const float* B, int N, int K,
                                          bool vec, int ws_off, int rows_live, Epi&& epi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wn = warp % kWarpsN, row0 = (warp / kWarpsN) * MT * 16;
  const int kchunks = cdiv(kp, kKC), steps = cdiv(N, kNC) * kchunks;
  // Fragments by ldmatrix (one instruction per m16 A tile or pair of n8 B tiles). Lane l points
  // at row l % 8 of block l / 8; A's blocks are (rows 0-7, k 0-3), (rows 8-15, k 0-3), (rows
  // 0-7, k 4-7), (rows 8-15, k 4-7) of an m16 tile; B's (k 0-3), (k 4-7) of n8 tile 2j, then of
  // tile 2j + 1.
  int a_ld[MT], b_ld[kNT / 2];
  const int lr = lane & 7, lh = (lane >> 3) & 1, lq = lane >> 4;
#pragma unroll
  for (int m = 0; m < MT; ++m) a_ld[m] = a_off + (row0 + m * 16 + lh * 8 + lr) * lda + lq * 4;
#pragma unroll
  for (int j = 0; j < kNT / 2; ++j)
    b_ld[j] = (((2 * j + lq) * kWarpsN + wn) * 8 + lr) * kLdw + lh * 4;

  __syncthreads();  // the stages and A may still be in use by the previous phase
  int fn = 0, fk = 0;  // (chunk, k-chunk) of the next stage to fetch
  auto fetch = [&](int stage) {
    load_stage(iwae_smem + ws_off + stage * kStageFloats, B, N, K, fn * kNC, fk * kKC, vec);
    if (++fk == kchunks) { fk = 0; ++fn; }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) fetch(s);
    cp_async_commit();
  }
  float acc[MT][kNT][4], corr[MT][kNT][4];
  auto zero = [&]() {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][n][i] = corr[m][n][i] = 0.0f;
  };
  zero();

  int nc = 0, kc = 0, stage = 0;
  for (int s = 0; s < steps; ++s) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage s landed for every thread; stage s - 1 is free to refill
    if (s + kStages - 1 < steps) fetch((stage + kStages - 1) % kStages);
    cp_async_commit();

    const int n0 = nc * kNC, k0 = kc * kKC, klen = min(kKC, kp - k0);
    const int st = ws_off + stage * kStageFloats;
    // n8 tiles past N multiply the stage's zero rows (no per-tile branch: each one cost a BRA,
    // WARPSYNC and NOP per k step); a warp with no tile inside N, or with every row past the
    // tile's samples, skips the k loop (warp-uniform).
    const bool idle = n0 + wn * 8 >= N || row0 >= rows_live;
#pragma unroll
    for (int kk = 0; kk < kKC; kk += 8) {
      if (kk >= klen || idle) break;
      const int ka = k0 + kk;
      uint32_t ah[MT][4], al[MT][4], bh[kNT][2], bl[kNT][2];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        uint32_t r[4];
        ldsm4(r, a_ld[m] + ka);
#pragma unroll
        for (int i = 0; i < 4; ++i) split_u(r[i], &ah[m][i], &al[m][i]);
      }
#pragma unroll
      for (int j = 0; j < kNT / 2; ++j) {
        uint32_t r[4];
        ldsm4(r, st + b_ld[j] + kk);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          split_u(r[i], &bh[2 * j + i / 2][i % 2], &bl[2 * j + i / 2][i % 2]);
      }
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma(corr[m][n], al[m], bh[n]);
          mma(corr[m][n], ah[m], bl[n]);
          mma(acc[m][n], ah[m], bh[n]);
        }
    }
    if (++kc == kchunks) {  // last stage of this chunk
      epi(n0, acc, corr);
      zero();
      kc = 0;
      ++nc;
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  cp_async_wait<0>();
}

template <int MT>
__global__ void __launch_bounds__(kThreads, 1) iwae_kernel(const IwaeParams p) {
  constexpr int M = 2 * MT * 16;
  const int zs_off = 0, ds_off = M * p.ldz, ws_off = ds_off + M * p.ldd;
  float* zs = iwae_smem + zs_off;           // M x ldz: z of the tile (pad columns 0)
  float* ds = iwae_smem + ds_off;           // M x ldd: relu(z w1^T + b1) (pad columns 0)
  float* ws = iwae_smem + ws_off;           // kStages B stages; also the z-fill scratch
  float* red = ws + kStages * kStageFloats; // kWarpsN x M: BCE row partials per warp column
  float* lpq = red + kWarpsN * M;           // M: log p(z) - log q(z|x) per sample
  float* lat = lpq + M;                     // mu, sigma, logvar of this image (3 x lp)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, wn = warp % kWarpsN, row0 = (warp / kWarpsN) * MT * 16;
  const int b = blockIdx.x / p.splits, split_id = blockIdx.x % p.splits;
  const int64_t k_begin = static_cast<int64_t>(split_id) * p.k_per_split;
  const int64_t k_end = min(p.K, k_begin + p.k_per_split);
  const int L = p.L, lp = p.lp;
  const float* xr = p.x + static_cast<int64_t>(b) * p.D;
  const uint64_t image = p.image ? static_cast<uint64_t>(p.image[b]) : static_cast<uint64_t>(b);

  for (int j = tid; j < lp; j += kThreads) {
    const float mu = j < L ? p.mu[static_cast<int64_t>(b) * L + j] : 0.0f;
    const float lv = j < L ? p.lv[static_cast<int64_t>(b) * L + j] : 0.0f;
    lat[j] = mu;
    lat[lp + j] = expf(0.5f * lv);
    lat[2 * lp + j] = lv;
  }
  const int fill_dm = kThreads / lp, fill_dj = kThreads % lp;
  // Running logsumexp of this thread's sample lane (thread m < M owns tile row m of every tile).
  float m_run = -INFINITY, s_run = 0.0f;
  bool nan_seen = false;

  for (int64_t k0 = k_begin; k0 < k_end; k0 += M) {
    __syncthreads();  // lat written; the previous tile's lpq / red / ws reads are done
    // z and the per-element log-density terms (into ws, summed per row in order below).
    for (int i = tid, m = tid / lp, j = tid % lp; i < M * lp; i += kThreads) {
      const int64_t k = k0 + m;
      float z = 0.0f, term = 0.0f;
      if (j < L && k < k_end) {
        const float e = p.eps ? p.eps[(k * p.B + b) * L + j]
                              : philox_randn(p.seed, (image << 32) + static_cast<uint64_t>(k * L + j));
        z = lat[j] + lat[lp + j] * e;
        term = e * e - z * z + lat[2 * lp + j];
      }
      zs[m * p.ldz + j] = z;
      ws[i] = term;
      m += fill_dm;  // (m, j) of i + kThreads without a division
      j += fill_dj;
      if (j >= lp) { j -= lp; ++m; }
    }
    __syncthreads();
    if (tid < M) {
      float acc = 0.0f;
      for (int j = 0; j < L; ++j) acc += ws[tid * lp + j];
      lpq[tid] = 0.5f * acc;
    }

    // GEMM 1: d = relu(z w1^T + b1), written whole into ds.
    tile_gemm<MT>(zs_off, p.ldz, lp, p.w1, p.H, L, p.vec, ws_off, M,
             [&](int n0, float (&acc)[MT][kNT][4], float (&corr)[MT][kNT][4]) {
#pragma unroll
               for (int n = 0; n < kNT; ++n)
#pragma unroll
                 for (int m = 0; m < MT; ++m)
#pragma unroll
                   for (int i = 0; i < 4; ++i) {
                     const int col = n0 + (n * kWarpsN + wn) * 8 + 2 * t + (i & 1);
                     const int row = row0 + m * 16 + g + (i >> 1) * 8;
                     if (col < p.hp)
                       ds[row * p.ldd + col] =
                           col < p.H ? relu(combine(acc[m][n][i], corr[m][n][i]) + p.b1[col])
                                     : 0.0f;
                   }
             });

    // GEMM 2: logits chunk by chunk, straight into sigmoid + clamped BCE + row sums.
    float rs[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) rs[m][0] = rs[m][1] = 0.0f;
    tile_gemm<MT>(ds_off, p.ldd, p.hp, p.w2, p.D, p.H, p.vec, ws_off,
             static_cast<int>(k_end - k0 < M ? k_end - k0 : M),
             [&](int n0, float (&acc)[MT][kNT][4], float (&corr)[MT][kNT][4]) {
               // The NaN rule of combine(), for the whole chunk at once: corr * 0 is NaN only
               // where corr is NaN or inf (an infinite operand), and then each NaN is dropped.
               float probe[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
               for (int n = 0; n < kNT; ++n)
#pragma unroll
                 for (int m = 0; m < MT; ++m)
#pragma unroll
                   for (int i = 0; i < 4; ++i) probe[i] = fmaf(corr[m][n][i], 0.0f, probe[i]);
               if (probe[0] + probe[1] + probe[2] + probe[3] != 0.0f) {
#pragma unroll
                 for (int n = 0; n < kNT; ++n)
#pragma unroll
                   for (int m = 0; m < MT; ++m)
#pragma unroll
                     for (int i = 0; i < 4; ++i)
                       corr[m][n][i] = combine(0.0f, corr[m][n][i]);
               }
#pragma unroll
               for (int n = 0; n < kNT; ++n) {
                 const int c0 = n0 + (n * kWarpsN + wn) * 8 + 2 * t;
#pragma unroll
                 for (int h = 0; h < 2; ++h) {
                   const int col = c0 + h;
                   if (col >= p.D) continue;
                   const float bias = p.b2[col], xv = xr[col];
                   const bool ok = !outside_unit(xv);
                   const float w1 = ok ? xv : __int_as_float(0x7fc00000), w0 = w1 - 1.0f;
#pragma unroll
                   for (int m = 0; m < MT; ++m)
#pragma unroll
                     for (int r = 0; r < 2; ++r)
                       rs[m][r] += bce_bits(
                           acc[m][n][2 * r + h] + corr[m][n][2 * r + h] + bias, w0, w1);
                 }
               }
             });
    // Row sums: over the 4 lanes of a quad, then over the kWarpsN warp columns in order.
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float v = rs[m][r];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (t == 0) red[wn * M + row0 + m * 16 + g + r * 8] = v;
      }
    __syncthreads();
    if (tid < M && k0 + tid < k_end) {
      float bce = red[tid];
#pragma unroll
      for (int w = 1; w < kWarpsN; ++w) bce += red[w * M + tid];
      bce *= kLn2;  // the row's BCE in nats
      const float wgt = lpq[tid] - bce;  // log p(x|z) + log p(z) - log q(z|x)
      if (wgt != wgt) {
        nan_seen = true;  // counted, not folded: the image's estimate becomes NaN below
      } else {
        const float m_new = nan_max(m_run, wgt);
        const float m_ref = m_new > -INFINITY ? m_new : 0.0f;  // exp(-inf - -inf) would be NaN
        s_run = s_run * expf(m_run - m_ref) + expf(wgt - m_ref);
        m_run = m_new;
      }
    }
  }

  // Merge the M lanes in order (thread 0), write the partial logsumexp of this split.
  __syncthreads();
  if (tid < M) {
    red[tid] = m_run;
    red[M + tid] = s_run;
    red[2 * M + tid] = nan_seen ? 1.0f : 0.0f;
  }
  __syncthreads();
  if (tid == 0) {
    float m_all = -INFINITY, any_nan = 0.0f;
    for (int i = 0; i < M; ++i) {
      m_all = fmaxf(m_all, red[i]);
      any_nan += red[2 * M + i];
    }
    const float m_ref = m_all > -INFINITY ? m_all : 0.0f;
    float s_all = 0.0f;
    for (int i = 0; i < M; ++i) s_all += red[M + i] * expf(red[i] - m_ref);
    p.part[static_cast<int64_t>(b) * p.splits + split_id] =
        any_nan > 0.0f ? __int_as_float(0x7fc00000) : m_all + logf(s_all);
  }
}

long long smem_floats(int M, int ldz, int ldd, int lp) {
  return static_cast<long long>(M) * ldz + static_cast<long long>(M) * ldd +
         kStages * kStageFloats + kWarpsN * M + M + 3LL * lp;
}

}  // namespace

ElboStatus iwae_plan(IwaeParams& p, int device, cudaError_t* cuda_err) noexcept {
  ClusterDevice dev;
  const cudaError_t e = cluster_device(device, &dev);
  if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
  if (dev.major < 9) return kElboBadArch;
  p.lp = (p.L + 7) & ~7;
  p.hp = (p.H + 7) & ~7;
  p.ldz = p.lp + 4;
  p.ldd = p.hp + 4;
  for (int mt : {4, 2}) {
    const int M = 2 * mt * 16;
    const long long bytes = 4 * smem_floats(M, p.ldz, p.ldd, p.lp);
    // The z fill uses the B stages as M x lp scratch.
    if (bytes > dev.smem_optin || static_cast<long long>(M) * p.lp > kStages * kStageFloats)
      continue;
    p.mt = mt;
    p.smem_bytes = static_cast<int>(bytes);
    const void* k = mt == 4 ? reinterpret_cast<const void*>(&iwae_kernel<4>)
                            : reinterpret_cast<const void*>(&iwae_kernel<2>);
    const cudaError_t a =
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem_bytes);
    if (a != cudaSuccess) { *cuda_err = a; return kElboCudaError; }
    return kElboOk;
  }
  return kElboTooLarge;
}

cudaError_t iwae_launch(const IwaeParams& p, cudaStream_t stream) noexcept {
  const long long blocks = static_cast<long long>(p.B) * p.splits;
  if (blocks < 1 || blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  if (p.mt == 4)
    iwae_kernel<4><<<static_cast<unsigned>(blocks), kThreads, p.smem_bytes, stream>>>(p);
  else
    iwae_kernel<2><<<static_cast<unsigned>(blocks), kThreads, p.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fastelbo
