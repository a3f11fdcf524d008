// The backward's fused engine (gemm="fused"; `auto` under FASTELBO_TC_TRAIN=1): elbo_backward's
// gradients with its four large GEMMs on tc_gemm.cu's tensor-core kernel (tf32x3) at every
// batch size, their operands written split and transposed by the kernels that produce them
// (backward_fused.cu), and the latent side (g_z, the reparameterisation and KL backward, the
// encoder's hidden-layer gradient, the three small weight gradients, the five bias sums) in two
// launches instead of cuBLAS's ~15. Per call, on PyTorch's current stream (CUDA-graph
// capturable), in this order:
//   fused_prep        keep, the branch gradients, xc, xc^T split; dec_w2's halves, both ways
//   h, mu, lv         cuBLAS, as today: h's ReLU mask and, through z, d's are the gradient's
//   z, d              kinks, so they keep the reference's own bits (tf32x3's larger error flipped
//                     a mask in 2 of 45 cases: benchmarks/PERF.md)
//   logits            tc: d dec_w2^T + dec_b2
//   fused_bce_grad    ga, ga^T; d^T split
//   g_d, g_dec_w2     tc: threshold_backward(ga dec_w2, d, 0); ga^T d
//   fused_latent      g_mu, g_lv, g_eps, g_a1 and g_a1^T
//   g_enc_w           tc: g_a1^T xc
//   fused_wgrad       g_mu^T h, g_lv^T h, g_d^T z and the bias sums (+ its finish above 256 rows)
//   g_x               where wanted, as elbo_backward: BCE's part + g_a1 enc_w (cuBLAS)
// The GEMMs read what TcSplits would have written (the same layout and halves), so logits, ga,
// g_d and the dec_w2 gradient are the unfused tc engine's bits; the rest differ from it (and
// from cuBLAS) only in the order of float32 sums.
#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <vector>

#include "../kernels/backward_fused.h"
#include "binding.h"
#include "binding_common.h"
#include "../kernels/elbo.h"

