"""Bad input gets a clear Python exception naming the argument, before any kernel runs."""
import pytest
import torch

import fastelbo
from fastelbo.contract import validation, validation_enabled


@pytest.fixture
def model():
    return fastelbo.ModelNew(16, 8, 3)


@pytest.mark.parametrize("x, exc, match", [
    (lambda: torch.rand(4, 15), ValueError, r"x must have shape \(batch, 16\)"),
    (lambda: torch.rand(16), ValueError, "x must have shape"),
    (lambda: torch.rand(0, 16), ValueError, "batch size 0"),
    (lambda: torch.randint(0, 2, (4, 16)), TypeError, "x must be floating point"),
    (lambda: torch.rand(4, 16, dtype=torch.float64), TypeError, "x has dtype torch.float64"),
    (lambda: [[0.5] * 16], TypeError, "x must be a torch.Tensor"),
    (lambda: torch.rand(4, 16, device="meta"), ValueError, "x is on meta"),
])
def test_bad_x(model, x, exc, match):
    with pytest.raises(exc, match=match):
        model(x())


@pytest.mark.parametrize("eps, exc, match", [
    (lambda: torch.randn(4, 2), ValueError, r"eps must have shape \(4, 3\)"),
    (lambda: torch.randn(4, 3, dtype=torch.float64), TypeError, "eps must be torch.float32"),
    (lambda: 0.5, TypeError, "eps must be a torch.Tensor"),
    (lambda: torch.randn(4, 3, device="meta"), ValueError, "eps is on meta"),  # as x is
])
def test_bad_eps(model, eps, exc, match):
    with pytest.raises(exc, match=match):
        model(torch.rand(4, 16), eps())


@pytest.mark.parametrize("value", [float("nan"), -1e-3, 1.001, float("inf")])
def test_values_outside_unit_interval_raise(model, value):
    x = torch.rand(4, 16)
    x[2, 5] = value
    with pytest.raises(ValueError, match=r"x\[2, 5\]"):
        model(x)


def test_validation_switch_restores_state(model):
    assert validation_enabled()
    x = torch.rand(3, 16)
    x[0, 0] = 2.0
    with validation(False):
        assert not validation_enabled()
        elbo, recon, kl = model(x)
    assert validation_enabled()
    assert torch.isnan(elbo[0]) and torch.isnan(recon[0]) and torch.isnan(kl[0])
    assert torch.isfinite(elbo[1:]).all()


