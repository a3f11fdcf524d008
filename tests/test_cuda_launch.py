"""The cuda backend's launch.py against binding_module.cpp, on CPU (no GPU, no build).

One keyword-only wrapper per bound entry point, calling it positionally: a wrapper that passes
an argument in the wrong place would hand a kernel the wrong tensor with no error at all, so
each wrapper is called on a stand-in extension whose entry points name their arguments as the
C++ binding does, and every argument must arrive under its own name.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from fastelbo.backends.cuda import build, launch, status
from fastelbo.params import VAEParams

MODULE_CPP = build.source_path(build.BINDING_MODULE).read_text()
BINDING_H = build.source_path("binding.h").read_text()


def _bound_entries() -> dict[str, list[str]]:
    """{Python name: [argument names]} of every m.def in binding_module.cpp."""
    entries = {}
    for m in re.finditer(r'm\.def\("(\w+)",(.*?)\);$', MODULE_CPP, re.DOTALL | re.MULTILINE):
        entries[m.group(1)] = re.findall(r'py::arg\("(\w+)"\)', m.group(2))
    return entries


ENTRIES = _bound_entries()
# A wrapper argument the binding does not name: the binding's arguments it stands for, in order.
EXPANDS = {"dims": ("D", "H", "L"), "batch": ("B",)}
# The entries that take the VAE's tensors: each takes the ten parameters as one list.
TAKES_PARAMS = ("forward", "backward", "checked_start", "checked_start_deferred",
                "iwae_partials", "iwae_wgmma_partials")


def test_the_binding_is_parsed():
    assert len(ENTRIES) == 18, sorted(ENTRIES)
    assert ENTRIES["forward"] == ["x", "eps", "params", "options"]
    assert ENTRIES["pdl_launches"] == [] and ENTRIES["last_status"] == []


def test_one_signature_takes_the_parameters_as_one_list():
    """No entry names a parameter tensor (the positional twelve-tensor signature is gone), in
    the bound module or in binding.h's declarations; every entry that takes the VAE's tensors
    takes `params` (a std::vector<at::Tensor>, VaeTensors reads it by name)."""
    for name in TAKES_PARAMS:
        assert "params" in ENTRIES[name], name
    for name, args in ENTRIES.items():
        assert not set(args) & set(VAEParams._fields), (name, args)
    for field in VAEParams._fields:
        assert not re.search(rf"const at::Tensor& {field}\b", BINDING_H), field
    # Nor does any helper of the binding files take the biases one by one (VaeTensors instead).
    for name in (*build.BINDING_SOURCES, *build.BINDING_HEADERS):
        text = build.source_path(name).read_text()
        assert not re.search(r"const at::Tensor& (enc_b|mu_b|lv_b|dec_b1|dec_b2)\b", text), name
    assert BINDING_H.count("const std::vector<at::Tensor>& params") == len(TAKES_PARAMS) + 1


class _Recorder:
    """A stand-in extension: each entry point records {argument name: value}."""

    def __init__(self):
        self.calls = {}
        for name, argnames in ENTRIES.items():
            setattr(self, name, self._entry(name, argnames))

    def _entry(self, name, argnames):
        def call(*args):
            assert len(args) == len(argnames), (name, len(args), argnames)
            self.calls[name] = dict(zip(argnames, args))
            return [object()] * 3
        return call


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_each_entry_has_a_keyword_only_wrapper_passing_every_argument_by_name(name):
    wrapper = getattr(launch, name)
    params = list(inspect.signature(wrapper).parameters.values())
    assert params[0].name == "ext" and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:]), params
    given, want = {}, {}
    for p in params[1:]:
        parts = (p.name,) if p.name in ENTRIES[name] else EXPANDS[p.name]
        values = [object() for _ in parts] if p.name != "dims" else [11, 12, 13]
        given[p.name] = values[0] if len(parts) == 1 else tuple(values)
        want.update(zip(parts, values))
    ext = _Recorder()
    wrapper(ext, **given)
    got = ext.calls[name]
    assert set(got) == set(want), (sorted(got), sorted(want))
    for arg, value in want.items():
        assert got[arg] is value or got[arg] == value and type(value) is int, arg


def test_no_wrapper_without_an_entry():
    wrappers = {n for n, f in vars(launch).items() if inspect.isfunction(f)
                and list(inspect.signature(f).parameters)[:1] == ["ext"]
                and not n.startswith("_")}
    helpers = {"forward_options", "default_forward_options", "forward_default",
               "backward_options"}
    assert wrappers - helpers == set(ENTRIES)


def _struct_fields(struct: str) -> list[str]:
    body = re.search(r"struct " + struct + r" \{(.*?)\};", BINDING_H, re.DOTALL).group(1)
    return re.findall(r"^\s+(?:int64_t|bool) (\w+) =", body, re.MULTILINE)


@pytest.mark.parametrize("struct, builder", [("ForwardOptions", launch.forward_options),
                                             ("BackwardOptions", launch.backward_options)])
def test_option_structs_are_bound_and_built_by_every_field(struct, builder):
    fields = _struct_fields(struct)
    assert len(fields) >= 5, fields
    bound = re.findall(r'def_readwrite\("(\w+)", &fb::' + struct + r"::(\w+)\)", MODULE_CPP)
    assert [a for a, _ in bound] == [b for _, b in bound] == fields

    class Options:
        pass

    built = builder(type("Ext", (), {struct: Options}),
                    **{f: {"path": "fast", "gemm": "tc", "deferred": True,
                           "latent": "fused", "output": "pingpong"}.get(f, (f == "rows") * 3)
                       for f in fields})
    assert set(vars(built)) == set(fields)


def test_the_deferred_option_is_set_only_where_asked():
    """forward_options leaves ForwardOptions::deferred at the struct's default (off) unless
    asked, so that the product's default options carry exactly the fields they did before it
    (the exported file's stand-in records every field set)."""
    class Options:
        pass

    ext = type("Ext", (), {"ForwardOptions": Options})
    assert "deferred" not in vars(launch.forward_options(ext))
    assert "latent" not in vars(launch.forward_options(ext))
    assert "output" not in vars(launch.forward_options(ext))
    assert launch.forward_options(ext, deferred=True).deferred is True
    assert "deferred" not in vars(launch.default_forward_options(ext, draw=True, awaits=True))
    for draw in (False, True):
        opt = launch.default_forward_options(ext, draw=draw, deferred=True)
        assert (opt.deferred, opt.draw, opt.awaits) == (True, draw, False)
        assert launch.default_forward_options(ext, draw=draw, deferred=True) is opt


def test_paths_are_the_bindings():
    enum = re.search(r"enum Path : int64_t \{(.*?)\};", BINDING_H).group(1)
    numbered = {name.lower(): int(v) for name, v in re.findall(r"kPath(\w+) = (\d+)", enum)}
    assert numbered == launch.PATHS


def test_latents_are_the_bindings():
    enum = re.search(r"enum Latent : int64_t \{(.*?)\};", BINDING_H).group(1)
    numbered = {name.lower(): int(v) for name, v in re.findall(r"kLatent(\w+) = (\d+)", enum)}
    assert numbered == launch.LATENTS
    opt = launch.forward_options(type("Ext", (), {"ForwardOptions": type("O", (), {})}),
                                 latent="fused")
    assert opt.latent == launch.LATENTS["fused"]


def test_outputs_are_the_bindings():
    enum = re.search(r"enum Output : int64_t \{(.*?)\};", BINDING_H).group(1)
    numbered = {name.lower(): int(v) for name, v in re.findall(r"kOutput(\w+) = (\d+)", enum)}
    assert numbered == launch.OUTPUTS
    opt = launch.forward_options(type("Ext", (), {"ForwardOptions": type("O", (), {})}),
                                 output="pingpong")
    assert opt.output == launch.OUTPUTS["pingpong"]


def test_gemms_are_the_bindings():
    enum = re.search(r"enum Gemm : int64_t \{(.*?)\};", BINDING_H).group(1)
    numbered = {name.lower(): int(v) for name, v in re.findall(r"kGemm(\w+) = (\d+)", enum)}
    assert numbered == launch.GEMMS


def test_default_options_are_built_once_per_extension():
    class Options:
        pass

    ext = type("Ext", (), {"ForwardOptions": Options})
    a = launch.default_forward_options(ext)
    assert launch.default_forward_options(ext) is a
    both = launch.default_forward_options(ext, draw=True, awaits=True)
    assert (both.draw, both.awaits, a.draw, a.awaits) == (True, True, False, False)
    assert a.path == launch.PATHS["auto"] and (a.rows, a.cluster, a.staged) == (0, 0, -1)
    other = type("Ext", (), {"ForwardOptions": Options})
    assert launch.default_forward_options(other) is not a


def test_only_launch_calls_the_extension():
    """Every other module reaches the extension through a wrapper (no direct ext.entry(...))."""
    src = Path(launch.__file__).resolve().parents[3]
    pattern = re.compile(r"\b(?:ext|extension\(\))\.(" + "|".join(ENTRIES) + r")\(")
    offenders = []
    for path in src.rglob("*.py"):
        if path.name == "launch.py" and path.parent.name == "cuda":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(src)}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_status_names_the_checks_codes_and_fields_in_their_order():
    """status.py's CODES and FIELDS are binding_check.h's enums, value for value."""
    header = build.source_path("binding_check.h").read_text()

    def enum(name):
        body = re.search(rf"enum {name} : int64_t \{{(.*?)\}};", header, re.DOTALL).group(1)
        return {k: int(v) for k, v in re.findall(r"^\s+(k\w+) = (\d+),", body, re.MULTILINE)}

    codes = enum("CheckCode")
    assert sorted(codes.values()) == list(range(len(status.CODES)))
    for name, value in codes.items():  # kCheckDeviceType -> "device type"
        words = re.sub(r"(?<!^)(?=[A-Z])", " ", name.removeprefix("kCheck")).lower()
        assert status.CODES[value] == words, (name, status.CODES[value])
    fields = enum("CheckField")
    assert fields["kFieldParams"] == status.FIELDS.index("enc_w")
    for name, value in fields.items():
        if name not in ("kFieldParams", "kFieldGrads"):
            assert status.FIELDS[value] == name.removeprefix("kField").lower(), name
    assert status.FIELDS[fields["kFieldGrads"]] == "g_elbo"
    assert re.search(rf"kFieldCount = {len(status.FIELDS)};", header)
    assert status.FIELDS[2:12] == VAEParams._fields


def test_every_entry_taking_the_vaes_tensors_checks_them_with_check_inputs():
    """Each definition that takes `params` (Adam's aside: optimizer state, not the VAE's
    inputs) goes through passes(call) (check_inputs) before anything else reads them, and no
    binding file checks a VAE tensor's shape, dtype or device on its own."""
    defined = 0
    for name in build.BINDING_SOURCES:
        text = build.source_path(name).read_text()
        for m in re.finditer(r"^[\w:<>, ]+ (\w+)\(([^)]*const std::vector<at::Tensor>& params"
                             r"[^)]*)\) \{\n(.*?)^\}", text, re.DOTALL | re.MULTILINE):
            fn, body = m.group(1), m.group(3)
            if fn == "adam_step":
                continue
            defined += 1
            first = body.index("passes(call)")
            assert "params[" not in body[:first] and "VaeTensors" not in body[:first], fn
        assert "check_shape(" not in text, name
        uses = re.findall(r"FE_CHECK_TENSOR\(\*?(\w+)", text)
        assert set(uses) <= {"t", "x"}, (name, uses)  # Adam's tensors; the value check's x
    assert defined == len(TAKES_PARAMS)
