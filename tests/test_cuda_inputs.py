"""The cuda backend's Python-side input checks, on CPU (no GPU, no nvcc, no build).

The binding's FE_CHECKs must never fire: on the H200 image a C++ exception whose message
streamed a number killed the process, so `check_inputs` (checks.py, built from
fastelbo.contract) raises first. It reads tensor metadata only, so CUDA tensors are stood in for
by FakeTensorMode ones (a device and a shape, no memory).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastelbo.backends import Verdict, cuda
from fastelbo.backends.cuda import build, launch
from fastelbo.params import VAEParams

B, D, H, L = 4, 33, 7, 5
SHAPES = {"enc_w": (H, D), "enc_b": (H,), "mu_w": (L, H), "mu_b": (L,), "lv_w": (L, H),
          "lv_b": (L,), "dec_w1": (H, L), "dec_b1": (H,), "dec_w2": (D, H), "dec_b2": (D,)}
ALL = ("x", "eps", *VAEParams._fields)


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


def replaced(args, name, fn):
    """args with tensor `name` (x, eps or a parameter) replaced by fn(tensor)."""
    x, params, eps = args
    if name == "x":
        return fn(x), params, eps
    if name == "eps":
        return x, params, fn(eps)
    return x, params._replace(**{name: fn(getattr(params, name))}), eps


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


def test_valid_fake_cuda_inputs_pass(fake):
    """Valid inputs pass (fake tensors have no memory, so the check read only metadata), and
    the very same tensors with one of them swapped for a wrong one do not: the check looked."""
    x, params, eps = make(fake)
    for seq, kw in ((params, {}), (tuple(params), {}),  # a plain sequence of 10 tensors is fine
                    (params, {"rows": 64, "cluster": 16, "staged": 1, "path": "cluster"}),
                    (params, {"path": "rows"})):
        assert cuda.check_inputs(x, seq, eps, **kw) == VAEParams(*seq)  # as the binding takes them
    _, _, eps_wide = make(fake, dims=(D, H, L + 1))
    with pytest.raises(ValueError, match=re.escape(f"eps must have shape ({B}, {L}), got "
                                                   f"({B}, {L + 1})")):
        cuda.check_inputs(x, params, eps_wide)
    with pytest.raises(ValueError, match="cluster must be 0"):
        cuda.check_inputs(x, params, eps, cluster=17)


@pytest.mark.parametrize("name", ALL)
def test_cpu_tensor_is_rejected_by_name(fake, name):
    args = replaced(make(fake), name, lambda t: torch.empty(t.shape))
    with pytest.raises(ValueError, match=f"^{name} "):
        cuda.check_inputs(*args)


def test_everything_on_cpu_or_meta_is_rejected():
    for device in ("cpu", "meta"):
        x = torch.empty(B, D, device=device)
        eps = torch.empty(B, L, device=device)
        params = VAEParams(*(torch.empty(SHAPES[n], device=device) for n in VAEParams._fields))
        with pytest.raises(cuda.CudaInputError, match=f"x must be a CUDA tensor, got one on "
                                                      f"{device}"):
            cuda.check_inputs(x, params, eps)


@pytest.mark.parametrize("name", ALL[1:])
def test_meta_tensor_among_cuda_ones_is_rejected(fake, name):
    args = replaced(make(fake), name, lambda t: torch.empty(t.shape, device="meta"))
    with pytest.raises(ValueError, match=f"{name} must be a CUDA tensor, got one on meta"):
        cuda.check_inputs(*args)


@pytest.mark.parametrize("name", ALL[1:])
def test_other_cuda_device_is_rejected(fake, name):
    x, params, eps = make(fake)
    other = make(fake, device="cuda:1")
    args = replaced((x, params, eps), name,
                    lambda t: getattr(other[1], name) if name in SHAPES else other[2])
    with pytest.raises(ValueError, match=f"{name} is on cuda:1 but x is on cuda:0"):
        cuda.check_inputs(*args)


@pytest.mark.parametrize("name", ALL)
def test_non_contiguous_is_rejected(fake, name):
    def strided(t):  # every other element of a twice-as-long buffer
        with fake:
            return torch.empty_strided(t.shape, [2 * s for s in t.stride()], device=t.device)
    args = replaced(make(fake), name, strided)
    assert not {"x": args[0], "eps": args[2]}.get(name, getattr(args[1], name, None)) \
        .is_contiguous()
    with pytest.raises(ValueError, match=f"{name} must be contiguous"):
        cuda.check_inputs(*args)


def test_transposed_weight_is_rejected(fake):
    x, params, eps = make(fake)
    with fake:
        w = torch.empty(D, H, device="cuda:0").t()
    with pytest.raises(RuntimeError, match="enc_w must be contiguous"):  # as the binding said
        cuda.check_inputs(x, params._replace(enc_w=w), eps)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("name", ALL)
def test_non_float32_is_a_type_error(fake, name, dtype):
    args = replaced(make(fake), name, lambda t: t.to(dtype))
    with pytest.raises(TypeError, match=f"float32 only; {name} is {dtype}"):
        cuda.check_inputs(*args)


@pytest.mark.parametrize("name", ALL)
def test_not_a_tensor_is_a_type_error(fake, name):
    args = replaced(make(fake), name, lambda t: t.tolist() if t.device.type == "cpu" else [1.0])
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
        cuda.check_inputs(*args)


def test_sparse_is_a_type_error():
    x = torch.empty(B, D).to_sparse()
    params = VAEParams(*(torch.empty(SHAPES[n]) for n in VAEParams._fields))
    with pytest.raises(TypeError, match="x must be a dense"):
        cuda.check_inputs(x, params, torch.empty(B, L))


def test_wrong_param_count_is_a_type_error(fake):
    x, params, eps = make(fake)
    with pytest.raises(TypeError, match="params must be a VAEParams"):
        cuda.check_inputs(x, tuple(params)[:-1], eps)


def test_dims_and_shapes(fake):
    x, params, eps = make(fake)
    with fake:
        x1 = torch.empty(D, device="cuda:0")
        x0 = torch.empty(0, D, device="cuda:0")
        e0 = torch.empty(0, L, device="cuda:0")
        w3 = torch.empty(1, H, D, device="cuda:0")
    with pytest.raises(ValueError, match=re.escape(f"x must have shape (batch, {D}), got ({D},)")):
        cuda.check_inputs(x1, params, eps)
    with pytest.raises(ValueError, match="enc_w must be 2-D"):
        cuda.check_inputs(x, params._replace(enc_w=w3), eps)
    with pytest.raises(ValueError, match="x must hold at least one row"):
        cuda.check_inputs(x0, params, e0)
    with pytest.raises(ValueError, match="dims must be positive"):
        cuda.check_inputs(*make(fake, dims=(D, 0, L)))
    for name in ("eps", *VAEParams._fields):
        def shrink(t):
            with fake:
                return torch.empty(*t.shape[:-1], t.shape[-1] + 1, device=t.device)
        args = replaced((x, params, eps), name, shrink)
        # The contract reads the dims off enc_w and mu_w: a wider enc_w makes dec_w2 the
        # parameter that disagrees (and x, were the parameters consistent).
        blamed = "dec_w2" if name == "enc_w" else name
        with pytest.raises(ValueError, match=f"{blamed} must have shape"):
            cuda.check_inputs(*args)


def test_sizes_must_fit_int32(fake):
    with pytest.raises(ValueError, match="sizes must fit in int32"):
        cuda.check_inputs(*make(fake, batch=2**31))
    cuda.check_inputs(*make(fake, batch=2**31 - 1))


@pytest.mark.parametrize("option, bad", [("rows", -1), ("rows", 65), ("cluster", -1),
                                         ("cluster", 17), ("staged", -2), ("staged", 2)])
def test_forced_plan_out_of_range(fake, option, bad):
    with pytest.raises(ValueError, match=f"{option} must be"):
        cuda.check_inputs(*make(fake), **{option: bad})
    with pytest.raises(ValueError, match=f"{option} must be"):
        cuda.check_options(**{option: bad})


@pytest.mark.parametrize("option, bad", [("rows", 1.0), ("cluster", True), ("staged", "1"),
                                         ("rows", None)])
def test_forced_plan_must_be_int(fake, option, bad):
    with pytest.raises(TypeError, match=f"{option} must be an int"):
        cuda.check_inputs(*make(fake), **{option: bad})


@pytest.mark.parametrize("path", ["turbo", "", None, 1, "Rows"])
def test_bad_path(fake, path):
    with pytest.raises(ValueError, match="path must be one of"):
        cuda.check_inputs(*make(fake), path=path)


@pytest.mark.parametrize("forced", [{"rows": 8}, {"cluster": 4}, {"staged": 0}])
def test_forced_plan_conflicts_with_rows_path(fake, forced):
    with pytest.raises(ValueError, match="conflict with path='rows'"):
        cuda.check_inputs(*make(fake), path="rows", **forced)
    cuda.check_inputs(*make(fake), path="cluster", **forced)


def test_forward_checks_before_touching_the_extension(fake, monkeypatch):
    def no_extension():
        raise AssertionError("the extension was reached")
    monkeypatch.setattr(build, "extension", no_extension)
    x, params, eps = make(fake)
    with pytest.raises(ValueError, match="rows must be"):
        cuda.forward(x, params, eps, rows=99)
    with pytest.raises(ValueError, match="path must be"):
        cuda.forward(x, params, eps, path="turbo")
    with pytest.raises(ValueError, match="eps must be a CUDA tensor"):
        cuda.forward(x, params, torch.empty(B, L))
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


def _recording_extension(monkeypatch, answer=None):
    """A stand-in extension whose forward records its positional arguments."""
    calls = []

    def forward(*args):
        calls.append(args)
        b = args[0].shape[0]
        return [args[0].new_empty(b) for _ in range(3)] if answer is None else answer

    ext = type("Ext", (), {"forward": staticmethod(forward), "ForwardOptions": _Options})
    monkeypatch.setattr(build, "extension", lambda: ext)
    return calls


def test_forward_prepared_launches_with_the_default_options(fake, monkeypatch):
    """Tensors in binding order, then one options object: the defaults (each tuning field at
    its binding.h default), pre-built (the same object call after call: nothing is built or
    parsed per call), and forward's defaults equal to them."""
    calls = _recording_extension(monkeypatch)
    x, params, eps = make(fake)
    cuda.forward_prepared(x, params, eps)
    cuda.forward_prepared(x, params, eps)
    cuda.forward(x, params, eps)
    cuda.forward_prepared(x, params, eps, draw=True)
    prepared, again, forward, drawing = calls
    assert len(prepared) == 2 + 10 + 1
    assert all(a is b for a, b in zip(prepared[:12], (x, eps, *params)))
    assert prepared[12] is again[12] and forward[12] is not prepared[12]
    assert prepared[12].fields() == forward[12].fields() == _Options().fields()
    assert drawing[12].fields() == {**_Options().fields(), "draw": True}
    assert launch.PATHS["auto"] == _Options().path


