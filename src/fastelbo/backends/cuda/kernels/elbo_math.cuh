// Device-side math shared by every kernel of the cuda backend (cluster path, rows path,
// backward): the per-element formulas, op by op as eager PyTorch rounds them, so all paths agree
// with each other and with the reference. No torch types; included by the .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fastelbo {

constexpr int kThreads = 256;  // threads per block of every kernel in this backend
constexpr int kWarps = kThreads / 32;

// std::max(a, b) as PyTorch's kernels use it: returns a when a is NaN (fmaxf would drop it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a < b) ? b : a; }
__device__ __forceinline__ float relu(float v) { return nan_max(v, 0.0f); }

__host__ __device__ __forceinline__ int round4(int v) { return (v + 3) & ~3; }

// The per-element math, shared by both paths (op by op as eager PyTorch rounds it).
// z = mu + exp(0.5 logvar) * eps, separate roundings.
__device__ __forceinline__ float reparam(float mu, float lv, float ep) {
  return __fadd_rn(mu, __fmul_rn(expf(__fmul_rn(0.5f, lv)), ep));
}
// One term of the KL sum: 1 + logvar - mu^2 - exp(logvar).
__device__ __forceinline__ float kl_term(float mu, float lv) {
  return __fsub_rn(__fsub_rn(__fadd_rn(1.0f, lv), __fmul_rn(mu, mu)), expf(lv));
}
// sigmoid as PyTorch's CUDA kernel: 1 / (1 + exp(-a)).
__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }
// The value check's predicate (torch_ref.invalid_rows, validation.py): x outside [0, 1], or NaN.
__device__ __forceinline__ bool outside_unit(float v) { return !(v >= 0.0f && v <= 1.0f); }
// BCE as PyTorch: (x - 1) * max(log1p(-p), -100) - x * max(log(p), -100), p = sigmoid(a);
// x outside [0, 1] or NaN -> NaN and *bad set.
__device__ __forceinline__ float bce_term(float a, float xv, bool* bad) {
  const float pr = sigmoid(a);
  const float lp = nan_max(logf(pr), -100.0f), l1p = nan_max(log1pf(-pr), -100.0f);
  const bool ok = !outside_unit(xv);
  *bad |= !ok;
  return ok ? __fsub_rn(__fmul_rn(xv - 1.0f, l1p), __fmul_rn(xv, lp))
            : __int_as_float(0x7fc00000);
}
// The clamped BCE term, in bits (log2 units: the caller scales each row sum by ln 2 once; the
// IWAE and tc_gemm kernels), with PyTorch's float32 numerics where they decide anything:
// den = 1 + expf(-a) and p = 1 / den as
// PyTorch rounds them (IEEE expf; rcp_den is bit-exact to __frcp_rn where it matters), so
// 1 - p is PyTorch's exactly. Both logs come from the hardware log2 (MUFU, ~2^-22 per term):
//   log p     = -log2(den) ln 2: den >= 1, never subnormal (differs from log of the rounded p by
//               <= 2^-24 nats); den = inf gives -inf, clamped to -100 as PyTorch's log(p = 0);
//   log(1-p)  = log2(1 - p) ln 2: 1 - p is 0 or >= 2^-24, never subnormal; 0 clamps to -100.
// Those are the only elements either clamp can reach (log p >= -88.8 for any finite den), so the
// clamps fall on exactly PyTorch's elements, and flush-to-zero logs lose nothing. Not unbiased:
// summed over D the estimate moves by up to ~2^-22 (D + |log p(x|z)|) nats, e.g. 1.2e-4 at
// D = 781 where log p(x) = -544 (2 ulps of the float32 result; the bound tests/test_cuda_iwae.py
// allows). IEEE logf + log1pf would cost ~60 instructions per element (0.15 s at the target).
// w0 = x - 1 and w1 = x, both NaN where x lies outside [0, 1] (then the term is NaN).
constexpr float kLn2 = 0.693147180559945309f;
constexpr float kClampBits = -144.269504088896341f;  // -100 nats in bits
__device__ __forceinline__ float lg2_ftz(float v) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
// max(v, c) keeping a NaN v as PyTorch's std::max does, in one instruction.
__device__ __forceinline__ float max_nan(float v, float c) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(v), "f"(c));
  return r;
}
// p = 1 / den for den in [1, inf] or NaN without __frcp_rn's out-of-line slow path: below 2^100
// the reciprocal approximation plus one FMA Newton step is bit-exact to __frcp_rn; above, p is
// below 2^-100 and 1 - p = 1 either way (both claims were checked for every float den on the
// GPU). A NaN den becomes 2^100 here; the term stays NaN through log2(den).
__device__ __forceinline__ float rcp_den(float den) {
  const float d = fminf(den, 0x1p100f);
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return fmaf(r, fmaf(-d, r, 1.0f), r);
}
__device__ __forceinline__ float bce_bits(float a, float w0, float w1) {
  const float den = 1.0f + expf(-a);
  const float l1p = max_nan(lg2_ftz(1.0f - rcp_den(den)), kClampBits);
  return w0 * l1p - w1 * max_nan(-lg2_ftz(den), kClampBits);
}

