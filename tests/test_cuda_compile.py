"""The cuda backend's sources compile for sm_90 with no register spills (no GPU needed).

nvcc is found via CUDA_HOME / CUDA_PATH / /usr/local/cuda / PATH. The tests that need it (the
`nvcc` fixture; conftest.py marks them `needs_nvcc`, and device_run.sh's `tests` stage runs them
all) skip without it, except where a missing nvcc is a failure: CI set (CI's machine has the
toolkit), FASTELBO_REQUIRE_GPU=1 (a device run) or FASTELBO_REQUIRE_NVCC=1. curand_kernel.h
comes from the toolkit or from the nvidia-curand package (the dev extra), whose headers any
nvcc 12+ compiles.
The torch CPU wheel ships the c10/ATen headers but not c10/cuda/impl/cuda_cmake_macros.h
(generated at torch build time), so those compiles define C10_CUDA_NO_CMAKE_CONFIGURE_FILE.

Every compile is one job of `builds` (below): run once per session, in parallel, and cached
across sessions under a hash of its command and inputs, as the extension itself is cached.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import pytest
import torch.utils.cpp_extension as cpp_ext

from fastelbo import export
from fastelbo.backends.cuda import build as cuda_backend


def _nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


NVCC = _nvcc()
REQUIRE_NVCC = "FASTELBO_REQUIRE_NVCC"


def nvcc_required() -> str | None:
    """What makes a missing nvcc a failure here rather than a skip, or None: CI (its machine
    has the CUDA toolkit), a device run (FASTELBO_REQUIRE_GPU=1) or FASTELBO_REQUIRE_NVCC=1."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        return "CI is set"
    return next((f"{var}=1" for var in (REQUIRE_NVCC, "FASTELBO_REQUIRE_GPU")
                 if os.environ.get(var) == "1"), None)

TORCH_INCLUDES = [f"-I{p}" for p in cpp_ext.include_paths()]
TORCH_NVCC_DEFINES = [*cpp_ext.COMMON_NVCC_FLAGS, "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]
# The backend's own flags minus -lineinfo, plus the register / spill report.
NVCC_FLAGS = [f for f in cuda_backend.NVCC_FLAGS if f != "-lineinfo"] + ["-Xptxas", "-v"]
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)}\nfailed:\n{out[-6000:]}"
    return out


@pytest.fixture(scope="session")
def nvcc() -> str:
    """nvcc's path; a test that takes it is marked needs_nvcc (conftest.py)."""
    if NVCC is None:
        why = "nvcc (CUDA toolkit) not found in CUDA_HOME, CUDA_PATH, /usr/local/cuda or PATH"
        required = nvcc_required()
        if required:
            pytest.fail(f"{why}, and {required}: a missing nvcc fails, it does not skip",
                        pytrace=False)
        pytest.skip(why)
    return NVCC


