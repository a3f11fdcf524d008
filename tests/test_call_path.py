"""The eager ELBO path enters each fastelbo file at most once (issue #38).

One call of fastelbo.ops.elbo is recorded with sys.setprofile: an *entry* into a file under
src/fastelbo is a call of one of its functions whose nearest fastelbo caller is in another file
(or that has none: the op itself). Frames of torch, of the standard library and of these tests
are passed over, so a stand-in defined here, or torch's dispatcher calling back into the file
that called it, is neither an entry nor a caller; a call within one file is not an entry.

Covered on a CPU: the torch backend (what `auto` runs there) with eps given and drawn, the
value check on and off, without autograd and with parameters that require grad; and the GPU
backends' shape of the path, through a stand-in registered as 'cuda' (tests/fake_backends.py):
called directly, drawing its own noise, and behind the custom op that autograd needs.

The real cuda backend's Python path is recorded here with a stand-in for the compiled
extension (the entry points the ops' path calls, answered by the torch spec) and the CPU
admitted as a device it runs on, so every file of the backend is the real one; a GPU test
records the same with the real extension. One file is over the target, the same with eps given
or drawn: launch.py, the extension's edge (one keyword-only wrapper per binding entry, each
passing exactly that entry's arguments: test_cuda_launch.py), entered twice: the lane's
checked_start, then the forward's forward_default. The check's call and the launch are two
crossings into the extension by design: the host prepares the call while the value check runs
on the GPU. One crossing would put that preparation before the check's launch and its round
trip on the host's path (up to ~1.8 us at B=128 on the H200). Until 2026-12-05 the forward
entered it twice (default_forward_options, then forward). CUDA_PATH holds these counts
exactly, so the path can neither grow nor shrink unnoticed. Before that the ops asked
backends/__init__.py twice (native
for the check's lane, resolve for the backend) where backends.start now does both, and waited
for the value check themselves with eps given (three lanes.py entries, a fourth launch.py one)
where the binding now waits; before that the lanes and the forward each called
build.extension() (three build.py entries, four with eps). The triton backend answers
availability and runs its forward from one file (triton/__init__.py).

The documented exceptions (VALIDATION_OFF, THROUGH_OP) are the structural ones; any other file
entered twice fails, printing the whole path, one (file, function) entry a line.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import fastelbo
from fake_backends import gpu_stand_in
from fastelbo import backends
from fastelbo.backends import torch_ref
from fastelbo.contract import validation
from fastelbo.ops import elbo as elbo_op
from fastelbo.params import VAEParams, param_shapes

PKG = str(Path(fastelbo.__file__).parent) + os.sep
DIMS, BATCH = (784, 256, 32), 128  # the problem's

# The documented exceptions: file -> entries allowed, each for a structural reason.
#
# With the value check off, the torch spec masks invalid rows (NaN out) with the contract's
# predicate, contract.unit_mask: the contract, stated once, is read by the ops' checks and then
# by the backend.
VALIDATION_OFF = {"contract.py": 2}
# Autograd needs the custom op, whose kernel torch's dispatcher calls with what a schema carries:
# the backend's name (a str, not a module) and tensors (not the value check's verdict). So the
# kernel looks the backend up again by name (backends.module), and the torch spec, given no
# verdict, masks invalid rows itself (contract.unit_mask) whether or not the ops' check read x.
THROUGH_OP = {"backends/__init__.py": 2, "contract.py": 2}


def _fastelbo_file(frame) -> str | None:
    name = frame.f_code.co_filename
    return name[len(PKG):] if name.startswith(PKG) else None


def record(call) -> list[tuple[str, str]]:
    """The (file, function) entries into fastelbo files while call() runs, in order."""
    path = []

    def profile(frame, event, arg):
        if event != "call":
            return
        file = _fastelbo_file(frame)
        if file is None:
            return
        caller = frame.f_back
        while caller is not None and _fastelbo_file(caller) is None:
            caller = caller.f_back
        if caller is None or _fastelbo_file(caller) != file:
            code = frame.f_code
            path.append((file, getattr(code, "co_qualname", code.co_name)))  # 3.10: co_name

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return path


def over_the_target(path, exceptions=None) -> dict[str, int]:
    """Files entered more often than once, or than their documented exception allows."""
    allowed = exceptions or {}
    return {f: n for f, n in Counter(f for f, _ in path).items() if n > allowed.get(f, 1)}


def show(path) -> str:
    counts = Counter(f for f, _ in path)
    return "\n".join([f"the path ({len(path)} entries):",
                      *(f"  {file:28} {fn}" for file, fn in path),
                      "entries per file: " + ", ".join(f"{f} {n}" for f, n in counts.items())])


def assert_within_target(path, exceptions=None):
    assert path and path[0] == ("ops/elbo.py", "elbo"), show(path)  # the recorder saw the op
    assert not over_the_target(path, exceptions), show(path)


def _inputs(requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    params = VAEParams(*(0.05 * torch.randn(s, generator=gen) for s in param_shapes(*DIMS)))
    if requires_grad:
        params = VAEParams(*(p.requires_grad_() for p in params))
    x = torch.rand(BATCH, DIMS[0], generator=gen)
    eps = torch.randn(BATCH, DIMS[2], generator=gen)
    return x, params, eps


def _record_elbo(x, params, eps, *, grad, backend="auto"):
    def call():
        with torch.set_grad_enabled(grad):
            return elbo_op.elbo(x, params, eps, backend=backend)

    call()  # the first call imports the backend: not part of the path being measured
    return record(call)


@pytest.mark.parametrize("validate", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("given_eps", [True, False], ids=["eps", "drawn"])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "requires-grad"])
def test_the_torch_backend_enters_each_file_once(validate, given_eps, grad):
    """`auto` on a CPU: the torch backend, TRACEABLE, called directly with or without
    autograd recording it."""
    x, params, eps = _inputs(requires_grad=grad)
    with validation(validate):
        path = _record_elbo(x, params, eps if given_eps else None, grad=grad)
    assert_within_target(path, None if validate else VALIDATION_OFF)
    assert ("backends/torch_ref.py", "forward_prepared") in path, show(path)


@pytest.fixture
def stand_in(monkeypatch):
    """The torch spec registered as the loaded 'cuda' backend (where backends.module finds
    it), so the path through backends/__init__.py is the real one. Its availability answer is
    this file's: the real cuda backend gives it from build.py, not its forward's file, and
    torch_ref's would count as a second torch_ref.py entry that only the stand-in makes."""
    fake = gpu_stand_in(DTYPES=(torch.float32,), unavailable_reason=lambda device: None)
    monkeypatch.setitem(backends._LOADED, "cuda", fake)
    return fake


