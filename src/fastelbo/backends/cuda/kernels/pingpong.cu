// The decoder's output layer at large B as ONE persistent, warp-specialised ping-pong kernel
// (issue #56 item 3): logits = relu(d) dec_w2^T + dec_b2 on wgmma in tf32x3 (tc_gemm.cu's
// numerics), then sigmoid, the clamped BCE against x and the row sums, written straight into
// recon / elbo / kl: the (B, 784) logits never reach memory, and there are no per-tile partials
// and no finish kernel. Off the default path until a GPU run accepts it (binding_tc.cpp:
// ForwardOptions::output, or FASTELBO_PINGPONG=1 for `auto`).
//
// Block (one per SM, persistent: pingpong_blocks): a producer warpgroup (one thread issues every
// TMA load) and two consumer warpgroups. Work unit: 64 rows of d (one m64 wgmma); the block
// takes unit pairs p = blockIdx.x, + gridDim.x, ...: consumer c owns unit 2p + c (the last pair
// of an odd unit count leaves consumer 1 idle). A unit's rows of d stay resident in shared memory
// (TMA, K <= kMaxK) for all of its column tiles; W (hi and lo halves, pre-split as tc_gemm's)
// streams through a ring of kStages stages of kBK columns of K, one column tile (kBN = 112
// columns of N; 784 = 7 x 112) at a time. The ring's order is the schedule: per pair, per column
// tile n, consumer 0's nk stages, then consumer 1's. So consumer 1 gets its first stage of tile n
// as consumer 0 retires its last ones, and while consumer 1 runs its MMAs consumer 0 runs the
// epilogue of tile n (sigmoid, BCE: the MUFU-bound half), and the other way round: each
// consumer's epilogue overlaps the other's MMAs (ping-pong), where tc_gemm.cu's one block per
// 128 x 112 tile leaves the tensor cores idle during its epilogue (ncu: tensor pipe 45%).
// Per stage as tc_gemm.cu: A fragments from shared memory (ldmatrix, swizzle 128), relu'd and
// split (tf32_split_act: W is finite) one stage ahead, 12 wgmma m64n112k8 (lo*hi, hi*lo, hi*hi)
// into an accumulator that joins the running sum (from the bias) by a float32 add per stage.
// Epilogue per column tile: the thread's 56 targets loaded at once from global memory (an L2
// prefetch went out when the tile's MMAs began), then the BCE terms in bits (elbo_math.cuh
// bce_bits) summed per row in column order across all column tiles; at the unit's end the quad
// butterfly (xor 1, then 2), x ln 2, and write_row (an x outside [0, 1] makes the row NaN).
// tests/test_cuda_pingpong.py's pingpong_model replays this schedule on the CPU.
// No deferred check here (the binding keeps tc_gemm.cu's kernels where it is on). No torch
// types; the launch returns cudaError_t.
#include <cstdint>

#include "cluster.cuh"
#include "elbo.h"
#include "elbo_math.cuh"
#include "wgmma.cuh"

