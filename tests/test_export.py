"""The exported KernelBench file, generated from the package's sources (no GPU, no build).

The file runs in a child process that cannot import fastelbo, with load_inline replaced by a
recorder: its ModelNew must reach the extension's forward with what launch.py's wrapper passes,
and refuse bad input with the messages the package's own checks give. Editing launch.py or the
spec shows in the file; what the file cannot carry stops the export with a CarryError.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from fastelbo import codegen, contract, export
from fastelbo.backends.cuda import build, launch
from fastelbo.params import STATE_DICT_KEYS, VAEParams
from fastelbo.problems import vae_elbo

# The child: no fastelbo, a recording load_inline, and (for the cases marked "cpu") the carried
# check_kernel_tensors told that CPU is the kernel's device, so that a CPU forward reaches it.
DRIVER = r'''
import importlib.abc, importlib.util, sys


class NoFastelbo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "fastelbo":
            raise ImportError(f"the exported file imports {name}")


sys.meta_path.insert(0, NoFastelbo())
import torch

spec = importlib.util.spec_from_file_location("solution", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
builds, calls, lane = [], [], []
status = [0]  # what the stand-in checked_start answers


class Options:
    pass


class Extension:
    ForwardOptions = Options

    def forward(self, *args):
        calls.append(args)
        b = args[0].shape[0]
        return [torch.full((b,), 1.0), torch.full((b,), 2.0), torch.full((b,), 3.0)]

    def checked_start(self, *args):
        lane.append(args)
        return status[0]


ext = Extension()


def load_inline(**kwargs):
    builds.append(kwargs)
    return ext


mod.load_inline = load_inline
kernel_check, contract_runs = mod.check_kernel_tensors, []


def on(device_type):
    def check(*a, **k):
        contract_runs.append(1)
        return kernel_check(*a, **{**k, "device_type": device_type})
    mod.check_kernel_tensors = check


def model(dtype=torch.float32, swap=None):
    torch.manual_seed(0)
    m = mod.ModelNew(*mod.get_init_inputs()).to(dtype)
    if swap:
        setattr(m.fc_logvar, "weight", torch.nn.Parameter(torch.zeros(swap)))
    return m


def error(m, x):
    try:
        m(x)
    except Exception as exc:
        return [type(exc).__name__, isinstance(exc, ValueError), str(exc)]


cases = {
    "list": ("cuda", model(), [[0.5] * 784]),
    "float64 x": ("cuda", model(), torch.rand(2, 784, dtype=torch.float64)),
    "cpu x": ("cuda", model(), torch.rand(2, 784)),
    "float64 model": ("cpu", model(torch.float64), torch.rand(2, 784)),
    "x shape": ("cpu", model(), torch.rand(2, 100)),
    "x 1-D": ("cpu", model(), torch.rand(784)),
    "batch 0": ("cpu", model(), torch.rand(0, 784)),
    "lv_w shape": ("cpu", model(swap=(31, 256)), torch.rand(2, 784)),
}
refused = {}
for name, (device_type, m, x) in cases.items():
    on(device_type)
    refused[name] = {"device_type": device_type, "x": x, "error": error(m, x),
                     "params": [p.detach() for p in m.state_dict().values()]}
before_the_build = {"builds": len(builds), "lane": len(lane), "launches": len(calls)}
on("cpu")
contract_runs.clear()
m = model()
x = torch.rand(5, 784)
torch.manual_seed(11)
out = m(x)  # the first call: the contract's checks, then the build
first = {"contract": len(contract_runs), "lane": len(lane)}
x2 = torch.rand(3, 784)
m(x2)  # built: the lane (status 0) and no contract check
lane_call = {"contract": len(contract_runs), "args": list(lane[-1])}
status[0] = -(11 * 18 + 0)  # binding_check.h: a shape broken on x
after = {"x shape": error(m, torch.rand(2, 100)), "list": error(m, [[0.5] * 784]),
         "lane": len(lane), "launches": len(calls)}
opt = calls[0][-1]
torch.save({"refused": refused, "before_the_build": before_the_build, "x": x, "x2": x2,
            "out": out, "state": m.state_dict(), "args": list(calls[0][:-1]),
            "options": vars(opt), "same_options": calls[1][-1] is opt, "first": first,
            "lane_call": lane_call, "after": after,
            "builds": [{k: v for k, v in b.items() if not k.endswith("sources")} for b in builds],
            "sources": [(b["cuda_sources"] == mod.CUDA_SOURCE, b["cpp_sources"] == mod.CPP_SOURCE)
                        for b in builds],
            "fastelbo_loaded": [k for k in sys.modules if k.partition(".")[0] == "fastelbo"]},
           sys.argv[2])
'''


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    return export.write_kernelbench(tmp_path_factory.mktemp("export") / "solution.py")


@pytest.fixture(scope="module")
def run(solution, tmp_path_factory):
    """What the file did in the child process (see DRIVER)."""
    folder = tmp_path_factory.mktemp("run")
    (folder / "driver.py").write_text(DRIVER)
    proc = subprocess.run([sys.executable, "driver.py", str(solution), "out.pt"], cwd=folder,
                          capture_output=True, text=True, timeout=600, check=False,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(folder / "out.pt", weights_only=False)


def _python_part(text: str) -> str:
    return text[text.index("\n", text.rindex("'''")):]  # after CPP_SOURCE's closing quotes


def _binding_args(entry: str) -> list[str]:
    """The argument names binding_module.cpp gives entry point `entry`."""
    cpp = build.source_path(build.BINDING_MODULE).read_text()
    args = re.search(rf'm\.def\("{entry}",(.*?)\);$', cpp, re.DOTALL | re.MULTILINE).group(1)
    return re.findall(r'py::arg\("(\w+)"\)', args)


def test_the_file_runs_without_fastelbo_and_builds_on_first_use(run):
    assert run["fastelbo_loaded"] == []
    # refused input never builds nor launches
    assert run["before_the_build"] == {"builds": 0, "lane": 0, "launches": 0}
    (kwargs,) = run["builds"]
    assert kwargs["name"].startswith("fastelbo_kb_")
    assert (kwargs["extra_cflags"], kwargs["extra_cuda_cflags"]) == (
        list(build.CXX_FLAGS), list(build.NVCC_FLAGS))
    assert run["sources"] == [(True, True)]


def test_forward_reaches_the_binding_as_launch_py_calls_it(run):
    """Every argument where binding_module.cpp's forward names it: x, the reference's noise
    draw, the ten parameters in VAEParams order, then the product's default options."""
    names = _binding_args("forward")
    assert names[-1] == "options"
    got = dict(zip(names[:-1], run["args"], strict=True))
    assert torch.equal(got["x"], run["x"])
    torch.manual_seed(11)
    want_eps = torch.randn(5, 32)  # what the reference's randn_like(std) draws
    assert torch.equal(got["eps"], want_eps)
    assert len(got["params"]) == len(STATE_DICT_KEYS)  # one list, in VAEParams order
    for name, key, p in zip(VAEParams._fields, STATE_DICT_KEYS, got["params"], strict=True):
        assert torch.equal(p, run["state"][key]), name
    assert run["options"] == {"rows": 0, "cluster": 0, "staged": -1, "poison": False,
                              "path": launch.PATHS["auto"], "draw": False, "awaits": False}
    assert run["same_options"]  # built once per extension, as in the package
    assert [o.tolist() for o in run["out"]] == [[1.0] * 5, [2.0] * 5, [3.0] * 5]


