// The Python module: binding.h's entry points and option structs, bound by name. Every argument
// is positional without a default (pybind11 then parses no keywords on the hot path);
// backends/cuda/launch.py is the keyword-only Python side of each entry.
#include <torch/extension.h>

#include "binding.h"

namespace py = pybind11;
namespace fb = fastelbo::binding;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastelbo's cuda backend: fused VAE ELBO forward, backward, Adam and IWAE kernels";
  // module_local: the exported single-file solution binds these names too, and pybind11
  // registers types process-wide; a second module of the same types would fail to import.
  py::class_<fb::ForwardOptions>(m, "ForwardOptions", py::module_local(),
                                 "how one forward launches (binding.h)")
      .def(py::init<>())
      .def_readwrite("rows", &fb::ForwardOptions::rows)
      .def_readwrite("cluster", &fb::ForwardOptions::cluster)
      .def_readwrite("staged", &fb::ForwardOptions::staged)
      .def_readwrite("poison", &fb::ForwardOptions::poison)
      .def_readwrite("path", &fb::ForwardOptions::path)
      .def_readwrite("draw", &fb::ForwardOptions::draw)
      .def_readwrite("awaits", &fb::ForwardOptions::awaits)
      .def_readwrite("deferred", &fb::ForwardOptions::deferred)
      .def_readwrite("latent", &fb::ForwardOptions::latent)
      .def_readwrite("output", &fb::ForwardOptions::output);
  py::class_<fb::BackwardOptions>(m, "BackwardOptions", py::module_local(),
                                  "which gradients one backward computes (binding.h)")
      .def(py::init<>())
      .def_readwrite("use_elbo", &fb::BackwardOptions::use_elbo)
      .def_readwrite("use_recon", &fb::BackwardOptions::use_recon)
      .def_readwrite("use_kl", &fb::BackwardOptions::use_kl)
      .def_readwrite("need_x", &fb::BackwardOptions::need_x)
      .def_readwrite("need_eps", &fb::BackwardOptions::need_eps)
      .def_readwrite("gemm", &fb::BackwardOptions::gemm);

  // Every entry that takes the VAE's tensors takes its ten parameters as one list (params, in
  // VAEParams order) and returns [] (iwae_partials: None) where its input check fails;
  // last_status says why.
  m.def("forward", &fb::elbo_forward, "(elbo, recon, kl) of the VAE, or [] (binding.h)",
        py::arg("x"), py::arg("eps"), py::arg("params"), py::arg("options"));
  m.def("backward", &fb::elbo_backward,
        "gradients {x, eps, 10 params} of <g, (elbo, recon, kl)>, or [] (binding.h)",
        py::arg("x"), py::arg("eps"), py::arg("params"), py::arg("grads"), py::arg("options"));
  m.def("adam_step", &fb::adam_step, "one Adam update of float32 CUDA tensors, in place",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("steps"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"));
  m.def("plan", &fb::elbo_plan_info,
        "launch plan {R, C, smem_bytes, variant, staged} or {-status, 0, 0, 0, 0}",
        py::arg("device"), py::arg("B"), py::arg("D"), py::arg("H"), py::arg("L"),
        py::arg("rows"), py::arg("cluster"), py::arg("staged"));
  m.def("fast_plan", &fb::elbo_fast_plan_info,
        "fast-path plan {R, C, smem_bytes, 0} or {0, 0, 0, status}", py::arg("device"),
        py::arg("B"), py::arg("D"), py::arg("H"), py::arg("L"), py::arg("one_wave"));
  m.def("iwae_partials", &fb::iwae_partials, "IWAE partial logsumexps (B, splits), or None",
        py::arg("x"), py::arg("mu"), py::arg("logvar"), py::arg("eps"), py::arg("image"),
        py::arg("params"), py::arg("samples"), py::arg("k_per_split"), py::arg("splits"),
        py::arg("seed"));
  m.def("iwae_plan", &fb::iwae_plan_info,
        "IWAE tile {samples per tile, smem_bytes, 0} or {0, 0, status}", py::arg("device"),
        py::arg("D"), py::arg("H"), py::arg("L"));
  m.def("iwae_wgmma_partials", &fb::iwae_wgmma_partials,
        "IWAE partial logsumexps (B, splits) from the wgmma kernel, or None", py::arg("x"),
        py::arg("mu"), py::arg("logvar"), py::arg("eps"), py::arg("image"), py::arg("params"),
        py::arg("samples"), py::arg("k_per_split"), py::arg("splits"), py::arg("seed"));
  m.def("iwae_wgmma_plan", &fb::iwae_wgmma_plan_info,
        "the wgmma IWAE kernel's tile {128, smem_bytes, 0} or {0, 0, status}",
        py::arg("device"), py::arg("D"), py::arg("H"), py::arg("L"));
  m.def("x_in_unit_range", &fb::x_in_unit_range,
        "whether every element of x lies in [0, 1] (NaN does not); one launch, one wait",
        py::arg("x"));
  m.def("range_check_start", &fb::range_check_start,
        "launch x_in_unit_range's check; range_check_finish waits for it", py::arg("x"));
  m.def("range_check_finish", &fb::range_check_finish,
        "the verdict of this thread's check in flight on the device (waits)",
        py::arg("device"));
  m.def("checked_start", &fb::checked_start,
        "the input checks, and the value check on x started: 1 started, 0 passed without it, "
        "< 0 the packed status of the rule broken (never raises)",
        py::arg("x"), py::arg("eps"), py::arg("params"), py::arg("validate"));
  m.def("checked_start_deferred", &fb::checked_start_deferred,
        "the input checks for a forward with the deferred value check: 2 passed, 3 passed "
        "while the stream captures, < 0 the packed status of the rule broken (never raises)",
        py::arg("x"), py::arg("eps"), py::arg("params"));
  m.def("take_deferred", &fb::take_deferred,
        "{count, row, col, value bits} of the bad x values deferred checks met on the device "
        "since the last take, zeroed (waits for the device where any ran)", py::arg("device"));
  m.def("last_status", &fb::last_status,
        "the packed status of this thread's last input check by an entry (0: passed)");
  m.def("draw_randn", &fb::draw_randn,
        "torch.randn(n) on the device's default generator, reproduced in a kernel",
        py::arg("n"), py::arg("device"));
  m.def("pdl_launches", &fb::pdl_launches,
        "how many cluster-kernel launches so far were programmatic dependents (tests)");
}
