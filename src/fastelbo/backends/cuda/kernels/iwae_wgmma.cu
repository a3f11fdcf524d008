// The importance-weighted bound (IWAE) on wgmma (issue #56 item 5): iwae.cu's blocks, tile,
// noise, numerics and partials, with the decoder's two GEMMs on Hopper's asynchronous
// warpgroup MMAs, so that the sigmoid / BCE epilogue runs while the tensor cores work. Off the
// default path until a GPU run accepts it (FASTELBO_IWAE_WGMMA=1, or kernel="wgmma").
//
// One block per (image, K-split), as iwae.cu; samples in tiles of kBM = 128 (the M dimension).
// Block: a producer warpgroup (one thread issues every TMA load) and two consumer warpgroups,
// consumer c owning tile rows 64c .. 64c + 63 (one m64 wgmma); warp w of it rows 16w .. 16w + 15
// of those, in both GEMMs, so every shared-memory hand-off of A (z, d, lpq) stays inside a
// warp (__syncwarp, no block barrier). Per tile:
//   eps (Philox as iwae.cu, or injected) -> z [128, 32] and log p(z) - log q(z|x)  (fill_z)
//   GEMM 1, jobs of kBN = 56 columns of H: d = relu(z w1^T + b1) [128, 256], kept in shared
//           memory (the tile's A for every job of GEMM 2; zero in columns H .. hp)
//   GEMM 2, jobs of 56 columns of D (784 = 14 x 56): logits -> + b2, sigmoid, clamped BCE vs x
//           (bce_bits, as iwae.cu) -> per-row sums -> log weights -> per-row running logsumexp
// A job is an m64n56 tile of either GEMM per consumer, over K in stages of kBK = 32; W's hi and
// lo halves (pre-split, iwae_wgmma_split_launch) stream through a ring of kStages stages that
// BOTH consumers read (one W pass per 128 samples: 1.6 MB per tile from L2), in the order the
// producer issues them: per tile, GEMM 1's jobs x stages, then GEMM 2's. A job's MMAs go out in
// half stages (one commit group each, at most two in flight: wait_group 1 frees the fragments
// of the one before, and a stage once its second half is done) into one accumulator set, while
// the epilogue of job j - 1 runs from its combined values (lg: 28 registers, not a second set):
// its 7 n8 blocks (4 elements per thread each) spread over the job's half stages, so the
// MUFU-bound BCE overlaps the tensor cores; the last job of each GEMM drains alone.
//
// Numerics (iwae.cu's contract): A (z, d) split in registers by tf32_split, W pre-split the
// same way; per k8 step lo*hi and hi*lo accumulate into corr, hi*hi into acc, each over all of
// K, and combine() drops a NaN correction (an infinite operand); + bias; GEMM 1 relu; BCE and
// the logsumexp as iwae.cu. Orders of summation differ from iwae.cu's (within the 1e-4
// contract): a row's BCE is its quad lanes' sums (jobs, then n8 blocks, then the column pair)
// joined by the xor-1, xor-2 butterfly; log p(z) - log q(z|x) sums j < 16 and j >= 16 apart;
// the 128 row lanes merge in row order, as iwae.cu's.
// Shared memory (one block per SM): d 128 KB and z 16 KB in 128-byte-swizzled boxes of 32
// floats (row r's 16-byte chunk q at q ^ r % 8: ldmatrix and fill_z's stores are conflict-free,
// the epilogue's float2 stores of d 2-way), the W ring (4 x 14 KB), the image's targets and
// biases. The ragged last tile of a split: rows past it are zero in z and masked in the
// logsumexp (their MMAs run: a consumer skipping them would still have to wait for and release
// every stage). Registers (setmaxnreg 232 for the consumers): the set 56, lg 28, fragments 32.
// tests/iwae_wgmma_model.py replays the schedule, the layout and the numerics on the CPU. No
// torch types; launches return cudaError_t.
#include <cstdint>

#include "cluster.cuh"
#include "elbo.h"
#include "elbo_math.cuh"
#include "philox.cuh"
#include "wgmma.cuh"

