// The forward's torch-facing half: checks, path and launch plan, the launch on PyTorch's current
// stream (every status / CUDA error becomes an exception; the .cu host functions are noexcept
// and return codes), plus the two things a forward waits on or draws: the value check on x and
// torch.randn's noise. Declared in binding.h; elbo.cu and elbo_fast.cu never see torch.
//
// Which path (elbo.h, elbo_fast.cu, elbo.cu):
//   cluster (B <= kClusterMaxBatch, any dims): one launch of the general cluster kernel.
//   fast (kClusterMaxBatch < B <= kFastMaxBatch, dims multiples of 4): one launch of the fast
//     cluster kernel (elbo_fast.cu); where it does not apply, the general one up to
//     kClusterFallbackMax.
//   rows (larger B, or dims the cluster kernel cannot hold in shared memory): cuBLAS for every
//     GEMM (at::linear, the call eager F.linear makes, so TF32 only where
//     torch.backends.cuda.matmul.allow_tf32 says so; in-place ReLU after the two hidden
//     layers), reparam_kl_kernel and bce_kernel (rows.cu). Eager runs the same GEMMs plus ~15
//     elementwise passes over (B, D) tensors.
//   tc (auto wherever the rows path would run and tc_applies; binding_tc.cpp): the rows path
//     with its encoder and output-layer GEMMs on tensor cores (tc_gemm.cu), the logits never in
//     memory.
// All paths only launch on the current stream and allocate through the caching allocator:
// CUDA-graph capturable.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <optional>
#include <vector>

#include "binding.h"
#include "binding_common.h"
#include "../kernels/elbo.h"