class Builds:
    """The compiles of this file, each run once: `start(jobs)` sets them going on a pool (the
    compilers are single-threaded: on CI's 2 cores two at once halve the wait), `out(name)`
    waits for one and returns its output (the ptxas report) and folder (its products), failing
    with the command's output if it failed. A job is (argv, inputs): argv may name "{dir}", the
    job's folder, where `inputs` ({file name: text}) are written first. A job that passed is
    kept in `root`/<hash of argv, inputs, the files of the backend and the tools, the
    compilers' versions>, so an unchanged one is not run again (pytest's cache keeps that folder
    across sessions; `pytest --cache-clear` empties it). `prune()` drops the jobs of other
    sources and compilers, so the cache holds one set of builds."""

    def __init__(self, root: Path):
        self.root, self.jobs, self.done = root, {}, {}
        workers = int(os.environ.get("MAX_JOBS") or 0) or min(os.cpu_count() or 1, 8)
        self.pool = ThreadPoolExecutor(workers)
        tools = [_run([t, "--version"]) for t in (NVCC, _cxx()) if t]
        files = sorted([*cuda_backend.HERE.iterdir(), *cuda_backend.KERNEL_DIR.iterdir(),
                        *cuda_backend.BINDING_DIR.iterdir(), *(BENCH / "experiments").iterdir()])
        salt = repr((tools, [(f.name, f.read_bytes()) for f in files if f.is_file()]))
        self.salt = hashlib.sha256(salt.encode()).hexdigest()

    def start(self, jobs: dict[str, tuple[list[str], dict[str, str]]]) -> None:
        for name, job in jobs.items():
            if name not in self.jobs:
                self.jobs[name] = job
                self.done[name] = self.pool.submit(self._build, *job)

    def _build(self, argv: list[str], inputs: dict[str, str]) -> tuple[int, str, Path]:
        key = hashlib.sha256(repr((argv, sorted(inputs.items()), self.salt)).encode())
        folder = self.root / key.hexdigest()[:16]
        if (folder / "salt").exists():
            return 0, (folder / "log").read_text(), folder
        work = Path(f"{folder}.part{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for name, text in inputs.items():
            (work / name).write_text(text)
        cmd = [a.replace("{dir}", str(work)) for a in argv]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode:  # kept for the test's message only: a failure is never cached
            return proc.returncode, log, work
        (work / "log").write_text(log)
        (work / "salt").write_text(self.salt)  # written last: the job is complete
        shutil.rmtree(folder, ignore_errors=True)
        work.rename(folder)  # a killed run leaves a .part folder, never a half-written job
        return 0, log, folder

    def prune(self) -> None:
        for folder in self.root.iterdir():  # not the .part folders of builds under way
            salt = folder / "salt"
            if ".part" not in folder.name and not (salt.exists() and
                                                   salt.read_text() == self.salt):
                shutil.rmtree(folder, ignore_errors=True)

    def out(self, name: str) -> tuple[str, Path]:
        rc, log, folder = self.done[name].result()
        assert rc == 0, f"{' '.join(self.jobs[name][0])}\nfailed:\n{log[-6000:]}"
        return log, folder


def _cxx() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def _host_compile_job(source: str, text: str | None = None) -> tuple[list[str], dict[str, str]]:
    """`source` (a backend file, or a file `text` written into the job's folder) compiled by the
    host compiler as cpp_extension.load compiles a .cpp (the torch, Python and CUDA headers;
    the backend's CXX_FLAGS) into {dir}/out.o."""
    import torch

    path = str(cuda_backend.source_path(source)) if text is None else "{dir}/" + source
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    argv = [_cxx(), "-std=c++20", *cuda_backend.CXX_FLAGS, "-c", path, "-o", "{dir}/out.o",
            *TORCH_INCLUDES, f"-I{sysconfig.get_paths()['include']}",
            f"-I{Path(NVCC).parent.parent / 'include'}",
            "-DTORCH_EXTENSION_NAME=fastelbo_test", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]
    return argv, ({} if text is None else {source: text})


def _exe_job(main: str, *flags: str) -> tuple[list[str], dict[str, str]]:
    """A host program `main` (CUDA C++ text) built by nvcc into {dir}/exe."""
    return [NVCC, "-std=c++17", *flags, f"-I{cuda_backend.KERNEL_DIR}", "-o", "{dir}/exe",
            "{dir}/main.cu"], {"main.cu": main}


def _jobs_of(test: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The jobs a test of this file reads (by the test function's name)."""
    kernels = {f"kernel:{s}": ([NVCC, *NVCC_FLAGS, *TORCH_NVCC_DEFINES, "-c",
                                str(cuda_backend.source_path(s)), "-o", "{dir}/k.o"], {})
               for s in cuda_backend.KERNEL_SOURCES}
    if test == "test_benchmark_tools_build":
        gencode = [f for f in cuda_backend.NVCC_FLAGS if "sm_90a" in f]
        return {f"tool:{s}": ([NVCC, "-O3", "-std=c++17", *gencode, f"-I{cuda_backend.KERNEL_DIR}",
                               "-o", "{dir}/tool", str(BENCH / s)], {}) for s in BENCH_CU}
    if test in ("test_kernel_compiles_sm90_without_spills",
                "test_wgmma_kernels_keep_their_mma_pipelines"):
        return kernels
    if test == "test_iwae_wgmma_layout_is_the_models":
        flags = [f for f in NVCC_FLAGS if f not in ("-Xptxas", "-v")]
        return {"iwae_wgmma_layout": ([NVCC, *flags, *TORCH_NVCC_DEFINES,
                                       f"-I{cuda_backend.KERNEL_DIR}", "-c", "{dir}/main.cu", "-o",
                                       "{dir}/k.o"], {"main.cu": _iwae_wgmma_layout_main()})}
    if test == "test_binding_compiles_with_torch_headers_and_links_up":
        return {f"binding:{n}": _host_compile_job(n)
                for n in (*cuda_backend.BINDING_SOURCES, cuda_backend.BINDING_MODULE)}
    if test == "test_export_inline_source_compiles":
        # The device code is the kernels' own (per file, above); here nvcc checks the single
        # unit's syntax for the device and compiles its host side (the binding's entry points).
        flags = [f for f in NVCC_FLAGS if f not in ("-Xptxas", "-v")]
        return {**kernels,
                "export:cuda": ([NVCC, *flags, "-fdevice-syntax-only", *TORCH_NVCC_DEFINES,
                                 *TORCH_INCLUDES, "-c", "{dir}/inline.cu", "-o", "{dir}/out.o"],
                                {"inline.cu": export.LOAD_INLINE_CUDA_PRELUDE
                                 + export.cuda_source()}),
                "export:cpp": _host_compile_job("main.cpp", export.LOAD_INLINE_CPP_PRELUDE
                                                + export.cpp_source())}
    if test == "test_philox_matches_tritons_stream":
        return {"philox": _exe_job(_PHILOX_MAIN % (", ".join(f"{s}ULL" for s in PHILOX_SEEDS),
                                                   ", ".join(f"{o}ULL" for o in PHILOX_OFFSETS)))}
    if test == "test_philox_known_answers":
        return {"kat": _exe_job(_KAT_MAIN)}
    if test == "test_fused_backward_plans_are_the_models":
        return {"plans": _exe_job(_PLANS_MAIN, *(f for f in cuda_backend.NVCC_FLAGS
                                                  if "sm_90a" in f))}
    if test == "test_deferred_shares_cover_x_once_in_order":
        return {"deferred": _exe_job(_DEFERRED_MAIN, *(f for f in cuda_backend.NVCC_FLAGS
                                                        if "sm_90a" in f))}
    if test == "test_torch_randn_words_follow_curand":
        try:
            include = _curand_include()
        except AssertionError:
            return {}  # the test says where it looked
        # -O3: its 1,716 draws step curand up to 2^25 times each (~300 s unoptimised, ~10 s)
        return {"curand": _exe_job(_CURAND_MAIN, "-O3", f"-I{include}")}
    return {}


@pytest.fixture(scope="module")
def builds(request, nvcc, tmp_path_factory):
    """The jobs of every selected test of this file, started together at the first use. Its
    pool's threads end with this file: a later test that forks (the harness's workers) may
    only while no other thread runs."""
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    root = cache.mkdir("fastelbo-nvcc") if cache else tmp_path_factory.mktemp("nvcc")
    b = Builds(Path(root))
    here, jobs = Path(__file__).name, {}
    for item in request.session.items:
        if item.path.name == here:
            jobs.update(_jobs_of(getattr(item, "originalname", item.name)))
    # The longest first (the exported unit's host sides with all of torch's headers: 95 and
    # 51 s of CPU here, binding_module.cpp 62 s, every other job 32 s or less), so that no
    # long one is left running alone at the end.
    long = ("export:cuda", "binding:binding_module.cpp", "export:cpp")
    b.start(dict(sorted(jobs.items(), key=lambda kv: long.index(kv[0]) if kv[0] in long
                        else len(long))))
    yield b
    b.pool.shutdown(wait=True, cancel_futures=True)
    b.prune()


def _ptxas_report(out: str) -> dict[str, dict[str, int]]:
    """{kernel mangled name: {registers, stack, spill_stores, spill_loads}} for sm_90 entries."""
    kernels: dict[str, dict[str, int]] = {}
    name = None
    for line in out.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for 'sm_90a?'", line)
        if m:
            name = m.group(1)
            kernels[name] = {}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            kernels[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                 spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            kernels[name]["registers"] = int(m.group(1))
    return kernels


# Each source's kernels: the cluster kernel's two register-tile variants (elbo_kernel<2,2>,
# <4,4>), the rows path's two with the noise check's, the value check's and the deferred
# check's two (its record's take, the rows path's poison), the backward's five,
# the optimizer's one, the IWAE kernel's two tiles (iwae_kernel<4> for 128 samples, <2> for 64),
# the tensor-core GEMM's epilogues (tc_gemm_kernel<kTcStore, 128> with A split for finite W or
# not, <kTcBce, 112 or 128 columns>)
# and its three helpers, the fused latent block's one, the output layer's persistent
# ping-pong kernel, the fused backward's five (its latent kernel at R = 8 and 32 rows), and the
# IWAE kernel on wgmma with its weight split.
EXPECTED_KERNELS = {
    "elbo_fast.cu": {"elbo_fast_kernel": 1},
    "elbo.cu": {"elbo_kernel": 2},
    "rows.cu": {"reparam_kl_kernel": 1, "bce_kernel": 1, "randn_fill_kernel": 1,
                "range_flags_kernel": 1, "deferred_take_kernel": 1, "deferred_poison_kernel": 1},
    "backward.cu": {"prep_kernel": 1, "bce_grad_kernel": 1, "latent_bwd_kernel": 1,
                    "colsum_kernel": 1, "colsum_finish_kernel": 1},
    "adam.cu": {"adam_kernel": 1},
    "iwae.cu": {"iwae_kernel": 2},
    "tc_gemm.cu": {"tc_gemm_kernel": 4, "tc_bce_finish_kernel": 1, "tc_split_t_kernel": 1,
                   "tc_splitk_kernel": 1},
    "latent.cu": {"latent_kernel": 1},
    "pingpong.cu": {"pingpong_kernel": 1},
    "backward_fused.cu": {"fused_prep_kernel": 1, "fused_bce_grad_kernel": 1,
                          "fused_latent_kernel": 2, "fused_wgrad_kernel": 1,
                          "fused_wgrad_finish_kernel": 1},
    "iwae_wgmma.cu": {"iwae_wgmma_kernel": 1, "iwae_wgmma_split_kernel": 1},
}
# One block per SM by their shared memory: these may use all 255 registers (tc_gemm_kernel's and
# pingpong_kernel's launch bounds give the count their setmaxnreg split starts from: 168).
ONE_BLOCK_PER_SM = ("elbo_fast_kernel", "iwae_kernel", "tc_gemm_kernel", "pingpong_kernel",
                    "iwae_wgmma_kernel")


def _check_kernels(report: dict[str, dict[str, int]], expected: dict[str, int]) -> None:
    counts = {k: sum(f"{len(k)}{k}" in name for name in report) for k in expected}
    assert counts == expected and len(report) == sum(expected.values()), (counts, list(report))
    for name, r in report.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        assert r["stack"] == 0, f"{name}: unexpected stack frame {r}"
        # __launch_bounds__(256, 2): two blocks per SM need <= 128 registers per thread.
        limit = 255 if any(k in name for k in ONE_BLOCK_PER_SM) else 128
        assert r["registers"] <= limit, (name, r)


# ---- The nvcc tests themselves: marked, run on the device, and not skipped where required ----

HERE = Path(__file__).resolve()
NVCC_STILL_MISSING = ("test_benchmark_tools_build", "test_kernel_compiles_sm90_without_spills",
                      "test_binding_compiles_with_torch_headers_and_links_up",
                      "test_export_inline_source_compiles")  # device_run.sh ran none of these
# In a child pytest: this module without nvcc, whatever the machine has.
HIDE_NVCC = """import sys


def pytest_collection_finish(session):
    sys.modules["test_cuda_compile"].NVCC = None
"""


def _child_pytest(*args: str, env: dict[str, str] | None = None, plugin_dir: Path | None = None):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("CI", REQUIRE_NVCC, "FASTELBO_REQUIRE_GPU")}
    paths = [str(HERE.parents[1] / "src"), *([str(plugin_dir)] if plugin_dir else []),
             clean.get("PYTHONPATH", "")]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=HERE.parents[1], capture_output=True, text=True, check=False,
                          env={**clean, **(env or {}),
                               "PYTHONPATH": os.pathsep.join(filter(None, paths))})


def test_every_nvcc_test_is_marked_and_device_run_runs_them_all():
    """conftest.py marks each test that takes the nvcc fixture (here: through `builds`) as
    needs_nvcc, and device_run.sh's `tests` stage selects by that mark, not by name."""
    tree = ast.parse(HERE.read_text())
    takes = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
             and f.name.startswith("test_") and {a.arg for a in f.args.args} & {"nvcc", "builds"}}
    assert set(NVCC_STILL_MISSING) < takes
    res = _child_pytest("--collect-only", "-m", "needs_nvcc", str(HERE))
    marked = {line.split("::")[1].split("[")[0] for line in res.stdout.splitlines()
              if line.startswith("tests/")}
    assert marked == takes, res.stdout + res.stderr
    script = (HERE.parents[1] / "benchmarks" / "device_run.sh").read_text().replace("\\\n", " ")
    (command,) = [line for line in script.splitlines() if "run test_needs_nvcc" in line]
    assert command.endswith(" -m needs_nvcc tests/test_cuda_compile.py ;;"), command
    assert " -k " not in command, command


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, {REQUIRE_NVCC: "1"}, {"FASTELBO_REQUIRE_GPU": "1"}],
                         ids=["default", "require_nvcc", "require_gpu"])
