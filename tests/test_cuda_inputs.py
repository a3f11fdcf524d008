"""The cuda backend's Python side of its input checks, on CPU (no GPU, no nvcc, no build).

The binding checks its inputs itself (binding_check.h; tests/test_cuda_status.py holds that check
to the contract) and answers with a status, never an exception: here a stand-in extension gives
the answers, and the Python side must launch nothing more, raise the contract's exception for
them, check the launch options before the extension is reached, and hand the binding the
tensors and options it should. CUDA tensors are stood in for by FakeTensorMode ones (a device
and a shape, no memory).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastelbo.backends import Verdict, cuda
from fastelbo.backends.cuda import build, launch, status
from fastelbo.params import VAEParams

B, D, H, L = 4, 33, 7, 5
SHAPES = {"enc_w": (H, D), "enc_b": (H,), "mu_w": (L, H), "mu_b": (L,), "lv_w": (L, H),
          "lv_b": (L,), "dec_w1": (H, L), "dec_b1": (H,), "dec_w2": (D, H), "dec_b2": (D,)}


@pytest.fixture(scope="module")
def fake():
    return FakeTensorMode()


def make(fake, device="cuda:0", batch=B, dims=(D, H, L)):
    """(x, params, eps) on a fake CUDA device, all valid."""
    d, h, lat = dims
    shapes = {"enc_w": (h, d), "enc_b": (h,), "mu_w": (lat, h), "mu_b": (lat,),
              "lv_w": (lat, h), "lv_b": (lat,), "dec_w1": (h, lat), "dec_b1": (h,),
              "dec_w2": (d, h), "dec_b2": (d,)}
    with fake:
        x = torch.empty(batch, d, device=device)
        eps = torch.empty(batch, lat, device=device)
        params = VAEParams(*(torch.empty(shapes[n], device=device) for n in VAEParams._fields))
    return x, params, eps


def test_import_needs_no_gpu_and_builds_nothing():
    code = ("import fastelbo.backends.cuda\n"
            "from fastelbo.backends.cuda import build\n"
            "assert build._build.cache_info().currsize == 0, 'built at import'\n"
            "print('ok')")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CUDA_HOME": "/nonexistent",
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, check=False)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("option, bad", [("rows", -1), ("rows", 65), ("cluster", -1),
                                         ("cluster", 17), ("staged", -2), ("staged", 2)])
def test_forced_plan_out_of_range(option, bad):
    with pytest.raises(ValueError, match=f"{option} must be"):
        cuda.check_options(**{option: bad})


@pytest.mark.parametrize("option, bad", [("rows", 1.0), ("cluster", True), ("staged", "1"),
                                         ("rows", None)])
def test_forced_plan_must_be_int(option, bad):
    with pytest.raises(TypeError, match=f"{option} must be an int"):
        cuda.check_options(**{option: bad})


@pytest.mark.parametrize("path", ["turbo", "", None, 1, "Rows"])
def test_bad_path(path):
    with pytest.raises(ValueError, match="path must be one of"):
        cuda.check_options(path=path)


@pytest.mark.parametrize("forced", [{"rows": 8}, {"cluster": 4}, {"staged": 0}])
def test_forced_plan_conflicts_with_rows_path(forced):
    with pytest.raises(ValueError, match="conflict with path='rows'"):
        cuda.check_options(path="rows", **forced)
    cuda.check_options(path="cluster", **forced)


def test_forward_checks_its_options_before_touching_the_extension(fake, monkeypatch):
    def no_extension():
        raise AssertionError("the extension was reached")
    monkeypatch.setattr(build, "extension", no_extension)
    x, params, eps = make(fake)
    with pytest.raises(ValueError, match="rows must be"):
        cuda.forward(x, params, eps, rows=99)
    with pytest.raises(ValueError, match="path must be"):
        cuda.forward(x, params, eps, path="turbo")
    with pytest.raises(ValueError, match="staged must be"):
        cuda.plan(x, params, staged=5)
    with pytest.raises(ValueError, match="conflict with path='fast'"):
        cuda.forward(x, params, eps, cluster=8, path="fast")


class _Options:
    """Stands in for the extension's ForwardOptions (binding.h's defaults)."""

    def __init__(self):
        self.rows, self.cluster, self.staged, self.poison = 0, 0, -1, False
        self.path, self.draw, self.awaits = 0, False, False

    def fields(self):
        return dict(vars(self))


def _packed(code: int, name: str) -> int:
    """binding_check.h CheckStatus::packed for (code, field name)."""
    return -(code * len(status.FIELDS) + status.FIELDS.index(name))


class _Ext:
    """A stand-in extension: forward records its arguments and answers as the binding would
    (outputs, or [] with `refuse` as the thread's last status); checked_start answers
    `refuse` too (0 when None)."""
    ForwardOptions = _Options

    def __init__(self, refuse=None):
        self.refuse, self.calls, self.last = refuse, [], 0
        self.entries = []  # every entry called, by name

    def forward(self, *args):
        self.calls.append(args)
        if self.refuse is not None:
            self.last = self.refuse
            return []
        self.last = 0
        return [args[0].new_empty(args[0].shape[0]) for _ in range(3)]

    def checked_start(self, x, eps, params, validate):
        self.entries.append("checked_start")
        self.last = self.refuse or 0
        return self.last

    class BackwardOptions:
        pass

    def backward(self, x, eps, params, grads, options):
        self.entries.append("backward")
        self.grads = grads
        self.last = self.refuse or 0
        if self.refuse is not None:
            return []
        return [x.new_empty(0), eps.new_empty(0), *(p.new_empty(p.shape) for p in params)]

    def last_status(self):
        return self.last


def _extension(monkeypatch, refuse=None) -> _Ext:
    ext = _Ext(refuse)
    monkeypatch.setattr(build, "extension", lambda: ext)
    return ext


def test_forward_prepared_launches_with_the_default_options(fake, monkeypatch):
    """x, eps, the parameters as one list, then one options object: the defaults (each tuning
    field at its binding.h default), pre-built (the same object call after call: nothing is
    built or parsed per call), and forward's defaults equal to them."""
    calls = _extension(monkeypatch).calls
    x, params, eps = make(fake)
    cuda.forward_prepared(x, params, eps)
    cuda.forward_prepared(x, params, eps)
    cuda.forward(x, params, eps)
    cuda.forward_prepared(x, params, eps, draw=True)
    prepared, again, forward, drawing = calls
    assert len(prepared) == 4 and prepared[0] is x and prepared[1] is eps
    assert len(prepared[2]) == 10 and all(a is b for a, b in zip(prepared[2], params))
    assert prepared[3] is again[3] and forward[3] is not prepared[3]
    assert prepared[3].fields() == forward[3].fields() == _Options().fields()
    assert drawing[3].fields() == {**_Options().fields(), "draw": True}
    assert launch.PATHS["auto"] == _Options().path


def test_forward_options_by_name(fake, monkeypatch):
    """forward's tuning arguments reach the binding as the options' named fields."""
    calls = _extension(monkeypatch).calls
    x, params, eps = make(fake)
    cuda.forward(x, params, eps, rows=5, cluster=4, staged=1, path="cluster", _poison=True)
    cuda.forward(x, params, eps, path="rows", draw=True)
    assert calls[0][3].fields() == {"rows": 5, "cluster": 4, "staged": 1, "poison": True,
                                    "path": launch.PATHS["cluster"], "draw": False,
                                    "awaits": False}
    assert calls[1][3].fields() == {**_Options().fields(), "path": launch.PATHS["rows"],
                                    "draw": True}


class _Other(Verdict):
    """Another lane's check in flight (not this backend's own), logging its wait()."""
    in_flight = True

    def __init__(self, log):
        super().__init__()
        self.log = log

    def wait(self):
        self.log.append("wait")


class _Given(_Other):
    """A verdict already given (in_flight False): nothing to wait for, so wait() is not
    called (it would log)."""
    in_flight = False


class _InFlight(cuda.RangeCheck):
    """The cuda backend's own check in flight, logging wait() and fail()."""

    def __init__(self, log):
        super().__init__(torch.empty(0))
        self.log = log

    def wait(self):
        self.log.append("wait")

    def fail(self):
        self.log.append("fail")
        raise ValueError("x must lie in [0, 1] (stand-in)")


def _Verdict(in_flight, log):
    return _InFlight(log) if in_flight else _Other(log)


def test_forward_prepared_hands_a_check_in_flight_to_the_binding(fake, monkeypatch):
    """A verdict still in flight on the GPU (the cuda value check) is waited for inside the
    binding (options.awaits); an empty answer whose status is the value check's means it
    failed, and the verdict's error is raised. Another lane's verdict in flight is waited for
    before the call; a given one is not waited for at all."""
    calls = _extension(monkeypatch).calls
    x, params, eps = make(fake)
    log = []
    cuda.forward_prepared(x, params, eps, draw=True, verdict=_Verdict(True, log))
    assert log == [] and calls[-1][-1].draw and calls[-1][-1].awaits
    cuda.forward_prepared(x, params, eps, verdict=_Verdict(False, log))
    assert log == ["wait"] and not calls[-1][-1].awaits
    cuda.forward_prepared(x, params, eps, verdict=_Given(log))
    assert log == ["wait"] and not calls[-1][-1].awaits
    calls = _extension(monkeypatch, refuse=_packed(status.VALUE, "x")).calls
    with pytest.raises(ValueError, match="stand-in"):
        cuda.forward_prepared(x, params, eps, draw=True, verdict=_Verdict(True, log))
    assert log == ["wait", "fail"] and calls[-1][-1].awaits


@pytest.mark.parametrize("entry", ["forward_prepared", "forward"])
def test_a_refusal_raises_the_contracts_exception(fake, monkeypatch, entry):
    """Where the binding refuses a call (its status), the entry raises the contract's exception
    for it: the one check_kernel_tensors or check_elbo_call raises for these tensors. The
    tuning forward asks first (checked_start) and then launches nothing."""
    x, params, _ = make(fake)
    cases = [(_packed(status.DEVICE_TYPE, "eps"), (x, params, torch.empty(B, L)), ValueError,
              "eps must be a CUDA tensor, got one on cpu"),
             (_packed(status.EMPTY, "enc_w"), make(fake, dims=(D, 0, L)), ValueError,
              "dims must be positive"),
             (_packed(status.INT32, "x"), make(fake, batch=2**31), ValueError,
              "sizes must fit in int32"),
             (_packed(status.LAYOUT, "eps"), (x, params, torch.empty(B, L).to_sparse()),
              TypeError, "eps must be a dense")]
    for code, args, exc, match in cases:
        ext = _extension(monkeypatch, refuse=code)
        with pytest.raises(exc, match=match):
            getattr(cuda, entry)(*args)
        assert len(ext.calls) == (entry == "forward_prepared")


def test_backward_makes_one_binding_call_and_raises_its_refusal(fake, monkeypatch):
    """The training step's backward: its own binding call checks the inputs (no separate
    checked_start), and a refusal raises the contract's exception for it; gemm='tc' asks
    first, as its test reads the tensors."""
    x, params, eps = make(fake)
    ext = _extension(monkeypatch)
    g_x, _, grads = cuda.backward(x, params, eps, (None, None, None), need_x=False)
    assert ext.entries == ["backward"] and g_x is None and len(grads) == 10
    # an unused gradient: a (B,) placeholder, never read
    assert [tuple(g.shape) for g in ext.grads] == [(B,)] * 3
    ext = _extension(monkeypatch, refuse=_packed(status.DEVICE_TYPE, "eps"))
    with pytest.raises(ValueError, match="eps must be a CUDA tensor, got one on cpu"):
        cuda.backward(x, params, torch.empty(B, L), (None, None, None))
    assert ext.entries == ["backward"]
    with pytest.raises(ValueError, match="eps must be a CUDA tensor, got one on cpu"):
        cuda.backward(x, params, torch.empty(B, L), (None, None, None), gemm="tc")
    assert ext.entries == ["backward", "checked_start"]
    with pytest.raises(TypeError, match="dec_w1 must be a torch.Tensor, got list"):
        cuda.backward(x, params._replace(dec_w1=[1.0]), eps, (None, None, None))


def test_forward_refuses_what_is_not_a_tensor_before_the_binding(fake, monkeypatch):
    """pybind11 would refuse a list with a message naming no argument: the contract's type
    check names it first."""
    ext = _extension(monkeypatch)
    x, params, eps = make(fake)
    with pytest.raises(TypeError, match="dec_b1 must be a torch.Tensor, got list"):
        cuda.forward(x, params._replace(dec_b1=[1.0]), eps)
    with pytest.raises(TypeError, match="eps must be a torch.Tensor, got NoneType"):
        cuda.forward(x, params, None)
    with pytest.raises(TypeError, match="params must be a VAEParams"):
        cuda.forward(x, tuple(params)[:-1], eps)
    assert not ext.calls


def test_a_device_found_able_is_not_asked_again(monkeypatch):
    """unavailable_reason remembers a yes per indexed CUDA device (ops asks on every call),
    never a no."""
    asked = []

    def capability(index):
        asked.append(index)
        return (9, 0) if index == 0 else (8, 0)

    monkeypatch.setattr(build, "RUNS_ON", {})
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    ext = object()
    monkeypatch.setattr(build, "_build", lambda: (ext, None))
    for _ in range(3):
        assert cuda.unavailable_reason(torch.device("cuda:0")) is None
        assert "compute capability 9.0+" in cuda.unavailable_reason(torch.device("cuda:1"))
    assert asked == [0, 1, 1, 1]
    assert build.RUNS_ON == {torch.device("cuda:0"): ext}  # where the lanes take it from


def test_iwae_checks_pass_injected_eps_without_a_seed(fake):
    """The ops hand the fused IWAE injected eps with seed None (or 0): the call's checks pass
    and the call goes on to ask whether the kernel runs here (it cannot), not for a seed."""
    x, params, _ = make(fake)
    with fake:
        eps = torch.empty(3, B, L, device="cuda:0")
    for seed in (None, 0):
        with pytest.raises(ValueError, match="; use the triton or torch iwae backend$"):
            cuda.iwae_log_likelihood(x, params, 3, eps=eps, seed=seed)
    with pytest.raises(ValueError, match=r"eps must have shape \(4, 4, 5\)"):
        cuda.iwae_log_likelihood(x, params, 4, eps=eps)


def test_iwae_refuses_the_torch_backends_options():
    x = torch.rand(B, D)
    params = VAEParams(*(torch.empty(SHAPES[n]) for n in VAEParams._fields))
    for kw in ({"generator": torch.Generator()}, {"chunk": 8}):
        with pytest.raises(ValueError, match=f"cuda iwae does not take {next(iter(kw))}"):
            cuda.iwae_log_likelihood(x, params, 4, **kw)
    assert "CUDA devices only" in cuda.iwae_unavailable_reason(torch.device("cpu"), (D, H, L))


# ---- the deferred value check (contract.deferred): its Python side --------------------------
def _fields(options):
    """The options' fields, deferred included (forward_options sets it only where asked)."""
    return {"deferred": False, **vars(options)}


class _DeferredVerdict(cuda.DeferredCheck):
    """The lane's deferred check, logging wait() (which would run the check now)."""

    def __init__(self, x, log):
        super().__init__(x)
        self.log = log

    def wait(self):
        self.log.append("wait")


def test_forward_prepared_leaves_a_deferred_check_to_the_kernels(fake, monkeypatch):
    """A DeferredCheck (in flight or handed out in a capture) is not waited for: the binding
    gets the deferred option (and not awaits), with or without the in-kernel draw; the tuning
    forward takes it by name."""
    calls = _extension(monkeypatch).calls
    x, params, eps = make(fake)
    log = []
    cuda.forward_prepared(x, params, eps, draw=True, verdict=_DeferredVerdict(x, log))
    assert log == [] and _fields(calls[-1][-1]) == {**_Options().fields(), "draw": True,
                                                    "deferred": True}
    cuda.forward_prepared(x, params, eps, verdict=cuda.CapturedDeferredCheck(x))
    assert _fields(calls[-1][-1]) == {**_Options().fields(), "deferred": True}
    cuda.forward_prepared(x, params, eps)  # no verdict: no deferral
    assert _fields(calls[-1][-1])["deferred"] is False
    cuda.forward(x, params, eps, path="rows", deferred=True)
    assert _fields(calls[-1][-1]) == {**_Options().fields(), "path": launch.PATHS["rows"],
                                      "deferred": True}


def test_the_noise_fallback_keeps_the_deferral(fake, monkeypatch):
    """Where the in-kernel draw does not match torch.randn (the noise is drawn first), a
    deferred check is still the kernels': nothing waits, and the forward gets it."""
    from fastelbo.backends.cuda import noise
    calls = _extension(monkeypatch).calls
    x, params, _ = make(fake)
    monkeypatch.setitem(noise._MATCHES, 0, False)
    log = []
    with fake:
        cuda.forward_drawing(x, params, _DeferredVerdict(x, log))
    assert log == [] and _fields(calls[-1][-1])["deferred"] is True
    assert _fields(calls[-1][-1])["draw"] is False


class _LaneExt(_Ext):
    """A stand-in for the lane's entries: checked_start_deferred answers `answer`; the value
    check is torch's."""

    def __init__(self, answer=2):
        super().__init__()
        self.answer = answer

    def checked_start(self, x, eps, params, validate):
        self.entries.append(("checked_start", validate))
        return 0

    def checked_start_deferred(self, x, eps, params):
        self.entries.append("checked_start_deferred")
        return self.answer

    def range_check_start(self, x):
        self.entries.append("range_check_start")

    def x_in_unit_range(self, x):
        self.entries.append("x_in_unit_range")
        return bool((x >= 0).logical_and(x <= 1).all())


def _cpu_lane(monkeypatch, answer=2):
    ext = _LaneExt(answer)
    monkeypatch.setattr(build, "RUNS_ON", {torch.device("cpu"): ext})
    params = VAEParams(*(torch.zeros(SHAPES[n]) for n in VAEParams._fields))
    return ext, torch.rand(B, D), params


def test_the_lanes_start_no_check_when_deferred(monkeypatch):
    """With the switch on (and validate), the plain lane asks checked_start_deferred and starts
    nothing: a plain DeferredCheck in flight (2), a CapturedDeferredCheck in a capture (3,
    nothing to wait for, not checked), None for a rule broken; start_value_check hands out a
    DeferredCheck too. With validate off, or the switch off, the lane is as before."""
    from fastelbo import contract
    from fastelbo.backends.cuda import lanes
    ext, x, params = _cpu_lane(monkeypatch)
    with contract.deferred_check(True):
        v = lanes.start_checks(x, params, None, True)
        assert type(v) is cuda.DeferredCheck and v.plain and v.in_flight and v.checked
        ext.answer = 3
        v = lanes.start_checks(x, params, None, True)
        assert type(v) is cuda.CapturedDeferredCheck and v.plain and not v.in_flight
        assert not v.checked
        ext.answer = _packed(status.SHAPE, "x")
        assert lanes.start_checks(x, params, None, True) is None
        assert lanes.start_checks(x, params, None, False).in_flight is False
        assert type(lanes.start_value_check(x)) is cuda.DeferredCheck
    assert ext.entries == ["checked_start_deferred"] * 3 + [("checked_start", False)]
    assert lanes.start_checks(x, params, None, True).in_flight is False  # stand-in: 0
    assert ext.entries[-1] == ("checked_start", True)


def test_a_deferred_check_run_by_anyone_else_raises_at_once(monkeypatch):
    """DeferredCheck.wait() (another backend, the autograd path) runs the value check now: the
    lane's one launch where it applies, torch ops where it does not; the contract's error."""
    ext, x, _ = _cpu_lane(monkeypatch)
    cuda.DeferredCheck(x).wait()
    assert ext.entries == ["x_in_unit_range"]
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"first x\[1, 2\] = nan"):
        cuda.DeferredCheck(x).wait()
    strided = torch.rand(D, B).t()  # not contiguous: not the lane's case
    strided[3, 0] = 2.0
    with pytest.raises(ValueError, match=r"first x\[3, 0\] = 2.0"):
        cuda.DeferredCheck(strided).wait()
    assert ext.entries == ["x_in_unit_range"] * 2
    cuda.CapturedDeferredCheck(strided).wait()  # in a capture nothing may wait: no check
