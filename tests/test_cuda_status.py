"""The binding's one input check (binding_check.h check_inputs), built for the CPU and held to
fastelbo.contract: the same calls refused, and each refusal turned (backends/cuda/status.py)
into the contract's own exception and message.

check_inputs reads tensor metadata only and takes the device type it wants, so this file builds
binding_check.cpp with a small pybind11 module by the host compiler (no nvcc, no GPU) and runs
it on CPU tensors (and meta tensors for sizes beyond int32). Every rule is tried alone, one
tensor at a time, and hypothesis tries calls with several broken at once.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_ext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastelbo import contract
from fastelbo.backends.cuda import build, status
from fastelbo.params import VAEParams, param_shapes

pytestmark = pytest.mark.slow  # the first run compiles the module (about a minute here)

B, D, H, L, S = 4, 33, 7, 5, 3
NAMES = ("x", "eps", *VAEParams._fields)

MODULE = r"""
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "binding_check.h"

namespace fb = fastelbo::binding;

// check_inputs on a call of `device_type` tensors: the packed status.
int64_t check(const std::optional<at::Tensor>& x, const std::optional<at::Tensor>& eps,
              bool eps_required, const std::vector<at::Tensor>& params, int64_t samples,
              const std::vector<std::optional<at::Tensor>>& grads,
              const std::optional<at::Tensor>& mu, const std::optional<at::Tensor>& logvar,
              const std::optional<at::Tensor>& image, const std::string& device_type) {
  fb::CheckCall call;
  call.x = x ? &*x : nullptr;
  call.params = &params;
  call.eps = eps ? &*eps : nullptr;
  call.eps_required = eps_required;
  call.samples = samples;
  for (size_t i = 0; i < grads.size() && i < 3; ++i)
    call.grads[i] = grads[i] ? &*grads[i] : nullptr;
  call.mu = mu ? &*mu : nullptr;
  call.logvar = logvar ? &*logvar : nullptr;
  call.image = image ? &*image : nullptr;
  call.device_type = c10::Device(device_type).type();
  return fb::check_inputs(call).packed();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("check", &check); }
"""


def _compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


@pytest.fixture(scope="module")
def ext(request, tmp_path_factory):
    """The module, built once per content (kept in pytest's cache across sessions)."""
    cxx = _compiler()
    if cxx is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail("no C++ compiler, and CI is set: CI's machine has one", pytrace=False)
        pytest.skip("no C++ compiler (c++ or g++) on PATH")
    source = build.source_path("binding_check.cpp").read_text()
    header = build.source_path("binding_check.h").read_text()
    key = hashlib.sha256(repr((MODULE, source, header, torch.__version__, cxx,
                               sys.version)).encode()).hexdigest()[:16]
    name = f"fastelbo_check_cpu_{key}"
    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir("fastelbo-check")) if cache else tmp_path_factory.mktemp("check")
    lib = root / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not lib.exists():
        work = root / f"{name}.part{os.getpid()}"
        work.mkdir(parents=True, exist_ok=True)
        (work / "module.cpp").write_text(MODULE)
        libdirs = cpp_ext.library_paths()
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-fvisibility=hidden",
               str(build.source_path("binding_check.cpp")), str(work / "module.cpp"),
               "-o", str(work / lib.name), f"-I{build.BINDING_DIR}",
               *(f"-I{p}" for p in cpp_ext.include_paths()),
               f"-I{sysconfig.get_paths()['include']}", f"-DTORCH_EXTENSION_NAME={name}",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               *(f"-L{p}" for p in libdirs), *(f"-Wl,-rpath,{p}" for p in libdirs),
               "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"{' '.join(cmd)}\nfailed:\n{proc.stderr[-6000:]}"
        (work / lib.name).rename(lib)  # whole or not at all
        shutil.rmtree(work, ignore_errors=True)
    spec = importlib.util.spec_from_file_location(name, lib)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make(device="cpu", batch=B, dims=(D, H, L)):
    """(x, params, eps), all valid, on `device`."""
    d, h, lat = dims
    x = torch.rand(batch, d, device=device)
    params = VAEParams(*(torch.randn(s, device=device) for s in param_shapes(d, h, lat)))
    return x, params, torch.randn(batch, lat, device=device)


def replaced(args, name, fn):
    """args with tensor `name` (x, eps or a parameter) replaced by fn(tensor)."""
    x, params, eps = args
    if name == "x":
        return fn(x), params, eps
    if name == "eps":
        return x, params, fn(eps)
    return x, params._replace(**{name: fn(getattr(params, name))}), eps