namespace fastelbo {
namespace {
namespace iw {  // own names: the export inlines every source into one translation unit

constexpr int kBK = 32;            // floats of K per box and stage (128 bytes: one swizzle row)
constexpr int kBN = 56;            // columns per job (m64n56k8)
constexpr int kBM = 128;           // samples per tile
constexpr int kCons = 2;           // consumer warpgroups, 64 rows each
constexpr int kStages = 4;         // the W ring
constexpr int kBlock = 128 * (1 + kCons);
constexpr int kAcc = kBN / 2;      // accumulators per thread per set (m64n56: 28)
constexpr int kSlices = kBN / 8;   // epilogue slices per job: one n8 block each
constexpr int kLBoxes = kIwaeWgmmaMaxL / kBK, kHBoxes = kIwaeWgmmaMaxH / kBK;
constexpr int kBoxBytes = kBM * kBK * 4;
constexpr unsigned kStageTx = 2u * kBN * kBK * 4;  // bytes per stage (W hi and lo)
constexpr int kProducerRegs = 40;  // setmaxnreg: the producer gives what the consumers take

struct Smem {  // every box a multiple of 1024 bytes (8-row swizzle atoms), 1024-aligned
  float d[kHBoxes][kBM * kBK];
  float z[kLBoxes][kBM * kBK];
  float whi[kStages][kBN * kBK];
  float wlo[kStages][kBN * kBK];
  float lat[3][kIwaeWgmmaMaxL];    // mu, sigma = exp(lv / 2), lv (0 past L)
  float b1[kIwaeWgmmaMaxH + kBN];  // b1 (0 past H) over GEMM 1's jobs
  float lpq[kBM];                  // the tile's log p(z) - log q(z|x) per row
  float lse[3][kBM];               // the final merge: m, s, NaN seen per row lane
  unsigned long long full[kStages], empty[kStages];
};
// After Smem: b2 and x over GEMM 2's jobs (2 jobs_d kBN floats; 0 past D; x NaN outside
// [0, 1]).
constexpr int kSmemFixed = sizeof(Smem) + 1024;  // + alignment slack
extern __shared__ __align__(16) float iw_smem[];

// desc_sw128, wgmma_fence / commit and fence_regs: wgmma.cuh; mbar_arrive: cluster.cuh.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The consumers' own barrier (the producer warpgroup has left): named barrier 1, 256 threads.
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
}
// d (+)= a x b, m64n56k8: a this thread's m64k8 fragment (rows 16 warp + lane / 4 and + 8,
// columns lane % 4 and + 4, as mma.sync m16n8k8), b (56 x 8, K-major) via its descriptor.
__device__ __forceinline__ void wgmma_k8(float (&d)[28], const uint32_t (&a)[4], uint64_t db,
                                         int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %33, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n56k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27}, {%28, %29, %30, %31}, %32, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ float combine(float acc, float corr) {
  return acc + (corr == corr ? corr : 0.0f);  // NaN in the small terms: dropped (iwae.cu)
}
// Float offset of (row r, column c) in a 32-column box of 128 rows: chunk c / 4 at c / 4 ^ r % 8.
__device__ __forceinline__ int box_off(int r, int c) {
  return r * kBK + ((((c & 31) >> 2) ^ (r & 7)) << 2) + (c & 3);
}

using Frag = uint32_t[2][4];  // a half stage's A fragments (2 k8 steps)
__device__ __forceinline__ void fence_frag(const Frag& f) {
#pragma unroll
  for (int k = 0; k < 2; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" ::"r"(f[k][i]) : "memory");
}

// One consumer thread's view: its rows, its fragment addressing, the block's data.
struct Consumer {
  const IwaeWgmmaParams& p;
  Smem& s;
  const float* b2s;  // (jobs_d * kBN): b2, 0 past D
  const float* xs;   // (jobs_d * kBN): x, NaN where outside [0, 1], 0 past D
  int lane, gq, t, row_w;  // quad row lane / 4, quad lane lane % 4, the warp's first tile row
  unsigned a_row;    // bytes: this lane's ldmatrix row (row_w + 8 (lane / 8 % 2) + lane % 8)
  int hp;            // d's columns: H rounded up to kBK (0 past H)
  uint64_t image;
  int b;

  // Half hf (k8 steps 2 hf, 2 hf + 1) of stage kt's A fragments from box kt of z or d (byte
  // address box0 of box 0), split.
  __device__ __forceinline__ void load_frags(unsigned box0, int kt, int hf, Frag& hi,
                                             Frag& lo) const {
    const unsigned base = box0 + static_cast<unsigned>(kt) * kBoxBytes + a_row;
    const int lr = lane & 7, chunk = lane >> 4;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      uint32_t r[4];
      ldsm_x4(r, base + 16u * ((2 * (2 * hf + k) + chunk) ^ lr));
#pragma unroll
      for (int i = 0; i < 4; ++i) tf32_split(__uint_as_float(r[i]), &hi[k][i], &lo[k][i]);
    }
  }
  // Half hf of stage st's MMAs as one commit group: corr += lo*hi, += hi*lo; acc += hi*hi over
  // its two k8 steps. first: the job's first group (the sums start from zero).
  __device__ __forceinline__ void issue(float (&acc)[kAcc], float (&corr)[kAcc], const Frag& hi,
                                        const Frag& lo, int st, int hf, bool first) const {
    const float* wh = s.whi[st] + 16 * hf;
    const float* wl = s.wlo[st] + 16 * hf;
    fence_frag(hi);  // the fragments' writes stay before the fence (else ptxas splits the group)
    fence_frag(lo);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 2; ++k)
      wgmma_k8(corr, lo[k], desc_sw128(wh + 8 * k), first && k == 0 ? 0 : 1);
#pragma unroll
    for (int k = 0; k < 2; ++k) wgmma_k8(corr, hi[k], desc_sw128(wl + 8 * k), 1);
#pragma unroll
    for (int k = 0; k < 2; ++k)
      wgmma_k8(acc, hi[k], desc_sw128(wh + 8 * k), first && k == 0 ? 0 : 1);
    wgmma_commit();
  }
  // A finished job at column n0: lg = combine(acc, corr) + bias; GEMM 1 also relu, 0 past H.
  // Accumulator layout (m64n56k8, f32): element 4 J + 2 h + e is row row_w + gq + 8 h, column
  // n0 + 8 J + 2 t + e.
  template <bool kBce>
  __device__ __forceinline__ void finish(const float (&acc)[kAcc], const float (&corr)[kAcc],
                                         float (&lg)[kAcc], int n0) const {
#pragma unroll
    for (int J = 0; J < kSlices; ++J) {
      const int c = n0 + 8 * J + 2 * t;
      const float2 bb = *reinterpret_cast<const float2*>(kBce ? &b2s[c] : &s.b1[c]);
#pragma unroll
      for (int i = 4 * J; i < 4 * J + 4; ++i) {
        const float v = combine(acc[i], corr[i]) + (i & 1 ? bb.y : bb.x);
        lg[i] = kBce ? v : (c + (i & 1) < p.H ? relu(v) : 0.0f);
      }
    }
  }
  // GEMM 1's epilogue, n8 block J of the job at column n0: the thread's 4 values of d into the
  // swizzled boxes (float2 stores), columns up to hp.
  template <int J>
  __device__ __forceinline__ void epi_hidden(const float (&lg)[kAcc], int n0) const {
    const int c = n0 + 8 * J + 2 * t;
    if (c >= hp) return;  // hp % 32 == 0 and c even: c + 1 < hp too
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float2*>(&s.d[c >> 5][box_off(row_w + gq + 8 * h, c)]) =
          make_float2(lg[4 * J + 2 * h], lg[4 * J + 2 * h + 1]);
  }
  // GEMM 2's epilogue, n8 block J of the job at column n0: the BCE terms of the thread's 4
  // logits into its rows' sums (column pair order); columns past D are masked.
  template <int J>
  __device__ __forceinline__ void epi_bce(const float (&lg)[kAcc], int n0, float (&rs)[2]) const {
    const int c = n0 + 8 * J + 2 * t, lim = p.D - c;
    const float2 xv = *reinterpret_cast<const float2*>(&xs[c]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float t0 = bce_bits(lg[4 * J + 2 * h], xv.x - 1.0f, xv.x);
      const float t1 = bce_bits(lg[4 * J + 2 * h + 1], xv.y - 1.0f, xv.y);
      if (lim > 0) rs[h] += t0;
      if (lim > 1) rs[h] += t1;
    }
  }
  template <bool kBce, int J>
  __device__ __forceinline__ void epi_j(const float (&lg)[kAcc], int n0, float (&rs)[2]) const {
    if (kBce) epi_bce<J>(lg, n0, rs);
    else epi_hidden<J>(lg, n0);
  }
  // Epilogue slices (n8 blocks) [first, end) of the job at column n0, in order (one copy of
  // each block's code; the switch is warp-uniform).
  template <bool kBce>
  __device__ __forceinline__ void epi_run(const float (&lg)[kAcc], int first, int end, int n0,
                                          float (&rs)[2]) const {
    static_assert(kSlices == 7, "one case per n8 block of a job");
    for (int i = first; i < end; ++i) {
      switch (i) {
        case 0: epi_j<kBce, 0>(lg, n0, rs); break;
        case 1: epi_j<kBce, 1>(lg, n0, rs); break;
        case 2: epi_j<kBce, 2>(lg, n0, rs); break;
        case 3: epi_j<kBce, 3>(lg, n0, rs); break;
        case 4: epi_j<kBce, 4>(lg, n0, rs); break;
        case 5: epi_j<kBce, 5>(lg, n0, rs); break;
        default: epi_j<kBce, 6>(lg, n0, rs); break;
      }
    }
  }
  // The previous job's slices on half hn of this job's 2 nk: slice i on half i 2 nk / 7
  // (spread evenly; every slice once, in order), from `next` on, without a division.
  template <bool kBce>
  __device__ __forceinline__ void epi_on(const float (&lg)[kAcc], int hn, int nk, int& next,
                                         int n0, float (&rs)[2]) const {
    int end = next;
    while (end < kSlices && end * 2 * nk < (hn + 1) * kSlices) ++end;
    epi_run<kBce>(lg, next, end, n0, rs);
    next = end;
  }
  // Job j of a GEMM (columns n0 = j kBN ...): its MMAs into (acc, corr) over nk stages of the
  // ring from g on, in half stages (one commit group each, at most two in flight), while the
  // previous job's epilogue (prev: j > 0) runs from lg; then lg = this job's values. Per half:
  // issue it, wait for the one before (wait_group 1: its fragments are free; after a stage's
  // second half, the stage is released), load the next half's fragments, run epilogue slices.
  template <bool kBce>
  __device__ __forceinline__ void job(float (&acc)[kAcc], float (&corr)[kAcc], float (&lg)[kAcc],
                                      unsigned box0, int nk, int& g, int j, float (&rs)[2]) const {
    const bool prev = j > 0;
    const int n0 = j * kBN;
    int next = 0;  // the previous job's next epilogue slice
    Frag h0, l0, h1, l1;
    fence_regs(acc);  // the previous job's reads of the sets stay before its MMAs
    fence_regs(corr);
    load_frags(box0, 0, 0, h0, l0);
    for (int kt = 0; kt < nk; ++kt) {
      const int gi = g + kt, st = gi % kStages;
      mbar_wait(&s.full[st], (gi / kStages) & 1);
      issue(acc, corr, h0, l0, st, 0, kt == 0);
      if (kt > 0) {
        wgmma_wait<1>();  // stage kt - 1's second half is done
        if (lane == 0) mbar_arrive(&s.empty[(gi - 1) % kStages]);
      }
      load_frags(box0, kt, 1, h1, l1);
      if (prev) epi_on<kBce>(lg, 2 * kt, nk, next, n0 - kBN, rs);
      issue(acc, corr, h1, l1, st, 1, false);
      if (kt + 1 < nk) {
        wgmma_wait<1>();  // this stage's first half is done
        load_frags(box0, kt + 1, 0, h0, l0);
      }
      if (prev) epi_on<kBce>(lg, 2 * kt + 1, nk, next, n0 - kBN, rs);
    }
    wgmma_wait<0>();
    fence_regs(acc);
    fence_regs(corr);
    if (lane == 0) mbar_arrive(&s.empty[(g + nk - 1) % kStages]);  // this warp is done with it
    g += nk;
    finish<kBce>(acc, corr, lg, n0);
  }
  // A GEMM: its jobs in column order, then the last job's epilogue alone.
  template <bool kBce>
  __device__ __forceinline__ void gemm(unsigned box0, int nk, int jobs, int& g,
                                       float (&rs)[2]) const {
    float acc[kAcc], corr[kAcc], lg[kAcc];
    for (int j = 0; j < jobs; ++j) job<kBce>(acc, corr, lg, box0, nk, g, j, rs);
    epi_run<kBce>(lg, 0, kSlices, (jobs - 1) * kBN, rs);  // the last job's, alone
  }

