"""The cuda backend's extension: its sources and flags, the build, the cache, and where it runs.

The extension is built on first use with torch.utils.cpp_extension.load (a message on stderr
says so), cached in torch's extension directory under a name that carries a hash of the
sources, flags and torch version (an edit rebuilds), imported straight from there by later
processes, and memoised here. Nothing is built at import.
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

HERE = Path(__file__).resolve().parent
# The C++ by layer: kernels/ the kernels and their headers (no torch types: plain params structs
# in, a cudaError_t out), binding/ the torch-facing binding, the only C++ that sees a tensor
# (it includes kernels/elbo.h by a relative path; kernels/ never includes binding/). The lists
# name files as they lie in their folder (source_path says which). binding.h declares what
# binding_module.cpp binds, binding_check.h the one input check every entry makes
# (binding_check.cpp), binding_common.h what the other binding files share.
KERNEL_DIR = HERE / "kernels"
BINDING_DIR = HERE / "binding"
KERNEL_SOURCES = ("elbo_fast.cu", "elbo.cu", "rows.cu", "backward.cu", "adam.cu", "iwae.cu",
                  "tc_gemm.cu", "latent.cu", "pingpong.cu", "backward_fused.cu",
                  "iwae_wgmma.cu")
# In include order (the exported file inlines them so): each after those it includes.
HEADERS = ("elbo.h", "elbo_math.cuh", "cluster.cuh", "philox.cuh", "deferred.cuh",
           "tile_gemm.cuh", "wgmma.cuh", "backward_fused.h")
BINDING_SOURCES = ("binding_check.cpp", "binding_forward.cpp", "binding_backward.cpp",
                   "binding_iwae.cpp", "binding_tc.cpp", "binding_backward_fused.cpp")
BINDING_MODULE = "binding_module.cpp"
BINDING_HEADERS = ("binding.h", "binding_check.h", "binding_common.h")

# IEEE float32 throughout (no --use_fast_math): sm_90a machine code (Hopper's wgmma, which
# tc_gemm.cu needs; it runs on compute capability 9.0 alone), plus PTX for newer GPUs (where
# tc_gemm's kernel compiles to a trap and the binding never dispatches to it).
NVCC_FLAGS = [
    "-O3",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
    "-lineinfo",
]
# Hidden visibility as pybind11 asks: the option structs it binds are then no more visible
# than pybind11's own types (else gcc warns on every class_), and only PyInit_ is exported.
CXX_FLAGS = ["-O3", "-fvisibility=hidden"]


def source_path(name: str) -> Path:
    """Where the file the lists call `name` lies: kernels/ or binding/."""
    if name in (*KERNEL_SOURCES, *HEADERS):
        return KERNEL_DIR / name
    if name in (*BINDING_SOURCES, BINDING_MODULE, *BINDING_HEADERS):
        return BINDING_DIR / name
    raise ValueError(f"{name!r} is no source of the cuda backend's build")


def source_files() -> list[Path]:
    """Every file the build reads (the hash covers them all)."""
    names = (*KERNEL_SOURCES, *BINDING_SOURCES, BINDING_MODULE, *HEADERS, *BINDING_HEADERS)
    return [source_path(n) for n in names]


def _source_hash() -> str:
    """Names the build: the sources, the flags and the torch it is built against (an ABI)."""
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.relative_to(HERE).as_posix().encode())
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


# Wall time of a first build, for the message that one is starting (measured on the H200 host,
# 16 cores: 34-52 s).
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
            sources=[str(source_path(n))
                     for n in (*KERNEL_SOURCES, *BINDING_SOURCES, BINDING_MODULE)],
            extra_cflags=CXX_FLAGS,
            extra_cuda_cflags=NVCC_FLAGS,
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


# CUDA devices (with an index) this backend was found to run on, each with the extension (one
# module for all): the ops ask once per call, and a device that can run it keeps being able to
# (a no is asked again every time). lanes.py's fast lanes apply only on these (so they never
# build), and they and the ops' forward take the extension from here: a lookup, not a call.
RUNS_ON: dict[torch.device, ModuleType] = {}


def unavailable_reason(device: torch.device) -> str | None:
    """Why this backend cannot run on `device`, or None when it can."""
    if device in RUNS_ON:
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
    mod, why = _build()
    if why is None and device.index is not None:
        RUNS_ON[device] = mod
    return why
