"""CUDA C++ backend: the lowest-latency path (sm_90+), and never slower than eager PyTorch.

Three forward paths (binding.cpp picks by batch size; `path=` forces one): small batches run ONE
launch of a fused cluster kernel (thread-block clusters + distributed shared memory): elbo.cu,
the general one, up to B=80; elbo_fast.cu for 80 < B <= 384 where the dims are multiples of 4
(else elbo.cu up to 192); large batches run every GEMM with cuBLAS (as eager does)
and two small fused kernels (rows.cu) for everything else. `backward` (any batch) recomputes the activations the same way
and runs the gradient's GEMMs with cuBLAS around four fused kernels (backward.cu). The .cu
files hold the kernels (no torch types), elbo.h their plain params structs, elbo_math.cuh the
shared per-element math, binding.cpp the only torch-facing file. The extension is built on
first use with torch.utils.cpp_extension.load (a message on stderr says so), cached in torch's
extension directory under a name that carries a hash of the sources, flags and torch version
(an edit rebuilds), imported straight from there by later processes, and memoised here.
noise.py: the forward's torch.randn drawn inside the cluster kernels (forward_drawing);
x_in_unit_range / start_range_check: fastelbo.validation's value check in one launch.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

# The dtypes this backend computes in: fastelbo.ops refuses others before drawing any noise.
DTYPES = (torch.float32,)

from ...params import PLAIN_TYPES, VAEParams

HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = ("elbo_fast.cu", "elbo.cu", "rows.cu", "backward.cu", "adam.cu", "iwae.cu")
BINDING_SOURCE = "binding.cpp"
HEADERS = ("elbo.h", "elbo_math.cuh", "cluster.cuh", "philox.cuh")

# IEEE float32 throughout (no --use_fast_math): sm_90 machine code, plus PTX for newer GPUs.
NVCC_FLAGS = [
    "-O3",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
    "-lineinfo",
]
CXX_FLAGS = ["-O3"]


def source_files() -> list[Path]:
    return [HERE / n for n in (*KERNEL_SOURCES, BINDING_SOURCE, *HEADERS)]


def _source_hash() -> str:
    """Names the build: the sources, the flags and the torch it is built against (an ABI)."""
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(repr((NVCC_FLAGS, CXX_FLAGS, torch.__version__, torch.version.cuda)).encode())
    return h.hexdigest()[:12]


def _nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is not None:
        exe = Path(CUDA_HOME) / "bin" / "nvcc"
        if exe.exists():
            return str(exe)
    return shutil.which("nvcc")


# Wall time of a first build, for the message that one is starting (H200 host, 16 cores:
# 34-52 s in benchmarks/device_run.sh's build stage, runs 57-80).
BUILD_TIME = "about a minute on 16 cores, several on fewer"


def _build_dir(name: str) -> Path:
    """Where torch.utils.cpp_extension.load builds and caches extension `name`: its
    _get_build_directory, written out, as importing cpp_extension costs ~0.3 s (setuptools)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs

        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{python}_{accelerator}")
    return Path(root) / name


def _load_cached(name: str) -> ModuleType | None:
    """The extension from load()'s cache, without load()'s machinery (the compiler checks and
    ninja's up-to-date pass, which run in every process): the name carries the hash of the
    sources, flags and torch, so a library of that name is this build. None when there is none
    yet, a build holds the lock, or it does not import (then load() builds it again)."""
    import importlib.util
    from importlib.machinery import EXTENSION_SUFFIXES

    root = _build_dir(name)
    lib = root / f"{name}.so"  # cpp_extension's LIB_EXT off Windows
    if (root / "lock").exists() or not lib.is_file() or ".so" not in EXTENSION_SUFFIXES:
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, lib)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError):
        return None
    return mod