  // z and log p(z) - log q(z|x) of the warp's 16 rows of the tile at sample k0: lane l takes
  // row l % 16 and columns 16 (l / 16) .. + 15 (0 past L, all 0 past k_end).
  __device__ __forceinline__ void fill_z(long long k0, long long k_end) const {
    __syncwarp();  // the previous tile's reads of z and lpq by other lanes are done
    const int r = row_w + (lane & 15), half = lane >> 4;
    const long long k = k0 + r;
    const bool ok = k < k_end;
    float sum = 0.0f;
#pragma unroll 1
    for (int q = 0; q < 4; ++q) {  // not unrolled: 16 Philox draws at once would spill
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = 16 * half + 4 * q + e;
        v[e] = 0.0f;
        if (ok && j < p.L) {
          const float ep = p.eps ? p.eps[(k * p.B + b) * p.L + j]
                                 : philox_randn(p.seed, (image << 32) +
                                                            static_cast<uint64_t>(k * p.L + j));
          const float z = s.lat[0][j] + s.lat[1][j] * ep;
          sum += ep * ep - z * z + s.lat[2][j];
          v[e] = z;
        }
      }
      *reinterpret_cast<float4*>(&s.z[0][box_off(r, 16 * half + 4 * q)]) =
          make_float4(v[0], v[1], v[2], v[3]);
    }
    const float other = __shfl_xor_sync(0xffffffffu, sum, 16);
    if (half == 0) s.lpq[r] = 0.5f * (sum + other);  // columns < 16, then 16 .. 31
    __syncwarp();
  }
  // The tile's log weights into the row lanes' running logsumexps (iwae.cu's update).
  __device__ __forceinline__ void fold(float (&rs)[2], long long k0, long long k_end,
                                       float (&m_run)[2], float (&s_run)[2],
                                       bool (&nan_seen)[2]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = rs[h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      const int r = row_w + gq + 8 * h;
      if (t != 0 || k0 + r >= k_end) continue;
      const float wgt = s.lpq[r] - v * kLn2;  // log p(x|z) + log p(z) - log q(z|x)
      if (wgt != wgt) {
        nan_seen[h] = true;
      } else {
        const float m_new = nan_max(m_run[h], wgt);
        const float m_ref = m_new > -INFINITY ? m_new : 0.0f;
        s_run[h] = s_run[h] * expf(m_run[h] - m_ref) + expf(wgt - m_ref);
        m_run[h] = m_new;
      }
    }
  }
};