namespace fastelbo {
namespace {
namespace pp {  // own names: the export inlines every source into one translation unit

constexpr int kBK = 32;    // floats of K per box (128 bytes: one swizzle row)
constexpr int kBM = 64;    // rows per unit (one consumer's m64)
constexpr int kBN = kPingpongTileN;  // columns per tile (m64n112k8)
constexpr int kKBoxes = kPingpongMaxK / kBK;  // resident A boxes per consumer
constexpr int kStages = 3;
constexpr int kCons = 2;
constexpr int kBlock = 128 * (1 + kCons);
constexpr int kAcc = kBN / 2;  // accumulators per thread (m64n112: 56)
constexpr unsigned kWTx = 2u * kBN * kBK * 4;  // bytes per W stage (hi and lo)
constexpr int kProducerRegs = 40;  // setmaxnreg: the producer gives what the consumers take

struct Smem {  // each box a multiple of 1024 bytes (8-row swizzle atoms)
  float a[kCons][kKBoxes][kBM * kBK];  // per consumer: its unit's rows of d, K in boxes of kBK
  float w[kStages][kBN * kBK];
  float wlo[kStages][kBN * kBK];
  unsigned long long full[kStages], empty[kStages], afull[kCons], aempty[kCons];
  unsigned long long turn[kCons];  // consumer c may start its next MMA loop
};
constexpr int kSmemBytes = sizeof(Smem) + 1024;  // + alignment slack

__device__ __forceinline__ void prefetch_l2(const float* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// The ring's stage index of consumer c's stage kt in column tile n of the block's i-th pair is
// base + c * nk + kt, base counting every stage of the block's earlier (pair, tile)s: nk per
// consumer with a unit there (pingpong_model replays this).
__global__ void __launch_bounds__(kBlock, 1)
    pingpong_kernel(const __grid_constant__ PingpongParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                     ~uintptr_t(1023));
  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int units = cdiv(p.M, kBM), pairs = cdiv(units, 2);
  const int nk = cdiv(p.K, kBK), tiles_n = cdiv(p.N, kBN);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 4);  // one arrival per warp of the stage's consumer
    }
    for (int c = 0; c < kCons; ++c) {
      mbar_init(&s.afull[c], 1);
      mbar_init(&s.aempty[c], 4);
      mbar_init(&s.turn[c], 4);  // one arrival per warp of the other consumer
    }
    mbar_fence_init();
  }
  __syncthreads();
  if (wg == 0) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (threadIdx.x == 0) {
      int g = 0;                // W stages issued: the ring's sequence
      int loads[kCons] = {0, 0};  // A loads issued per consumer
      for (int pr = static_cast<int>(blockIdx.x); pr < pairs; pr += static_cast<int>(gridDim.x))
        for (int n = 0; n < tiles_n; ++n)
          for (int c = 0; c < kCons; ++c) {
            const int u = 2 * pr + c;
            if (u >= units) continue;  // an odd unit count's last pair: consumer 1 idles
            if (n == 0) {  // the unit's rows of d, resident for all its column tiles; the
                           // consumer's previous unit has retired its last MMA
              if (loads[c] > 0) mbar_wait(&s.aempty[c], (loads[c] - 1) & 1);
              mbar_arrive_expect(&s.afull[c], static_cast<unsigned>(nk * kBM * kBK * 4));
              for (int kb = 0; kb < nk; ++kb)
                tma_load_2d(s.a[c][kb], &p.a_map, kb * kBK, u * kBM, &s.afull[c]);
              ++loads[c];
            }
            for (int kt = 0; kt < nk; ++kt, ++g) {
              const int st = g % kStages;
              if (g >= kStages) mbar_wait(&s.empty[st], ((g / kStages) & 1) ^ 1);
              mbar_arrive_expect(&s.full[st], kWTx);
              tma_load_2d(s.w[st], &p.w_map, kt * kBK, n * kBN, &s.full[st]);
              tma_load_2d(s.wlo[st], &p.wlo_map, kt * kBK, n * kBN, &s.full[st]);
            }
          }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1, tid = static_cast<int>(threadIdx.x) - 128 * wg;
  // Accumulator layout (m64nNk8, f32): warp w holds rows 16w + g and 16w + g + 8 of the unit
  // (g = lane / 4); n8 block j holds columns 8j + 2t and 8j + 2t + 1 (t = lane % 4).
  const int lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t = lane & 3;
  // ldmatrix: lane l gives row 16 warp + 8 ((l / 8) % 2) + l % 8 of the unit, at 16-byte chunk
  // 2 k + l / 16 of k8 step k (XOR the row's l % 8: the swizzle).
  const int lr = lane & 7, a_chunk = lane >> 4;
  const unsigned a_row = 4u * ((16 * warp + 8 * ((lane >> 3) & 1) + lr) * kBK);
  using Frag = uint32_t[kBK / 8][4];
  float run[kAcc], acc[kAcc];
  int base = 0, unit_i = 0;  // the ring's index at this (pair, tile); units done by consumer c
  int turns = 0;             // waits on s.turn[c] so far
  for (int pr = static_cast<int>(blockIdx.x); pr < pairs; pr += static_cast<int>(gridDim.x)) {
    const int u = 2 * pr + c;
    if (u >= units) break;  // consumer 1 in an odd count's last pair (no later pair has units)
    const bool both = 2 * pr + 1 < units;
    const int per_tile = (both ? 2 : 1) * nk;  // the ring's stages per tile
    const int m0 = u * kBM, r0 = m0 + 16 * warp + gq;  // this thread's rows: r0, r0 + 8
    float rsum[2] = {0.0f, 0.0f};
    bool rbad[2] = {false, false};
    mbar_wait(&s.afull[c], unit_i & 1);
    // Stage kt's A fragments (resident box kt), relu'd and split.
    auto load_frags = [&](int kt, Frag& hi, Frag& lo) {
      const unsigned ab = smem_addr(s.a[c][kt]) + a_row;
#pragma unroll
      for (int k = 0; k < kBK / 8; ++k) {
        uint32_t r[4];
        ldsm_x4(r, ab + 16u * ((2 * k + a_chunk) ^ lr));
#pragma unroll
        for (int i = 0; i < 4; ++i)
          tf32_split_act(relu(__uint_as_float(r[i])), &hi[k][i], &lo[k][i]);
      }
    };
    for (int n = 0; n < tiles_n; ++n, base += per_tile) {
      const int n0 = n * kBN;
      {  // this tile's targets toward L2 while the MMAs run: 2 threads a row, <= 3 lines each
        const int r = m0 + (tid >> 1);
        if (r < p.M) {
          const float* xr = p.x + static_cast<size_t>(r) * p.ldx;
#pragma unroll
          for (int q = 0; q < 3; ++q) prefetch_l2(xr + min(n0 + 56 * (tid & 1) + 28 * q, p.N - 1));
        }
      }
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {  // the sums start at the bias (0 beyond N)
        const int col = n0 + 8 * j + 2 * t;
        const float b0 = col < p.N ? __ldg(p.bias + col) : 0.0f;
        const float b1 = col + 1 < p.N ? __ldg(p.bias + col + 1) : 0.0f;
        run[4 * j] = b0;
        run[4 * j + 1] = b1;
        run[4 * j + 2] = b0;
        run[4 * j + 3] = b1;
      }
      const bool last_tile = n + 1 == tiles_n;
      // The MMA loops run one at a time in the ring's order, (pair, tile, consumer 0), then
      // consumer 1: wait for the other consumer's loop before this one (wait_turn), and hand
      // over after it (pass_turn). Also what makes the ring's parity waits exact: a consumer
      // waits on stage g only once every stage before g has landed (no phase aliasing).
      const bool first_pair = pr == static_cast<int>(blockIdx.x);
      const bool wait_turn = c == 1 || (n > 0 ? both : !first_pair);
      const bool pass_turn = c == 0 ? both
                                    : (!last_tile || pr + static_cast<int>(gridDim.x) < pairs);
      auto mma_stage = [&](int kt, const Frag& hi, const Frag& lo, Frag& nhi, Frag& nlo) {
        const int gi = base + c * nk + kt, st = gi % kStages;
        mbar_wait(&s.full[st], (gi / kStages) & 1);
        const float* w = s.w[st];
        const float* wlo = s.wlo[st];
        wgmma_fence();
        fence_regs(acc);
#pragma unroll
        for (int k = 0; k < kBK / 8; ++k) wgmma_k8(acc, lo[k], desc_sw128(w + 8 * k), k > 0);
#pragma unroll
        for (int k = 0; k < kBK / 8; ++k) wgmma_k8(acc, hi[k], desc_sw128(wlo + 8 * k), 1);
#pragma unroll
        for (int k = 0; k < kBK / 8; ++k) wgmma_k8(acc, hi[k], desc_sw128(w + 8 * k), 1);
        wgmma_commit();
        if (kt + 1 < nk) load_frags(kt + 1, nhi, nlo);  // overlaps this stage's MMAs
        wgmma_wait0();
        fence_regs(acc);
        if (lane == 0) {
          mbar_arrive(&s.empty[st]);
          if (last_tile && kt + 1 == nk) mbar_arrive(&s.aempty[c]);  // the unit's A is read
        }
#pragma unroll
        for (int i = 0; i < kAcc; ++i) run[i] = __fadd_rn(run[i], acc[i]);
      };
      Frag hi0, lo0, hi1, lo1;
      load_frags(0, hi0, lo0);
      if (wait_turn) mbar_wait(&s.turn[c], turns++ & 1);
      for (int kt = 0; kt < nk; kt += 2) {  // two stages per trip: the fragment buffers alternate
        mma_stage(kt, hi0, lo0, hi1, lo1);
        if (kt + 1 < nk) mma_stage(kt + 1, hi1, lo1, hi0, lo0);
      }
      if (pass_turn && lane == 0) mbar_arrive(&s.turn[1 - c]);
      // Epilogue (overlapping the other consumer's MMAs): the thread's targets, all loads in
      // flight at once (n8 block j: columns n0 + 8j + 2t and + 1, both inside N or neither as
      // N % 4 == 0; rows r0 and r0 + 8), then the BCE terms in column order.
      float2 xv[kBN / 8][2];
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
        const int col = n0 + 8 * j + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r0 + 8 * h;
          xv[j][h] = r < p.M && col < p.N
                         ? __ldg(reinterpret_cast<const float2*>(
                               p.x + static_cast<size_t>(r) * p.ldx + col))
                         : make_float2(0.0f, 0.0f);
        }
      }
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
        const int col = n0 + 8 * j + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (r0 + 8 * h < p.M && col < p.N) {
            const float2 v = xv[j][h];
            rbad[h] |= outside_unit(v.x) || outside_unit(v.y);
            rsum[h] += bce_bits(run[4 * j + 2 * h], v.x - 1.0f, v.x);
            rsum[h] += bce_bits(run[4 * j + 2 * h + 1], v.y - 1.0f, v.y);
          }
        }
      }
    }
    // The unit's rows: the quad's sums (xor 1, then 2), in nats, written with kl and elbo.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        rsum[h] += __shfl_xor_sync(0xffffffffu, rsum[h], off);
        rbad[h] = (__shfl_xor_sync(0xffffffffu, static_cast<int>(rbad[h]), off) != 0) || rbad[h];
      }
      const int r = r0 + 8 * h;
      if (t == 0 && r < p.M) write_row(p.recon, p.kl, p.elbo, r, rsum[h] * kLn2, rbad[h]);
    }
    ++unit_i;
  }