@pytest.mark.parametrize("given_eps", [True, False], ids=["eps", "drawn"])
def test_a_gpu_backend_called_directly_enters_each_file_once(stand_in, given_eps):
    x, params, eps = _inputs()
    path = _record_elbo(x, params, eps if given_eps else None, grad=False, backend="cuda")
    assert_within_target(path)
    assert ("backends/torch_ref.py", "forward_prepared") in path, show(path)


def test_a_gpu_backend_drawing_its_noise_enters_each_file_once(stand_in, monkeypatch):
    """DRAWS_NOISE (the cuda backend draws torch.randn's numbers inside its launch): the ops
    hand it the call without eps."""
    def forward_drawing(x, params, verdict=None):
        eps = torch.randn(x.shape[0], params[2].shape[0])
        return torch_ref.forward_prepared(x, params, eps, verdict=verdict)

    monkeypatch.setattr(stand_in, "DRAWS_NOISE", True)
    monkeypatch.setattr(stand_in, "forward_drawing", forward_drawing)
    x, params, _ = _inputs()
    path = _record_elbo(x, params, None, grad=False, backend="cuda")
    assert_within_target(path)
    assert ("backends/torch_ref.py", "forward_prepared") in path, show(path)


@pytest.mark.parametrize("given_eps", [True, False], ids=["eps", "drawn"])
def test_a_gpu_backend_behind_the_custom_op_keeps_to_its_exceptions(stand_in, given_eps):
    """With parameters that require grad the call goes through fastelbo::elbo_forward, whose
    kernel (ops/elbo.py again, but from torch's dispatcher: not an entry) looks the backend
    up by name and hands it no verdict: THROUGH_OP."""
    x, params, eps = _inputs(requires_grad=True)
    path = _record_elbo(x, params, eps if given_eps else None, grad=True, backend="cuda")
    assert_within_target(path, THROUGH_OP)
    assert ("backends/__init__.py", "module") in path, show(path)  # the kernel's lookup
    assert ("ops/elbo.py", "_elbo_forward_kernel") not in path, show(path)


