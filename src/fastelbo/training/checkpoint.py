"""Checkpoints: one safetensors file, written atomically (temp file + rename).

Tensors:   model.<state_dict key>            the VAE (same keys as the reference Model)
           optim.<param index>.<state key>   Adam state (exp_avg, exp_avg_sq, step)
           rng.torch, rng.cuda.<i>           global RNG states (training draws its batches and
                                             noise from seeds, see step.py; these are restored
                                             so nothing else drifts either)
Metadata:  "fastelbo" -> JSON {format, step, args, history, param_groups, optim_scalars}
No pickle anywhere, so a checkpoint is safe to load from an untrusted source.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as serialize

from . import rundir

FORMAT = "fastelbo-checkpoint-1"
NAME = rundir.CHECKPOINT
# Hyperparameters restored from a checkpoint; implementation flags (fused, capturable, foreach)
# stay as built for the current device, so a GPU checkpoint resumes on CPU and back.
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def save(path: str | Path, model, optimizer, meta: dict) -> None:
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    osd = optimizer.state_dict()
    scalars = {}
    for idx, st in osd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    groups = [{k: v for k, v in g.items()} for g in osd["param_groups"]]
    meta = dict(meta, format=FORMAT, param_groups=groups, optim_scalars=scalars)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        # Serialized in memory, written by Python: a failed write is an OSError (safetensors'
        # own file writer raises its SafetensorError), which train saves elsewhere.
        tmp.write_bytes(serialize(tensors, metadata={"fastelbo": json.dumps(meta)}))
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C mid-write too: the previous checkpoint stays, whole
        tmp.unlink(missing_ok=True)
        raise


def read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a checkpoint, with a clear error for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("fastelbo")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from exc
    meta = json.loads(raw) if raw else {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a fastelbo checkpoint (format {meta.get('format')!r})")
    return tensors, meta


def read_meta(path: str | Path) -> dict | None:
    """The metadata of a readable fastelbo checkpoint at `path` (the header only, no tensors),
    else None: what a Ctrl-C message reports as the state a --resume continues from."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("fastelbo", "{}"))
    except Exception:  # noqa: BLE001 - missing, partial or foreign: no checkpoint to report
        return None
    return meta if meta.get("format") == FORMAT else None


def model_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}


def restore(tensors: dict, meta: dict, model, optimizer, *, restore_rng: bool = True) -> None:
    model.load_state_dict(model_state(tensors))
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            idx, name = k[len("optim."):].split(".", 1)
            state.setdefault(int(idx), {})[name] = v
    for k, v in meta["optim_scalars"].items():
        idx, name = k.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    current = optimizer.state_dict()["param_groups"]
    if len(current) != len(meta["param_groups"]):
        raise ValueError("checkpoint optimizer has a different number of parameter groups")
    groups = []
    for cur, old in zip(current, meta["param_groups"]):
        g = dict(cur, **{k: old[k] for k in _GROUP_KEYS if k in old})
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    if restore_rng:
        torch.set_rng_state(tensors["rng.torch"])
        cuda = [tensors[f"rng.cuda.{i}"] for i in range(torch.cuda.device_count())
                if f"rng.cuda.{i}" in tensors]
        if cuda and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