#else
  __trap();  // sm_90a only: the binding dispatches here on compute capability 9.0 alone
#endif
}

}  // namespace pp
}  // namespace

bool pingpong_fits(int N, int K) noexcept {
  return N >= 4 && N % 4 == 0 && K >= 1 && K <= kPingpongMaxK && K % 4 == 0;
}

int pingpong_blocks(int M, int sms) noexcept {
  const int pairs = cdiv(cdiv(M, pp::kBM), 2);
  return pairs < sms ? pairs : sms;
}

cudaError_t pingpong_launch(PingpongParams& p, const float* a, int lda, const float* w_hi,
                            const float* w_lo, cudaStream_t stream) noexcept {
  if (p.ldw == 0) p.ldw = p.K;
  if (p.M < 1 || p.sms < 1 || !pingpong_fits(p.N, p.K) || lda % 4 != 0 || lda < p.K ||
      p.ldw % 4 != 0 || p.ldw < p.K || p.ldx % 2 != 0 || p.ldx < p.N ||
      reinterpret_cast<uintptr_t>(p.x) % 8 != 0)
    return cudaErrorInvalidValue;
  if (!encode_tensor_map_2d(&p.a_map, a, p.K, p.M, lda, pp::kBK, pp::kBM,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B) ||
      !encode_tensor_map_2d(&p.w_map, w_hi, p.K, p.N, p.ldw, pp::kBK, pp::kBN,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B) ||
      !encode_tensor_map_2d(&p.wlo_map, w_lo, p.K, p.N, p.ldw, pp::kBK, pp::kBN,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B))
    return cudaErrorInvalidValue;
  // Per device: set at every launch (cheap; host-only, so graph capture is unaffected).
  const cudaError_t attr = cudaFuncSetAttribute(
      pp::pingpong_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, pp::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  pp::pingpong_kernel<<<pingpong_blocks(p.M, p.sms), pp::kBlock, pp::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fastelbo