namespace fastelbo::binding {
namespace {

int sms_of(int device) {
  int sms = 0;
  FE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess,
           "fused backward: cannot read the multiprocessor count");
  return sms;
}

// A GEMM operand of rows x cols laid out as TcSplits::add lays it: (2 halves, or 1 plain copy,
// rows, ld), ld = cols rounded up to 4; unwritten (its producer fills it).
TcHalves operand(int64_t rows, int64_t cols, bool split, const at::TensorOptions& opts) {
  return {at::empty({split ? 2 : 1, rows, (cols + 3) / 4 * 4}, opts), cols};
}
float* half(const TcHalves& o, int i) {
  return i < o.t.size(0) ? o.t[i].data_ptr<float>() : nullptr;
}
int ld_of(const TcHalves& o) { return static_cast<int>(o.t.size(2)); }

// A side job: src (2-D, unit column stride) into dst, transposed where trans.
fastelbo::TileJob split_job(const at::Tensor& src, const TcHalves& dst, bool trans) {
  return {src.data_ptr<float>(), half(dst, 0), half(dst, 1), static_cast<int>(src.size(0)),
          static_cast<int>(src.size(1)), static_cast<int>(src.stride(0)), ld_of(dst),
          trans ? 1 : 0};
}

// out (M x N) = a (M x K, row stride lda) w^T on tc_gemm.cu's kTcStore kernel: + bias (or none),
// 0 where mask <= 0 (threshold_backward(., mask, 0)). w_finite: w holds weights.
void gemm(const float* a, int64_t lda, int64_t M, const TcHalves& w, const at::Tensor& out,
          const float* bias, const at::Tensor* mask, bool w_finite, cudaStream_t stream,
          const char* what) {
  TcStore s;
  s.a = a;
  s.lda = lda;
  s.M = M;
  s.w = &w;
  s.bias = bias;
  s.out = out.data_ptr<float>();
  s.ldo = out.stride(0);
  s.w_finite = w_finite;
  if (mask != nullptr) {
    s.mask = mask->data_ptr<float>();
    s.ldm = mask->stride(0);
  }
  tc_store(s, out.options(), stream, what);
}

// What the stages hand on.
struct Work {
  bool rec, kl;
  int sms;
  at::Tensor xc, keep, g_rec, g_kl, h, mu, lv, z, ga, g_d, g_mu, g_lv, g_a1;
  TcHalves xt, dec_h, dec_t, g_a1t;
};

void prep(const FusedCall& c, const VaeTensors& p, Work& w, cudaStream_t stream) {
  const at::Tensor& x = *c.x;
  const int64_t B = x.size(0), D = x.size(1), H = p.enc_w.size(0);
  const auto opts = x.options();
  w.xc = at::empty({B, D}, opts);
  w.keep = at::empty({B}, opts);
  w.g_rec = w.rec ? at::empty({B}, opts) : at::Tensor();
  w.g_kl = w.kl ? at::empty({B}, opts) : at::Tensor();
  w.xt = operand(D, B, true, opts);
  fastelbo::FusedPrepParams f{};
  fastelbo::PrepParams& q = f.prep;
  q.x = x.data_ptr<float>();
  q.g_elbo = c.g_elbo != nullptr ? c.g_elbo->data_ptr<float>() : nullptr;
  q.g_recon = c.g_recon != nullptr ? c.g_recon->data_ptr<float>() : nullptr;
  q.g_kl = c.g_kl != nullptr ? c.g_kl->data_ptr<float>() : nullptr;
  q.xc = w.xc.data_ptr<float>();
  q.keep = w.keep.data_ptr<float>();
  q.rec_out = w.rec ? w.g_rec.data_ptr<float>() : nullptr;
  q.kl_out = w.kl ? w.g_kl.data_ptr<float>() : nullptr;
  q.n = static_cast<int>(B);
  q.D = static_cast<int>(D);
  f.xt_hi = half(w.xt, 0);
  f.xt_lo = half(w.xt, 1);
  f.ldt = ld_of(w.xt);
  f.col_groups = fastelbo::fused_col_groups(q.n, q.D, w.sms);
  if (w.rec) {  // the logits' W (dec_w2 as it is) and the decoder gradient's (transposed)
    w.dec_h = operand(D, H, true, opts);
    w.dec_t = operand(H, D, true, opts);
    f.side.job[0] = split_job(p.dec_w2, w.dec_h, false);
    f.side.job[1] = split_job(p.dec_w2, w.dec_t, true);
    f.side.count = 2;
  }
  check_launch(fastelbo::fused_prep_launch(f, stream), "fused prep kernel");
}

// z, d, the logits, ga and ga^T, g_d, and the dec_w2 gradient into out[10].
void decoder(const FusedCall& c, const VaeTensors& p, Work& w, std::vector<at::Tensor>& out,
             cudaStream_t stream) {
  const int64_t B = w.xc.size(0), D = w.xc.size(1), H = p.enc_w.size(0), L = p.mu_w.size(0);
  const auto opts = w.xc.options();
  w.z = at::empty({B, L}, opts);
  reparam(w.mu, w.lv, c.eps->data_ptr<float>(), w.z, nullptr, stream);
  const at::Tensor d = relu_linear(w.z, p.dec_w1, p.dec_b1);
  const at::Tensor logits = at::empty({B, D}, opts);
  gemm(d.data_ptr<float>(), H, B, w.dec_h, logits, p.dec_b2.data_ptr<float>(), nullptr, true,
       stream, "fused logits kernel");
  w.ga = at::empty({B, D}, opts);
  const TcHalves gat = operand(D, B, false, opts), dt = operand(H, B, true, opts);
  fastelbo::FusedBceGradParams f{};
  f.bce.ga = w.ga.data_ptr<float>();
  f.bce.x = w.xc.data_ptr<float>();
  f.bce.g_rec = w.g_rec.data_ptr<float>();
  f.bce.keep = w.keep.data_ptr<float>();
  f.bce.gx = c.need_x ? out[0].data_ptr<float>() : nullptr;
  f.bce.n = static_cast<int>(B);
  f.bce.D = static_cast<int>(D);
  f.logits = logits.data_ptr<float>();
  f.gat = half(gat, 0);
  f.ldt = ld_of(gat);
  f.col_groups = fastelbo::fused_col_groups(f.bce.n, f.bce.D, w.sms);
  f.side.job[0] = split_job(d, dt, true);  // the dec_w2 gradient's W
  f.side.count = 1;
  check_launch(fastelbo::fused_bce_grad_launch(f, stream), "fused bce_grad kernel");
  gemm(w.ga.data_ptr<float>(), D, B, w.dec_t, w.g_d, nullptr, &d, true, stream,
       "fused decoder gradient kernel");
  gemm(half(gat, 0), ld_of(gat), D, dt, out[10], nullptr, nullptr, false, stream,
       "fused dec_w2 gradient kernel");
}

// The latent kernel's parameters, those known before any launch (the plan needs them).
fastelbo::FusedLatentParams latent_params(const FusedCall& c, const VaeTensors& p, Work& w,
                                          std::vector<at::Tensor>& out) {
  const auto opts = c.x->options();
  const int64_t B = c.x->size(0), H = p.enc_w.size(0), L = p.mu_w.size(0);
  w.g_d = w.rec ? at::empty({B, H}, opts) : at::Tensor();
  w.g_mu = at::empty({B, L}, opts);
  w.g_lv = at::empty({B, L}, opts);
  w.g_a1 = at::empty({B, H}, opts);
  w.g_a1t = operand(H, B, false, opts);
  fastelbo::FusedLatentParams l{};
  l.g_d = w.rec ? w.g_d.data_ptr<float>() : nullptr;
  l.wd1 = p.dec_w1.data_ptr<float>();
  l.eps = c.eps->data_ptr<float>();
  l.wmu = p.mu_w.data_ptr<float>();
  l.wlv = p.lv_w.data_ptr<float>();
  l.g_mu = w.g_mu.data_ptr<float>();
  l.g_lv = w.g_lv.data_ptr<float>();
  l.g_eps = c.need_eps ? out[1].data_ptr<float>() : nullptr;
  l.g_a1 = w.g_a1.data_ptr<float>();
  l.g_a1t = half(w.g_a1t, 0);
  l.n = static_cast<int>(B);
  l.H = static_cast<int>(H);
  l.L = static_cast<int>(L);
  l.ldt = ld_of(w.g_a1t);
  return l;
}

// The small weight gradients and the bias sums: out[4], [6], [8] and [3], [5], [7], [9], [11].
void wgrad(const Work& w, std::vector<at::Tensor>& out, cudaStream_t stream) {
  fastelbo::FusedWgradParams f{};
  auto add = [&](const at::Tensor* g, const at::Tensor& a, at::Tensor& dst) {
    const int t = f.count++;
    f.g[t] = g != nullptr ? g->data_ptr<float>() : nullptr;
    f.a[t] = a.data_ptr<float>();
    f.dst[t] = dst.data_ptr<float>();
    f.P[t] = g != nullptr ? static_cast<int>(g->size(1)) : 1;
    f.Q[t] = static_cast<int>(a.size(1));
    f.ldg[t] = g != nullptr ? static_cast<int>(g->stride(0)) : 0;
    f.lda[t] = static_cast<int>(a.stride(0));
  };
  add(&w.g_mu, w.h, out[4]);
  add(&w.g_lv, w.h, out[6]);
  if (w.rec) add(&w.g_d, w.z, out[8]);
  add(nullptr, w.g_a1, out[3]);
  add(nullptr, w.g_mu, out[5]);
  add(nullptr, w.g_lv, out[7]);
  if (w.rec) {
    add(nullptr, w.g_d, out[9]);
    add(nullptr, w.ga, out[11]);
  }
  f.n = static_cast<int>(w.xc.size(0));
  at::Tensor ws;
  const int floats = fastelbo::fused_wgrad_workspace(f);
  FE_CHECK(floats >= 0, "fused backward: the weight gradients' workspace is too large");
  if (floats > 0) {
    ws = at::empty({floats}, w.xc.options());
    f.ws = ws.data_ptr<float>();
  }
  check_launch(fastelbo::fused_wgrad_launch(f, stream), "fused wgrad kernel");
}

}  // namespace

