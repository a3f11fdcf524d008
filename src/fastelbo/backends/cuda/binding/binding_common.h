// What the binding files (binding_*.cpp) share: the input check's entry (passes), the macros
// for what is left to check after it (options, launches, internal invariants) and their
// messages, and the few helpers more than one entry point uses. Host code; sees torch (the
// kernels never do).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "binding.h"
#include "binding_check.h"
#include "../kernels/elbo.h"

// Check messages are built without iostreams: on the H200 image (torch 2.11, gcc 13.3) an
// extension exception whose message streamed a number killed the process, while one whose
// message was a single string raised as it should. So numbers, devices, dtypes and shapes are
// formatted here and TORCH_CHECK gets one std::string.
namespace fe_msg {
inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, const c10::Device& d) { s += d.str(); }  // no stream inside
inline void put(std::string& s, at::ScalarType t) { s += c10::toString(t); }
inline void put(std::string& s, at::IntArrayRef a) {
  s += "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  s += "]";
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void put(std::string& s, T v) { s += std::to_string(v); }
template <typename... A>
std::string join(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}
}  // namespace fe_msg

#define FE_CHECK(cond, ...) \
  TORCH_CHECK(cond, fe_msg::join("fastelbo cuda backend: ", __VA_ARGS__))
#define FE_CHECK_TENSOR(t, name, dev)                                                        \
  do {                                                                                       \
    FE_CHECK((t).defined(), name, " is undefined");                                          \
    FE_CHECK((t).is_cuda(), name, " must be a CUDA tensor, got one on ", (t).device());      \
    FE_CHECK((t).scalar_type() == at::kFloat, name, " must be float32, got ",               \
             (t).scalar_type());                                                             \
    FE_CHECK((t).is_contiguous(), name, " must be contiguous");                              \
    FE_CHECK((t).device() == (dev), name, " is on ", (t).device(), " but x is on ", (dev));  \
  } while (0)

namespace fastelbo::binding {

// This thread's last check by an entry, for last_status().
inline CheckStatus& last_check() {
  thread_local CheckStatus status;
  return status;
}

// The CheckCall of the VAE's own inputs: x, eps (absent: nullptr) and the ten parameters; an
// entry adds what else it takes.
inline CheckCall vae_call(const at::Tensor& x, const std::optional<at::Tensor>& eps,
                          const std::vector<at::Tensor>& params) {
  CheckCall call;
  call.x = &x;
  call.params = &params;
  call.eps = eps.has_value() ? &*eps : nullptr;
  return call;
}

// check_inputs, its answer kept for last_status(): whether the entry may go on.
inline bool passes(const CheckCall& call) { return (last_check() = check_inputs(call)).ok(); }

inline bool aligned16(const void* ptr) {
  return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0;
}

inline void check_launch(cudaError_t err, const char* what) {
  FE_CHECK(err == cudaSuccess, what, " launch failed: ", cudaGetErrorString(err));
}


// relu(a w^T + b) as F.relu(F.linear(...)): the GEMM, then an in-place ReLU that keeps NaN.
// (at::_addmm_activation would fuse the ReLU into cuBLASLt's epilogue, one pass fewer, but
// that epilogue's NaN rule is not documented: a NaN pre-activation, e.g. inf - inf once z
// overflows, must stay NaN as in the reference.)
inline at::Tensor relu_linear(const at::Tensor& a, const at::Tensor& w, const at::Tensor& b) {
  return at::linear(a, w, b).relu_();
}

// z = mu + exp(0.5 lv) eps into z, and kl into `kl` unless it is nullptr (rows.cu). mu and lv:
// rows of one stride (e.g. the two halves of one (n, 2L) GEMM's output), unit column stride.
// zero: set to 0 first where given (the deferred check's per-call flag, before its setters).
inline void reparam(const at::Tensor& mu, const at::Tensor& lv, const float* eps, at::Tensor& z,
                    float* kl, cudaStream_t stream, int* zero = nullptr) {
  FE_CHECK(mu.stride(1) == 1 && lv.stride(1) == 1 && mu.stride(0) == lv.stride(0),
           "reparam: mu and logvar need one row stride and unit column stride");
  fastelbo::ReparamParams rp{};
  rp.mu = mu.data_ptr<float>();
  rp.lv = lv.data_ptr<float>();
  rp.eps = eps;
  rp.z = z.data_ptr<float>();
  rp.kl = kl;
  rp.n = static_cast<int>(mu.size(0));
  rp.L = static_cast<int>(mu.size(1));
  rp.ld = static_cast<int>(mu.stride(0));
  rp.zero = zero;
  check_launch(fastelbo::reparam_launch(rp, stream), "reparam_kl kernel");
}

// The tensor-core GEMMs (binding_tc.cpp): whether they run here (an sm_90 GPU, input_dim and
// hidden_dim multiples of 4, x, enc_w and dec_w2 16-byte aligned), the rows path's forward on
// them, and what the backward's use of them needs (binding_backward.cpp).
bool tc_applies(const at::Tensor& x, const at::Tensor& enc_w, const at::Tensor& dec_w2);

// A GEMM's W operand in TF32 halves: (2, rows, ld) with ld % 4 == 0; cols (<= ld) is its K.
struct TcHalves {
  at::Tensor t;
  int64_t cols;
};
// Up to fastelbo::kTcSplitMax operands made in one launch (tc_split_t_launch): add() returns
// the (2 or 1, rows, ld) destination of `src` (2-D, unit column stride), transposed where
// `trans`, split into TF32 halves where `split` (else copied: a GEMM's A operand).
class TcSplits {
 public:
  TcHalves add(const at::Tensor& src, bool trans, bool split);
  // The row-wise concatenation of `srcs` (2-D, one column count, unit column stride), copied
  // (not split) into one (1, rows, ld) destination: at::cat inside this launch.
  TcHalves add_rows(std::initializer_list<at::Tensor> srcs);
  void launch(cudaStream_t stream);