def binding(ext, x, params, eps, *, device_type="cpu", eps_required=True, samples=0,
            grads=(), mu=None, logvar=None, image=None) -> int:
    return ext.check(x, eps, eps_required, list(params), samples, list(grads), mu, logvar, image,
                     device_type)


def contract_verdict(x, params, eps, device_type="cpu"):
    """The contract's exception for a forward call of a kernel backend on `device_type`, or
    None: its kernel terms, its call checks, positive dims."""
    try:
        named = [("x", x), ("eps", eps), *zip(contract.PARAM_NAMES, params)]
        contract.check_kernel_tensors("cuda", named, device_type=device_type)
        contract.check_elbo_call(x, params, eps)
        contract.check_positive_dims(params)
    except (TypeError, ValueError) as exc:
        return exc
    return None


def assert_same(ext, x, params, eps, device_type="cpu"):
    """The binding refuses exactly what the contract refuses, and status.error gives the
    contract's exception (type and message) for it."""
    code = binding(ext, x, params, eps, device_type=device_type)
    want = contract_verdict(x, params, eps, device_type)
    if want is None:
        assert code == 0, status.describe(code)
        return None
    assert code < 0, f"the binding took what the contract refuses: {want!r}"
    got = status.error(code, {"x": x, "eps": eps, "params": params}, device_type=device_type)
    assert type(got) is type(want) and str(got) == str(want), (status.describe(code), got, want)
    return got


def test_valid_calls_pass(ext):
    for dims in ((D, H, L), (1, 1, 1), (784, 256, 32)):
        for batch in (1, 128):
            x, params, eps = make(batch=batch, dims=dims)
            assert binding(ext, x, params, eps) == 0
            assert binding(ext, x, params, None, eps_required=False) == 0


def test_a_missing_eps_is_refused_only_where_required(ext):
    x, params, _ = make()
    code = binding(ext, x, params, None)
    assert status.decode(code) == (status.MISSING, status.FIELDS.index("eps"))
    exc = status.error(code, {"x": x, "eps": None, "params": params}, device_type="cpu")
    assert isinstance(exc, TypeError) and str(exc) == "eps must be a torch.Tensor, got NoneType"


@pytest.mark.parametrize("name", NAMES)
def test_each_rule_alone_on_each_tensor(ext, name):
    """Every rule broken on one tensor at a time: the binding names that tensor, and status.error
    gives the contract's exception for the call."""
    cases = {
        "meta device": lambda t: torch.empty(t.shape, device="meta"),
        "non-contiguous": lambda t: torch.empty([2 * s for s in t.shape])[
            tuple(slice(None, None, 2) for _ in t.shape)],
        "float64": lambda t: t.double(),
        "float16": lambda t: t.half(),
        "int32": lambda t: t.int(),
        "sparse": lambda t: t.to_sparse(),
        "wider": lambda t: torch.empty(*t.shape[:-1], t.shape[-1] + 1),
        "longer": lambda t: torch.empty(t.shape[0] + 1, *t.shape[1:]),
        "3-D": lambda t: t.unsqueeze(0),
        "flat": lambda t: t.reshape(-1),
    }
    for case, fn in cases.items():
        args = replaced(make(), name, fn)
        got = assert_same(ext, *args)
        flat_already = case == "flat" and name in ("enc_b", "mu_b", "lv_b", "dec_b1", "dec_b2")
        assert (got is None) == flat_already, (case, name)
        code, field = status.decode(binding(ext, *args))
        if case in ("meta device", "non-contiguous", "float64", "sparse"):
            assert status.FIELDS[field] == name and code == {
                "meta device": status.DEVICE_TYPE, "non-contiguous": status.CONTIGUOUS,
                "float64": status.DTYPE, "sparse": status.LAYOUT}[case], (case, name)


def test_the_dims(ext):
    x, params, eps = make()
    for args in (make(batch=0), make(dims=(D, 0, L)), make(dims=(D, H, 0)), make(dims=(0, H, L)),
                 (x[0].contiguous(), params, eps)):
        got = assert_same(ext, *args)
        assert got is not None
    assert "at least one row" in str(assert_same(ext, *make(batch=0)))
    assert "dims must be positive" in str(assert_same(ext, *make(dims=(D, 0, L))))


def test_sizes_beyond_int32(ext):
    """On meta tensors (no memory): 2^31 rows are refused, 2^31 - 1 taken."""
    assert "int32" in str(assert_same(ext, *make("meta", batch=2**31), device_type="meta"))
    assert assert_same(ext, *make("meta", batch=2**31 - 1), device_type="meta") is None
    assert assert_same(ext, *make("meta", dims=(2**31, 1, 1)), device_type="meta") is not None