def test_env_var_turns_validation_off():
    import subprocess
    import sys
    code = "import fastelbo; print(fastelbo.validation_enabled())"
    out = subprocess.run([sys.executable, "-c", code], env={"FASTELBO_VALIDATE": "0", "PATH": ""},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_bad_backend_name(model):
    with pytest.raises(ValueError, match="backend must be one of"):
        fastelbo.elbo(torch.rand(2, 16), model.vae_params(), backend="cudnn")


def test_gpu_backend_on_cpu_tensor_names_fallback(model):
    with pytest.raises(RuntimeError, match="backend='torch' runs everywhere"):
        fastelbo.elbo(torch.rand(2, 16), model.vae_params(), backend="cuda")


def test_parameter_mismatch_is_reported():
    model = fastelbo.ModelNew(16, 8, 3)
    p = model.vae_params()._replace(mu_b=torch.zeros(4))
    with pytest.raises(ValueError, match="parameter mu_b must have shape"):
        fastelbo.elbo(torch.rand(2, 16), p)


@pytest.mark.parametrize("field, value, exc, match", [
    ("enc_w", torch.zeros(8), ValueError, "parameter enc_w must be 2-D"),
    ("mu_w", torch.zeros(3), ValueError, "parameter mu_w must be 2-D"),
    ("dec_b2", [0.0] * 16, TypeError, "parameter dec_b2 must be a torch.Tensor"),
])
def test_malformed_parameters_are_named(field, value, exc, match):
    p = fastelbo.ModelNew(16, 8, 3).vae_params()._replace(**{field: value})
    with pytest.raises(exc, match=match):
        fastelbo.elbo(torch.rand(2, 16), p)


def test_parameters_on_two_devices_or_dtypes(model):
    from fastelbo.contract import check_params

    params = model.vae_params()
    with pytest.raises(ValueError, match="dec_b2 is on meta"):
        check_params(params._replace(dec_b2=params.dec_b2.to("meta")))
    with pytest.raises(TypeError, match="dec_b2 is torch.float64"):
        check_params(params._replace(dec_b2=params.dec_b2.double()))


def test_the_cuda_value_check_stays_out_of_cpu_tensors():
    """The one-launch check applies only on a GPU the cuda backend already runs on; a CPU x
    takes the torch-ops check (and never triggers an extension build)."""
    from fastelbo.backends import cuda

    assert cuda.in_unit_range(torch.rand(3, 4)) is None
    assert cuda.start_value_check(torch.rand(3, 4)) is None
    assert cuda.start_checks(torch.rand(3, 4), [torch.rand(1)] * 10, None, True) is None


def test_start_takes_the_native_backends_lanes(model, monkeypatch):
    """ops.checks.start asks backends.native(x.device) through the protocol (backends.start),
    for a device type listed in backends.NATIVE (here the CPU, posing as one): its one-call
    lane's verdict is taken as it is; where that lane declines, the contract's checks run and
    the lane's started value check is the verdict; where that declines too, in_unit_range
    (then torch ops) decides at once. Bad metadata is still the contract's error, and the
    backend comes back resolved with the verdict."""
    from fastelbo import backends
    from fastelbo.ops.checks import check_values, start

    lane_verdict, started = backends.Verdict(plain=True), backends.Verdict(checked=True)
    answers = {"start_checks": lane_verdict, "start_value_check": started,
               "in_unit_range": None}
    calls = []

    def member(name):
        return lambda *a: calls.append(name) or answers[name]

    native = type("Native", (), {n: staticmethod(member(n)) for n in answers})()
    monkeypatch.setattr(backends, "native", lambda device: native)
    monkeypatch.setitem(backends.NATIVE, "cpu", "stand-in")
    params, x = model.vae_params(), torch.rand(5, 16)
    assert start("torch", x, params, None) == (lane_verdict, "torch", backends.module("torch"))
    assert calls == ["start_checks"]
    answers["start_checks"] = None
    assert start("torch", x, params, None)[0] is started
    with pytest.raises(ValueError, match="eps must have shape"):
        start("torch", x, params, torch.randn(5, 2))
    with pytest.raises(ValueError, match="eps must have shape"):  # the contract's error first
        start("cuda", x, params, torch.randn(5, 2))
    answers["start_value_check"] = None
    calls.clear()
    assert start("torch", x, params, None)[0].checked
    assert calls == ["start_checks", "start_value_check", "in_unit_range"]
    bad = x.clone()
    bad[1, 2] = 1.5
    answers["in_unit_range"] = True  # the lane's answer, not the torch ops', decides
    check_values(bad)
    answers["in_unit_range"] = None
    with pytest.raises(ValueError, match=r"first x\[1, 2\] = 1.5"):
        check_values(bad)


def test_start_on_cpu_gives_its_verdict_at_once(model):
    """Off the GPU the value check runs inside start: a bad x raises there, a good one comes
    back with a verdict whose wait() passes; the other checks raise as the contract's."""
    from fastelbo.ops.checks import start

    params = model.vae_params()
    x = torch.rand(5, 16)
    start("auto", x, params, None)[0].wait()
    x[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"first x\[2, 3\] = nan"):
        start("auto", x, params, None)
    with validation(False):
        start("auto", x, params, None)[0].wait()  # off: nothing to check
    with pytest.raises(ValueError, match="eps must have shape"):
        start("auto", x, params, torch.randn(5, 2))