namespace fastelbo::binding {
namespace {

// Crossovers between the paths, from `benchmarks/experiments/cuda_bench.py --paths` on an H200
// (2026-11-29, graph replays of 100 forwards, us per forward, fixed eps):
//   B       1     16     64    128    192    256    384    512
//   cluster 13.5  15.7   22.0   30.1   69.2   80.4  135    172
//   fast    23.0  23.0   23.0   23.1   45.0   45.1   67.2   90.3
//   rows    24.6  32.4   77.6   79.7   91.8   76.6   78.2   69.5
// The general cluster kernel's time grows with its rows per cluster (~13 us + 0.13 us/row);
// the fast one is flat up to 140 rows (one wave of 7 clusters of 16 blocks on an H200), then
// grows a wave at a time; the rows path runs cuBLAS-rate GEMMs.
constexpr int64_t kClusterMaxBatch = 80;   // general cluster kernel up to here
constexpr int64_t kFastMaxBatch = 384;     // then the fast kernel (where it applies) up to here
constexpr int64_t kClusterFallbackMax = 192;  // where it does not: the general one up to here
// Rows per chunk of the rows path: intermediates h, d (chunk x H) and logits (chunk x D) are
// 65536 * (256 + 256 + 784) * 4 B = 340 MB at the reference dims, vs ~490 MB eager allocates at
// B=65536. Chunks of 8192 rows (42 MB) made cuBLAS pick smaller tiles: +37% GEMM time at
// B=65536 on an H200 (an nsys profile), which made the path slower than eager.
constexpr int64_t kRowsChunk = 65536;
// Wherever `auto` runs the rows path it takes its tensor-core variant (binding_tc.cpp) where that
// applies (cuda_bench.py --paths, H200, 2026-12-02, us per forward: rows 79.8 / 69.5 / 68.3 /
// 149.6 / 1561 vs tc 56.5 / 57.3 / 50.3 / 81.7 / 820 at B = 128 / 512 / 1024 / 4096 / 65536).

// The tensors and dims of one forward into either cluster kernel's params (checked by the caller).
void fill_forward(fastelbo::ForwardArgs& a, const at::Tensor& x, const at::Tensor& eps,
                  const VaeTensors& p, std::vector<at::Tensor>& out) {
  a.x = x.data_ptr<float>();
  a.eps = eps.data_ptr<float>();
  a.w1 = p.enc_w.data_ptr<float>();
  a.b1 = p.enc_b.data_ptr<float>();
  a.wmu = p.mu_w.data_ptr<float>();
  a.bmu = p.mu_b.data_ptr<float>();
  a.wlv = p.lv_w.data_ptr<float>();
  a.blv = p.lv_b.data_ptr<float>();
  a.wd1 = p.dec_w1.data_ptr<float>();
  a.bd1 = p.dec_b1.data_ptr<float>();
  a.wd2 = p.dec_w2.data_ptr<float>();
  a.bd2 = p.dec_b2.data_ptr<float>();
  a.elbo = out[0].data_ptr<float>();
  a.recon = out[1].data_ptr<float>();
  a.kl = out[2].data_ptr<float>();
  a.B = static_cast<int>(x.size(0));
  a.D = static_cast<int>(x.size(1));
  a.H = static_cast<int>(p.enc_w.size(0));
  a.L = static_cast<int>(p.mu_w.size(0));
}

// The rows path (see the file comment); outputs already allocated. err != nullptr: the deferred
// check (bce_kernel notes and flags bad rows, then one poison launch NaNs the call if any).
void rows_forward(const at::Tensor& x, const at::Tensor& eps, const VaeTensors& p,
                  std::vector<at::Tensor>& out, cudaStream_t stream,
                  fastelbo::DeferredRecord* err, bool latent) {
  const int64_t B = x.size(0), D = x.size(1), L = p.mu_w.size(0);
  const int64_t chunk = std::min(B, kRowsChunk);
  // z, and after it the deferred check's call flag (zeroed by the first chunk's reparam_kl).
  at::Tensor zbuf = at::empty({chunk * L + 1}, x.options());
  at::Tensor z = zbuf.narrow(0, 0, chunk * L).view({chunk, L});
  int* flag = err != nullptr ? reinterpret_cast<int*>(zbuf.data_ptr<float>() + chunk * L)
                             : nullptr;
  for (int64_t s = 0; s < B; s += chunk) {
    const int64_t n = std::min(chunk, B - s);
    const at::Tensor xs = x.narrow(0, s, n);
    at::Tensor h = relu_linear(xs, p.enc_w, p.enc_b);
    at::Tensor d = h;  // the fused latent block writes d over h
    if (!latent || !latent_fused(h, p, eps.data_ptr<float>() + s * L,
                                 out[2].data_ptr<float>() + s, s == 0 ? flag : nullptr, true,
                                 false, stream)) {
      const at::Tensor mu = at::linear(h, p.mu_w, p.mu_b), lv = at::linear(h, p.lv_w, p.lv_b);
      at::Tensor zs = z.narrow(0, 0, n);
      reparam(mu, lv, eps.data_ptr<float>() + s * L, zs, out[2].data_ptr<float>() + s, stream,
              s == 0 ? flag : nullptr);
      d = relu_linear(zs, p.dec_w1, p.dec_b1);
    }
    const at::Tensor logits = at::linear(d, p.dec_w2, p.dec_b2);
    FE_CHECK(logits.is_contiguous(), "unexpected decoder output");
    fastelbo::BceParams bp{};
    bp.logits = logits.data_ptr<float>();
    bp.x = xs.data_ptr<float>();
    bp.elbo = out[0].data_ptr<float>() + s;
    bp.recon = out[1].data_ptr<float>() + s;
    bp.kl = out[2].data_ptr<float>() + s;
    bp.n = static_cast<int>(n);
    bp.D = static_cast<int>(D);
    bp.vec = (D % 4 == 0 && aligned16(bp.logits) && aligned16(bp.x)) ? 1 : 0;
    bp.err = err;
    bp.flag = flag;
    bp.row0 = static_cast<int>(s);
    check_launch(fastelbo::bce_launch(bp, stream), "bce kernel");
  }
  if (err != nullptr)
    check_launch(fastelbo::deferred_poison_launch(flag, out[0].data_ptr<float>(),
                                                  out[1].data_ptr<float>(),
                                                  out[2].data_ptr<float>(),
                                                  static_cast<int>(B), stream),
                 "deferred poison kernel");
}

// FASTELBO_PINGPONG=1: `auto` runs the tc path's output layer on pingpong.cu where it applies.
bool pingpong_by_env() {
  static const bool on = [] {
    const char* v = std::getenv("FASTELBO_PINGPONG");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

// FASTELBO_FUSED_LATENT=1: `auto` fuses the latent block (latent.cu) where it applies.
bool latent_by_env() {
  static const bool on = [] {
    const char* v = std::getenv("FASTELBO_FUSED_LATENT");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

// The ops' value check on x (every element in [0, 1], NaN not; fastelbo.contract) in two steps, so
// that the host can prepare the forward while the check runs: range_check_start launches
// rows.cu's flag kernel (a flag per block) writing straight into mapped pinned memory and
// records an event; range_check_finish waits for that event and reads the flags. The flags
// and the event belong to the calling thread and device (one check in flight per pair; a start
// first waits out an unfinished one, so an abandoned check never races the next), allocated on
// first use and kept: no allocation, copy or launch besides the kernel per check.
struct RangeSlot {
  int* flags = nullptr;       // mapped pinned host memory, fastelbo::kRangeFlagsMax ints
  int* device_flags = nullptr;  // the same memory as the device sees it
  cudaEvent_t done = nullptr;   // recorded after the kernel
  int blocks = 0;               // > 0 while a check is in flight
};

struct RangeSlots {
  std::vector<RangeSlot> by_device;
  ~RangeSlots() {  // at thread exit; errors ignored (the context may already be gone)
    for (RangeSlot& s : by_device) {
      if (s.done != nullptr) (void)cudaEventDestroy(s.done);
      if (s.flags != nullptr) (void)cudaFreeHost(s.flags);
    }
    (void)cudaGetLastError();
  }
};

RangeSlot& range_slot(c10::DeviceIndex dev) {
  thread_local RangeSlots slots;
  if (slots.by_device.size() <= static_cast<size_t>(dev)) slots.by_device.resize(dev + 1);
  RangeSlot& s = slots.by_device[dev];
  if (s.flags == nullptr) {  // under the caller's device guard: the event is this device's
    void* host = nullptr;
    cudaError_t err = cudaHostAlloc(&host, sizeof(int) * fastelbo::kRangeFlagsMax,
                                    cudaHostAllocMapped | cudaHostAllocPortable);
    void* mapped = nullptr;
    if (err == cudaSuccess) err = cudaHostGetDevicePointer(&mapped, host, 0);
    cudaEvent_t ev = nullptr;
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      if (host != nullptr) (void)cudaFreeHost(host);
      (void)cudaGetLastError();
      FE_CHECK(false, "allocating the value check's flags failed: ", cudaGetErrorString(err));
    }
    s.flags = static_cast<int*>(host);
    s.device_flags = static_cast<int*>(mapped);
    s.done = ev;
  }
  return s;
}

// Wait for the slot's check in flight; whether every flag it wrote is 0.
bool range_slot_wait(RangeSlot& s) {
  const int blocks = s.blocks;
  s.blocks = 0;
  const cudaError_t err = cudaEventSynchronize(s.done);
  FE_CHECK(err == cudaSuccess, "waiting for the value check failed: ", cudaGetErrorString(err));
  return std::none_of(s.flags, s.flags + blocks, [](int f) { return f != 0; });
}

// Programmatic dependent launch of the two cluster kernels (elbo.h ForwardArgs::pdl: ~0.9 us
// per forward off back-to-back forwards on an H200), on unless FASTELBO_PDL=0. A kernel reads
// weights and biases before griddepcontrol.wait, so a launch may overlap its predecessor on
// the stream only if that kernel cannot have written them. Only these kernels trigger early
// (any other kernel completes before a dependent starts), each does so only once its own
// predecessor has completed (so no grid older than the previous one still runs), and each
// writes its outputs and eps_out alone: the last such launch's output ranges are kept per
// stream, and a launch whose weights overlap them (or on a stream without a record) goes
// without PDL.
bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("FASTELBO_PDL");
    return v == nullptr || v[0] != '0';
  }();
  return on;
}

struct Span {
  uintptr_t lo, hi;  // [lo, hi) bytes
};

Span span_of(const float* p, long long n) {
  const auto lo = reinterpret_cast<uintptr_t>(p);
  return {lo, lo + static_cast<uintptr_t>(n) * sizeof(float)};
}

struct LaunchOutputs {
  cudaStream_t stream;
  Span out[4];  // elbo, recon, kl, eps_out (empty without an in-kernel draw)
};

std::atomic<long long> g_pdl_launches{0};  // cluster-kernel launches made with PDL (tests)

// Whether this cluster-kernel launch may be a programmatic dependent; records its outputs for
// the next.
bool pdl_launch_allowed(cudaStream_t stream, const fastelbo::ForwardArgs& f) {
  if (!pdl_enabled()) return false;
  const long long B = f.B, D = f.D, H = f.H, L = f.L;
  const Span reads[] = {span_of(f.w1, H * D), span_of(f.b1, H), span_of(f.wmu, L * H),
                        span_of(f.bmu, L), span_of(f.wlv, L * H), span_of(f.blv, L),
                        span_of(f.wd1, H * L), span_of(f.bd1, H), span_of(f.wd2, D * H),
                        span_of(f.bd2, D)};
  const LaunchOutputs now{stream, {span_of(f.elbo, B), span_of(f.recon, B), span_of(f.kl, B),
                                    f.draw ? span_of(f.eps_out, B * L) : Span{0, 0}}};
  static std::mutex mutex;
  static std::vector<LaunchOutputs> last;  // one entry per stream, the most recent first
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = std::find_if(last.begin(), last.end(),
                         [&](const LaunchOutputs& o) { return o.stream == stream; });
  bool allowed = it != last.end();
  if (allowed)
    for (const Span& w : it->out)
      for (const Span& r : reads)
        if (w.lo < w.hi && r.lo < w.hi && w.lo < r.hi) allowed = false;
  if (it != last.end()) last.erase(it);
  last.insert(last.begin(), now);
  if (last.size() > 16) last.pop_back();  // a stream forgotten launches once without PDL
  if (allowed) ++g_pdl_launches;
  return allowed;
}

// Whether torch.randn(n) (float32, contiguous) is one launch of normal_'s kernel, which is what
// reserve_randn and philox.cuh reproduce: TensorIterator's can_use_32bit_indexing (element
// count, and the largest byte offset 4 (n - 1) + 1, within int32); beyond it PyTorch splits the
// draw into sub-iterators with counters of their own, and the kernels leave the draw to it.
bool randn_in_one_launch(int64_t n) { return n >= 1 && n <= (int64_t{1} << 29); }

// Reserves one torch.randn(n) float32 draw from the device's default CUDA generator, as
// PyTorch's normal_ does (ATen/native/cuda/DistributionTemplates.h: calc_execution_policy with
// curand_normal4's 4 outputs per call, then philox_cuda_state under the generator's mutex),
// and returns what a kernel needs to reproduce it (philox.cuh). Graph capture: the generator
// hands out device pointers and an intra-graph offset, as it does to PyTorch's own kernels.
fastelbo::TorchRandn reserve_randn(int64_t n, c10::DeviceIndex device) {
  // The two device properties PyTorch reads (attribute queries: no cudaGetDeviceProperties).
  int sms = 0, threads_per_sm = 0;
  FE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
               cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor,
                                      device) == cudaSuccess,
           "reading device ", static_cast<int>(device), "'s attributes failed");
  constexpr int64_t kBlock = 256, kUnroll = 4;
  const int64_t grid = std::min<int64_t>((n + kBlock - 1) / kBlock,
                                         static_cast<int64_t>(sms) * (threads_per_sm / kBlock));
  const uint64_t increment = static_cast<uint64_t>((n - 1) / (kBlock * grid * kUnroll) + 1) * 4;
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device);
  at::PhiloxCudaState st;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    st = at::check_generator<at::CUDAGeneratorImpl>(gen)->philox_cuda_state(increment);
  }
  fastelbo::TorchRandn r{};
  r.captured = st.captured_ ? 1 : 0;
  if (st.captured_) {
    r.seed_ptr = reinterpret_cast<const long long*>(st.seed_.ptr);
    r.offset_ptr = reinterpret_cast<const long long*>(st.offset_.ptr);
    r.offset_intragraph = static_cast<unsigned long long>(st.offset_intragraph_);
  } else {
    r.seed = st.seed_.val;
    r.offset = st.offset_.val;
  }
  r.threads = static_cast<unsigned long long>(kBlock * grid);
  return r;
}