def test_a_missing_nvcc_skips_unless_it_is_required(env, tmp_path):
    (tmp_path / "hide_nvcc.py").write_text(HIDE_NVCC)
    res = _child_pytest("-p", "hide_nvcc", "-rs", f"{HERE}::test_philox_known_answers",
                        env=env, plugin_dir=tmp_path)
    out = res.stdout + res.stderr
    assert "nvcc (CUDA toolkit) not found" in out, out
    if not env:
        assert res.returncode == 0 and "1 skipped" in out, out
    else:
        (var,) = env
        assert res.returncode == 1 and "1 error" in out, out
        assert f"{var}=1: a missing nvcc fails, it does not skip" in out, out


def test_every_kernel_source_is_listed():
    assert set(EXPECTED_KERNELS) == set(cuda_backend.KERNEL_SOURCES)
    on_disk = {p.name for p in cuda_backend.KERNEL_DIR.glob("*.cu")}
    assert on_disk == set(cuda_backend.KERNEL_SOURCES), on_disk


# The standalone GPU tools kept in benchmarks/experiments/: the per-phase trace driver (includes
# both cluster kernels with -DFASTELBO_TRACE) and the tensor-core GEMMs' check and timing
# driver. They build without torch, for the backend's machine code (sm_90a).
BENCH_CU = ("experiments/cuda_trace.cu", "experiments/tc_gemm_bench.cu")