def test_wrong_parameter_count(ext):
    x, params, eps = make()
    code = binding(ext, x, params[:-1], eps)
    assert status.decode(code)[0] == status.COUNT
    exc = status.error(code, {"x": x, "eps": eps, "params": params[:-1]})
    assert isinstance(exc, TypeError) and "params must be a VAEParams" in str(exc)


def test_the_iwae_call(ext):
    """eps (samples, B, L), mu and logvar (B, L), image (B,) int64: each checked."""
    x, params, _ = make()
    eps = torch.randn(S, B, L)
    mu, logvar, image = torch.randn(B, L), torch.randn(B, L), torch.arange(B)
    kw = {"samples": S, "mu": mu, "logvar": logvar, "image": image, "eps_required": False}
    assert binding(ext, x, params, eps, **kw) == 0
    assert binding(ext, x, params, None, **kw) == 0
    code = binding(ext, x, params, torch.randn(S + 1, B, L), **kw)
    exc = status.error(code, {"x": x, "eps": torch.randn(S + 1, B, L), "params": params},
                       device_type="cpu", samples=S)
    assert isinstance(exc, ValueError) and f"eps must have shape ({S}, {B}, {L})" in str(exc)
    for name, bad in (("mu", torch.randn(B, L + 1)), ("logvar", torch.randn(B + 1, L)),
                      ("image", image.int()), ("image", torch.arange(B + 1))):
        code = binding(ext, x, params, eps, **{**kw, name: bad})
        assert status.FIELDS[status.decode(code)[1]] == name, (name, status.describe(code))
        exc = status.error(code, {"x": x, "eps": eps, "params": params, name: bad},
                           device_type="cpu", samples=S)
        assert isinstance(exc, (TypeError, ValueError)) and str(exc).startswith(name), exc


def test_the_backward_grads(ext):
    x, params, eps = make()
    grads = [torch.randn(B) for _ in range(3)]
    assert binding(ext, x, params, eps, grads=grads) == 0
    for i, bad in enumerate((torch.randn(B + 1), torch.randn(B).double(),
                             torch.randn(2 * B)[::2])):
        broken = grads[:i] + [bad] + grads[i + 1:]
        code = binding(ext, x, params, eps, grads=broken)
        name = ("g_elbo", "g_recon", "g_kl")[i]
        assert status.FIELDS[status.decode(code)[1]] == name, status.describe(code)
        exc = status.error(code, {"x": x, "eps": eps, "params": params, "grads": broken},
                           device_type="cpu")
        assert str(exc).startswith(f"{name} must be a contiguous torch.float32 tensor of shape "
                                   f"({B},)"), exc


def test_a_code_the_contract_does_not_confirm_is_reported_as_a_bug():
    x, params, eps = make()
    fake = -(status.SHAPE * len(status.FIELDS) + status.FIELDS.index("dec_b1"))
    exc = status.error(fake, {"x": x, "eps": eps, "params": params}, device_type="cpu")
    assert isinstance(exc, RuntimeError) and "a fastelbo bug" in str(exc)


_BREAKS = {
    "meta": lambda t: torch.empty(t.shape, device="meta"),
    "strided": lambda t: torch.empty([2 * s for s in t.shape])[
        tuple(slice(None, None, 2) for _ in t.shape)],
    "double": lambda t: t.double(),
    "wider": lambda t: torch.empty(*t.shape[:-1], t.shape[-1] + 1),
    "none": lambda t: None,
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(breaks=st.dictionaries(st.sampled_from(NAMES), st.sampled_from(sorted(_BREAKS)),
                              max_size=4),
       dims=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9)),
       batch=st.integers(1, 5))
def test_several_rules_broken_at_once(ext, breaks, dims, batch):
    """Whatever is broken, the binding refuses exactly when the contract does, and the refusal
    maps to one of the contract's own exceptions (never the bug report)."""
    args = make(batch=batch, dims=dims)
    for name, how in breaks.items():
        if how == "none" and name != "eps":
            continue  # pybind11 refuses None for x or a parameter before the check
        args = replaced(args, name, _BREAKS[how])
    x, params, eps = args
    code = binding(ext, x, params, eps)
    want = contract_verdict(x, params, eps)
    assert (code < 0) == (want is not None), (status.describe(code), want)
    if code < 0:
        got = status.error(code, {"x": x, "eps": eps, "params": params}, device_type="cpu")
        assert isinstance(got, (TypeError, ValueError)), got