def test_once_built_plain_tensors_take_the_bindings_lane(run):
    """As fastelbo.ops: checked_start (metadata only, validate=False: nothing launched) with
    each argument where the binding names it, and no Python check; where it answers < 0, or x
    is no tensor (the binding never sees it), the contract's checks decide."""
    assert run["first"] == {"contract": 1, "lane": 0}  # before the build: the contract's
    assert run["lane_call"]["contract"] == 1
    got = dict(zip(_binding_args("checked_start"), run["lane_call"]["args"], strict=True))
    assert torch.equal(got.pop("x"), run["x2"])
    assert (got.pop("eps"), got.pop("validate")) == (None, False)
    params = got.pop("params")  # one list, in VAEParams order
    assert len(params) == len(STATE_DICT_KEYS)
    for name, key, p in zip(VAEParams._fields, STATE_DICT_KEYS, params, strict=True):
        assert torch.equal(p, run["state"][key]), name
    assert got == {}
    after = run["after"]
    assert after["x shape"] == ["ValueError", True, "x must have shape (batch, 784), got (2, 100)"]
    assert after["list"] == ["TypeError", False, "x must be a torch.Tensor, got list"]
    assert (after["lane"], after["launches"]) == (2, 2)  # the list never reached the binding


def _package_error(case):
    """What the contract says of the same input to a kernel backend (its kernel terms, with the
    kernel's device type as the child had it, the call's checks, positive dims), as the cuda
    backend raises it for a call its binding refuses."""
    x, params = case["x"], case["params"]
    eps = torch.zeros(x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else 1, 32)
    try:
        params = contract.as_params(params)
        contract.check_kernel_tensors(  # None: the file's own, a kernel standing alone
            None, (("x", x), ("eps", eps), *zip(contract.PARAM_NAMES, params)),
            device_type=case["device_type"])
        contract.check_elbo_call(x, params, eps)
        contract.check_positive_dims(params)
    except (TypeError, ValueError) as exc:
        return [type(exc).__name__, isinstance(exc, ValueError), str(exc)]
    return None