@pytest.mark.slow
@pytest.mark.parametrize("source", BENCH_CU)
def test_benchmark_tools_build(source, builds):
    assert [f for f in cuda_backend.NVCC_FLAGS if "sm_90a" in f], cuda_backend.NVCC_FLAGS
    _, folder = builds.out(f"tool:{source}")
    assert (folder / "tool").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("source", cuda_backend.KERNEL_SOURCES)
def test_kernel_compiles_sm90_without_spills(source, builds):
    """Each kernel file compiled alone, as cpp_extension.load compiles it (torch's nvcc flags
    and the backend's)."""
    _check_kernels(_ptxas_report(builds.out(f"kernel:{source}")[0]), EXPECTED_KERNELS[source])


# The kernels that issue wgmma: ptxas keeps their MMA pipelines as written, neither serialising
# the MMAs (C7510-C7518, "Potential Performance Loss") nor injecting a fence (C7519: a
# fragment written after the one the kernel issues splits its commit group).
WGMMA_SOURCES = ("tc_gemm.cu", "pingpong.cu", "iwae_wgmma.cu")


@pytest.mark.slow
@pytest.mark.parametrize("source", WGMMA_SOURCES)
def test_wgmma_kernels_keep_their_mma_pipelines(source, builds):
    log = builds.out(f"kernel:{source}")[0]
    assert "wgmma" in cuda_backend.source_path(source).read_text()
    remarks = [line for line in log.splitlines() if re.search(r"\(C75\d\d\)", line)]
    assert not remarks, "\n".join(remarks)


def _iwae_wgmma_layout_main() -> str:
    """iwae_wgmma.cu itself, then static_asserts that its Smem struct has the offsets and size
    of tests/iwae_wgmma_model.py's (a wrong model fails the compile, naming the field)."""
    import iwae_wgmma_model as wm
    offsets, size = wm.smem_struct()
    lines = ['#include <cstddef>', '#include "iwae_wgmma.cu"',
             f"static_assert(sizeof(fastelbo::iw::Smem) == {size}, \"sizeof(Smem)\");"]
    lines += [f"static_assert(offsetof(fastelbo::iw::Smem, {name}) == {at}, \"{name}\");"
              for name, at in offsets.items()]
    lines.append(f"static_assert(fastelbo::iw::kSmemFixed == {size + 1024}, \"kSmemFixed\");")
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_iwae_wgmma_layout_is_the_models(builds):
    """The compiled Smem of iwae_wgmma.cu has the model's field offsets and size."""
    builds.out("iwae_wgmma_layout")