// The block's per-image data (every thread), then the barriers (thread 0).
__device__ __forceinline__ void setup(const IwaeWgmmaParams& p, Smem& s, float* b2s, float* xs,
                                      int b, int jobs_h, int jobs_d) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int j = tid; j < kIwaeWgmmaMaxL; j += kBlock) {
    const float mu = j < p.L ? p.mu[static_cast<int64_t>(b) * p.L + j] : 0.0f;
    const float lv = j < p.L ? p.lv[static_cast<int64_t>(b) * p.L + j] : 0.0f;
    s.lat[0][j] = mu;
    s.lat[1][j] = expf(0.5f * lv);
    s.lat[2][j] = lv;
  }
  for (int c = tid; c < jobs_h * kBN; c += kBlock) s.b1[c] = c < p.H ? p.b1[c] : 0.0f;
  const float* xr = p.x + static_cast<int64_t>(b) * p.D;
  for (int c = tid; c < jobs_d * kBN; c += kBlock) {
    const float xv = c < p.D ? xr[c] : 0.0f;
    b2s[c] = c < p.D ? p.b2[c] : 0.0f;
    xs[c] = outside_unit(xv) ? __int_as_float(0x7fc00000) : xv;
  }
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 4 * kCons);  // one arrival per consumer warp
    }
    mbar_fence_init();
  }
}

