"""Shared test configuration: `gpu`-marked tests skip where CUDA is not available."""
from pathlib import Path

import pytest
import torch

# Kept out of tests/candidates/ as a .py file because ruff (rightly) refuses to parse it.
SYNTAX_ERROR_SOURCE = '''"""A Python syntax error on line 6."""
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model

class ModelNew(Model:
    pass
'''


@pytest.fixture(scope="session")
def syntax_error_candidate(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("candidates") / "syntax_error.py"
    path.write_text(SYNTAX_ERROR_SOURCE)
    return path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_gpu_backend(monkeypatch):
    """'cuda' and 'triton' answered by the torch spec, so fastelbo.ops takes the GPU backends'
    path (the torch.library custom ops and their backward) on a CPU."""
    from fastelbo import backends
    from fastelbo.backends import torch_ref

    real = backends.module
    monkeypatch.setattr(backends, "module",
                        lambda name: torch_ref if name in ("cuda", "triton") else real(name))
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)


@pytest.fixture(scope="module")
def cuda():
    """The cuda backend module, or a skip naming why it cannot run here."""
    from fastelbo.backends import cuda as backend

    why = backend.unavailable_reason(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    return backend
