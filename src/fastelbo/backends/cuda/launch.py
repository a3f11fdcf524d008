"""One keyword-only wrapper per entry point of the cuda backend's extension (binding_module.cpp).

Every call into the extension goes through these: the backend's modules, training/adam.py and
the single file fastelbo.export writes, which carries the wrappers its ModelNew calls (with what
they use) out of this file as text. Each takes the extension module first, as the package and
the exported file build their own. The wrappers call the binding positionally (pybind11 then
parses no keywords) and check nothing: the binding checks its inputs (binding_check.h), and an
entry whose check fails launches nothing and returns [] (iwae_partials: None), `last_status`
saying why (status.py turns that into the contract's exception).
params: the ten parameter tensors in VAEParams order (enc_w, enc_b, mu_w, ..., dec_b2), as one
sequence: every entry takes them so.
"""
from __future__ import annotations

# The forward's paths, as binding.h's Path enum numbers them.
PATHS = {"auto": 0, "cluster": 1, "rows": 2, "fast": 3, "tc": 4}
# The rows and tc paths' latent block, as binding.h's Latent enum numbers them.
LATENTS = {"auto": 0, "fused": 1, "cublas": 2}
# The tc path's output layer, as binding.h's Output enum numbers them.
OUTPUTS = {"auto": 0, "pingpong": 1, "tc": 2}


def forward_options(ext, *, rows=0, cluster=0, staged=-1, poison=False, path="auto",
                    draw=False, awaits=False, deferred=False, latent="auto", output="auto"):
    """A new ext.ForwardOptions (binding.h says what each field does); path, latent and output
    by name. deferred, latent and output are set only where not their defaults (the
    struct's)."""
    opt = ext.ForwardOptions()
    opt.rows, opt.cluster, opt.staged = rows, cluster, staged
    opt.poison, opt.path, opt.draw, opt.awaits = poison, PATHS[path], draw, awaits
    if deferred:
        opt.deferred = True
    if latent != "auto":
        opt.latent = LATENTS[latent]
    if output != "auto":
        opt.output = OUTPUTS[output]
    return opt


_PRESETS = {}  # extension module -> per draw (no, yes): (plain, awaits, deferred)


def _presets(ext):
    _PRESETS[ext] = tuple(tuple(forward_options(ext, draw=d, awaits=m == 1, deferred=m == 2)
                                for m in range(3)) for d in (False, True))
    return _PRESETS[ext]


def default_forward_options(ext, *, draw=False, awaits=False, deferred=False):
    """The product's forward options (no tuning, no poison) for bools draw and awaits or
    deferred (not both): one of six objects built once per extension module, so the hot path
    builds nothing. Shared: never modify one."""
    return (_PRESETS.get(ext) or _presets(ext))[draw][2 if deferred else awaits]


def forward(ext, *, x, eps, params, options):
    """[elbo, recon, kl], each (B,) float32, on the current stream; [] where a check failed
    (the inputs', or with options.awaits the value check in flight): nothing was drawn or
    launched. With options.deferred the value check is the kernels' own: a bad x gives NaN in
    every output, and take_deferred reports it later."""
    return ext.forward(x, eps, params, options)


def forward_default(ext, *, x, eps, params, draw=False, awaits=False, deferred=False):
    """forward with default_forward_options(ext, draw=draw, awaits=awaits, deferred=deferred):
    the product's call, one entry into this file on the ops' path."""
    return forward(ext, x=x, eps=eps, params=params,
                   options=default_forward_options(ext, draw=draw, awaits=awaits,
                                                   deferred=deferred))


# The backward's engines for its large GEMMs, as binding.h's Gemm enum numbers them.
GEMMS = {"auto": 0, "cublas": 1, "tc": 2, "fused": 3}


def backward_options(ext, *, use_elbo, use_recon, use_kl, need_x, need_eps, gemm="auto"):
    """A new ext.BackwardOptions: which outputs a gradient reaches, which input grads to make,
    and the large GEMMs' engine by name."""
    opt = ext.BackwardOptions()
    opt.use_elbo, opt.use_recon, opt.use_kl = use_elbo, use_recon, use_kl
    opt.need_x, opt.need_eps, opt.gemm = need_x, need_eps, GEMMS[gemm]
    return opt