@cache
def _build() -> tuple[ModuleType | None, str | None]:
    """(module, None) or (None, why): the build is tried once per process."""
    name = f"fastelbo_cuda_{_source_hash()}"
    mod = _load_cached(name)
    if mod is not None:
        return mod, None
    if _nvcc() is None:
        return None, "the CUDA toolkit (nvcc) was not found: set CUDA_HOME"
    verbose = os.environ.get("FASTELBO_VERBOSE_BUILD", "0") == "1"
    print(f"fastelbo: building the CUDA extension {name} in {_build_dir(name)} (first use "
          f"of these sources; {BUILD_TIME}; later runs load it from there)",
          file=sys.stderr, flush=True)
    try:
        from torch.utils.cpp_extension import load

        mod = load(
            name=name,
            sources=[str(HERE / n) for n in (*KERNEL_SOURCES, BINDING_SOURCE)],
            extra_cflags=CXX_FLAGS,
            extra_cuda_cflags=NVCC_FLAGS,
            extra_include_paths=[str(HERE)],
            verbose=verbose,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure becomes a reason string
        return None, f"the CUDA extension failed to build: {type(exc).__name__}: {exc}"
    return mod, None


def extension() -> ModuleType:
    """The compiled extension; raises RuntimeError with the build error if it cannot be had."""
    mod, why = _build()
    if mod is None:
        raise RuntimeError(f"fastelbo cuda backend unavailable: {why}. "
                           f"Use backend='torch' or backend='triton'.")
    return mod


# CUDA devices (with an index) this backend was found to run on: fastelbo.ops asks once per
# call, and a device that can run it keeps being able to (a no is asked again every time).
_RUNS_ON: set[torch.device] = set()


def unavailable_reason(device: torch.device) -> str | None:
    """Why this backend cannot run on `device`, or None when it can."""
    if device in _RUNS_ON:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return f"the cuda backend runs on CUDA devices only, not {device.type}"
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return (f"the kernel needs compute capability 9.0+ (thread-block clusters), "
                f"device {index} has {major}.{minor}")
    _, why = _build()
    if why is None and device.index is not None:
        _RUNS_ON.add(device)
    return why


def _range_check_applies(x: torch.Tensor) -> bool:
    return (x.device in _RUNS_ON and x.dtype == torch.float32 and x.is_contiguous()
            and x.numel() > 0 and x.layout == torch.strided)


def x_in_unit_range(x: torch.Tensor) -> bool | None:
    """fastelbo.validation's value check in one launch and one wait (binding.cpp), for a
    non-empty contiguous float32 x on a device this backend already runs on (its extension
    built); None where it does not apply (the caller falls back to torch ops). Never builds."""
    return extension().x_in_unit_range(x) if _range_check_applies(x) else None


def start_range_check(x: torch.Tensor) -> bool:
    """x_in_unit_range's launch alone, where it applies (else False, nothing launched): the
    verdict comes from finish_range_check(x.device), which waits for it. One check in flight
    per thread and device: a second start first waits out the first."""
    if _range_check_applies(x):
        extension().range_check_start(x)
        return True
    return False


def checked_start(x: torch.Tensor, params: VAEParams, eps: torch.Tensor | None,
                  validate: bool) -> int | None:
    """fastelbo.validation.start_checks' fast lane: its checks in one binding call for the
    common case (contiguous float32 tensors, plain torch.Tensor / Parameter, on a device this
    backend already runs on) and, with validate, the value check started. 1: passed, the
    value check in flight (finish_range_check); 0: passed, no value check (validate off or a
    graph being captured); None: not the plain case or a check failed: the caller's own checks
    decide (and raise the precise error). Never builds the extension."""
    if (type(x) not in PLAIN_TYPES or x.device not in _RUNS_ON or len(params) != 10
            or (eps is not None and type(eps) not in PLAIN_TYPES)):
        return None
    for p in params:
        if type(p) not in PLAIN_TYPES:
            return None
    status = extension().checked_start(x, eps, *params, validate)
    return None if status < 0 else status


def finish_range_check(device: torch.device) -> bool:
    """Whether the check start_range_check began on `device` (this thread) found every value
    in [0, 1]."""
    return extension().range_check_finish(device.index)


def plan(x: torch.Tensor, params: VAEParams, *, rows: int = 0, cluster: int = 0,
         staged: int = -1) -> tuple[int, int, int, int, int]:
    """(R rows per cluster, C blocks per cluster, smem bytes, variant, staged) for this call.

    R <= 0 means no plan: -R is the kernel's status (1 too large, 3 arch, 4 no cluster fits).
    """
    check_options(rows, cluster, staged)
    d, h, lat = VAEParams(*params).dims
    r, c, smem, variant, st = extension().plan(x.device.index or 0, x.shape[0], d, h, lat,
                                               rows, cluster, staged)
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
    status = extension().fast_plan(x.device.index or 0, x.shape[0], d, h, lat)[3]
    if status:
        raise ValueError(f"path='fast' does not apply to input_dim={d} hidden_dim={h} "
                         f"latent_dim={lat}: {_FAST_STATUS.get(status, f'status {status}')}; "
                         f"use path='auto'")


PATHS = {"auto": 0, "cluster": 1, "rows": 2, "fast": 3}
INT32_MAX = 2**31 - 1


class CudaInputError(ValueError, RuntimeError):
    """A tensor the binding would reject for its device, layout or contiguity.

    A ValueError for callers, and a RuntimeError as the binding's own TORCH_CHECK failure was:
    these checks stand in for the binding's, since on some images a C++ exception cannot reach
    Python at all (it kills the process; benchmarks/NOTES.md, run 8).
    """


def _int_option(name: str, value, lo: int, hi: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int ({meaning}), got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be {meaning}, got {value}")
    return value


def check_options(rows: int = 0, cluster: int = 0, staged: int = -1,
                  path: str = "auto") -> None:
    """The binding's checks on the launch options (rows, cluster, staged, path), in Python."""
    _int_option("rows", rows, 0, 64, "0 (auto) or 1..64")
    _int_option("cluster", cluster, 0, 16, "0 (auto) or 1..16")
    _int_option("staged", staged, -1, 1, "-1 (auto), 0 or 1")
    if not isinstance(path, str) or path not in PATHS:
        raise ValueError(f"path must be one of {tuple(PATHS)}, got {path!r}")
    if (rows > 0 or cluster > 0 or staged >= 0) and path in ("rows", "fast"):
        raise ValueError(f"rows / cluster / staged force the cluster path; they conflict with "
                         f"path={path!r} (got rows={rows}, cluster={cluster}, staged={staged})")


def check_inputs(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, *, rows: int = 0,
                 cluster: int = 0, staged: int = -1, path: str = "auto") -> None:
    """Raise TypeError / ValueError naming the argument, before anything reaches C++.

    Mirrors every check binding.cpp's elbo_forward makes before it launches (FE_CHECK_TENSOR on
    x, eps and each parameter; dims, shapes and int32 limits; the launch options), so that the
    binding never throws: on some images a C++ exception kills the process. Reads tensor
    metadata only (no data, no CUDA call), so it runs anywhere, meta tensors included.
    """
    try:
        params = VAEParams(*params)
    except TypeError:
        raise TypeError(f"params must be a VAEParams (or a sequence of "
                        f"{len(VAEParams._fields)} tensors {VAEParams._fields})") from None
    tensors = (("x", x), ("eps", eps), *zip(VAEParams._fields, params))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dtype != torch.float32:
            raise TypeError(f"the cuda backend computes in float32 only; {name} is {t.dtype}. "
                            f"Use backend='torch' for other dtypes.")
    dev = x.device
    for name, t in tensors:
        if t.device.type != "cuda":
            raise CudaInputError(f"{name} must be a CUDA tensor, got one on {t.device}. "
                                 f"Use backend='torch' on other devices.")
        if t.device != dev:
            raise CudaInputError(f"{name} is on {t.device} but x is on {dev}: every tensor "
                                 f"must be on x's device")
        if not t.is_contiguous():
            raise CudaInputError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride "
                                 f"{t.stride()}); call .contiguous() first")
    for name, t, nd, what in (("x", x, 2, "(batch, input_dim)"),
                              ("enc_w", params.enc_w, 2, "(hidden_dim, input_dim)"),
                              ("mu_w", params.mu_w, 2, "(latent_dim, hidden_dim)")):
        if t.dim() != nd:
            raise ValueError(f"{name} must be {nd}-D {what}, got shape {tuple(t.shape)}")
    batch, d = x.shape
    h, lat = params.enc_w.shape[0], params.mu_w.shape[0]
    if batch < 1:
        raise ValueError("x must hold at least one row")
    if d < 1 or h < 1 or lat < 1:
        raise ValueError(f"dims must be positive, got input_dim={d} hidden_dim={h} "
                         f"latent_dim={lat}")
    if max(batch, d, h, lat) > INT32_MAX:
        raise ValueError(f"sizes must fit in int32, got B={batch} D={d} H={h} L={lat}")
    want = {"x": (batch, d), "eps": (batch, lat), "enc_w": (h, d), "enc_b": (h,),
            "mu_w": (lat, h), "mu_b": (lat,), "lv_w": (lat, h), "lv_b": (lat,),
            "dec_w1": (h, lat), "dec_b1": (h,), "dec_w2": (d, h), "dec_b2": (d,)}
    for name, t in (("eps", eps), *zip(VAEParams._fields, params)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} must have shape {want[name]}, got {tuple(t.shape)} "
                             f"(x is {tuple(x.shape)}, enc_w {tuple(params.enc_w.shape)}, "
                             f"mu_w {tuple(params.mu_w.shape)})")
    check_options(rows, cluster, staged, path)


