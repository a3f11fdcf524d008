"""The ELBO on the cuda backend: forward (the ops' prepared entry and the tuning entry), backward.

Paths (binding_forward.cpp picks by batch size; `path=` forces one): small batches run ONE
launch of a fused cluster kernel (thread-block clusters + distributed shared memory): elbo.cu,
the general one, up to B=80; elbo_fast.cu for 80 < B <= 384 where the dims are multiples of 4
(else elbo.cu up to 192); large batches run every GEMM with cuBLAS (as eager does) and two
small fused kernels (rows.cu) for everything else, or, on an sm_90 GPU where the dims are
multiples of 4, its tensor-core variant "tc" (tc_gemm.cu: the encoder and output layers on
wgmma in float32-accurate tf32x3, logits never in memory). `backward` (any batch)
recomputes the activations and runs the gradient's GEMMs around its fused kernels
(backward.cu); four of its large GEMMs run on the same tensor-core kernel from B=2048 up
where "tc" applies (`gemm=` forces an engine), the rest with cuBLAS. Its "fused" engine
(backward_fused.cu; `auto` takes it at every batch where FASTELBO_TC_TRAIN=1 and "tc"
applies, until a GPU run accepts it) has those GEMMs' operands written split and transposed by
the kernels that produce them, and the latent side in two launches.
"""
from __future__ import annotations

import torch

from ...params import VAEParams
from .. import Verdict
from . import build, launch, status
from .lanes import DeferredCheck, RangeCheck


def _int_option(name: str, value, lo: int, hi: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int ({meaning}), got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be {meaning}, got {value}")
    return value


def check_options(rows: int = 0, cluster: int = 0, staged: int = -1,
                  path: str = "auto", latent: str = "auto", output: str = "auto") -> None:
    """The launch options (binding.h ForwardOptions, which the binding checks again)."""
    _int_option("rows", rows, 0, 64, "0 (auto) or 1..64")
    _int_option("cluster", cluster, 0, 16, "0 (auto) or 1..16")
    _int_option("staged", staged, -1, 1, "-1 (auto), 0 or 1")
    if not isinstance(path, str) or path not in launch.PATHS:
        raise ValueError(f"path must be one of {tuple(launch.PATHS)}, got {path!r}")
    if not isinstance(latent, str) or latent not in launch.LATENTS:
        raise ValueError(f"latent must be one of {tuple(launch.LATENTS)}, got {latent!r}")
    if not isinstance(output, str) or output not in launch.OUTPUTS:
        raise ValueError(f"output must be one of {tuple(launch.OUTPUTS)}, got {output!r}")
    if output == "pingpong" and path not in ("auto", "tc"):
        raise ValueError(f"output='pingpong' is the tc path's output layer; it conflicts with "
                         f"path={path!r}")
    if (rows > 0 or cluster > 0 or staged >= 0) and path in ("rows", "fast", "tc"):
        raise ValueError(f"rows / cluster / staged force the cluster path; they conflict with "
                         f"path={path!r} (got rows={rows}, cluster={cluster}, staged={staged})")


def plan(x: torch.Tensor, params: VAEParams, *, rows: int = 0, cluster: int = 0,
         staged: int = -1) -> tuple[int, int, int, int, int]:
    """(R rows per cluster, C blocks per cluster, smem bytes, variant, staged) for this call.

    R <= 0 means no plan: -R is the kernel's status (1 too large, 3 arch, 4 no cluster fits).
    """
    check_options(rows, cluster, staged)
    r, c, smem, variant, st = launch.plan(build.extension(), device=x.device.index or 0,
                                          batch=x.shape[0], dims=VAEParams(*params).dims,
                                          rows=rows, cluster=cluster, staged=staged)
    return r, c, smem, variant, st


# Why path='fast' cannot run, by the planner's status (elbo.h ElboStatus).
_FAST_STATUS = {1: "its shared memory does not fit this GPU for these dims",
                3: "it needs compute capability 9.0+",
                4: "no thread-block cluster of 16 or 8 blocks fits on this GPU",
                5: "input_dim, hidden_dim and latent_dim must be multiples of 4 and hidden_dim "
                   "a multiple of 32 (4 x 8 blocks)"}
_FAST_ALIGNED = ("x", "enc_w", "enc_b", "mu_w", "lv_w", "dec_w1", "dec_b1", "dec_w2")


def check_fast_path(x: torch.Tensor, params: VAEParams) -> None:
    """ValueError unless path='fast' applies to these tensors (dims, 16-byte alignment, GPU)."""
    named = {"x": x, **params._asdict()}
    for name in _FAST_ALIGNED:
        if named[name].data_ptr() % 16:
            raise ValueError(f"path='fast' needs 16-byte aligned tensors; {name} is not (a view "
                             f"with an offset?): use path='auto'")
    d, h, lat = params.dims
    status = launch.fast_plan(build.extension(), device=x.device.index or 0, batch=x.shape[0],
                              dims=(d, h, lat))[3]
    if status:
        raise ValueError(f"path='fast' does not apply to input_dim={d} hidden_dim={h} "
                         f"latent_dim={lat}: {_FAST_STATUS.get(status, f'status {status}')}; "
                         f"use path='auto'")


_TC_ALIGNED = ("x", "enc_w", "dec_w2")


def tc_applies(x: torch.Tensor, params: VAEParams) -> bool:
    """Whether path='tc' runs here: an sm_90 GPU (its sm_90a wgmma code), input_dim and
    hidden_dim multiples of 4, x, enc_w and dec_w2 16-byte aligned (binding_tc.cpp)."""
    params = VAEParams(*params)
    named = {"x": x, **params._asdict()}
    d, h, _ = params.dims
    return (x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0)
            and d % 4 == 0 and h % 4 == 0 and all(named[n].data_ptr() % 16 == 0
                                                  for n in _TC_ALIGNED))


