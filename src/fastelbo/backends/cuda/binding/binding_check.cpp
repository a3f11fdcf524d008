// check_inputs (binding_check.h): the binding's one input check, in three passes: each tensor
// on its own (present, dense, its dtype, x's device, contiguous), then the dims read off x,
// enc_w and mu_w, then every shape against them. The first rule broken is the answer.
#include "binding_check.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

namespace fastelbo::binding {
namespace {

struct Want {
  const at::Tensor* t;  // nullptr: absent
  int64_t field;
  at::ScalarType dtype;
  bool required;
};

CheckStatus broken(CheckCode code, int64_t field) { return {code, field}; }

// The first pass for one tensor; ok where it is absent and not required.
CheckStatus check_one(const Want& w, const at::Tensor& x, c10::DeviceType type) {
  if (w.t == nullptr || !w.t->defined())
    return w.required ? broken(kCheckMissing, w.field) : CheckStatus{};
  const at::Tensor& t = *w.t;
  if (t.layout() != at::kStrided || t.is_nested()) return broken(kCheckLayout, w.field);
  if (t.scalar_type() != w.dtype) return broken(kCheckDtype, w.field);
  if (t.device().type() != type) return broken(kCheckDeviceType, w.field);
  if (t.device() != x.device()) return broken(kCheckDevice, w.field);
  if (!t.is_contiguous()) return broken(kCheckContiguous, w.field);
  return {};
}

bool has_shape(const at::Tensor* t, std::initializer_list<int64_t> shape) {
  return t == nullptr || !t->defined() || t->sizes().equals(at::IntArrayRef(shape));
}

// `field`: the tensor being checked, for check_inputs' answer should reading it throw.
CheckStatus check(const CheckCall& c, int64_t& field) {
  if (c.params == nullptr || static_cast<int64_t>(c.params->size()) != kParamCount)
    return broken(kCheckCount, kFieldParams);
  if (c.x == nullptr || !c.x->defined()) return broken(kCheckMissing, kFieldX);
  const at::Tensor& x = *c.x;
  const std::vector<at::Tensor>& p = *c.params;
  const at::ScalarType f32 = at::kFloat;

  // 1. Each tensor on its own, in field order.
  Want wants[kFieldCount] = {{c.x, kFieldX, f32, true}, {c.eps, kFieldEps, f32, c.eps_required}};
  int n = 2;
  for (int64_t i = 0; i < kParamCount; ++i) wants[n++] = {&p[i], kFieldParams + i, f32, true};
  for (int64_t i = 0; i < 3; ++i) wants[n++] = {c.grads[i], kFieldGrads + i, f32, false};
  wants[n++] = {c.mu, kFieldMu, f32, false};
  wants[n++] = {c.logvar, kFieldLogvar, f32, false};
  wants[n++] = {c.image, kFieldImage, at::kLong, false};
  for (int i = 0; i < n; ++i) {
    field = wants[i].field;
    const CheckStatus s = check_one(wants[i], x, c.device_type);
    if (!s.ok()) return s;
  }

  // 2. The dims: B and D off x, H off enc_w, L off mu_w; each >= 1 and within int32.
  const at::Tensor &enc_w = p[0], &mu_w = p[2];
  if (x.dim() != 2) return broken(kCheckRank, kFieldX);
  if (enc_w.dim() != 2) return broken(kCheckRank, kFieldParams + 0);
  if (mu_w.dim() != 2) return broken(kCheckRank, kFieldParams + 2);
  const int64_t B = x.size(0), D = x.size(1), H = enc_w.size(0), L = mu_w.size(0);
  if (B < 1 || D < 1) return broken(kCheckEmpty, kFieldX);
  if (H < 1) return broken(kCheckEmpty, kFieldParams + 0);
  if (L < 1) return broken(kCheckEmpty, kFieldParams + 2);
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  if (B > kIntMax || D > kIntMax) return broken(kCheckInt32, kFieldX);
  if (H > kIntMax) return broken(kCheckInt32, kFieldParams + 0);
  if (L > kIntMax) return broken(kCheckInt32, kFieldParams + 2);
  if (c.samples > kIntMax) return broken(kCheckInt32, kFieldEps);

  // 3. Every shape (params.param_shapes' order).
  const int64_t rows[kParamCount] = {H, H, L, L, L, L, H, H, D, D};
  const int64_t cols[kParamCount] = {D, 0, H, 0, H, 0, L, 0, H, 0};  // 0: a bias (1-D)
  for (int64_t i = 0; i < kParamCount; ++i) {
    field = kFieldParams + i;
    if (!(cols[i] ? has_shape(&p[i], {rows[i], cols[i]}) : has_shape(&p[i], {rows[i]})))
      return broken(kCheckShape, field);
  }
  if (!(c.samples > 0 ? has_shape(c.eps, {c.samples, B, L}) : has_shape(c.eps, {B, L})))
    return broken(kCheckShape, kFieldEps);
  for (int64_t i = 0; i < 3; ++i)
    if (!has_shape(c.grads[i], {B})) return broken(kCheckShape, kFieldGrads + i);
  if (!has_shape(c.mu, {B, L})) return broken(kCheckShape, kFieldMu);
  if (!has_shape(c.logvar, {B, L})) return broken(kCheckShape, kFieldLogvar);
  if (!has_shape(c.image, {B})) return broken(kCheckShape, kFieldImage);
  return {};
}

}  // namespace

CheckStatus check_inputs(const CheckCall& call) noexcept {
  int64_t field = kFieldX;
  try {
    return check(call, field);
  } catch (...) {  // a tensor whose metadata ATen refuses to read: not one the kernels take
    return broken(kCheckLayout, field);
  }
}

}  // namespace fastelbo::binding