// The producer thread: every stage of every tile, in the consumers' order (its counts computed
// here, after setmaxnreg, rather than carried across it).
__device__ __forceinline__ void produce(const IwaeWgmmaParams& p, Smem& s) {
  const int split = static_cast<int>(blockIdx.x) % p.splits;
  const long long k_begin = static_cast<long long>(split) * p.k_per_split;
  const long long k_end = min(p.K, k_begin + p.k_per_split);
  const int tiles = static_cast<int>((k_end - k_begin + kBM - 1) / kBM);
  const int nk1 = cdiv(p.L, kBK), nk2 = cdiv(p.H, kBK);
  const int jobs_h = cdiv(nk2 * kBK, kBN), jobs_d = cdiv(p.D, kBN);
  int g = 0;
  auto load = [&](const CUtensorMap* hi, const CUtensorMap* lo, int k, int n) {
    const int st = g % kStages;
    if (g >= kStages) mbar_wait(&s.empty[st], ((g / kStages) & 1) ^ 1);
    mbar_arrive_expect(&s.full[st], kStageTx);
    tma_load_2d(s.whi[st], hi, k, n, &s.full[st]);
    tma_load_2d(s.wlo[st], lo, k, n, &s.full[st]);
    ++g;
  };
  for (int tile = 0; tile < tiles; ++tile) {
    for (int n = 0; n < jobs_h; ++n)
      for (int kt = 0; kt < nk1; ++kt) load(&p.w1hi_map, &p.w1lo_map, kt * kBK, n * kBN);
    for (int n = 0; n < jobs_d; ++n)
      for (int kt = 0; kt < nk2; ++kt) load(&p.w2hi_map, &p.w2lo_map, kt * kBK, n * kBN);
  }
}