// The forward's noise for a cluster kernel: drawn inside it (draw, rng, eps_out) where one
// normal_ launch would draw it (randn_in_one_launch), else by normal_ into eps before it.
void set_draw(fastelbo::ForwardArgs& a, const at::Tensor& eps, int64_t n,
              c10::DeviceIndex device) {
  if (randn_in_one_launch(n)) {
    a.draw = 1;
    a.rng = reserve_randn(n, device);
    a.eps_out = eps.data_ptr<float>();
  } else {
    eps.normal_(0.0, 1.0);
  }
}

// The deferred check on the host: each device's record address (elbo.h DeferredRecord, looked
// up once), and whether take_deferred must wait for the device: 0 no deferred forward since the
// last take, 1 some, 2 one was captured into a CUDA graph (whose replays launch nothing here:
// every take waits from then on).
constexpr int kMaxDevices = 64;
std::atomic<fastelbo::DeferredRecord*> g_records[kMaxDevices];
std::atomic<int> g_armed[kMaxDevices];

// This device's record for a forward's kernels, the device armed (under the caller's guard).
fastelbo::DeferredRecord* deferred_arm(c10::DeviceIndex dev, cudaStream_t stream) {
  FE_CHECK(dev >= 0 && dev < kMaxDevices, "the deferred check takes devices 0..",
           kMaxDevices - 1, ", got ", static_cast<int>(dev));
  fastelbo::DeferredRecord* rec = g_records[dev].load();
  if (rec == nullptr) {
    const cudaError_t e = fastelbo::deferred_record(&rec);
    FE_CHECK(e == cudaSuccess && rec != nullptr, "finding the deferred check's record failed: ",
             cudaGetErrorString(e));
    g_records[dev].store(rec);
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const bool captured = cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
                        capture != cudaStreamCaptureStatusNone;  // unknown: as if captured
  (void)cudaGetLastError();
  if (captured) g_armed[dev].store(2);
  else {
    int expected = 0;
    g_armed[dev].compare_exchange_strong(expected, 1);
  }
  return rec;
}

}  // namespace