def test_kernel_and_binding_files_define_no_macros():
    """The exported file compiles these files as one translation unit (after every header),
    and its test takes their machine code from the per-file builds: that holds while none of
    them defines a macro (which would reach the files after it there) or a __constant__
    (one 64 KiB bank for the whole unit)."""
    for name in (*cuda_backend.KERNEL_SOURCES, *cuda_backend.BINDING_SOURCES):
        text = cuda_backend.source_path(name).read_text()
        assert not re.search(r"^\s*#\s*(define|undef)\b", text, re.MULTILINE), name
        assert "__constant__" not in text, name


def test_kernel_sources_have_no_torch_and_no_fast_math():
    for name in (*cuda_backend.KERNEL_SOURCES, *cuda_backend.HEADERS):
        text = cuda_backend.source_path(name).read_text()
        assert not re.search(r"#\s*include\s*<(torch|ATen|c10)/", text), name
        assert "at::" not in text and "torch::" not in text, name
    flags = " ".join(cuda_backend.NVCC_FLAGS)
    assert "fast_math" not in flags and "fast-math" not in flags and "ftz=true" not in flags


def test_the_layers_include_down_only():
    """kernels/ includes only kernels/ (never a torch header: above), binding/ its own folder
    and kernels/: every quoted #include resolves from the including file's folder, as nvcc
    and the host compiler resolve it with no -I of ours."""
    files = cuda_backend.source_files()
    for f in files:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read_text(), re.MULTILINE):
            target = (f.parent / name).resolve()
            assert target in files, (f.name, name)
            allowed = ((cuda_backend.KERNEL_DIR,) if f.parent == cuda_backend.KERNEL_DIR
                       else (cuda_backend.KERNEL_DIR, cuda_backend.BINDING_DIR))
            assert target.parent in allowed, (f.name, name)


def test_sources_are_package_data():
    """Every file the build reads is one of pyproject's package-data patterns (so a wheel
    ships it), and kernels/ and binding/ hold no file the build does not list."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the dev extra installs tomli where tomllib is missing
        import tomli as tomllib
    project = tomllib.loads((HERE.parents[1] / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["fastelbo"]
    package = cuda_backend.HERE.parents[1]  # src/fastelbo
    for f in cuda_backend.source_files():
        assert f.exists(), f
        rel = f.relative_to(package).as_posix()
        assert any(PurePosixPath(rel).match(p) and rel.count("/") == p.count("/")
                   for p in patterns), rel
    on_disk = {f for d in (cuda_backend.KERNEL_DIR, cuda_backend.BINDING_DIR)
               for f in d.iterdir()}
    assert on_disk == set(cuda_backend.source_files()), on_disk ^ set(cuda_backend.source_files())


def _binding_symbols(obj: Path) -> tuple[set[str], set[str]]:
    """(defined in text, undefined) fastelbo::binding functions of an object file, demangled."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) to read the objects' symbols")
    defined, undefined = set(), set()
    for line in _run([nm, "-C", str(obj)]).splitlines():
        m = re.match(r"^[0-9a-fA-F]*\s+([A-Za-z])\s+(fastelbo::binding::.*)$", line)
        if m and m.group(1) in "TU":
            (undefined if m.group(1) == "U" else defined).add(m.group(2))
    return defined, undefined


@pytest.mark.slow
def test_binding_compiles_with_torch_headers_and_links_up(builds):
    """Each binding file compiles alone, and every entry point binding_module.cpp binds is
    defined by exactly one of the others (what the extension's link needs)."""
    objs = {name: builds.out(f"binding:{name}")[1] / "out.o"
            for name in (*cuda_backend.BINDING_SOURCES, cuda_backend.BINDING_MODULE)}
    _, needed = _binding_symbols(objs[cuda_backend.BINDING_MODULE])
    defined = [_binding_symbols(objs[n])[0] for n in cuda_backend.BINDING_SOURCES]
    assert len(needed) >= 13, needed  # every entry point of binding.h
    for sym in needed:
        assert sum(sym in d for d in defined) == 1, sym