def forward(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, *, rows: int = 0,
            cluster: int = 0, staged: int = -1, path: str = "auto", draw: bool = False,
            _poison: bool = False):
    """(elbo, recon, kl), each (B,) float32, on the current stream.

    path: "auto" (a cluster kernel for small batches, the rows path for large ones), "fast"
    (elbo_fast.cu: dims multiples of 4, any B), "cluster" (elbo.cu, any dims) or "rows".
    rows / cluster > 0 and staged in (0, 1) force the cluster kernel's launch plan
    (tuning only); draw=True overwrites eps with one torch.randn(B, latent_dim) draw from the
    default generator of x's device and computes with it (inside the cluster kernels where
    they run; noise.py says when that is exact); _poison fills the outputs with NaN first, so
    tests can prove every element is written.
    """
    check_inputs(x, params, eps, rows=rows, cluster=cluster, staged=staged, path=path)
    params = VAEParams(*params)
    if path == "fast":
        check_fast_path(x, params)
    out = extension().forward(x, eps, *params, rows, cluster, staged, bool(_poison),
                              PATHS[path], bool(draw), False)
    return out[0], out[1], out[2]


def _within_limits(x: torch.Tensor, params: VAEParams, eps: torch.Tensor) -> bool:
    """What check_inputs checks beyond fastelbo.validation's: dense layouts, sizes in int32."""
    batch, d = x.shape
    h, lat = params[0].shape[0], params[2].shape[0]
    return (0 < batch <= INT32_MAX and 0 < d <= INT32_MAX and 0 < h <= INT32_MAX
            and 0 < lat <= INT32_MAX and x.layout == eps.layout == torch.strided
            and all(p.layout == torch.strided for p in params))