// The 128 row lanes' logsumexps merged in row order (iwae.cu's), into part[out]: the split's
// partial (NaN where any weight was NaN).
__device__ __forceinline__ void merge(const IwaeWgmmaParams& p, Smem& s, const Consumer& me, int c,
                                      const float (&m_run)[2], const float (&s_run)[2],
                                      const bool (&nan_seen)[2], int64_t out) {
  if (me.t == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = me.row_w + me.gq + 8 * h;
      s.lse[0][r] = m_run[h];
      s.lse[1][r] = s_run[h];
      s.lse[2][r] = nan_seen[h] ? 1.0f : 0.0f;
    }
  }
  consumers_sync();
  if (c != 0 || me.row_w != 0 || me.lane != 0) return;
  float m_all = -INFINITY, any_nan = 0.0f;
  for (int i = 0; i < kBM; ++i) {
    m_all = fmaxf(m_all, s.lse[0][i]);
    any_nan += s.lse[2][i];
  }
  const float m_ref = m_all > -INFINITY ? m_all : 0.0f;
  float s_all = 0.0f;
  for (int i = 0; i < kBM; ++i) s_all += s.lse[1][i] * expf(s.lse[0][i] - m_ref);
  p.part[out] = any_nan > 0.0f ? __int_as_float(0x7fc00000) : m_all + logf(s_all);
}

__global__ void __launch_bounds__(kBlock, 1)
    iwae_wgmma_kernel(const __grid_constant__ IwaeWgmmaParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // The 1024-aligned layout, addressed from iw_smem itself so that the compiler keeps the
  // shared address space (LDS / STS, 32-bit addresses; a uintptr_t round trip loses it).
  Smem& s = *reinterpret_cast<Smem*>(iw_smem +
                                     ((1024u - (smem_addr(iw_smem) & 1023u)) & 1023u) / 4);
  float* b2s = reinterpret_cast<float*>(&s + 1);
  const int b = static_cast<int>(blockIdx.x) / p.splits;
  const int split = static_cast<int>(blockIdx.x) % p.splits;
  const long long k_begin = static_cast<long long>(split) * p.k_per_split;
  const long long k_end = min(p.K, k_begin + p.k_per_split);
  const int nk1 = cdiv(p.L, kBK), nk2 = cdiv(p.H, kBK), hp = nk2 * kBK;
  const int jobs_h = cdiv(hp, kBN), jobs_d = cdiv(p.D, kBN);
  float* xs = b2s + jobs_d * kBN;
  setup(p, s, b2s, xs, b, jobs_h, jobs_d);
  __syncthreads();
  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (threadIdx.x == 0) produce(p, s);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1, tid = static_cast<int>(threadIdx.x) - 128 * wg;
  const int lane = tid & 31, warp = tid >> 5, row_w = 64 * c + 16 * warp;
  const Consumer me{p, s, b2s, xs, lane, lane >> 2, lane & 3, row_w,
                    4u * static_cast<unsigned>((row_w + 8 * ((lane >> 3) & 1) + (lane & 7)) * kBK),
                    hp, p.image ? static_cast<uint64_t>(p.image[b]) : static_cast<uint64_t>(b), b};
  float m_run[2] = {-INFINITY, -INFINITY}, s_run[2] = {0.0f, 0.0f};
  bool nan_seen[2] = {false, false};
  int g = 0;  // the ring's stages consumed so far
  for (long long k0 = k_begin; k0 < k_end; k0 += kBM) {
    me.fill_z(k0, k_end);
    float rs[2] = {0.0f, 0.0f};
    me.gemm<false>(smem_addr(s.z[0]), nk1, jobs_h, g, rs);
    __syncwarp();  // the warp's rows of d are written
    me.gemm<true>(smem_addr(s.d[0]), nk2, jobs_d, g, rs);
    me.fold(rs, k0, k_end, m_run, s_run, nan_seen);
  }
  merge(p, s, me, c, m_run, s_run, nan_seen, static_cast<int64_t>(b) * p.splits + split);
#else
  __trap();  // sm_90a only: iwae_wgmma_plan refuses other devices
#endif
}