def check_tc_path(x: torch.Tensor, params: VAEParams, what: str = "path='tc'") -> None:
    """ValueError unless the tensor-core GEMMs (`what` asks for them) apply to these tensors."""
    if not tc_applies(x, params):
        d, h, lat = VAEParams(*params).dims
        raise ValueError(f"{what} does not apply to input_dim={d} hidden_dim={h} "
                         f"latent_dim={lat} on this device: it needs an sm_90 GPU, input_dim "
                         f"and hidden_dim multiples of 4, and x, enc_w, dec_w2 16-byte aligned; "
                         f"use {what.split('=')[0]}='auto'")


PINGPONG_MAX_HIDDEN = 256  # elbo.h kPingpongMaxK


def check_pingpong(x: torch.Tensor, params: VAEParams, deferred: bool) -> None:
    """ValueError unless output='pingpong' applies: the tc path, hidden_dim <= 256 (its rows of
    d stay in shared memory), no deferred check (binding_forward.cpp checks it again)."""
    check_tc_path(x, params, "output='pingpong'")
    h = VAEParams(*params).dims[1]
    if h > PINGPONG_MAX_HIDDEN or deferred:
        raise ValueError(f"output='pingpong' needs hidden_dim <= {PINGPONG_MAX_HIDDEN} (got {h}) "
                         f"and no deferred check (got deferred={deferred}); use output='auto'")


def forward(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, *, rows: int = 0,
            cluster: int = 0, staged: int = -1, path: str = "auto", draw: bool = False,
            deferred: bool = False, latent: str = "auto", output: str = "auto",
            _poison: bool = False):
    """(elbo, recon, kl), each (B,) float32, on the current stream; every input checked.

    path: "auto" (a cluster kernel for small batches, the rows path for large ones), "fast"
    (elbo_fast.cu: dims multiples of 4, any B), "cluster" (elbo.cu, any dims), "rows" (cuBLAS)
    or "tc" (the rows path on tensor cores; tc_applies says where).
    rows / cluster > 0 and staged in (0, 1) force the cluster kernel's launch plan (tuning;
    tests/test_cuda_backend.py and benchmarks/cuda_sanitize.py run every plan); draw=True
    overwrites eps with one torch.randn(B, latent_dim) draw from the default generator of x's
    device and computes with it (inside the cluster kernels where they run; noise.py says when
    that is exact); deferred=True runs the deferred value check in the kernels (a bad x: every
    output NaN, and fastelbo.check_errors raises); latent: the rows and tc paths' latent
    block, "fused" (latent.cu, one launch), "cublas" or "auto" (fused where
    FASTELBO_FUSED_LATENT=1); output: the tc path's output layer, "pingpong" (pingpong.cu, one
    persistent launch; wherever the tc path runs, so path='tc' forces it at every B; no deferred
    check, hidden_dim <= 256), "tc" (tc_gemm.cu) or "auto" (pingpong where FASTELBO_PINGPONG=1
    and it applies); _poison fills the outputs with NaN first, so tests can prove every element
    is written.
    """
    check_options(rows, cluster, staged, path, latent, output)
    ext = build.extension()
    params = status.check_call(ext, x, params, eps)
    if path == "fast":
        check_fast_path(x, params)
    elif path == "tc":
        check_tc_path(x, params)
    if output == "pingpong":
        check_pingpong(x, params, bool(deferred))
    options = launch.forward_options(ext, rows=rows, cluster=cluster, staged=staged,
                                     poison=bool(_poison), path=path, draw=bool(draw),
                                     deferred=bool(deferred), latent=latent, output=output)
    out = launch.forward(ext, x=x, eps=eps, params=params, options=options)
    if not out:
        raise status.error(launch.last_status(ext), {"x": x, "eps": eps, "params": params})
    return out[0], out[1], out[2]