def test_forward_options_by_name(fake, monkeypatch):
    """forward's tuning arguments reach the binding as the options' named fields."""
    calls = _recording_extension(monkeypatch)
    x, params, eps = make(fake)
    cuda.forward(x, params, eps, rows=5, cluster=4, staged=1, path="cluster", _poison=True)
    cuda.forward(x, params, eps, path="rows", draw=True)
    assert calls[0][12].fields() == {"rows": 5, "cluster": 4, "staged": 1, "poison": True,
                                     "path": launch.PATHS["cluster"], "draw": False,
                                     "awaits": False}
    assert calls[1][12].fields() == {**_Options().fields(), "path": launch.PATHS["rows"],
                                     "draw": True}


class _Given(Verdict):
    """A verdict already given, logging its wait()."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def wait(self):
        self.log.append("wait")


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
    return _InFlight(log) if in_flight else _Given(log)


def test_forward_prepared_hands_a_check_in_flight_to_the_binding(fake, monkeypatch):
    """A verdict still in flight on the GPU (the cuda value check) is waited for inside the
    binding (options.awaits); an empty answer means it failed, and the verdict's error is
    raised. Any other verdict is waited for before the call."""
    calls = _recording_extension(monkeypatch)
    x, params, eps = make(fake)
    log = []
    cuda.forward_prepared(x, params, eps, draw=True, verdict=_Verdict(True, log))
    assert log == [] and calls[-1][-1].draw and calls[-1][-1].awaits
    cuda.forward_prepared(x, params, eps, verdict=_Verdict(False, log))
    assert log == ["wait"] and not calls[-1][-1].awaits
    calls = _recording_extension(monkeypatch, answer=[])
    with pytest.raises(ValueError, match="stand-in"):
        cuda.forward_prepared(x, params, eps, draw=True, verdict=_Verdict(True, log))
    assert log == ["wait", "fail"] and calls[-1][-1].awaits


def test_forward_prepared_refuses_what_ops_does_not_check(fake, monkeypatch):
    """ops has checked shapes, dtype, device and made the tensors contiguous; what is left
    (positive dims, int32 sizes, a dense layout) raises check_inputs' own exception."""
    calls = _recording_extension(monkeypatch)
    cases = [(make(fake, dims=(D, 0, L)), ValueError, "dims must be positive"),
             (make(fake, batch=2**31), ValueError, "sizes must fit in int32")]
    x, params, _ = make(fake)
    cases.append(((x, params, torch.empty(B, L).to_sparse()), TypeError,
                  "eps must be a dense"))
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            cuda.forward_prepared(*args)
    assert not calls


def test_a_device_found_able_is_not_asked_again(monkeypatch):
    """unavailable_reason remembers a yes per indexed CUDA device (ops asks on every call),
    never a no."""
    asked = []

    def capability(index):
        asked.append(index)
        return (9, 0) if index == 0 else (8, 0)

    monkeypatch.setattr(build, "RUNS_ON", set())
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(build, "_build", lambda: (object(), None))
    for _ in range(3):
        assert cuda.unavailable_reason(torch.device("cuda:0")) is None
        assert "compute capability 9.0+" in cuda.unavailable_reason(torch.device("cuda:1"))
    assert asked == [0, 1, 1, 1]


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
