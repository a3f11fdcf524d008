// The tensor-core GEMMs' torch-facing half (tc_gemm.cu). TcSplits and tc_store are what the
// backward uses of them (binding_backward.cpp); tc_rows_forward is the rows path's
// tensor-core variant (path "tc"): the two large GEMMs on wgmma in tf32x3 (float32 accuracy),
// the encoder's with its bias and ReLU fused, the decoder's output layer with sigmoid, clamped
// BCE and the row sums fused (the (B, D) logits never exist). The small GEMMs stay cuBLAS (mu
// and logvar as one (n, 2L) product, then the decoder's hidden layer), reparam_kl_kernel as in
// the rows path; the hidden layer's ReLU is applied as the output layer reads it (relu_a).
// Memory beyond the outputs: W's halves for the two large layers and, per chunk of kTcChunk
// rows, one (chunk, H) buffer (h, then d in its place), z, mu / logvar and the BCE partials.
// With `pingpong` (ForwardOptions::output) the output layer is pingpong.cu's one persistent
// launch per chunk, which writes recon, elbo and kl itself: no partials, no finish kernel.
#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <vector>

#include "binding.h"
#include "binding_common.h"
#include "../kernels/elbo.h"

namespace fastelbo::binding {
namespace {

// 16384 rows: 256 x 2 encoder tiles (~2 waves of 132 SMs) and a 16 MiB (chunk, 256) buffer.
constexpr int64_t kTcChunk = 16384;

int multiprocessors(int device) {
  int sms = 0;
  FE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess,
           "tc: cannot read the multiprocessor count");
  return sms;
}

// pingpong.cu's persistent grid bound: the multiprocessors, or FASTELBO_PINGPONG_BLOCKS=n where
// that is fewer (tests and sanitizer runs: blocks then take several unit pairs, which a 16384-row
// chunk never gives 132 SMs). Read per call, on the pingpong branch only.
int pingpong_sms(int device) {
  const int sms = multiprocessors(device);
  const char* v = std::getenv("FASTELBO_PINGPONG_BLOCKS");
  const int cap = v != nullptr ? std::atoi(v) : 0;
  return cap > 0 && cap < sms ? cap : sms;
}

}  // namespace

void TcSplits::job(const at::Tensor& src, float* hi, float* lo, int64_t ld, bool trans) {
  const int c = p_.count++;  // the callers checked that it fits
  p_.src[c] = src.data_ptr<float>();
  p_.hi[c] = hi;
  p_.lo[c] = lo;
  p_.rows[c] = static_cast<int>(src.size(0));
  p_.cols[c] = static_cast<int>(src.size(1));
  p_.lds[c] = static_cast<int>(src.stride(0));
  p_.ldt[c] = static_cast<int>(ld);
  p_.trans[c] = trans ? 1 : 0;
}

TcHalves TcSplits::add(const at::Tensor& src, bool trans, bool split) {
  FE_CHECK(p_.count < fastelbo::kTcSplitMax, "tc splits: more than ", fastelbo::kTcSplitMax,
           " operands in one launch");
  FE_CHECK(src.dim() == 2 && src.stride(1) == 1, "tc splits: a 2-D operand with unit column "
           "stride");
  const int64_t rows = trans ? src.size(1) : src.size(0), cols = trans ? src.size(0) : src.size(1);
  const int64_t ld = (cols + 3) / 4 * 4;  // TMA: 16-byte row strides
  at::Tensor t = at::empty({split ? 2 : 1, rows, ld}, src.options());
  job(src, t[0].data_ptr<float>(), split ? t[1].data_ptr<float>() : nullptr, ld, trans);
  return {t, cols};
}

TcHalves TcSplits::add_rows(std::initializer_list<at::Tensor> srcs) {
  FE_CHECK(srcs.size() > 0 && srcs.begin()->dim() == 2, "tc splits: add_rows of no operand, or "
           "of one that is not 2-D");
  const int64_t cols = srcs.begin()->size(1);
  int64_t rows = 0;
  for (const at::Tensor& src : srcs) {
    FE_CHECK(src.dim() == 2 && src.size(1) == cols && src.stride(1) == 1,
             "tc splits: add_rows takes 2-D operands of one column count, unit column stride");
    rows += src.size(0);
  }
  FE_CHECK(p_.count + static_cast<int>(srcs.size()) <= fastelbo::kTcSplitMax, "tc splits: more "
           "than ", fastelbo::kTcSplitMax, " operands in one launch");
  const int64_t ld = (cols + 3) / 4 * 4;
  at::Tensor t = at::empty({1, rows, ld}, srcs.begin()->options());
  int64_t r0 = 0;
  for (const at::Tensor& src : srcs) {
    job(src, t[0].data_ptr<float>() + r0 * ld, nullptr, ld, false);
    r0 += src.size(0);
  }
  return {t, cols};
}