def test_bad_input_is_refused_with_the_contracts_messages(run):
    refused = run["refused"]
    assert len(refused) == 8
    for name, case in refused.items():
        assert case["error"] is not None, name
        assert case["error"] == _package_error(case), name
    # the file stands alone: its messages point to no fastelbo backend
    assert refused["cpu x"]["error"][1:] == [True, "x must be a CUDA tensor, got one on cpu."]
    assert refused["list"]["error"][0] == "TypeError"


def test_the_file_holds_only_what_it_uses(solution):
    text = solution.read_text()
    python = _python_part(text)
    tree = ast.parse(text)
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert {"forward", "forward_default", "default_forward_options", "check_kernel_tensors",
            "check_x", "check_param_tensors", "param_shapes", "ModelNew", "get_inputs",
            "get_init_inputs"} <= defined
    for absent in ("backward", "plan", "adam_step", "iwae_partials", "draw_randn", "as_params",
                   "check_params", "set_validation", "unit_mask", "outside_range_error",
                   "VAEParams"):
        assert absent not in defined and f"{absent}(" not in python, absent
    assert "__future__" not in python
    assert not re.search(r"^\s*(import|from)\s+fastelbo", text, re.MULTILINE)
    assert codegen.free_names(text) == set()
    # Each carried wrapper is launch.py's own text, its annotations stripped.
    for fn in (launch.forward, launch.forward_default, launch.default_forward_options,
               contract.check_x):
        assert codegen.strip_annotations(inspect.getsource(fn)) in text, fn.__name__