bool latent_fused(const at::Tensor& h, const VaeTensors& p, const float* eps, float* kl,
                  int* zero, bool relu, bool required, cudaStream_t stream) {
  FE_CHECK(h.dim() == 2 && h.stride(1) == 1, "latent block: h must be 2-D, unit column stride");
  fastelbo::LatentParams lp{};
  lp.h = h.data_ptr<float>();
  lp.wmu = p.mu_w.data_ptr<float>();
  lp.bmu = p.mu_b.data_ptr<float>();
  lp.wlv = p.lv_w.data_ptr<float>();
  lp.blv = p.lv_b.data_ptr<float>();
  lp.eps = eps;
  lp.wd1 = p.dec_w1.data_ptr<float>();
  lp.bd1 = p.dec_b1.data_ptr<float>();
  lp.d = h.data_ptr<float>();
  lp.kl = kl;
  lp.zero = zero;
  lp.n = static_cast<int>(h.size(0));
  lp.H = static_cast<int>(h.size(1));
  lp.L = static_cast<int>(p.mu_w.size(0));
  lp.ldh = static_cast<int>(h.stride(0));
  lp.relu = relu ? 1 : 0;
  cudaError_t err = cudaSuccess;
  const fastelbo::ElboStatus st = fastelbo::latent_plan(lp, h.device().index(), &err);
  FE_CHECK(st != fastelbo::kElboCudaError, "planning the latent block failed: ",
           cudaGetErrorString(err));
  if (st != fastelbo::kElboOk) {
    FE_CHECK(!required, "latent=fused: hidden_dim=", lp.H, " does not fit the fused latent "
             "block's shared memory; use latent='auto'");
    return false;
  }
  check_launch(fastelbo::latent_launch(lp, stream), "latent kernel");
  return true;
}