void TcSplits::launch(cudaStream_t stream) {
  if (p_.count > 0) check_launch(fastelbo::tc_split_t_launch(p_, stream), "tc split kernel");
  p_ = fastelbo::TcSplitParams{};
}

void tc_store(const TcStore& s, const at::TensorOptions& opts, cudaStream_t stream,
              const char* what) {
  fastelbo::TcGemmParams e{};
  e.bias = s.bias;
  e.out = s.out;
  e.mask = s.mask;
  e.ldm = static_cast<int>(s.ldm);
  e.M = static_cast<int>(s.M);
  e.N = static_cast<int>(s.w->t.size(1));
  e.K = static_cast<int>(s.w->cols);
  e.ldo = static_cast<int>(s.ldo);
  e.ldw = static_cast<int>(s.w->t.size(2));
  e.mode = fastelbo::kTcStore;
  e.act = s.relu ? 1 : 0;
  e.w_finite = s.w_finite ? 1 : 0;
  e.splits = fastelbo::tc_gemm_splits(e.M, e.N, e.K, multiprocessors(opts.device().index()));
  at::Tensor ws;
  if (e.splits > 1) {
    ws = at::empty({e.splits, s.M, e.N}, opts);
    e.ws = ws.data_ptr<float>();
  }
  check_launch(fastelbo::tc_gemm_launch(e, s.a, static_cast<int>(s.lda),
                                        s.w->t[0].data_ptr<float>(),
                                        s.w->t[1].data_ptr<float>(), stream),
               what);
}

bool tc_applies(const at::Tensor& x, const at::Tensor& enc_w, const at::Tensor& dec_w2) {
  int major = 0, minor = 0;
  const int dev = x.device().index();
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0 && x.size(1) % 4 == 0 && enc_w.size(0) % 4 == 0 &&
         aligned16(x.data_ptr()) && aligned16(enc_w.data_ptr()) && aligned16(dec_w2.data_ptr());
}

bool pingpong_applies(int64_t D, int64_t H) {
  return fastelbo::pingpong_fits(static_cast<int>(D), static_cast<int>(H));
}