def test_model_new_is_built_by_the_specs_init(solution):
    tree = ast.parse(solution.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelNew"]
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    spec_init = inspect.getsource(vae_elbo.Model.__init__)
    assert ast.get_source_segment(solution.read_text(), init, padded=True) == spec_init.rstrip()


def test_launch_py_is_an_ordinary_module():
    """It has a docstring and `from __future__ import annotations` like its neighbours; the
    export carries what it needs of it all the same."""
    tree = ast.parse(inspect.getsource(launch))
    assert ast.get_docstring(tree)
    assert any(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in tree.body)


def _launch_copy(tmp_path, name, edit) -> object:
    """launch.py edited by `edit` (text -> text), imported from tmp_path as `name`."""
    path = tmp_path / f"{name}.py"
    path.write_text(edit(inspect.getsource(launch)))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load(tmp_path, text: str):
    """The generated text as a module (its extension never built)."""
    path = tmp_path / "solution.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("fastelbo_test_solution", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _generate_with(monkeypatch, launch_module) -> str:
    monkeypatch.setattr(export, "SOURCES", (launch_module, *export.SOURCES[1:]))
    return export.kernelbench_source()


def test_imports_in_launch_py_do_not_reach_the_file(tmp_path, monkeypatch):
    future = "from __future__ import annotations\n"
    add = "import os\nimport json as _json\n\n\ndef cwd():\n    return os.getcwd(), _json\n"
    copy = _launch_copy(tmp_path, "with_imports", lambda t: t.replace(future, future + add))
    text = _generate_with(monkeypatch, copy)
    assert "import os" not in text and "def cwd" not in text and "_json" not in text
    uses_os = _launch_copy(tmp_path, "uses_os", lambda t: t.replace(future, future + add).replace(
        "    return ext.forward(x, eps, params, options)",
        "    os.getcwd()\n    return ext.forward(x, eps, params, options)"))
    with pytest.raises(codegen.CarryError, match=r"uses_os.forward uses os \(os, imported"):
        _generate_with(monkeypatch, uses_os)


def test_renamed_definitions_in_launch_py_are_followed(tmp_path, monkeypatch):
    copy = _launch_copy(tmp_path, "renamed", lambda t: re.sub(
        r"\b_presets\b", "_build_presets", re.sub(r"\bPATHS\b", "PATH_NUMBERS", t)))
    text = _generate_with(monkeypatch, copy)
    python = _python_part(text)
    assert "def _build_presets(ext):" in python and "PATH_NUMBERS = {" in python
    assert not re.search(r"\b(_presets|PATHS)\b", python)
    solution = _load(tmp_path, text)
    options = type("Ext", (), {"ForwardOptions": type("O", (), {})})
    assert solution.default_forward_options(options).path == 0
    renamed = _launch_copy(tmp_path, "no_forward_default",
                           lambda t: t.replace("def forward_default(ext", "def run(ext"))
    with pytest.raises(codegen.CarryError,
                       match="uses forward_default, which none of no_forward_default"):
        _generate_with(monkeypatch, renamed)
    # A wrapper's own helper that is gone: named with the wrapper that uses it.
    renamed = _launch_copy(tmp_path, "no_forward",
                           lambda t: t.replace("def forward(ext", "def run(ext"))
    with pytest.raises(codegen.CarryError, match="no_forward.forward_default uses forward, "
                                                 "which no_forward.py does not define"):
        _generate_with(monkeypatch, renamed)


def test_the_spec_init_brings_what_it_uses(tmp_path, monkeypatch):
    """A spec whose __init__ calls a helper of its own: the file carries the helper."""
    source = inspect.getsource(vae_elbo).replace(
        "        self.encoder = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.ReLU())",
        "        self.encoder = _encoder(input_dim, hidden_dim)").replace(
        "class Model(nn.Module):",
        textwrap.dedent("""\
            def _encoder(d, h):
                return nn.Sequential(nn.Linear(d, h), nn.ReLU())


            class Model(nn.Module):"""))
    path = tmp_path / "spec_copy.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("spec_copy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(export, "SPEC", mod)
    text = export.kernelbench_source()
    assert "def _encoder(d, h):" in text
    solution = _load(tmp_path, text)
    model = solution.ModelNew(*solution.get_init_inputs())
    assert tuple(model.state_dict()) == STATE_DICT_KEYS


# The deferred value check's file (export's deferred=True), run as DRIVER runs the default one:
# no fastelbo, a stand-in extension whose take_deferred hands out a record once.
DEFERRED_DRIVER = r'''
import importlib.abc, importlib.util, json, sys


class NoFastelbo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "fastelbo":
            raise ImportError(f"the exported file imports {name}")


sys.meta_path.insert(0, NoFastelbo())
import torch

spec = importlib.util.spec_from_file_location("solution", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
record, log = [0, 0, 0, 0], []


class Options:
    pass


class Extension:
    ForwardOptions = Options

    def forward(self, x, eps, params, options):
        log.append({"forward": vars(options)})
        return [torch.zeros(x.shape[0]) for _ in range(3)]

    def checked_start(self, *args):
        return 0

    def take_deferred(self, device):
        log.append({"take": device})
        out = list(record)
        record[:] = [0, 0, 0, 0]
        return out


mod.load_inline = lambda **kwargs: Extension()
kernel_check = mod.check_kernel_tensors
mod.check_kernel_tensors = lambda *a, **k: kernel_check(*a, **{**k, "device_type": "cpu"})


def errors():
    try:
        mod.check_errors(0)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]


before = errors()  # not built: nothing asked
torch.manual_seed(0)
m = mod.ModelNew(*mod.get_init_inputs())
m(torch.rand(3, 784))
clean = errors()
record[:] = [2, 1, 5, 0x7FC00000]  # a NaN at x[1, 5], and one more bad value
found = errors()
print(json.dumps({"before": before, "clean": clean, "found": found, "again": errors(),
                  "log": log}))
'''


def test_the_deferred_file_passes_the_option_and_raises_from_check_errors(tmp_path):
    """export's deferred=True: ModelNew's forward asks the binding for the deferred check (the
    default options plus deferred), and the file's check_errors() raises the contract's
    message for the record the binding hands out (once), nothing before the build or for an
    empty record."""
    path = export.write_kernelbench(tmp_path / "solution.py", deferred=True)
    (tmp_path / "driver.py").write_text(DEFERRED_DRIVER)
    proc = subprocess.run([sys.executable, "driver.py", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, check=False,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["before"] is None and got["clean"] is None and got["again"] is None
    want = str(contract.deferred_value_error(2, 1, 5, 0x7FC00000))
    assert got["found"] == ["ValueError", want] and "first x[1, 5] = nan" in want
    assert got["log"] == [{"forward": {"rows": 0, "cluster": 0, "staged": -1, "poison": False,
                                       "path": launch.PATHS["auto"], "draw": False,
                                       "awaits": False, "deferred": True}},
                          {"take": 0}, {"take": 0}, {"take": 0}]


def test_the_default_file_has_no_deferred_check(solution, tmp_path):
    """Without the switch the file is as before: no check_errors, no deferred option, nothing
    of the deferred record carried; with it, both."""
    default = _python_part(solution.read_text())
    deferred = _python_part(export.kernelbench_source(deferred=True))
    for name in ("def check_errors(", "def take_deferred(", "def deferred_value_error(",
                 "deferred=True)"):
        assert name not in default and name in deferred, name
    with contract.deferred_check(True):
        assert _python_part(export.kernelbench_source()) == deferred
    assert _python_part(export.kernelbench_source(deferred=False)) == default