// hi = w's top 11 significant bits, lo = w - hi (tf32_split, as iwae.cu splits its operands),
// (rows, cols) row-major into (rows, ld) buffers; columns cols .. ld are not written.
__global__ void __launch_bounds__(kThreads) iwae_wgmma_split_kernel(const float* w, int rows,
                                                                    int cols, float* hi,
                                                                    float* lo, int ld) {
  const long long n = static_cast<long long>(rows) * cols;
  for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    const long long r = i / cols, c = i % cols;
    uint32_t h, l;
    tf32_split(w[i], &h, &l);
    hi[r * ld + c] = __uint_as_float(h);
    lo[r * ld + c] = __uint_as_float(l);
  }
}

bool encode_w(CUtensorMap* map, const float* base, int cols, int rows, int ld) {
  return encode_tensor_map_2d(map, base, cols, rows, ld, kBK, kBN, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

}  // namespace iw
}  // namespace

ElboStatus iwae_wgmma_plan(IwaeWgmmaParams& p, int device, cudaError_t* cuda_err) noexcept {
  ClusterDevice dev;
  const cudaError_t e = cluster_device(device, &dev);
  if (e != cudaSuccess) { *cuda_err = e; return kElboCudaError; }
  if (dev.major != 9) return kElboBadArch;  // sm_90a machine code only
  if (p.L < 1 || p.L > kIwaeWgmmaMaxL || p.H < 1 || p.H > kIwaeWgmmaMaxH || p.D < 1)
    return kElboTooLarge;
  const long long bytes = iw::kSmemFixed + 8LL * cdiv(p.D, iw::kBN) * iw::kBN;  // b2s, xs
  if (bytes > dev.smem_optin) return kElboTooLarge;
  p.smem_bytes = static_cast<int>(bytes);
  const cudaError_t a = cudaFuncSetAttribute(
      iw::iwae_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem_bytes);
  if (a != cudaSuccess) { *cuda_err = a; return kElboCudaError; }
  return kElboOk;
}

cudaError_t iwae_wgmma_split_launch(const float* w, int rows, int cols, float* hi, float* lo,
                                    int ld, cudaStream_t stream) noexcept {
  if (rows < 1 || cols < 1 || ld < cols) return cudaErrorInvalidValue;
  const long long blocks = (static_cast<long long>(rows) * cols + kThreads - 1) / kThreads;
  iw::iwae_wgmma_split_kernel<<<static_cast<int>(blocks < 1024 ? blocks : 1024), kThreads, 0,
                                stream>>>(w, rows, cols, hi, lo, ld);
  return cudaGetLastError();
}

cudaError_t iwae_wgmma_launch(IwaeWgmmaParams& p, const float* w1_hi, const float* w1_lo,
                              int ldw1, const float* w2_hi, const float* w2_lo, int ldw2,
                              cudaStream_t stream) noexcept {
  const long long blocks = static_cast<long long>(p.B) * p.splits;
  if (blocks < 1 || blocks > 0x7fffffffLL || p.smem_bytes <= 0 || ldw1 % 4 != 0 ||
      ldw2 % 4 != 0 || ldw1 < p.L || ldw2 < p.H)
    return cudaErrorInvalidValue;
  if (!iw::encode_w(&p.w1hi_map, w1_hi, p.L, p.H, ldw1) ||
      !iw::encode_w(&p.w1lo_map, w1_lo, p.L, p.H, ldw1) ||
      !iw::encode_w(&p.w2hi_map, w2_hi, p.H, p.D, ldw2) ||
      !iw::encode_w(&p.w2lo_map, w2_lo, p.H, p.D, ldw2))
    return cudaErrorInvalidValue;
  iw::iwae_wgmma_kernel<<<static_cast<unsigned>(blocks), iw::kBlock, p.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fastelbo