def forward_prepared(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, *,
                     draw: bool = False, verdict: Verdict | None = None):
    """forward with the default launch options, for fastelbo.ops only (the Backend protocol).

    ops has already checked the call against fastelbo.contract, resolved this backend for x and
    made every tensor contiguous; the binding checks its inputs again (binding_check.h, no
    exception: a refused call launches nothing and raises here what `forward` would). draw: as
    forward's (noise.forward_drawing). verdict: the ops' value check on x, waited for just
    before anything is drawn or launched (its error raised then), so that this preparation
    overlaps the value check: inside the binding where the check is this backend's own, still
    in flight (a lanes.RangeCheck), else by verdict.wait() before the call. A
    lanes.DeferredCheck is left to the kernels (the deferred option): nothing waits.
    """
    awaits = isinstance(verdict, RangeCheck)  # this backend's own check, in flight
    deferred = isinstance(verdict, DeferredCheck)  # its kernels' own check
    if verdict is not None and verdict.in_flight and not (awaits or deferred):
        verdict.wait()
    ext = build.RUNS_ON.get(x.device) or build.extension()  # the ops resolved x's device
    out = launch.forward_default(ext, x=x, eps=eps, params=params, draw=draw, awaits=awaits,
                                 deferred=deferred)
    if not out:  # a check failed: nothing was drawn or launched
        code = launch.last_status(ext)
        if awaits and status.decode(code)[0] == status.VALUE:
            verdict.fail()
        raise status.error(code, {"x": x, "eps": eps, "params": params})
    return out[0], out[1], out[2]


def backward(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, grads, *,
             need_x: bool = True, need_eps: bool = True, gemm: str = "auto"):
    """(g_x, g_eps, [10 parameter grads]) of <grads, forward(x, params, eps)>, as
    torch_ref.backward (the spec) gives them: GEMMs + backward.cu's fused kernels.

    grads = (g_elbo, g_recon, g_kl), each (B,) or None where no gradient reaches that output.
    need_x / need_eps False: that gradient is not computed and None comes back in its place.
    gemm: the large GEMMs' engine: "auto", "cublas" (float32), "tc" (tensor cores in tf32x3,
    where tc_applies; else ValueError) or "fused" (those GEMMs at every batch, their operands
    written by their producers, the latent side fused; where tc_applies, else ValueError).
    """
    if gemm not in launch.GEMMS:
        raise ValueError(f"gemm must be one of {sorted(launch.GEMMS)}, got {gemm!r}")
    ext = build.extension()
    if gemm in ("tc", "fused"):  # its test reads the tensors: they must pass the check first
        params = status.check_call(ext, x, params, eps)
        check_tc_path(x, params, f"gemm={gemm!r}")
    else:  # the backward's own call checks them (the training step's path: one check)
        params = status.tensors_only(x, params, eps)
    if len(grads) != 3:
        raise ValueError(f"grads must be (g_elbo, g_recon, g_kl), got {len(grads)} entries")
    used = [g is not None for g in grads]
    given = []
    for name, g in zip(("g_elbo", "g_recon", "g_kl"), grads):
        if g is None:
            g = x.new_empty(x.shape[:1])  # unread: the binding takes a defined tensor
        elif not isinstance(g, torch.Tensor):
            raise TypeError(f"{name} must be a float32 tensor or None, got {type(g).__name__}")
        given.append(g.contiguous())  # e.g. mean()'s gradient is an expanded scalar
    options = launch.backward_options(ext, use_elbo=used[0], use_recon=used[1], use_kl=used[2],
                                      need_x=bool(need_x), need_eps=bool(need_eps), gemm=gemm)
    out = launch.backward(ext, x=x, eps=eps, params=params, grads=given, options=options)
    if not out:
        raise status.error(launch.last_status(ext),
                           {"x": x, "eps": eps, "params": params, "grads": given})
    return (out[0] if need_x else None), (out[1] if need_eps else None), list(out[2:])