def forward_prepared(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, *,
                     draw: bool = False, verdict=None):
    """forward with the default launch options, for fastelbo.ops only.

    ops has already run validation.check_inputs (types, shapes, one dtype, one device),
    resolved this backend for x (so a CUDA device this backend runs on, and float32) and made
    every tensor contiguous: of check_inputs' checks, only those left are repeated here (a dense
    layout, positive dims, sizes within int32). Any failure is re-checked by check_inputs,
    which raises the same exception as `forward` would. Call `forward` otherwise. draw: as
    forward's (noise.forward_drawing). verdict: fastelbo.validation.start_checks' verdict on
    x, waited for just before anything is drawn or launched (its error raised then), so that
    this preparation overlaps the value check: inside the binding where the check is this
    backend's own, still in flight (verdict.in_flight), else by verdict.wait() before the call.
    """
    # A plain verdict: checked_start has checked all of this (and more) in the binding.
    if not (verdict is not None and verdict.plain or _within_limits(x, params, eps)):
        check_inputs(x, params, eps)
        raise AssertionError("forward_prepared was handed inputs fastelbo.ops did not prepare")
    awaits = verdict is not None and verdict.in_flight
    if verdict is not None and not awaits:
        verdict.wait()
    out = extension().forward(x, eps, *params, 0, 0, -1, False, PATHS["auto"], draw, awaits)
    if not out:  # the check in flight failed: nothing was drawn or launched
        verdict.fail()
    return out[0], out[1], out[2]


def backward(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, grads, *,
             need_x: bool = True, need_eps: bool = True):
    """(g_x, g_eps, [10 parameter grads]) of <grads, forward(x, params, eps)>, as
    torch_ref.backward (the spec) gives them: cuBLAS GEMMs + backward.cu's fused kernels.

    grads = (g_elbo, g_recon, g_kl), each (B,) or None where no gradient reaches that output.
    need_x / need_eps False: that gradient is not computed and None comes back in its place.
    """
    check_inputs(x, params, eps)
    params = VAEParams(*params)
    if len(grads) != 3:
        raise ValueError(f"grads must be (g_elbo, g_recon, g_kl), got {len(grads)} entries")
    batch = x.shape[0]
    used, given = [], []
    for name, g in zip(("g_elbo", "g_recon", "g_kl"), grads):
        used.append(g is not None)
        if g is None:
            given.append(x.new_empty(batch))  # unread: the binding takes a defined tensor
            continue
        if not isinstance(g, torch.Tensor) or g.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got {getattr(g, 'dtype', g)!r}")
        if g.device != x.device or tuple(g.shape) != (batch,):
            raise CudaInputError(f"{name} must have shape ({batch},) on {x.device}, got "
                                 f"{tuple(g.shape)} on {g.device}")
        given.append(g.contiguous())  # e.g. mean()'s gradient is an expanded scalar
    out = extension().backward(x, eps, *params, *given, *used, bool(need_x), bool(need_eps))
    return (out[0] if need_x else None), (out[1] if need_eps else None), list(out[2:])


from .noise import forward_drawing, randn_matches  # noqa: F401  (needs the names above)