# The real cuda backend's path today (module docstring): the files over the target, exactly.
CUDA_PATH = {
    "drawn": {"backends/cuda/launch.py": 2},
    "eps": {"backends/cuda/launch.py": 2},
}


def assert_cuda_path(path, given_eps):
    expected = CUDA_PATH["eps" if given_eps else "drawn"]
    assert path and path[0] == ("ops/elbo.py", "elbo"), show(path)
    assert over_the_target(path) == expected, show(path)


class _StandInExtension:
    """What the cuda backend's Python calls of its extension on the ops' path, answered by the
    torch spec on the CPU: every check passes, the value check (validate) is 'in flight'."""

    class ForwardOptions:
        pass

    def checked_start(self, x, eps, params, validate):
        return 1 if validate else 0

    def range_check_finish(self, device):
        return True

    def last_status(self):
        return 0

    def forward(self, x, eps, params, options):
        if options.draw:  # as the kernel draws torch.randn's numbers into eps
            eps.copy_(torch.randn(eps.shape))
        return list(torch_ref.forward(x, VAEParams(*params), eps, valid=True))


@pytest.fixture
def real_cuda_backend(monkeypatch):
    """The cuda backend's own modules on a CPU x: its extension stood in for, the CPU
    admitted as a device it runs on (build.RUNS_ON), its lanes serving CPU tensors and its
    in-kernel noise taken as matching."""
    cuda = backends.module("cuda")
    from fastelbo.backends.cuda import build, noise
    ext = _StandInExtension()
    monkeypatch.setattr(build, "_build", lambda: (ext, None))
    monkeypatch.setattr(build, "RUNS_ON", {torch.device("cpu"): ext})
    monkeypatch.setitem(noise._MATCHES, None, True)  # a CPU device's index
    monkeypatch.setitem(backends.NATIVE, "cpu", "cuda")
    return cuda


@pytest.mark.parametrize("given_eps", [True, False], ids=["eps", "drawn"])
def test_the_real_cuda_backends_path_does_not_grow(real_cuda_backend, given_eps):
    x, params, eps = _inputs()
    path = _record_elbo(x, params, eps if given_eps else None, grad=False, backend="cuda")
    # the torch spec's file is the stand-in's: not part of the cuda backend's path
    path = [e for e in path if e[0] != "backends/torch_ref.py"]
    assert_cuda_path(path, given_eps)
    assert ("backends/cuda/lanes.py", "start_checks") in path, show(path)  # its own lanes
    assert ("backends/cuda/elbo.py", "forward_prepared") in path, show(path)
    if not given_eps:
        assert ("backends/cuda/noise.py", "forward_drawing") in path, show(path)


@pytest.mark.gpu
@pytest.mark.parametrize("given_eps", [True, False], ids=["eps", "drawn"])
def test_the_cuda_backends_path_on_a_gpu_does_not_grow(given_eps):
    """The same path with the real extension on a CUDA x: what the stand-in above stands for."""
    x, params, eps = _inputs()
    x, eps, params = x.cuda(), eps.cuda(), VAEParams(*[p.cuda() for p in params])
    path = _record_elbo(x, params, eps if given_eps else None, grad=False, backend="cuda")
    assert_cuda_path(path, given_eps)
    assert ("backends/cuda/elbo.py", "forward_prepared") in path, show(path)
    assert ("backends/cuda/lanes.py", "start_checks") in path, show(path)


def test_the_recorder_counts_entries_not_calls():
    """A call within a file is not an entry; a call into another file is, each time."""
    x, params, eps = _inputs()
    path = record(lambda: [torch_ref.forward(x, params, eps, valid=True) for _ in range(2)])
    assert path == [("backends/torch_ref.py", "forward")] * 2  # encode / decode: same file
    assert over_the_target(path) == {"backends/torch_ref.py": 2}
    assert over_the_target(path, {"backends/torch_ref.py": 2}) == {}