std::vector<int64_t> take_deferred(int64_t device) {
  FE_CHECK(device >= 0 && device < kMaxDevices, "device must be in 0..", kMaxDevices - 1,
           ", got ", device);
  int armed = 1;  // 1 -> 0 before the wait: a forward launched meanwhile arms it again
  if (!g_armed[device].compare_exchange_strong(armed, 0) && armed == 0) return {0, 0, 0, 0};
  const auto dev = static_cast<c10::DeviceIndex>(device);
  const c10::cuda::CUDAGuard guard(dev);
  cudaError_t e = cudaDeviceSynchronize();
  FE_CHECK(e == cudaSuccess, "waiting for the device before reading the deferred check failed: ",
           cudaGetErrorString(e));
  fastelbo::DeferredRecord r{};
  e = fastelbo::deferred_take(&r, c10::cuda::getCurrentCUDAStream(dev).stream());
  FE_CHECK(e == cudaSuccess, "reading the deferred check's record failed: ",
           cudaGetErrorString(e));
  if (r.count == 0) return {0, 0, 0, 0};
  const uint64_t pos = ~r.first.key;  // row << 32 | col
  return {static_cast<int64_t>(r.count), static_cast<int64_t>(pos >> 32),
          static_cast<int64_t>(pos & 0xffffffffu), static_cast<int64_t>(r.first.value)};
}

void range_check_start(const at::Tensor& x) {
  FE_CHECK_TENSOR(x, "x", x.device());
  const int64_t n = x.numel();
  FE_CHECK(n > 0, "x is empty");
  const c10::cuda::CUDAGuard guard(x.device());
  RangeSlot& s = range_slot(x.device().index());
  if (s.blocks > 0) (void)range_slot_wait(s);  // abandoned: its kernel must not outlive it
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  check_launch(fastelbo::range_flags_launch(x.data_ptr<float>(), n, s.device_flags, stream),
               "range check kernel");
  const cudaError_t err = cudaEventRecord(s.done, stream);
  FE_CHECK(err == cudaSuccess, "recording the value check failed: ", cudaGetErrorString(err));
  s.blocks = fastelbo::range_flags_blocks(n);
}

// Whether the check range_check_start began on `device` (this thread) found every value of x
// in [0, 1]; waits for it.
bool range_check_finish(int64_t device) {
  const auto dev = static_cast<c10::DeviceIndex>(device);
  const c10::cuda::CUDAGuard guard(dev);
  RangeSlot& s = range_slot(dev);
  FE_CHECK(s.blocks > 0, "no value check in flight on this device for this thread");
  return range_slot_wait(s);
}