bool fused_backward(const FusedCall& c, const VaeTensors& p, std::vector<at::Tensor>& out,
                    cudaStream_t stream) {
  Work w;
  w.rec = c.g_elbo != nullptr || c.g_recon != nullptr;
  w.kl = c.g_elbo != nullptr || c.g_kl != nullptr;
  // The latent kernel's plan first: where it does not fit, nothing has been launched.
  fastelbo::FusedLatentParams l = latent_params(c, p, w, out);
  cudaError_t err = cudaSuccess;
  const fastelbo::ElboStatus st = fastelbo::fused_latent_plan(l, c.x->device().index(), &err);
  FE_CHECK(st != fastelbo::kElboCudaError, "fused backward: planning the latent kernel failed: ",
           cudaGetErrorString(err));
  if (st != fastelbo::kElboOk) return false;
  w.sms = sms_of(c.x->device().index());
  prep(c, p, w, stream);
  w.h = relu_linear(w.xc, p.enc_w, p.enc_b);
  w.mu = at::linear(w.h, p.mu_w, p.mu_b);
  w.lv = at::linear(w.h, p.lv_w, p.lv_b);
  if (w.rec) decoder(c, p, w, out, stream);
  l.mu = w.mu.data_ptr<float>();
  l.lv = w.lv.data_ptr<float>();
  l.g_kl = w.kl ? w.g_kl.data_ptr<float>() : nullptr;
  l.h = w.h.data_ptr<float>();
  check_launch(fastelbo::fused_latent_launch(l, stream), "fused latent kernel");
  gemm(half(w.g_a1t, 0), ld_of(w.g_a1t), p.enc_w.size(0), w.xt, out[2], nullptr, nullptr, false,
       stream, "fused enc_w gradient kernel");
  wgrad(w, out, stream);
  if (c.need_x) {  // BCE's part (already in out[0]) + the encoder's, then invalid rows zeroed
    out[0].addmm_(w.g_a1, p.enc_w);
    out[0] = at::where(w.keep.unsqueeze(1) != 0, out[0], at::zeros({}, w.xc.options()));
  }
  return true;
}

}  // namespace fastelbo::binding