void tc_rows_forward(const at::Tensor& x, const at::Tensor& eps, const VaeTensors& p,
                     std::vector<at::Tensor>& out, cudaStream_t stream,
                     fastelbo::DeferredRecord* err, bool latent, bool pingpong) {
  const at::Tensor &enc_w = p.enc_w, &enc_b = p.enc_b, &mu_w = p.mu_w, &mu_b = p.mu_b;
  const at::Tensor &lv_w = p.lv_w, &lv_b = p.lv_b, &dec_w1 = p.dec_w1, &dec_b1 = p.dec_b1;
  const at::Tensor &dec_w2 = p.dec_w2, &dec_b2 = p.dec_b2;
  const int64_t B = x.size(0), D = x.size(1), H = enc_w.size(0), L = mu_w.size(0);
  // One launch makes the weight operands: the two large layers' halves, and mu's and logvar's
  // weights stacked as one (2L, H) matrix (ld = H: tc_applies has H % 4 == 0), so that mu and
  // logvar are one (n, 2L) GEMM (h read once, one launch per chunk instead of two).
  // (With the latent block fused none of that stacking is needed: latent.cu reads them as
  // they are.)
  TcSplits splits;
  const TcHalves enc = splits.add(enc_w, false, true), dec = splits.add(dec_w2, false, true);
  const at::Tensor ml_w = latent ? at::Tensor() : splits.add_rows({mu_w, lv_w}).t[0];
  splits.launch(stream);
  const at::Tensor ml_b = latent ? at::Tensor() : at::cat({mu_b, lv_b});
  const int64_t chunk = std::min(B, kTcChunk);
  const bool pp = pingpong && err == nullptr && pingpong_applies(D, H);
  const int sms = pp ? pingpong_sms(x.device().index()) : 0;
  const int tiles = fastelbo::tc_gemm_tiles_n(static_cast<int>(D));
  const auto opts = x.options();
  at::Tensor hbuf = at::empty({chunk, H}, opts), z = at::empty({chunk, L}, opts);
  at::Tensor part = at::empty({pp ? 0 : chunk, tiles}, opts);
  // The tiles' bad-x flags, and after them (4-byte aligned) the deferred check's call flag:
  // zeroed by the first chunk's reparam_kl, set by the output layer's kernels, read by the
  // finish kernels (the last one also NaNs the earlier chunks' rows).
  const int64_t flag_at = pp ? 0 : (chunk * tiles + 3) / 4 * 4;
  at::Tensor badbuf = at::empty({flag_at + 4}, opts.dtype(at::kByte));
  at::Tensor bad = badbuf.narrow(0, 0, pp ? 0 : chunk * tiles).view({pp ? 0 : chunk, tiles});
  int* flag = err != nullptr ? reinterpret_cast<int*>(badbuf.data_ptr<uint8_t>() + flag_at)
                             : nullptr;
  for (int64_t s = 0; s < B; s += chunk) {
    const int64_t n = std::min(chunk, B - s);
    const at::Tensor xs = x.narrow(0, s, n);
    at::Tensor h = hbuf.narrow(0, 0, n), zs = z.narrow(0, 0, n);
    TcStore e;
    e.a = xs.data_ptr<float>();
    e.lda = D;
    e.M = n;
    e.w = &enc;
    e.bias = enc_b.data_ptr<float>();
    e.out = h.data_ptr<float>();
    e.ldo = H;
    e.relu = true;
    e.w_finite = true;  // enc_w (an x outside [0, 1], e.g. inf, makes its row NaN anyway)
    tc_store(e, opts, stream, "tc encoder kernel");  // small chunks: K split
    if (!latent || !latent_fused(h, p, eps.data_ptr<float>() + s * L,
                                 out[2].data_ptr<float>() + s, s == 0 ? flag : nullptr, false,
                                 false, stream)) {
      const at::Tensor ml = at::linear(h, ml_w, ml_b);
      reparam(ml.narrow(1, 0, L), ml.narrow(1, L, L), eps.data_ptr<float>() + s * L, zs,
              out[2].data_ptr<float>() + s, stream, s == 0 ? flag : nullptr);
      at::addmm_out(h, dec_b1, zs, dec_w1.t());  // d before its ReLU (the kernel applies it)
    }
    if (pp) {  // recon, elbo and kl's NaN rows written by the one launch
      fastelbo::PingpongParams q{};
      q.bias = dec_b2.data_ptr<float>();
      q.x = xs.data_ptr<float>();
      q.elbo = out[0].data_ptr<float>() + s;
      q.recon = out[1].data_ptr<float>() + s;
      q.kl = out[2].data_ptr<float>() + s;
      q.M = static_cast<int>(n);
      q.N = static_cast<int>(D);
      q.K = static_cast<int>(H);
      q.ldx = static_cast<int>(D);
      q.ldw = static_cast<int>(dec.t.size(2));
      q.sms = sms;
      check_launch(fastelbo::pingpong_launch(q, h.data_ptr<float>(), static_cast<int>(H),
                                             dec.t[0].data_ptr<float>(),
                                             dec.t[1].data_ptr<float>(), stream),
                   "pingpong output-layer kernel");
      continue;
    }
    fastelbo::TcGemmParams d{};
    d.bias = dec_b2.data_ptr<float>();
    d.x = xs.data_ptr<float>();
    d.ldx = static_cast<int>(D);
    d.partial = part.data_ptr<float>();
    d.partial_bad = bad.data_ptr<uint8_t>();
    d.M = static_cast<int>(n);
    d.N = static_cast<int>(D);
    d.K = static_cast<int>(H);
    d.mode = fastelbo::kTcBce;
    d.relu_a = 1;
    d.w_finite = 1;  // dec_w2
    d.any_bad = flag;
    check_launch(fastelbo::tc_gemm_launch(d, h.data_ptr<float>(), static_cast<int>(H),
                                          dec.t[0].data_ptr<float>(),
                                          dec.t[1].data_ptr<float>(), stream),
                 "tc decoder kernel");
    fastelbo::TcFinishParams f{part.data_ptr<float>(), bad.data_ptr<uint8_t>(),
                               out[0].data_ptr<float>() + s, out[1].data_ptr<float>() + s,
                               out[2].data_ptr<float>() + s, static_cast<int>(n), tiles};
    if (err != nullptr) {
      f.err = err;
      f.flag = flag;
      f.x = xs.data_ptr<float>();
      f.D = static_cast<int>(D);
      f.row0 = static_cast<int>(s);
      f.prior = s + n == B ? static_cast<int>(s) : 0;
    }
    check_launch(fastelbo::tc_bce_finish_launch(f, stream), "tc finish kernel");
  }
}

}  // namespace fastelbo::binding