// The ops' input checks for the common case, in one call that never throws: check_inputs on
// x, eps (None: drawn by the op) and the parameters; 1 = it passed and the value check on x is
// in flight (range_check_start); 0 = it passed and no value check runs (validate false, or the
// current stream is capturing a graph); < 0 = a rule is broken (the packed status: a dtype,
// layout, device or shape this backend does not take), or kCheckStream: the caller runs the
// contract's checks, which raise its error or send the call elsewhere.
int64_t checked_start(const at::Tensor& x, const std::optional<at::Tensor>& eps,
                      const std::vector<at::Tensor>& params, bool validate) {
  CheckCall call = vae_call(x, eps, params);
  call.eps_required = false;
  if (!passes(call)) return last_check().packed();
  if (!validate) return 0;
  const auto dev = x.device();
  const c10::cuda::CUDAGuard guard(dev);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return CheckStatus{kCheckStream, kFieldX}.packed();  // the caller's own checks decide
  }
  if (capture != cudaStreamCaptureStatusNone) return 0;  // as start_checks: no sync in a capture
  range_check_start(x);
  return 1;
}

int64_t checked_start_deferred(const at::Tensor& x, const std::optional<at::Tensor>& eps,
                               const std::vector<at::Tensor>& params) {
  CheckCall call = vae_call(x, eps, params);
  call.eps_required = false;
  if (!passes(call)) return last_check().packed();
  const auto dev = x.device();
  const c10::cuda::CUDAGuard guard(dev);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return CheckStatus{kCheckStream, kFieldX}.packed();  // the caller's own checks decide
  }
  return capture != cudaStreamCaptureStatusNone ? 3 : 2;
}

int64_t last_status() { return last_check().packed(); }

