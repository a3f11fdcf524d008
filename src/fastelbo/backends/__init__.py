"""Backend registry: names, lazy imports, availability and the `auto` choice.

Every backend module exposes
    forward(x, params: VAEParams, eps) -> (elbo, recon, kl)   inputs already validated
    unavailable_reason(device: torch.device) -> str | None    None when it can run there
and may expose
    forward_prepared(x, params, eps)   what fastelbo.ops calls instead of forward, once it has
                                       validated, resolved this backend and made all contiguous
                                       (cuda: its forward re-checks everything, this does not)
Roles: torch = spec and CPU path; cuda = lowest latency; triton = throughput.
"""
from __future__ import annotations

import importlib
import json
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

NAMES = ("torch", "cuda", "triton")
_MODULES = {"torch": ".torch_ref", "cuda": ".cuda", "triton": ".triton"}
_CROSSOVER = Path(__file__).with_name("crossover.json")


_LOADED: dict[str, ModuleType] = {}


def module(name: str) -> ModuleType:
    mod = _LOADED.get(name)  # per call from fastelbo.ops: a dict lookup, not an import
    if mod is None:
        if name not in _MODULES:
            raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {name!r}")
        mod = _LOADED[name] = importlib.import_module(_MODULES[name], __name__)
    return mod


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why backend `name` cannot run on `device`, or None if it can."""
    if name == "torch":
        return None
    try:
        mod = module(name)
    except ImportError as exc:  # e.g. triton not installed
        return f"cannot import the {name} backend: {exc}"
    return mod.unavailable_reason(device)


@cache
def _crossover(graph: bool = False) -> list[dict]:
    """Rows {"backend", "max_batch"} measured by benchmarks/crossover.py, smallest batch first:
    for eager calls (per-call time in a loop, host launch work included), or with graph=True
    for calls being captured into a CUDA graph (replay time: GPU work only)."""
    if not _CROSSOVER.exists():
        return []
    table = json.loads(_CROSSOVER.read_text())
    return table.get("rules_graph", table["rules"]) if graph else table["rules"]


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def choose(device: torch.device, batch: int, dtype: torch.dtype = torch.float32,
           capturing: bool | None = None) -> str:
    """The backend `auto` runs for this call: the fastest measured one that is available, by
    eager per-call time, or by graph replay time while the current stream is capturing a CUDA
    graph (the Triton backend's host work per launch makes it the slower eager choice at
    batches where its GPU time already wins). The GPU backends compute in float32 only; any
    other dtype runs on the torch backend. `capturing`: whether the current stream captures,
    when the caller knows (fastelbo.ops does while a value check it started is in flight);
    None asks CUDA (~5 us of host time per call on the H200's host, run 73)."""
    if device.type != "cuda" or dtype != torch.float32:
        return "torch"
    graph = _capturing() if capturing is None else capturing
    preferred = [r["backend"] for r in _crossover(graph) if batch <= r["max_batch"]]
    for name in preferred + ["cuda", "triton"]:
        if unavailable_reason(name, device) is None:
            return name
    return "torch"