 private:
  // One job: src (as it is; transposed where `trans`) into hi / lo (nullptr: a copy), row
  // stride ld.
  void job(const at::Tensor& src, float* hi, float* lo, int64_t ld, bool trans);
  fastelbo::TcSplitParams p_{};
};
// out (M, N; row stride ldo) = a (M, K; row stride lda) x w^T as kTcStore computes it: + bias
// (nullptr: none), relu where `relu`, zero where mask (row stride ldm) <= 0. K is split across
// blocks where that fills the GPU (workspace from the caching allocator).
struct TcStore {
  const float* a = nullptr;
  int64_t lda = 0, M = 0;  // K = w->cols
  const TcHalves* w = nullptr;  // N = w->t.size(1)
  const float* bias = nullptr;
  float* out = nullptr;
  int64_t ldo = 0;
  bool relu = false;
  const float* mask = nullptr;
  int64_t ldm = 0;
  bool w_finite = false;  // w holds weights (finite): A's cheaper split (TcGemmParams::w_finite)
};
void tc_store(const TcStore& s, const at::TensorOptions& opts, cudaStream_t stream,
              const char* what);
// err != nullptr: the deferred check (elbo.h TcFinishParams); latent: the latent block fused;
// pingpong: the output layer on pingpong.cu's kernel where it fits (err == nullptr, hidden_dim
// <= kPingpongMaxK), else tc_gemm.cu's.
void tc_rows_forward(const at::Tensor& x, const at::Tensor& eps, const VaeTensors& p,
                     std::vector<at::Tensor>& out, cudaStream_t stream,
                     fastelbo::DeferredRecord* err, bool latent, bool pingpong = false);
// Whether the tc path's output layer may run on pingpong.cu's kernel for these dims.
bool pingpong_applies(int64_t D, int64_t H);

// The backward on the fused engine (binding_backward_fused.cpp): elbo_backward's gradients into
// `out` (allocated there: zeroed where a branch leaves them unwritten), given prep's branch
// rule (rec: a gradient reaches recon or elbo; kl: kl or elbo). False, with nothing launched,
// where its latent kernel does not fit (the caller runs the tc engine).
struct FusedCall {
  const at::Tensor* x;
  const at::Tensor* eps;
  const at::Tensor* g_elbo;  // each (B,) or nullptr: no gradient reaches that output
  const at::Tensor* g_recon;
  const at::Tensor* g_kl;
  bool need_x, need_eps;
};
bool fused_backward(const FusedCall& c, const VaeTensors& p, std::vector<at::Tensor>& out,
                    cudaStream_t stream);

// The latent block fused (latent.cu) over the rows of h (2-D, unit column stride): d = the
// decoder's hidden layer (relu'd where relu) written over h, kl from eps's rows; zero as
// reparam's. False, with nothing launched, where it does not fit (the caller runs the unfused
// path; at the reference dims it always fits), unless `required` (then an error).
bool latent_fused(const at::Tensor& h, const VaeTensors& p, const float* eps, float* kl,
                  int* zero, bool relu, bool required, cudaStream_t stream);

}  // namespace fastelbo::binding