// Returns {elbo, recon, kl}, each (B,) float32, or [] with nothing launched where
// check_inputs finds a rule broken (last_status says which). opt.path: auto, cluster, rows or
// fast (elbo_fast.cu; see the crossovers above for what auto takes). opt.rows / opt.cluster > 0
// and opt.staged >= 0 force the cluster plan (tuning; -1 / 0 = automatic) and imply the cluster
// path; opt.poison fills the outputs with NaN before the launch (tests: every element is
// written). opt.draw: eps's contents are not read but overwritten with one torch.randn(B, L)
// draw from the default CUDA generator (the same numbers and the same generator advance as that
// call): drawn inside the cluster kernels where they run (no separate launch), else by
// at::normal_ first (the rows path).
// opt.awaits: this thread's value check on x (range_check_start) is still in flight; it is
// waited for once the launch is prepared, just before anything is drawn or launched, and if it
// failed nothing is, and [] comes back with last_status kCheckValue (the caller raises the
// value error).
std::vector<at::Tensor> elbo_forward(const at::Tensor& x, const std::optional<at::Tensor>& eps_in,
                                     const std::vector<at::Tensor>& params,
                                     const ForwardOptions& opt) {
  const CheckCall call = vae_call(x, eps_in, params);
  if (!passes(call)) return {};
  const at::Tensor& eps = *eps_in;
  const VaeTensors p(params);
  const int64_t rows = opt.rows, cluster = opt.cluster, staged = opt.staged;
  const bool poison = opt.poison, draw = opt.draw, await_check = opt.awaits;
  const bool deferred = opt.deferred;
  int64_t path = opt.path;
  const auto dev = x.device();
  const int64_t B = x.size(0), D = x.size(1), H = p.enc_w.size(0), L = p.mu_w.size(0);
  // A value check in flight that failed: nothing drawn or launched, [] back.
  const auto value_check_failed = [&] {
    if (!await_check || range_check_finish(dev.index())) return false;
    last_check() = {kCheckValue, kFieldX};
    return true;
  };
  // The options (elbo.py checks them first: these are a second line).
  FE_CHECK(rows >= 0 && rows <= 64, "rows must be 0 (auto) or 1..64, got ", rows);
  FE_CHECK(cluster >= 0 && cluster <= 16, "cluster must be 0 (auto) or 1..16, got ", cluster);
  FE_CHECK(staged >= -1 && staged <= 1, "staged must be -1 (auto), 0 or 1, got ", staged);
  FE_CHECK(path >= kPathAuto && path <= kPathTc,
           "path must be 0 (auto), 1 (cluster), 2 (rows), 3 (fast) or 4 (tc), got ", path);
  const bool forced_plan = rows > 0 || cluster > 0 || staged >= 0;
  FE_CHECK(!(forced_plan && (path == kPathRows || path == kPathFast || path == kPathTc)),
           "rows / cluster / staged force the cluster path; they conflict with path=rows/fast/tc");
  FE_CHECK(path != kPathTc || tc_applies(x, p.enc_w, p.dec_w2),
           "path=tc does not apply here; fastelbo.backends.cuda checks this before the call");
  FE_CHECK(!(deferred && await_check), "deferred and awaits exclude each other");
  FE_CHECK(opt.latent >= kLatentAuto && opt.latent <= kLatentCublas,
           "latent must be 0 (auto), 1 (fused) or 2 (cublas), got ", opt.latent);
  const bool latent = opt.latent == kLatentFused || (opt.latent == kLatentAuto && latent_by_env());
  FE_CHECK(opt.output >= kOutputAuto && opt.output <= kOutputTc,
           "output must be 0 (auto), 1 (pingpong) or 2 (tc), got ", opt.output);
  FE_CHECK(opt.output != kOutputPingpong || (!deferred && (path == kPathAuto || path == kPathTc) &&
                                             pingpong_applies(D, H)),
           "output=pingpong needs the tc path (path auto or tc), no deferred check and "
           "hidden_dim <= ", fastelbo::kPingpongMaxK, "; fastelbo.backends.cuda checks this "
           "before the call");
  const bool pingpong = !deferred && (opt.output == kOutputPingpong ||
                                      (opt.output == kOutputAuto && pingpong_by_env()));
  if (forced_plan) path = kPathCluster;

  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  fastelbo::DeferredRecord* const record =
      deferred ? deferred_arm(dev.index(), stream) : nullptr;
  const auto opts = x.options();
  std::vector<at::Tensor> out;
  for (int i = 0; i < 3; ++i)
    out.push_back(poison ? at::full({B}, std::nanf(""), opts) : at::empty({B}, opts));
  const bool auto_fast = path == kPathAuto && B > kClusterMaxBatch && B <= kFastMaxBatch;
  if (auto_fast || path == kPathFast) {
    fastelbo::FastParams f{};
    fill_forward(f, x, eps, p, out);
    f.err = record;
    cudaError_t ferr = cudaSuccess;
    const auto fst = fastelbo::elbo_fast_plan(f, dev.index(), 0, false, &ferr);
    FE_CHECK(fst != fastelbo::kElboCudaError, "planning the fast launch failed: ",
             cudaGetErrorString(ferr));
    if (fst == fastelbo::kElboOk) {
      if (value_check_failed()) return {};
      if (draw) set_draw(f, eps, B * L, dev.index());
      f.pdl = pdl_launch_allowed(stream, f) ? 1 : 0;
      check_launch(fastelbo::elbo_fast_launch(f, stream), "fast cluster kernel");
      return out;
    }
    FE_CHECK(path == kPathAuto, "path=fast does not apply here (status ", static_cast<int>(fst),
             "); fastelbo.backends.cuda checks this before the call");
  }
  // The rows path: the draw (at::normal_) first, then cuBLAS and rows.cu's kernels, or its
  // tensor-core variant (path tc, or auto where it applies).
  const auto run_rows = [&]() -> std::vector<at::Tensor> {
    if (value_check_failed()) return {};
    if (draw) eps.normal_(0.0, 1.0);  // the default generator of eps's device, as torch.randn
    const bool tc = path == kPathTc || (path == kPathAuto && tc_applies(x, p.enc_w, p.dec_w2));
    FE_CHECK(tc || opt.output != kOutputPingpong, "output=pingpong: the tc path does not apply "
             "here; fastelbo.backends.cuda checks this before the call");
    if (tc)
      tc_rows_forward(x, eps, p, out, stream, record, latent, pingpong);
    else
      rows_forward(x, eps, p, out, stream, record, latent);
    return out;
  };
  const int64_t cluster_max = auto_fast ? kClusterFallbackMax : kClusterMaxBatch;
  if (path == kPathRows || path == kPathTc || (path == kPathAuto && B > cluster_max))
    return run_rows();

  fastelbo::ElboParams k{};
  fill_forward(k, x, eps, p, out);
  k.err = record;
  k.vec = ((D % 4 == 0 && aligned16(k.x) && aligned16(k.w1)) ? 1u : 0u) |
          ((H % 4 == 0 && aligned16(k.wmu) && aligned16(k.wlv)) ? 2u : 0u) |
          ((L % 4 == 0 && aligned16(k.wd1)) ? 4u : 0u) |
          ((H % 4 == 0 && aligned16(k.wd2)) ? 8u : 0u);

  cudaError_t err = cudaSuccess;
  const fastelbo::ElboStatus st =
      fastelbo::elbo_plan(k, dev.index(), static_cast<int>(rows), static_cast<int>(cluster),
                          static_cast<int>(staged), &err);
  if (path == kPathAuto && (st == fastelbo::kElboTooLarge || st == fastelbo::kElboNoCluster))
    return run_rows();  // the general path: dims whose activations do not fit a block
  FE_CHECK(st != fastelbo::kElboBadArch,
           "needs compute capability 9.0+ (thread-block clusters); use backend='torch' or "
           "backend='triton'");
  FE_CHECK(st != fastelbo::kElboTooLarge, "input_dim=", D, " hidden_dim=", H, " latent_dim=", L,
           " need ", fastelbo::elbo_smem_bytes(k.D, k.H, k.L, 1, 16, false),
           " bytes of shared memory per block even at one row per cluster, more than this GPU "
           "allows; use path='rows' (automatic), backend='torch' or backend='triton'");
  FE_CHECK(st != fastelbo::kElboNoCluster,
           "no thread-block cluster size fits on this GPU for these dims (rows=", rows,
           ", cluster=", cluster, "); use backend='torch' or backend='triton'");
  FE_CHECK(st == fastelbo::kElboOk, "planning the launch failed: ", cudaGetErrorString(err));

  if (value_check_failed()) return {};
  if (draw) set_draw(k, eps, B * L, dev.index());
  k.pdl = pdl_launch_allowed(stream, k) ? 1 : 0;
  err = fastelbo::elbo_launch(k, stream);
  FE_CHECK(err == cudaSuccess, "kernel launch failed (R=", k.R, ", C=", k.C, ", smem=",
           k.smem_bytes, " B, staged=", k.staged, "): ", cudaGetErrorString(err));
  return out;
}