// A row's final write (validation.py's rule): an x outside [0, 1] anywhere in the row makes
// recon, kl and elbo NaN; else recon = s, elbo = -(s + kl). kl is read and rewritten in place.
__device__ __forceinline__ void write_row(float* recon, float* kl, float* elbo, int row, float s,
                                          bool bad) {
  const float nan = __int_as_float(0x7fc00000);
  const float k = kl[row];
  recon[row] = bad ? nan : s;
  kl[row] = bad ? nan : k;
  elbo[row] = bad ? nan : -(s + k);
}

// ---- tf32x3 splits (iwae.cu, tc_gemm.cu) ----
// v = hi + lo with hi = v's top 11 significant bits (truncated: one LOP, NaN stays NaN, inf
// stays inf) and lo = v - hi exactly (|lo| < 2^-10 |v|); the MMA reads lo's top 11 bits. Per
// product hi*hi + hi*lo + lo*hi is within ~3 * 2^-20 of a*b (the lo*lo term and lo's dropped
// bits).
__device__ __forceinline__ void tf32_split(float v, uint32_t* hi, uint32_t* lo) {
  *hi = __float_as_uint(v) & 0xFFFFE000u;
  *lo = __float_as_uint(v - __uint_as_float(*hi));
}
// tf32_split for products that must keep float32's infinities (tc_gemm.cu): lo = v where v is
// not finite (inf - inf would be NaN), and hi * 2^-24 where v - hi is exactly 0 (v exact in
// TF32, e.g. a binary x), so that an infinite other factor times this lo is an infinity of the
// right sign, not inf * 0 = NaN; that adds at most 2^-24 of the product, a float32 rounding.
__device__ __forceinline__ void tf32_split_inf(float v, uint32_t* hi, uint32_t* lo) {
  const uint32_t h = __float_as_uint(v) & 0xFFFFE000u;
  const float l = v - __uint_as_float(h);
  *hi = h;
  *lo = __float_as_uint(!isfinite(v) ? v : l == 0.0f ? __uint_as_float(h) * 5.9604645e-8f : l);
}

// tf32_split for an operand whose partner is finite (a weight matrix): lo = v where v is not
// finite (inf - inf would be NaN), else v - hi. An exact-in-TF32 v keeps lo = 0, which is harmless
// when the other factor is finite. One compare and a select over tf32_split: the tc kernels split
// A per stage in their MMA loop, where tf32_split_inf's extra work cost up to 20% (H200, per
// 65536 rows: encoder 293 vs 244 us, output layer 417 vs 354; 6-19% at 1024 to 16384 rows).
__device__ __forceinline__ void tf32_split_act(float v, uint32_t* hi, uint32_t* lo) {
  const uint32_t h = __float_as_uint(v) & 0xFFFFE000u;
  const float l = v - __uint_as_float(h);
  *hi = h;
  *lo = __float_as_uint(l != l ? v : l);
}