def _load_solution(path: Path):
    spec = importlib.util.spec_from_file_location("fastelbo_exported_solution", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_export_is_self_contained_python(tmp_path):
    path = export.write_kernelbench(tmp_path / "solution.py")
    text = path.read_text()
    tree = ast.parse(text)
    compile(text, str(path), "exec")
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported == {"torch"}, imported
    assert "fastelbo" not in {n for n in imported}
    assert not re.search(r"^\s*(import|from)\s+fastelbo", text, re.MULTILINE)
    mod = _load_solution(path)
    import torch

    torch.manual_seed(0)
    model = mod.ModelNew(784, 256, 32)
    from fastelbo.params import STATE_DICT_KEYS
    from fastelbo.problems.vae_elbo import Model

    assert tuple(model.state_dict()) == STATE_DICT_KEYS
    torch.manual_seed(0)
    ref = Model(784, 256, 32)
    for (k, a), (k2, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    for header in (*cuda_backend.HEADERS, *cuda_backend.BINDING_HEADERS):
        assert f'#include "{header}"' not in mod.CUDA_SOURCE + mod.CPP_SOURCE
    assert '#include "../' not in mod.CUDA_SOURCE + mod.CPP_SOURCE  # binding/'s of kernels/
    # The pybind11 module goes to cpp_sources (the host compiler), the rest to nvcc.
    assert "PYBIND11_MODULE" in mod.CPP_SOURCE and "PYBIND11_MODULE" not in mod.CUDA_SOURCE
    assert "elbo_forward(" in mod.CUDA_SOURCE and "struct ForwardOptions" in mod.CPP_SOURCE
    # The package's keyword-only wrapper, carried: the file calls the binding as it does
    # (test_export.py runs the file against a stand-in extension).
    assert "def forward(ext, *, x, eps, params, options):" in text
    # Bad input is refused in Python, before any build or launch (no C++ exception path).
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        model(torch.rand(2, 784))
    with pytest.raises(TypeError, match="torch.Tensor"):
        model([[0.5] * 784])


def test_export_holds_every_binding_file_once():
    """Each source and header of the build is in the exported texts (a file added to the
    build but not to the export would leave the single file unable to build)."""
    texts = {"cuda": export.cuda_source(), "cpp": export.cpp_source()}
    where = {n: "cuda" for n in (*cuda_backend.HEADERS, *cuda_backend.KERNEL_SOURCES,
                                 *cuda_backend.BINDING_SOURCES, "binding_check.h",
                                 "binding_common.h")}
    where.update({cuda_backend.BINDING_MODULE: "cpp"})
    assert set(where) | {"binding.h"} == {f.name for f in cuda_backend.source_files()}
    for name, part in where.items():
        assert texts[part].count(f"// ---- {name} ----") == 1, name
        assert f"// ---- {name} ----" not in texts["cpp" if part == "cuda" else "cuda"], name
    for part in texts.values():  # both translation units declare the API
        assert part.count("// ---- binding.h ----") == 1


@pytest.mark.slow
def test_export_inline_source_compiles(builds, tmp_path):
    """The exported cuda_sources, with load_inline's prelude, compile with nvcc for sm_90 (the
    unit's host side, and its device syntax: the kernels' machine code is the per-file builds',
    the same text with the same flags, held to no spills here too); its cpp_sources with the
    host compiler; and the module's entry points are all defined in the CUDA unit (what
    load_inline's link needs)."""
    mod = _load_solution(export.write_kernelbench(tmp_path / "solution.py"))
    assert (mod.CUDA_SOURCE, mod.CPP_SOURCE) == (export.cuda_source(), export.cpp_source())
    for source in cuda_backend.KERNEL_SOURCES:  # each kernel file whole, as built alone
        text = export._INCLUDE_HEADER.sub("", cuda_backend.source_path(source).read_text())
        assert f"// ---- {source} ----\n{text}" in mod.CUDA_SOURCE, source
    report = {}
    for source in cuda_backend.KERNEL_SOURCES:
        report.update(_ptxas_report(builds.out(f"kernel:{source}")[0]))
    _check_kernels(report, {k: n for per in EXPECTED_KERNELS.values() for k, n in per.items()})
    defined, _ = _binding_symbols(builds.out("export:cuda")[1] / "out.o")
    _, needed = _binding_symbols(builds.out("export:cpp")[1] / "out.o")
    assert len(needed) >= 13 and needed <= defined, needed - defined


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# ---- the IWAE kernel's noise: Triton's Philox stream, checked on the host ----------------------
PHILOX_SEEDS = (0, 7, 123456789012345)
# (image << 32) + k * L + j offsets as the kernels form them: small, one tile in, large k, the
# top of image 0's low word, the last sample of image 9999, large image indices (8 offsets: the
# Triton side's tl.arange wants a power of 2).
PHILOX_OFFSETS = (0, 1, 31, 5000 * 32 + 5, 2**32 - 1, (9999 << 32) + 4999 * 32 + 31,
                  (3 << 32) + 17, ((2**31 - 1) << 32) + 2**32 - 1)
_PHILOX_MAIN = r"""
#include <cstdio>
#include "philox.cuh"
int main() {
  const unsigned long long seeds[] = {%s};
  const unsigned long long offsets[] = {%s};
  for (unsigned long long s : seeds)
    for (unsigned long long o : offsets) {
      uint32_t a, b;
      fastelbo::philox2(s, o, &a, &b);
      std::printf("%%u %%u %%.9g\n", a, b, fastelbo::philox_uniform(a));
    }
}
"""
_TRITON_PHILOX = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl

@triton.jit
def draw(seed, off_ptr, out_ptr, uni_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    r0, r1, _, _ = tl.randint4x(seed, tl.load(off_ptr + i))
    tl.store(out_ptr + 2 * i, r0.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 2 * i + 1, r1.to(tl.int32, bitcast=True))
    tl.store(uni_ptr + i, tl.rand(seed, tl.load(off_ptr + i)))

offs = torch.tensor(%s, dtype=torch.int64)
for seed in %s:
    out = torch.empty(2 * len(offs), dtype=torch.int32)
    uni = torch.empty(len(offs), dtype=torch.float32)
    draw[(1,)](seed, offs, out, uni, N=len(offs))
    for i in range(len(offs)):
        a, b = (int(v) & 0xFFFFFFFF for v in out[2 * i:2 * i + 2])
        print(a, b, repr(float(uni[i])))
"""


def test_philox_matches_tritons_stream(builds):
    """philox.cuh draws tl.randint4x's integers and tl.rand's uniforms for the same (seed,
    offset): the cuda IWAE kernel's noise is the Triton kernel's."""
    ours = [line.split() for line in _run([str(builds.out("philox")[1] / "exe")]).splitlines()]
    theirs = [line.split() for line in _run(
        [sys.executable, "-c", _TRITON_PHILOX % (list(PHILOX_OFFSETS), list(PHILOX_SEEDS))]
    ).splitlines()]
    assert len(ours) == len(theirs) == len(PHILOX_SEEDS) * len(PHILOX_OFFSETS)
    for o, t in zip(ours, theirs):
        assert o[:2] == t[:2], (o, t)
        # 9 significant digits name a float32 exactly: compare as float32.
        assert struct.pack("f", float(o[2])) == struct.pack("f", float(t[2])), (o, t)
    assert len({tuple(o[:2]) for o in ours}) == len(ours)  # distinct draws



# ---- torch.randn's stream (philox.cuh torch_randn_*), checked on the host -------------------
_KAT_MAIN = r"""
#include <cstdio>
#include "philox.cuh"
int main() {
  // Random123's known answers for philox4x32_10 (kat_vectors): zero, all-ones, pi's digits.
  uint32_t in[3][6] = {{0, 0, 0, 0, 0, 0},
                       {~0u, ~0u, ~0u, ~0u, ~0u, ~0u},
                       {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u,
                        0xa4093822u, 0x299f31d0u}};
  for (auto& v : in) {
    uint32_t c[4] = {v[0], v[1], v[2], v[3]};
    fastelbo::philox4x32_10(c, v[4], v[5]);
    std::printf("%08x %08x %08x %08x\n", c[0], c[1], c[2], c[3]);
  }
}
"""
_KAT_OUT = ["6627e8d5 e169c58d bc57ac4c 9b00dbd8", "408f276d 41c83b0e a20bc7c6 6d5451fd",
            "d16cfe09 94fdcceb 5001e420 24126ea1"]


def test_philox_known_answers(builds):
    assert _run([str(builds.out("kat")[1] / "exe")]).split("\n")[:3] == _KAT_OUT


# The deferred value check's index arithmetic (deferred.cuh), run on the host: the shares of
# `parts` blocks of `threads` threads each, for x 16-byte aligned or not, visit every element of
# x exactly once, each thread in increasing order (so a thread's first bad element is its
# earliest), and the per-thread counts and firsts combine into the whole x's; the record's key
# orders positions and reads back.
_DEFERRED_MAIN = r"""
#include <cstdint>
#include <cstdio>
#include <vector>
#include "deferred.cuh"
int main() {
  const long long ns[] = {1, 2, 3, 4, 5, 7, 31, 784, 785, 4 * 781 + 3, 1000 * 781, 128 * 784};
  const int parts_list[] = {1, 2, 3, 7, 16}, threads_list[] = {1, 32, 256};
  long cases = 0, bad = 0;
  for (long long n : ns) for (int parts : parts_list) for (int threads : threads_list)
  for (int off = 0; off < 2; ++off) {
    // Only the address decides the layout: a fake one, aligned or one float past.
    const float* x = reinterpret_cast<const float*>(uintptr_t{1} << 20) + off;
    std::vector<char> mask(n), seen(n, 0);
    for (long long e = 0; e < n; ++e) mask[e] = (e * 2654435761LL) % 97 == 3 || e == n - 1;
    long long want_count = 0, want_first = -1, count = 0, first = -1;
    for (long long e = 0; e < n; ++e)
      if (mask[e]) { ++want_count; if (want_first < 0) want_first = e; }
    for (int part = 0; part < parts; ++part) {
      const fastelbo::DeferredShare s = fastelbo::deferred_share(x, n, part, parts);
      for (int t = 0; t < threads; ++t) {
        long long last = -1, tc = 0, tf = -1;
        fastelbo::deferred_visit(s, n, t, threads, [&](long long e) {
          if (e < 0 || e >= n || e <= last) ++bad;
          else { ++seen[e]; last = e; if (mask[e]) { ++tc; if (tf < 0) tf = e; } }
        });
        count += tc;
        if (tf >= 0 && (first < 0 || tf < first)) first = tf;
      }
    }
    for (long long e = 0; e < n; ++e) bad += seen[e] != 1;
    bad += count != want_count || first != want_first;
    ++cases;
  }
  const long long pos[][2] = {{0, 0}, {0, 1}, {1, 0}, {5, 783}, {5, 784}, {2147483646, 7},
                              {3, 2147483646}};
  for (auto& a : pos) for (auto& b : pos) {
    const unsigned long long ka = fastelbo::deferred_key(a[0], a[1]);
    const unsigned long long kb = fastelbo::deferred_key(b[0], b[1]);
    const bool earlier = a[0] < b[0] || (a[0] == b[0] && a[1] < b[1]);
    bad += (ka > kb) != earlier || ka == 0 || (~ka >> 32) != (unsigned long long)a[0] ||
           (~ka & 0xffffffffULL) != (unsigned long long)a[1];
  }
  std::printf("%ld %ld\n", cases, bad);
}
"""


def test_deferred_shares_cover_x_once_in_order(builds):
    cases, bad = map(int, _run([str(builds.out("deferred")[1] / "exe")]).split())
    assert cases == 12 * 5 * 3 * 2 and bad == 0


# curand's own device API made host-callable (its QUALIFIERS macro), driven the way PyTorch's
# normal_ kernel drives it, against torch_randn_words for every word pair a float draws from.
_CURAND_MAIN = r"""
#define QUALIFIERS static __forceinline__ __host__ __device__
#include <curand_kernel.h>
#include <cstdio>
#include "philox.cuh"
int main() {
  const unsigned long long seeds[] = {0ULL, 42ULL, 0x123456789abcdefULL, ~0ULL};
  // PyTorch's offsets are multiples of 4; the others (and the 64-bit wrap) exercise curand4's
  // word shifts and carries.
  const unsigned long long offsets[] = {0, 4, 8, 1, 2, 3, 5, 4096, (1ULL << 34) + 7,
                                        ~0ULL - 3, ~0ULL};
  const unsigned long long threads[] = {256, 4096, 270336};
  const unsigned long long elems[] = {0, 1, 255, 4095, 4096, 8191, 270335, 270336, 270337,
                                      3 * 270336 + 5, 4 * 270336, 9 * 270336 + 17, 1ULL << 33};
  long bad = 0, n = 0;
  for (auto seed : seeds) for (auto off : offsets) for (auto T : threads) for (auto i : elems) {
    const unsigned long long t = i % T, k = i / T;
    curandStatePhilox4_32_10_t st;
    curand_init(seed, t, off, &st);
    uint4 r = curand4(&st);
    for (unsigned long long c = 0; c < k / 4; ++c) r = curand4(&st);
    const unsigned int w[4] = {r.x, r.y, r.z, r.w};
    const int pair = 2 * static_cast<int>((k % 4) / 2);
    unsigned int x, y;
    bool sine;
    fastelbo::torch_randn_words(seed, off, T, i, &x, &y, &sine);
    ++n;
    if (x != w[pair] || y != w[pair + 1] || sine != (k % 2 == 0)) ++bad;
  }
  std::printf("%ld %ld\n", n, bad);
}
"""


def _curand_include() -> str:
    """A directory holding curand_kernel.h: the CUDA toolkit's, or the nvidia-curand package's
    (nvidia/cu13 for CUDA 13's, nvidia/curand for the cu12 wheel's)."""
    roots = [Path(NVCC).resolve().parent.parent / "include"] if NVCC else []
    for base in map(Path, sys.path):
        roots += [base / "nvidia" / "cu13" / "include", base / "nvidia" / "curand" / "include"]
    found = next((str(r) for r in roots if (r / "curand_kernel.h").exists()), None)
    assert found, ("curand_kernel.h is neither in the CUDA toolkit nor in an nvidia-curand "
                   "package: `pip install nvidia-curand` (the dev extra has it)")
    return found


def test_torch_randn_words_follow_curand(builds):
    """The words torch_randn_words picks are those curand_init(seed, t, offset) + curand4 give
    the thread of PyTorch's normal_ launch that writes element i (the GPU tests then check the
    floats against torch.randn itself)."""
    _curand_include()
    n, bad = map(int, _run([str(builds.out("curand")[1] / "exe")]).split())
    assert n == 4 * 11 * 3 * 13 and bad == 0


# The fused backward's host plans, the real functions run on the host: the K split of
# tc_gemm.cu's kTcStore GEMMs, the row-tile kernels' column groups and the weight gradients'
# workspace, which tests/fused_backward_model.py computes on its own.
_PLANS_MAIN = r"""
#include <cstdio>
#include "tc_gemm.cu"
#include "backward_fused.cu"
namespace fastelbo {  // what the two files link against elsewhere: never called here
bool encode_tensor_map_2d(CUtensorMap*, const float*, int, int, int, int, int,
                          CUtensorMapSwizzle, CUtensorMapL2promotion) noexcept { return false; }
cudaError_t cluster_device(int, ClusterDevice*) noexcept { return cudaErrorNoDevice; }
}
int main() {
  const int ms[] = {1, 7, 128, 129, 784, 1000, 2048, 4096, 65536};
  const int ks[] = {1, 5, 32, 64, 128, 256, 784, 1000, 4096};
  const int sms[] = {1, 3, 132};
  for (int s : sms) for (int m : ms) for (int n : ms) for (int k : ks)
    std::printf("s %d %d %d %d %d\n", m, n, k, s, fastelbo::tc_gemm_splits(m, n, k, s));
  for (int s : sms) for (int m : ms) for (int d : ks)
    std::printf("g %d %d %d %d\n", m, d, s, fastelbo::fused_col_groups(m, d, s));
  for (int n : ms) {  // the reference dims' eight jobs: three products, five sums
    fastelbo::FusedWgradParams p{};
    const int P[] = {32, 32, 256, 1, 1, 1, 1, 1}, Q[] = {256, 256, 32, 256, 32, 32, 256, 784};
    for (int t = 0; t < 8; ++t) {
      p.g[t] = t < 3 ? reinterpret_cast<const float*>(16) : nullptr;
      p.P[t] = P[t];
      p.Q[t] = Q[t];
    }
    p.count = 8;
    p.n = n;
    std::printf("w %d %d\n", n, fastelbo::fused_wgrad_workspace(p));
  }
}
"""


def test_fused_backward_plans_are_the_models(builds):
    """tc_gemm_splits, fused_col_groups and fused_wgrad_workspace (the real host functions)
    give what tests/fused_backward_model.py assumes, over batches, dims and GPU sizes."""
    import fused_backward_model as fm

    lines = _run([str(builds.out("plans")[1] / "exe")]).split()
    rows = [lines[i:i + 1 + {"s": 5, "g": 4, "w": 2}[lines[i]]] for i in range(len(lines))
            if lines[i] in ("s", "g", "w")]
    seen = {"s": 0, "g": 0, "w": 0}
    for kind, *v in rows:
        v = list(map(int, v))
        seen[kind] += 1
        if kind == "s":
            assert fm.tc_splits(*v[:4]) == v[4], v
        elif kind == "g":
            assert fm.col_groups(*v[:3]) == v[3], v
        else:
            cols = 2 * 32 * 256 + 256 * 32 + 256 + 32 + 32 + 256 + 784
            assert v[1] == (fm.cdiv(v[0], fm.WGRAD_ROWS) * cols if v[0] > fm.WGRAD_ROWS
                            else 0), v
    assert seen == {"s": 3 * 9 * 9 * 9, "g": 3 * 9 * 9, "w": 9}