// The launch plan the kernel would use: {R, C, smem_bytes, variant, staged}, or
// {-status, 0, 0, 0, 0} when there is none; for tests and benchmarks.
std::vector<int64_t> elbo_plan_info(int64_t device, int64_t B, int64_t D, int64_t H, int64_t L,
                                    int64_t rows, int64_t cluster, int64_t staged) {
  fastelbo::ElboParams p{};
  p.B = static_cast<int>(B);
  p.D = static_cast<int>(D);
  p.H = static_cast<int>(H);
  p.L = static_cast<int>(L);
  cudaError_t err = cudaSuccess;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const auto st = fastelbo::elbo_plan(p, static_cast<int>(device), static_cast<int>(rows),
                                      static_cast<int>(cluster), static_cast<int>(staged), &err);
  if (st != fastelbo::kElboOk) return {-static_cast<int64_t>(st), 0, 0, 0, 0};
  return {p.R, p.C, p.smem_bytes, p.variant, p.staged};
}

// The fast path's plan: {R, C, smem_bytes, 0} or {0, 0, 0, status} when it does not apply
// (one_wave: only if every cluster is co-resident at once); for tests, benchmarks
// and fastelbo.backends.cuda's checks of path='fast'.
std::vector<int64_t> elbo_fast_plan_info(int64_t device, int64_t B, int64_t D, int64_t H,
                                         int64_t L, bool one_wave) {
  fastelbo::FastParams f{};
  f.B = static_cast<int>(B);
  f.D = static_cast<int>(D);
  f.H = static_cast<int>(H);
  f.L = static_cast<int>(L);
  cudaError_t err = cudaSuccess;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const auto st = fastelbo::elbo_fast_plan(f, static_cast<int>(device), 0, one_wave, &err);
  if (st != fastelbo::kElboOk) return {0, 0, 0, static_cast<int64_t>(st)};
  return {f.R, f.C, f.smem_bytes, 0};
}

// Both steps at once: launch, wait, read.
bool x_in_unit_range(const at::Tensor& x) {
  range_check_start(x);
  return range_check_finish(x.device().index());
}

// torch.randn(n) from `device`'s default generator, reproduced by rows.cu's randn_fill_kernel
// (philox.cuh): the numbers torch.randn would give and the same generator advance, where the
// reproduction is exact. backends/cuda/noise.py compares the two before the cluster kernels
// draw their own noise.
at::Tensor draw_randn(int64_t n, int64_t device) {
  FE_CHECK(n >= 1 && n <= std::numeric_limits<int>::max(), "n must be in [1, 2^31 - 1], got ", n);
  const auto dev = static_cast<c10::DeviceIndex>(device);
  const c10::cuda::CUDAGuard guard(dev);
  auto out = at::empty({n}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, dev));
  const fastelbo::TorchRandn r = reserve_randn(n, dev);
  check_launch(fastelbo::randn_fill_launch(out.data_ptr<float>(), n, r,
                                           c10::cuda::getCurrentCUDAStream(dev).stream()),
               "randn fill kernel");
  return out;
}

long long pdl_launches() { return g_pdl_launches.load(); }

}  // namespace fastelbo::binding