// ---- backward (autograd's formulas, as torch_ref.backward spells them out) ----
// binary_cross_entropy_backward: g * (p - x) / max((1 - p) * p, 1e-12) (fmaxf as PyTorch's max).
__device__ __forceinline__ float bce_backward(float g, float p, float xv) {
  return __fdiv_rn(__fmul_rn(g, __fsub_rn(p, xv)),
                   fmaxf(__fmul_rn(__fsub_rn(1.0f, p), p), 1e-12f));
}
// sigmoid_backward(g, y) = g * (1 - y) * y.
__device__ __forceinline__ float sigmoid_backward(float g, float y) {
  return __fmul_rn(__fmul_rn(g, __fsub_rn(1.0f, y)), y);
}
// torch.logit(p) without eps: log(p / (1 - p)).
__device__ __forceinline__ float logit(float p) { return logf(__fdiv_rn(p, __fsub_rn(1.0f, p))); }

// One row's branch gradient (prep_kernel; torch_ref.backward's sum(parts)): 0 + g_part +
// (-g_elbo), each term only where its pointer is set; 0 on an invalid row.
__device__ __forceinline__ float branch_grad(const float* g_part, const float* g_elbo, int row,
                                             bool bad) {
  const float ge = g_elbo != nullptr ? -__ldg(g_elbo + row) : 0.0f;
  const float g = g_part != nullptr ? __ldg(g_part + row) + ge : ge;
  return bad ? 0.0f : g;
}
// The gradient at a logit a (bce_grad_kernel's element): p = sigmoid(a); a row holding a NaN p
// (row_nan) has its BCE gradient zeroed and p -> 0.5 where BCE reads it (torch_ref's nan_rows);
// sigmoid_backward(bce_backward(g, p, x), p). g_rec: the row's recon-branch gradient.
__device__ __forceinline__ float bce_grad_elem(float a, float xv, float g_rec, bool row_nan) {
  const float g = row_nan ? 0.0f : g_rec;
  const float pr = sigmoid(a);
  const float gp = bce_backward(g, row_nan ? 0.5f : pr, xv);
  return sigmoid_backward(row_nan ? 0.0f : gp, pr);
}
// BCE's gradient with respect to its target x at the same element: -logit(p) * g, 0 where the
// row is invalid (keep false).
__device__ __forceinline__ float bce_grad_x(float a, float g_rec, bool row_nan, bool keep) {
  const float safe = row_nan ? 0.5f : sigmoid(a);
  return keep ? __fmul_rn(-logit(safe), row_nan ? 0.0f : g_rec) : 0.0f;
}
// The reparameterisation's and KL's backward at one (row, latent) element (latent_bwd_kernel):
// from g_z (rec: the recon branch reaches z) and the row's g_kl (kl), g_mu, g_lv and g_eps:
//   g_mu = g_z; g_lv = 0.5 * (g_z * eps * std); g_eps = g_z * std; then + g_kl * mu and
//   + (-0.5 * g_kl) * (1 - exp(lv)). eps is read only with rec, mu only with kl.
__device__ __forceinline__ void latent_grads(bool rec, float gz, float ep, bool kl, float gk,
                                             float mu, float lv, float* g_mu, float* g_lv,
                                             float* g_eps) {
  const float sd = expf(__fmul_rn(0.5f, lv));
  float gm = 0.0f, gl = 0.0f, ge = 0.0f;
  if (rec) {
    gm = gz;
    gl = __fmul_rn(0.5f, __fmul_rn(__fmul_rn(gz, ep), sd));
    ge = __fmul_rn(gz, sd);
  }
  if (kl) {
    const float kl_mu = __fmul_rn(gk, mu);
    const float kl_lv = __fmul_rn(__fmul_rn(-0.5f, gk), __fsub_rn(1.0f, expf(lv)));
    gm = rec ? __fadd_rn(gm, kl_mu) : kl_mu;
    gl = rec ? __fadd_rn(gl, kl_lv) : kl_lv;
  }
  *g_mu = gm;
  *g_lv = gl;
  *g_eps = ge;
}

__host__ __device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

}  // namespace fastelbo
