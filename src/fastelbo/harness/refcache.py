"""The reference's outputs on disk, so that checking a second candidate never reruns it.

A problem's key hashes the problem file's bytes, the seed, the device (the CPU's model name;
for CUDA the device string and CUDA_VISIBLE_DEVICES, with the GPU's name checked against the
candidate worker's before use), the torch version (its CUDA build included) and CACHE_VERSION.
The problem's entry lists every source file the problem imported outside the standard library
and site-packages, with its hash: an edit to any of them makes the entry stale. A regime's key
adds the regime, the module mode and the tolerance of the reference's determinism check.

Under the root (FASTELBO_CACHE_DIR, else $XDG_CACHE_HOME/fastelbo, else ~/.cache/fastelbo):

    reference/v<N>/<pkey>.meta.json   default batch size, input variants, dependencies, device
    reference/v<N>/<pkey>.init.pt     init inputs and the reference's state_dict
    reference/v<N>/<rkey>.<n>.inputs.pt   the inputs of n trials (the candidate worker's)
    reference/v<N>/<rkey>.<n>.ref.pt      their outputs, generator states, determinism
    reference/v<N>/<rkey>.count           n and both files' SHA-256, written last: complete
    reference/v<N>/<rkey>.env<t>.pt   trial t's perturbed-reference envelope, once one was needed

Every write is atomic (a temp file, then os.replace): two checks at once may both compute an
entry, never read half of one. The cache heals itself: an entry whose files do not load or do
not match the checksums recorded with it (a disk fault, a killed writer, a hand edit) is
deleted with a one-line note, and the reference recomputes it. The root is mode 0700, and no
candidate's worker may read it (sandbox.py). This module imports torch only to read and write
.pt files, so
the parent can look entries up before it imports torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

CACHE_VERSION = 4   # bump when what the reference pass records changes
MAX_BYTES = int(float(os.environ.get("FASTELBO_CACHE_MAX_GB", "4")) * 2**30)


def default_root() -> Path:
    if os.environ.get("FASTELBO_CACHE_DIR"):
        return Path(os.environ["FASTELBO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fastelbo"


def entry_dir(root: str | Path) -> Path:
    return Path(root) / "reference" / f"v{CACHE_VERSION}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_hash(path: str | Path) -> str | None:
    try:
        return _sha(Path(path).read_bytes())
    except OSError:
        return None


def torch_version() -> str:
    """torch's installed version (its local part names the CUDA build), read without importing
    torch, and the same in the harness and in its workers."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def device_key(device: str) -> str:
    """The device as far as it is known without touching it (no CUDA context)."""
    if device.startswith("cuda"):
        index = device.split(":", 1)[1] if ":" in device else "0"
        return f"cuda:{index} visible={os.environ.get('CUDA_VISIBLE_DEVICES', '')}"
    return "cpu"


def device_name_hint(root: str | Path, device: str) -> str | None:
    """The device's name: the CPU's model, or for CUDA the name the last reference pass on this
    device key saw (the candidate worker's own is compared with it before a cached entry is
    used, so a stale hint costs a rerun, never a wrong verdict)."""
    if not device.startswith("cuda"):
        from .results import cpu_name
        return cpu_name()
    try:
        return path(root, _sha(device_key(device).encode()), "device").read_text() or None
    except OSError:
        return None


def save_device_hint(root: str | Path, device: str, name: str) -> None:
    if device.startswith("cuda"):
        save(name, path(root, _sha(device_key(device).encode()), "device"))


def problem_key(problem: str | Path, seed: int, device: str, name: str) -> str:
    parts = [f"v{CACHE_VERSION}", file_hash(problem) or "missing", f"seed={seed}",
             device_key(device), name, torch_version()]
    return _sha("\n".join(parts).encode())


def regime_key(pkey: str, deps_digest: str, regime: dict, eval_mode: bool, atol: float,
               rtol: float) -> str:
    parts = [pkey, deps_digest, json.dumps(regime, sort_keys=True), f"eval={eval_mode}",
             f"atol={atol!r} rtol={rtol!r}"]
    return _sha("\n".join(parts).encode())


def deps_digest(deps: dict[str, str | None]) -> str:
    return _sha(json.dumps(deps, sort_keys=True).encode())


def path(root: str | Path, key: str, suffix: str) -> Path:
    return entry_dir(root) / f"{key}.{suffix}"


