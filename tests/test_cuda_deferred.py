"""The deferred value check (FASTELBO_DEFERRED_CHECK=1, fastelbo.deferred_check): x checked by
the cuda backend's forward kernels themselves, every output of a call with a bad x NaN, the
error raised later by fastelbo.check_errors(); no host wait in the forward; graph-capturable.

`deferred_spec` states the semantics as a torch model (what a forward with the deferred check
must return, and what the check must report); the CPU tests hold it to the contract, the GPU
tests (marked gpu) hold every path's kernels to it: bad values (NaN, infinities, below 0, above
1) in the first row, the last row and the last element, good x against the spec at atol = rtol
= 1e-4, the forward's host path waiting for nothing, and graph replays.
benchmarks/device_run.sh's `deferred` stage runs this file on the GPU.
"""
from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch

import fastelbo
from fastelbo import contract, export
from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model
from reference import assert_outputs_close

DIMS, ODD = (784, 256, 32), (781, 250, 31)
BAD_VALUES = (float("nan"), float("inf"), -float("inf"), -0.5, 1.0000001)


def deferred_spec(x, params, eps):
    """((elbo, recon, kl), record) of a forward with the deferred check: the spec's outputs
    where every value of x lies in [0, 1] (record None); else NaN in every element of all three,
    and the record (count, row, col, value) of the bad values, the first in row-major order."""
    bad = ~contract.unit_mask(x)
    if not bool(bad.any()):
        return torch_ref.forward(x, params, eps), None
    r, c = (int(i) for i in bad.nonzero()[0])
    nan = torch.full((x.shape[0],), float("nan"), dtype=x.dtype, device=x.device)
    return (nan, nan.clone(), nan.clone()), (int(bad.sum()), r, c, float(x[r, c]))


