// The backward's and the optimizer's torch-facing half (declared in binding.h): the gradient
// GEMMs around backward.cu's fused kernels, and adam.cu's one-launch Adam step. Four large
// GEMMs (the logits recomputed, the decoder's hidden-layer gradient, the two large weight
// gradients) run on tensor cores in tf32x3 (tc_gemm.cu) where tc_applies and
// B >= kTcBackwardMinBatch, else on cuBLAS (ATen) in float32, as the small ones always do.
// gemm="fused" (auto under FASTELBO_TC_TRAIN=1) hands the call to binding_backward_fused.cpp.
// Launches on PyTorch's current stream only: CUDA-graph capturable.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#include "binding.h"
#include "binding_common.h"
#include "../kernels/elbo.h"

namespace fastelbo::binding {
namespace {

// From here up auto takes the tensor-core GEMMs (benchmarks/PERF.md: the measured crossover).
constexpr int64_t kTcBackwardMinBatch = 2048;

// FASTELBO_TC_TRAIN=1: auto takes the fused engine wherever the tensor-core GEMMs apply. Read per
// call (a getenv), so that one process can time the step with it off and on
// (benchmarks/train_bench.py --tc-train).
bool fused_by_env() {
  const char* v = std::getenv("FASTELBO_TC_TRAIN");
  return v != nullptr && v[0] == '1';
}

enum class Engine { kCublas, kTc, kFused };

Engine backward_engine(const BackwardOptions& opt, const at::Tensor& x, const at::Tensor& enc_w,
                       const at::Tensor& dec_w2) {
  FE_CHECK(opt.gemm >= kGemmAuto && opt.gemm <= kGemmFused, "backward: gemm must be 0 (auto), 1 "
           "(cuBLAS), 2 (tensor cores) or 3 (fused), got ", opt.gemm);
  if (opt.gemm == kGemmCublas) return Engine::kCublas;
  const bool applies = tc_applies(x, enc_w, dec_w2);
  FE_CHECK(applies || opt.gemm == kGemmAuto, "backward: the tensor-core GEMMs need an sm_90 GPU, "
           "input_dim and hidden_dim multiples of 4 and 16-byte aligned x, enc_w and dec_w2");
  if (!applies) return Engine::kCublas;
  if (opt.gemm == kGemmFused || (opt.gemm == kGemmAuto && fused_by_env())) return Engine::kFused;
  return opt.gemm == kGemmTc || x.size(0) >= kTcBackwardMinBatch ? Engine::kTc : Engine::kCublas;
}

// The (M, N) output of a, a row-major (M, K) operand, against w's halves; into `out`.
// w_finite: w is a weight matrix (TcStore::w_finite), not an activation or a gradient.
void tc_into(const at::Tensor& a, int64_t lda, const TcHalves& w, const at::Tensor& out,
             const float* bias, bool relu, const at::Tensor* mask, bool w_finite,
             cudaStream_t stream, const char* what) {
  TcStore s;
  s.a = a.data_ptr<float>();
  s.lda = lda;
  s.M = out.size(0);
  s.w = &w;
  s.bias = bias;
  s.out = out.data_ptr<float>();
  s.ldo = out.stride(0);
  s.relu = relu;
  s.w_finite = w_finite;
  if (mask != nullptr) {
    s.mask = mask->data_ptr<float>();
    s.ldm = mask->stride(0);
  }
  tc_store(s, out.options(), stream, what);
}

// g^T a (the weight gradient of a layer with input a and output gradient g, both (B, .)) on
// tensor cores: the batch becomes K, so g is transposed and a transposed and split first.
void tc_weight_grad(const at::Tensor& g, const at::Tensor& a, const at::Tensor& out,
                    cudaStream_t stream, const char* what) {
  TcSplits ops;
  const TcHalves gt = ops.add(g, true, false), at_ = ops.add(a, true, true);
  ops.launch(stream);
  tc_into(gt.t[0], gt.t.size(2), at_, out, nullptr, false, nullptr, false, stream, what);
}

}  // namespace

// Gradients of <g, (elbo, recon, kl)> with respect to x, eps and the ten parameters, as
// torch_ref.backward (the spec: autograd's formulas written out) gives them. opt.use_*: whether
// a gradient reaches that output (an unused output's g is ignored, as autograd's None; the
// caller passes a (B,) placeholder); opt.need_x / opt.need_eps: whether those gradients are
// wanted (else an empty tensor comes back in their place). Inputs as for elbo_forward, grads =
// {g_elbo, g_recon, g_kl}, each (B,) float32 contiguous: check_inputs checks them all, and
// where a rule is broken nothing is launched and [] comes back (last_status says which).
// Returns {g_x, g_eps, g_enc_w, g_enc_b, ..., g_dec_b2}.
std::vector<at::Tensor> elbo_backward(const at::Tensor& x, const std::optional<at::Tensor>& eps_in,
                                      const std::vector<at::Tensor>& params,
                                      const std::vector<at::Tensor>& grads,
                                      const BackwardOptions& opt) {
  CheckCall call = vae_call(x, eps_in, params);
  if (grads.size() != 3) {
    last_check() = {kCheckCount, kFieldGrads};
    return {};
  }
  for (int i = 0; i < 3; ++i) call.grads[i] = &grads[i];
  if (!passes(call)) return {};
  const at::Tensor& eps = *eps_in;
  const VaeTensors p(params);
  const at::Tensor &enc_w = p.enc_w, &enc_b = p.enc_b, &mu_w = p.mu_w, &mu_b = p.mu_b;
  const at::Tensor &lv_w = p.lv_w, &lv_b = p.lv_b, &dec_w1 = p.dec_w1, &dec_b1 = p.dec_b1;
  const at::Tensor &dec_w2 = p.dec_w2, &dec_b2 = p.dec_b2;
  const at::Tensor &g_elbo = grads[0], &g_recon = grads[1], &g_kl = grads[2];
  const bool use_elbo = opt.use_elbo, use_recon = opt.use_recon, use_kl = opt.use_kl;
  const bool need_x = opt.need_x, need_eps = opt.need_eps;
  const auto dev = x.device();
  const int64_t B = x.size(0), D = x.size(1), L = mu_w.size(0), H = enc_w.size(0);
  const Engine engine = backward_engine(opt, x, enc_w, dec_w2);
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const auto opts = x.options();
  const bool rec = use_elbo || use_recon, kl = use_elbo || use_kl;
  // Zero-filled only where nothing below writes every element.
  auto grad = [&](const at::Tensor& t, bool written) {
    return written ? at::empty_like(t) : at::zeros_like(t);
  };
  std::vector<at::Tensor> out;
  out.push_back(need_x ? grad(x, rec) : at::empty({0}, opts));
  out.push_back(need_eps ? grad(eps, rec || kl) : at::empty({0}, opts));
  for (const at::Tensor* t : {&enc_w, &enc_b, &mu_w, &mu_b, &lv_w, &lv_b})
    out.push_back(grad(*t, rec || kl));
  for (const at::Tensor* t : {&dec_w1, &dec_b1, &dec_w2, &dec_b2}) out.push_back(grad(*t, rec));
  if (!rec && !kl) return out;  // no gradient reaches any output
  if (engine == Engine::kFused &&
      fused_backward({&x, &eps, use_elbo ? &g_elbo : nullptr, use_recon ? &g_recon : nullptr,
                      use_kl ? &g_kl : nullptr, need_x, need_eps}, p, out, stream))
    return out;
  // Where the fused engine's latent kernel does not fit: the unfused tc engine if it was asked
  // for, else auto's own choice.
  const bool tc = engine == Engine::kTc || (engine == Engine::kFused &&
                                            (opt.gemm == kGemmFused || B >= kTcBackwardMinBatch));

  // Invalid rows (x outside [0, 1] or NaN) are zeroed in x and in both branch gradients.
  at::Tensor xc = at::empty({B, D}, opts), keep = at::empty({B}, opts);
  at::Tensor g_rec = rec ? at::empty({B}, opts) : at::Tensor();
  at::Tensor g_klr = kl ? at::empty({B}, opts) : at::Tensor();
  fastelbo::PrepParams pp{};
  pp.x = x.data_ptr<float>();
  pp.g_elbo = use_elbo ? g_elbo.data_ptr<float>() : nullptr;
  pp.g_recon = use_recon ? g_recon.data_ptr<float>() : nullptr;
  pp.g_kl = use_kl ? g_kl.data_ptr<float>() : nullptr;
  pp.xc = xc.data_ptr<float>();
  pp.keep = keep.data_ptr<float>();
  pp.rec_out = rec ? g_rec.data_ptr<float>() : nullptr;
  pp.kl_out = kl ? g_klr.data_ptr<float>() : nullptr;
  pp.n = static_cast<int>(B);
  pp.D = static_cast<int>(D);
  check_launch(fastelbo::prep_launch(pp, stream), "prep kernel");

  TcHalves dec_h, dec_t;  // dec_w2's halves, as it is and transposed
  if (tc) {
    TcSplits ops;
    if (rec) {
      dec_h = ops.add(dec_w2, false, true);
      dec_t = ops.add(dec_w2, true, true);
    }
    ops.launch(stream);
  }
  // h on cuBLAS in both engines: its ReLU mask, and through z the decoder's, are the gradient's
  // kinks, so h has the reference's own bits; tf32x3's few-times-larger error flipped a mask
  // where a pre-activation was ~1e-6 (2 of 45 test cases; benchmarks/PERF.md).
  const at::Tensor h = relu_linear(xc, enc_w, enc_b);
  const at::Tensor mu = at::linear(h, mu_w, mu_b), lv = at::linear(h, lv_w, lv_b);
  at::Tensor g_z, g_d, g_a4;
  if (rec) {
    at::Tensor z = at::empty({B, L}, opts);
    reparam(mu, lv, eps.data_ptr<float>(), z, nullptr, stream);
    const at::Tensor d = relu_linear(z, dec_w1, dec_b1);
    at::Tensor ga;  // logits, then their gradient in place
    if (tc) {
      ga = at::empty({B, D}, opts);
      tc_into(d, H, dec_h, ga, dec_b2.data_ptr<float>(), false, nullptr, true, stream,
              "tc logits kernel");
    } else {
      ga = at::linear(d, dec_w2, dec_b2);
    }
    fastelbo::BceGradParams bg{};
    bg.ga = ga.data_ptr<float>();
    bg.x = xc.data_ptr<float>();
    bg.g_rec = g_rec.data_ptr<float>();
    bg.keep = keep.data_ptr<float>();
    bg.gx = need_x ? out[0].data_ptr<float>() : nullptr;
    bg.n = static_cast<int>(B);
    bg.D = static_cast<int>(D);
    check_launch(fastelbo::bce_grad_launch(bg, stream), "bce_grad kernel");
    if (tc) {
      tc_weight_grad(ga, d, out[10], stream, "tc dec_w2 gradient kernel");
      g_d = at::empty({B, H}, opts);
      tc_into(ga, D, dec_t, g_d, nullptr, false, &d, true, stream, "tc decoder gradient kernel");
    } else {
      at::mm_out(out[10], ga.t(), d);
      g_d = at::threshold_backward(at::mm(ga, dec_w2), d, 0);
    }
    at::mm_out(out[8], g_d.t(), z);
    g_z = at::mm(g_d, dec_w1);
    g_a4 = ga;
  }
  at::Tensor g_mu = at::empty({B, L}, opts), g_lv = at::empty({B, L}, opts);
  fastelbo::LatentBwdParams lb{};
  lb.g_z = rec ? g_z.data_ptr<float>() : nullptr;
  lb.mu = mu.data_ptr<float>();
  lb.lv = lv.data_ptr<float>();
  lb.eps = eps.data_ptr<float>();
  lb.g_kl = kl ? g_klr.data_ptr<float>() : nullptr;
  lb.g_mu = g_mu.data_ptr<float>();
  lb.g_lv = g_lv.data_ptr<float>();
  lb.g_eps = need_eps ? out[1].data_ptr<float>() : nullptr;
  lb.n = static_cast<int>(B);
  lb.L = static_cast<int>(L);
  check_launch(fastelbo::latent_bwd_launch(lb, stream), "latent_bwd kernel");

  const at::Tensor g_a1 =
      at::threshold_backward(at::addmm(at::mm(g_mu, mu_w), g_lv, lv_w), h, 0);
  if (tc)
    tc_weight_grad(g_a1, xc, out[2], stream, "tc enc_w gradient kernel");
  else
    at::mm_out(out[2], g_a1.t(), xc);
  at::mm_out(out[4], g_mu.t(), h);
  at::mm_out(out[6], g_lv.t(), h);
  // The bias gradients, column sums over the batch, in one launch.
  fastelbo::ColSumParams cs{};
  auto add_sum = [&](const at::Tensor& g, at::Tensor& dst) {
    cs.src[cs.count] = g.data_ptr<float>();
    cs.dst[cs.count] = dst.data_ptr<float>();
    cs.cols[cs.count] = static_cast<int>(g.size(1));
    ++cs.count;
  };
  add_sum(g_a1, out[3]);
  add_sum(g_mu, out[5]);
  add_sum(g_lv, out[7]);
  if (rec) {
    add_sum(g_d, out[9]);
    add_sum(g_a4, out[11]);
  }
  cs.n = static_cast<int>(B);
  at::Tensor cs_ws;
  if (const int ws = fastelbo::colsum_workspace(cs)) {
    cs_ws = at::empty({ws}, opts);
    cs.ws = cs_ws.data_ptr<float>();
  }
  check_launch(fastelbo::colsum_launch(cs, stream), "colsum kernel");
  if (need_x) {  // BCE's part (already in out[0]) + the encoder's, then invalid rows zeroed
    out[0].addmm_(g_a1, enc_w);
    out[0] = at::where(keep.unsqueeze(1) != 0, out[0], at::zeros({}, opts));
  }
  return out;
}

// One Adam update (adam.cu) of every tensor in `params`, in place, on the current stream; the
// step counts in `steps` (device scalars) already hold this step's count. fastelbo/training/
// adam.py checks devices, dtypes, shapes and contiguity in Python first.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
               double eps, double weight_decay) {
  const size_t n = params.size();
  FE_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
               steps.size() == n, "adam_step: one grad, exp_avg, exp_avg_sq and step per param");
  if (n == 0) return;
  const auto dev = params[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  for (size_t s = 0; s < n; s += fastelbo::kAdamMax) {
    fastelbo::AdamParams ap{};
    ap.lr = lr;
    ap.beta1 = beta1;
    ap.beta2 = beta2;
    ap.eps = eps;
    ap.weight_decay = weight_decay;
    for (size_t i = s; i < std::min(n, s + fastelbo::kAdamMax); ++i) {
      for (const at::Tensor* t : {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i], &steps[i]})
        FE_CHECK_TENSOR(*t, "every adam_step tensor", dev);
      ap.param[ap.count] = params[i].data_ptr<float>();
      ap.grad[ap.count] = grads[i].data_ptr<float>();
      ap.exp_avg[ap.count] = exp_avgs[i].data_ptr<float>();
      ap.exp_avg_sq[ap.count] = exp_avg_sqs[i].data_ptr<float>();
      ap.step[ap.count] = steps[i].data_ptr<float>();
      ap.numel[ap.count] = params[i].numel();
      ++ap.count;
    }
    check_launch(fastelbo::adam_launch(ap, stream), "adam kernel");
  }
}

}  // namespace fastelbo::binding