def backward(ext, *, x, eps, params, grads, options):
    """[g_x, g_eps, 10 parameter grads] of <grads, (elbo, recon, kl)>; grads: three (B,)
    float32 tensors (an unused one is not read); g_x / g_eps are empty where not needed; []
    where a check failed."""
    return ext.backward(x, eps, params, grads, options)


def plan(ext, *, device, batch, dims, rows=0, cluster=0, staged=-1):
    """The general cluster kernel's plan [R, C, smem bytes, variant, staged], or
    [-status, 0, 0, 0, 0]; dims = (input, hidden, latent)."""
    d, h, lat = dims
    return ext.plan(device, batch, d, h, lat, rows, cluster, staged)


def fast_plan(ext, *, device, batch, dims, one_wave=False):
    """The fast kernel's plan [R, C, smem bytes, 0], or [0, 0, 0, status]."""
    d, h, lat = dims
    return ext.fast_plan(device, batch, d, h, lat, one_wave)


def checked_start(ext, *, x, eps, params, validate):
    """1: the input checks passed and the value check on x is in flight; 0: passed, no value
    check started; < 0: the status of the rule broken (never raises). eps may be None."""
    return ext.checked_start(x, eps, params, validate)


def checked_start_deferred(ext, *, x, eps, params):
    """checked_start for a forward that takes the deferred value check: 2 passed, 3 passed and
    the current stream is capturing a graph, < 0 the status of the rule broken."""
    return ext.checked_start_deferred(x, eps, params)


def take_deferred(ext, *, device):
    """[count, row, col, value bits] of the x values outside [0, 1] (or NaN) that forwards
    with the deferred check met on CUDA device index `device` since the last take (count 0:
    none), the record zeroed; waits for the device's work where any such forward ran."""
    return ext.take_deferred(device)


def last_status(ext):
    """The status of this thread's last input check by an entry (0: passed; status.py)."""
    return ext.last_status()


def range_check_start(ext, *, x):
    """Launch the value check on x (non-empty, contiguous float32 CUDA)."""
    ext.range_check_start(x)


def range_check_finish(ext, *, device):
    """Whether the check this thread started on CUDA device index `device` passed (waits)."""
    return ext.range_check_finish(device)


def x_in_unit_range(ext, *, x):
    """The value check on x in one launch and one wait."""
    return ext.x_in_unit_range(x)


def draw_randn(ext, *, n, device):
    """torch.randn(n) from CUDA device `device`'s default generator, reproduced in a kernel."""
    return ext.draw_randn(n, device)


def pdl_launches(ext):
    """How many cluster-kernel launches so far were programmatic dependents."""
    return ext.pdl_launches()


def iwae_plan(ext, *, device, dims):
    """[samples per tile, smem bytes, 0], or [0, 0, status] where the IWAE kernel does not
    apply to dims = (input, hidden, latent) on CUDA device index `device`."""
    d, h, lat = dims
    return ext.iwae_plan(device, d, h, lat)


def iwae_partials(ext, *, x, mu, logvar, eps, image, params, samples, k_per_split, splits,
                  seed):
    """The (B, splits) partial logsumexps (the decoder's parameters are read), or None where a
    check failed; eps (samples, B, L) and image (B,) int64 may be None."""
    return ext.iwae_partials(x, mu, logvar, eps, image, params, samples, k_per_split, splits,
                             seed)


def iwae_wgmma_plan(ext, *, device, dims):
    """iwae_plan for the wgmma kernel (iwae_wgmma.cu): [128, smem bytes, 0] or [0, 0, status]."""
    d, h, lat = dims
    return ext.iwae_wgmma_plan(device, d, h, lat)


def iwae_wgmma_partials(ext, *, x, mu, logvar, eps, image, params, samples, k_per_split, splits,
                        seed):
    """iwae_partials from the wgmma kernel (iwae_wgmma.cu): the same call and answer."""
    return ext.iwae_wgmma_partials(x, mu, logvar, eps, image, params, samples, k_per_split,
                                   splits, seed)


def adam_step(ext, *, params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps,
              weight_decay):
    """One Adam update of float32 CUDA tensors, in place (lists of equal length)."""
    ext.adam_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps,
                  weight_decay)