def message_of(record) -> str:
    """What check_errors raises for `record` (its value as float32 bits, as the kernels keep
    it)."""
    count, r, c, v = record
    bits = int(torch.tensor([v], dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF
    return str(contract.deferred_value_error(count, r, c, bits))


def inputs(dims, batch, seed=0, device="cpu"):
    torch.manual_seed(seed)
    params = VAEParams(*(t.detach().to(device) for t in Model(*dims).state_dict().values()))
    x = torch.rand(batch, dims[0], device=device)
    eps = torch.randn(batch, dims[2], device=device)
    return params, x, eps


def positions(batch, d):
    """First row, last row, last element (and one inside)."""
    return sorted({(0, d // 2), (batch - 1, 0), (batch - 1, d - 1), (batch // 2, d // 3)})


# ---- the model, on the CPU ----------------------------------------------------------------
def test_the_spec_gives_the_reference_for_good_x():
    params, x, eps = inputs((33, 7, 5), 6)
    x[0, 0], x[5, 32] = 0.0, 1.0  # the ends are inside
    got, record = deferred_spec(x, params, eps)
    assert record is None
    assert_outputs_close(got, torch_ref.forward(x, params, eps), atol=0, rtol=0)


@pytest.mark.parametrize("value", BAD_VALUES)
def test_the_spec_poisons_every_output_and_reports_the_first_bad_value(value):
    params, x, eps = inputs((33, 7, 5), 6)
    x[4, 1] = value
    x[2, 30] = value  # earlier in row-major order
    x[5, 32] = 2.0
    outs, record = deferred_spec(x, params, eps)
    assert all(bool(o.isnan().all()) for o in outs)
    as_float32 = torch.tensor(value).item()
    assert record[:3] == (3, 2, 30) and (record[3] == as_float32 or math.isnan(value))
    msg = message_of(record)
    assert "3 value(s)" in msg and f"first x[2, 30] = {as_float32}" in msg


def test_the_deferred_switch_reads_the_environment():
    assert not contract.deferred_by_env({})
    for on in ("1", "true", "YES ", " True"):
        assert contract.deferred_by_env({contract.DEFERRED_ENV_VAR: on}), on
    for off in ("0", "", "no", "false", "2"):
        assert not contract.deferred_by_env({contract.DEFERRED_ENV_VAR: off}), off
    was = contract.deferred
    with fastelbo.deferred_check(True):
        assert contract.deferred is True
        fastelbo.set_deferred_check(False)
        assert contract.deferred is False
    assert contract.deferred is was


def test_check_errors_is_a_no_op_where_the_backend_never_ran():
    fastelbo.check_errors()  # no device the cuda backend runs on: nothing to wait for
    with pytest.raises(ValueError, match="must be a CUDA device"):
        fastelbo.check_errors("cpu")


# ---- the kernels, on the GPU --------------------------------------------------------------
def _registered(cuda):
    """The backend, with this GPU registered as one it runs on (check_errors reads those)."""
    assert cuda.unavailable_reason(torch.device("cuda", torch.cuda.current_device())) is None
    return cuda


# (dims, batch, path, x's offset in floats): every path of the forward, the cluster and fast
# kernels' shares of x 16-byte aligned and not (an offset view), tc with two row chunks.
CASES = [(DIMS, 1, "auto", 0), (DIMS, 7, "auto", 0), (DIMS, 80, "cluster", 1),
         (DIMS, 128, "auto", 0), (DIMS, 384, "auto", 0), (DIMS, 128, "cluster", 1),
         (DIMS, 385, "auto", 0), (DIMS, 1000, "rows", 0), (DIMS, 1000, "tc", 0),
         (DIMS, 20000, "tc", 0), (ODD, 7, "auto", 0), (ODD, 1000, "auto", 1)]


def _case_id(case):
    dims, batch, path, off = case
    return f"{'x'.join(map(str, dims))}-B{batch}-{path}" + ("-unaligned" if off else "")


def _on_gpu(case):
    dims, batch, path, off = case
    params, x, eps = inputs(dims, batch, seed=batch, device="cuda")
    if off:  # x one float past its storage's start: not 16-byte aligned
        base = torch.empty(batch * dims[0] + off, device="cuda")
        base[off:].copy_(x.flatten())
        x = base[off:].view(batch, dims[0])
    return params, x, eps, path


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_path_poisons_a_bad_x_and_reports_it(cuda, case):
    cuda = _registered(cuda)
    params, x, eps, path = _on_gpu(case)
    fastelbo.check_errors()  # nothing pending from earlier tests
    want, record = deferred_spec(x, params, eps)
    got = cuda.forward(x, params, eps, path=path, deferred=True, _poison=True)
    assert record is None
    assert_outputs_close(got, want, what=_case_id(case))
    fastelbo.check_errors()  # silent: good x
    for value in BAD_VALUES:
        for r, c in positions(*x.shape):
            y = x.clone()
            y[r, c] = value
            want, record = deferred_spec(y, params, eps)
            got = cuda.forward(y, params, eps, path=path, deferred=True, _poison=True)
            what = f"{_case_id(case)} x[{r}, {c}] = {value}"
            assert all(bool(o.isnan().all()) for o in got), what  # every output, every row
            with pytest.raises(ValueError, match=re.escape(message_of(record))):
                fastelbo.check_errors()
            fastelbo.check_errors()  # the record was cleared: nothing twice


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [7, 128, 1000])
def test_errors_of_several_calls_add_up_until_checked(cuda, batch):
    """Two bad calls before one check: their counts add, and the first value reported is the
    earliest position of either; a good call between them is unaffected."""
    cuda = _registered(cuda)
    params, x, eps, _ = _on_gpu((DIMS, batch, "auto", 0))
    fastelbo.check_errors()
    a, b = x.clone(), x.clone()
    a[batch - 1, 700], a[batch - 1, 701] = float("nan"), 3.0
    b[batch // 2, 5] = -1.0
    cuda.forward(a, params, eps, deferred=True)
    good = cuda.forward(x, params, eps, deferred=True)
    cuda.forward(b, params, eps, deferred=True)
    assert_outputs_close(good, deferred_spec(x, params, eps)[0])
    with pytest.raises(ValueError, match=re.escape(message_of((3, batch // 2, 5, -1.0)))):
        fastelbo.check_errors()


def _model(dims=DIMS, seed=0):
    torch.manual_seed(seed)
    return fastelbo.ModelNew(*dims, backend="cuda").cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("given_eps", [True, False], ids=["eps", "drawn"])
@pytest.mark.parametrize("batch", [1, 128, 384, 1000, 65536])
def test_the_ops_take_the_deferred_check(cuda, batch, given_eps):
    """fastelbo's own call (ModelNew, no autograd) with the switch on: the spec's numbers for
    good x (eps given, or drawn as torch.randn would), NaN and a later error for bad x."""
    _registered(cuda)
    model = _model()
    params = model.vae_params()
    x = torch.rand(batch, DIMS[0], device="cuda")
    eps = torch.randn(batch, DIMS[2], device="cuda")
    fastelbo.check_errors()
    with fastelbo.deferred_check(True), torch.no_grad():
        torch.manual_seed(3)
        got = model(x, eps if given_eps else None)
        torch.manual_seed(3)
        drawn = eps if given_eps else torch.randn(batch, DIMS[2], device="cuda")
        assert_outputs_close(got, deferred_spec(x, params, drawn)[0])
        fastelbo.check_errors()
        y = x.clone()
        y[batch - 1, DIMS[0] - 1] = float("inf")
        got = model(y, eps if given_eps else None)  # no exception here
        assert all(bool(o.isnan().all()) for o in got)
    with pytest.raises(ValueError, match=re.escape(f"first x[{batch - 1}, {DIMS[0] - 1}] = inf")):
        fastelbo.check_errors()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_autograd_and_other_backends_still_raise_at_the_call(cuda):
    """The deferral is the cuda kernels' alone: an autograd call (the custom op) and another
    backend run the check before their launch and raise the contract's error there."""
    _registered(cuda)
    model = _model()
    x = torch.rand(16, DIMS[0], device="cuda")
    x[3, 4] = float("nan")
    with fastelbo.deferred_check(True):
        with pytest.raises(ValueError, match=re.escape("first x[3, 4] = nan")):
            model(x)  # parameters require grad: the op's path
        params = VAEParams(*(p.detach() for p in model.vae_params()))
        with pytest.raises(ValueError, match=re.escape("first x[3, 4] = nan")):
            fastelbo.elbo(x, params, backend="torch")
    fastelbo.check_errors()  # nothing was deferred


def _queued_behind_a_sleep(call) -> bool:
    """Whether call() returned while ~1 s of earlier device work was still queued on the
    current stream, i.e. without waiting for the device (no PyTorch sync either: sync debug
    mode "error")."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s at 2 GHz: far longer than any host path
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return busy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dims, batch", [(DIMS, 7), (DIMS, 128), (DIMS, 1000), (ODD, 1000)])
def test_the_forward_waits_for_nothing(cuda, dims, batch):
    """With the switch on, the forward's host path returns while earlier work is still queued
    (nothing waited for the device, no PyTorch sync); with it off, today's check waits for the
    device (in the binding, not through PyTorch) before the launch."""
    _registered(cuda)
    model = _model(dims)
    x = torch.rand(batch, dims[0], device="cuda")

    def forward():
        with torch.no_grad():
            model(x)

    with fastelbo.deferred_check(True):
        forward()  # warm: plans, the noise check, allocations
        assert _queued_behind_a_sleep(forward)
    forward()
    assert not _queued_behind_a_sleep(forward)
    fastelbo.check_errors()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [7, 128, 1000])
def test_a_captured_forward_checks_every_replay(cuda, batch):
    """Captured into a CUDA graph with the switch on, the forward checks x on every replay:
    good x the spec's numbers, a bad one NaN and the error at the next check, then good again.
    check_errors itself refuses to run inside a capture."""
    _registered(cuda)
    model = _model()
    params = VAEParams(*(p.detach() for p in model.vae_params()))
    good = torch.rand(batch, DIMS[0], device="cuda")
    static_x, eps = good.clone(), torch.randn(batch, DIMS[2], device="cuda")
    with fastelbo.deferred_check(True), torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fastelbo.elbo(static_x, params, eps, backend="cuda")  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fastelbo.elbo(static_x, params, eps, backend="cuda")
            with pytest.raises(RuntimeError, match="capture"):
                fastelbo.check_errors()
    fastelbo.check_errors()
    for value in (None, float("nan"), None, 1.5):
        static_x.copy_(good)
        if value is not None:
            static_x[batch - 1, 0] = value
        graph.replay()
        want, record = deferred_spec(static_x, params, eps)
        assert_outputs_close(out, want, what=f"replay with {value}")
        if record is None:
            fastelbo.check_errors()
        else:
            with pytest.raises(ValueError, match=re.escape(message_of(record))):
                fastelbo.check_errors()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_exported_file_defers_too(tmp_path):
    """export's deferred=True: the single file's ModelNew passes the deferred option (NaN for a
    bad x, no wait) and its check_errors raises the contract's error; good x as the spec."""
    path = export.write_kernelbench(tmp_path / "solution.py", deferred=True)
    spec = importlib.util.spec_from_file_location("fastelbo_deferred_solution", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.ModelNew(*mod.get_init_inputs()).cuda()
    params = VAEParams(*(t.detach() for t in model.state_dict().values()))
    mod.check_errors()  # not built yet: nothing to check
    for batch in (7, 128, 1000):
        x = torch.rand(batch, DIMS[0], device="cuda")
        torch.manual_seed(batch)
        with torch.no_grad():
            got = model(x)
        torch.manual_seed(batch)
        eps = torch.randn(batch, DIMS[2], device="cuda")  # what the file draws
        assert_outputs_close(got, deferred_spec(x, params, eps)[0], what=f"B={batch}")
        mod.check_errors()
        x[0, 0] = -2.0
        with torch.no_grad():
            got = model(x)
        assert all(bool(o.isnan().all()) for o in got)
        with pytest.raises(ValueError, match=re.escape("first x[0, 0] = -2.0")):
            mod.check_errors()