def seal(root: str | Path) -> None:
    """Create the cache's root, readable by its owner alone."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)


def load_meta(root: str | Path, pkey: str, notes: list[str] | None = None) -> dict | None:
    """The problem's entry, or None when absent or stale (a dependency changed); a damaged one
    (unreadable, or its init.pt not the one recorded) is deleted, with a note."""
    meta_file, init = path(root, pkey, "meta.json"), path(root, pkey, "init.pt")
    try:
        meta = json.loads(meta_file.read_text())
    except OSError:
        return None
    except ValueError:
        return _discard([meta_file, init], notes, "its problem entry does not parse")
    if not init.is_file():
        return None
    if meta.get("init_sha") != file_hash(init):
        return _discard([meta_file, init], notes, "its init.pt does not match its checksum")
    if any(file_hash(p) != h for p, h in meta.get("deps", {}).items()):
        return None
    return meta


def regime_entry(root: str | Path, rkey: str, trials: int, notes: list[str] | None = None,
                 verify: bool = True, transient: bool = False) -> tuple[Path, Path] | None:
    """(inputs file, reference file) of a regime entry holding at least `trials` trials. With
    `verify`, both files are checked against the checksums written with the entry: a damaged
    entry is deleted (with a note in `notes`) and reads as absent. A transient entry (one that
    says the reference was refused memory: finish_entry) is read only with `transient`, by the
    check that computed it; for any other it is absent, so it is computed again."""
    count = path(root, rkey, "count")
    try:
        record = json.loads(count.read_text())
        n, sums = int(record["n"]), record["sha256"]
    except OSError:
        return None
    except (ValueError, KeyError, TypeError):
        return _discard([count], notes, "its count file does not parse")
    files = regime_files(root, rkey, n)
    if n < trials or (record.get("transient") and not transient):
        return None
    if verify and [file_hash(f) for f in files] != sums:
        return _discard([count, *files], notes, "a file does not match its checksum")
    return files


def finish_entry(root: str | Path, rkey: str, n: int, transient: bool = False) -> None:
    """Mark the entry of `n` trials complete, with its files' checksums (written last).
    `transient`: what it records depends on more than the problem and the seed (the reference
    was refused memory that others may have held), so no later check reuses it."""
    sums = [file_hash(f) for f in regime_files(root, rkey, n)]
    record = {"n": n, "sha256": sums, **({"transient": True} if transient else {})}
    save(json.dumps(record), path(root, rkey, "count"))  # atomic, as all


def _discard(files: list[Path], notes: list[str] | None, why: str) -> None:
    for f in files:
        try:
            f.unlink()
        except OSError:
            pass
    if notes is not None:
        notes.append(f"reference cache: discarded a damaged entry ({why}); recomputed")


def regime_files(root: str | Path, rkey: str, n: int) -> tuple[Path, Path]:
    """Where a regime's entry of `n` trials lives; the .count file, written last, names the
    complete one (two checks at once with different trial counts never mix their files)."""
    return path(root, rkey, f"{n}.inputs.pt"), path(root, rkey, f"{n}.ref.pt")


def save(obj, target: Path) -> None:
    """torch.save (or JSON for .json) atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    if target.suffix == ".json":
        tmp.write_text(json.dumps(obj, sort_keys=True))
    elif target.suffix == ".pt":
        import torch
        torch.save(obj, tmp)
    else:
        tmp.write_text(str(obj))
    os.replace(tmp, target)


def load(target: Path):
    """A .pt entry, memory-mapped: its tensors are read when used (a large state_dict or trial
    input costs nothing until a forward touches it). Entries are written once, atomically, and
    never modified, so the mapping stays valid (also if prune unlinks the file meanwhile)."""
    import torch
    return torch.load(target, weights_only=True, mmap=True)


def source_deps(modules_before: set[str], problem: str | Path) -> dict[str, str | None]:
    """Source files of the modules imported since `modules_before`, outside the standard
    library and site-packages (the user's own helpers), with their hashes."""
    skip = {Path(p).resolve() for p in {sys.prefix, sys.base_prefix, sys.exec_prefix,
                                        *sysconfig.get_paths().values()} if p}
    deps = {}
    for name in set(sys.modules) - modules_before:
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file or not file.endswith(".py"):
            continue
        resolved = Path(file).resolve()
        if resolved == Path(problem).resolve() or any(s in resolved.parents for s in skip):
            continue
        deps[str(resolved)] = file_hash(resolved)
    return deps


def prune(root: str | Path, max_bytes: int = MAX_BYTES) -> None:
    """Delete the least recently written entries until the cache holds at most `max_bytes`."""
    try:
        files = [(f.stat().st_mtime, f.stat().st_size, f) for f in entry_dir(root).iterdir()
                 if f.is_file()]
    except OSError:
        return
    total = sum(size for _, size, _ in files)
    for _, size, f in sorted(files):
        if total <= max_bytes:
            break
        try:
            f.unlink()
            total -= size
        except OSError:
            pass
