"""Find and import problems and candidates, build models with identical weights, draw inputs,
and move a module, its state and its inputs between a regime's forwards.

These helpers run inside workers: they execute problem and candidate code.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from types import ModuleType

import torch

from ...problems import load_module, load_problem
from ..files import candidate_path  # noqa: F401  (re-exported: bench and compile use it)
from .worker import TaskError, traceback_tail

BUILD_LOG_CHARS = 20000


def import_candidate(path: str | Path, sha256: str | None = None) -> ModuleType:
    """Import a candidate file; failures become TaskError("import") naming file:line. Its bytes
    are read once: those are what runs (never a .pyc), what names its compile caches in a
    confined worker (sandbox.narrow_builds), and, given `sha256` (of the bytes the harness
    parsed and scanned), what must hash to it: a file changed since is not run."""
    import hashlib

    from .sandbox import narrow_builds
    try:
        source = Path(path).read_bytes()
    except OSError as exc:
        raise TaskError("import", f"{path}: cannot read the candidate: {exc}") from None
    digest = hashlib.sha256(source).hexdigest()
    if sha256 is not None and digest != sha256:
        raise TaskError("import", f"{path}: the file changed after the harness read it "
                        f"(sha256 {digest[:12]}, read as {sha256[:12]}); not run")
    narrow_builds(digest)
    try:
        mod = load_module(path, source=source)
    except SyntaxError as exc:
        raise TaskError("import", f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}\n"
                        f"{(exc.text or '').rstrip()}") from None
    except Exception as exc:  # noqa: BLE001 - any import-time failure is the candidate's
        if _is_build_error(exc):  # keep the compiler's whole output: it holds the line numbers
            raise TaskError("build", f"{where(exc, path)}building the candidate's extension "
                            f"failed:\n{str(exc)[-BUILD_LOG_CHARS:]}") from None
        raise TaskError("import", f"{where(exc, path)}importing the candidate raised:\n"
                        f"{traceback_tail(exc)}") from None
    if not hasattr(mod, "ModelNew"):
        raise TaskError("import", f"{path}: defines no ModelNew")
    return mod


def _is_build_error(exc: Exception) -> bool:
    # torch.utils.cpp_extension reports compiler failures as "Error building extension".
    return "Error building extension" in str(exc)


def where(exc: BaseException, path: str | Path) -> str:
    """`file:line: ` of the deepest traceback frame inside the candidate file, if any."""
    target, found = str(Path(path).resolve()), ""
    tb = exc.__traceback__
    while tb is not None:
        if str(Path(tb.tb_frame.f_code.co_filename).resolve()) == target:
            found = f"{target}:{tb.tb_lineno}: "
        tb = tb.tb_next
    return found


def problem_module(path: str | Path) -> ModuleType:
    try:
        return load_problem(path)
    except Exception as exc:  # noqa: BLE001
        raise TaskError("reference", f"cannot load the problem: {traceback_tail(exc)}") from None


def init_inputs(mod: ModuleType, seed: int) -> list:
    """get_init_inputs() after torch.manual_seed(seed), as KernelBench calls it."""
    torch.manual_seed(seed)
    return list(mod.get_init_inputs())


def build_model(cls, init_inputs: list, seed: int,
                state_dict: dict | None = None) -> tuple[torch.nn.Module, str]:
    """Construct `cls(*init_inputs)` after `torch.manual_seed(seed)` and sync its weights
    (load_weights; the returned string says how)."""
    torch.manual_seed(seed)
    model = cls(*init_inputs)
    return model, ("reference" if state_dict is None else load_weights(model, state_dict))


def load_weights(model: torch.nn.Module, state_dict: dict) -> str:
    """Load the reference's state_dict when keys and shapes match exactly; otherwise the
    seed-identical construction is all there is (it gives equal weights only when the candidate
    creates its parameters in the reference's order). Says which."""
    own = model.state_dict()
    if set(own) != set(state_dict):
        missing = sorted(set(state_dict) - set(own))[:3]
        extra = sorted(set(own) - set(state_dict))[:3]
        return (f"seed-identical construction (state_dict keys differ: missing "
                f"{missing}, extra {extra})")
    bad = [k for k in own if tuple(own[k].shape) != tuple(state_dict[k].shape)]
    if bad:
        return f"seed-identical construction (state_dict shapes differ: {bad[:3]})"
    model.load_state_dict(state_dict)
    return "state_dict loaded from the reference"


def snapshot_state(model: torch.nn.Module) -> dict:
    """Copies of the module's parameters and persistent buffers (restore_state puts them back)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def restore_state(model: torch.nn.Module, state: dict) -> None:
    model.load_state_dict(state)


@torch.no_grad()
def scale_parameters(model: torch.nn.Module, factor: float) -> None:
    """Multiply every floating parameter: drives sigmoid/exp and friends into saturation."""
    if factor != 1:
        for p in model.parameters():
            if p.is_floating_point():
                p.mul_(factor)


def prepare(model: torch.nn.Module, scale: float, dev: torch.device, eval_mode: bool):
    """`model` scaled by `scale` (scale_parameters), moved to `dev`, in eval mode where
    `eval_mode` asks."""
    scale_parameters(model, scale)
    model = model.to(dev)
    return model.eval() if eval_mode else model  # else as constructed: KernelBench's mode


def buffers(model: torch.nn.Module) -> dict:
    """Copies of the module's buffers (restore_buffers puts them back)."""
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def restore_buffers(model: torch.nn.Module, state: dict) -> None:
    for n, b in model.named_buffers():
        if n in state:
            b.copy_(state[n])


@contextlib.contextmanager
def batch_size_set(mod: ModuleType, n: int | None):
    """KernelBench problems read a module-level `batch_size` in get_inputs(); override it."""
    if n is None:
        yield
        return
    old = mod.batch_size
    mod.batch_size = n
    try:
        yield
    finally:
        mod.batch_size = old


def draw_inputs(mod: ModuleType, seed: int, batch_size: int | None = None,
                variant: str | None = None, seed_with=None) -> list:
    """get_inputs() (or a named input variant) with a fixed seed, returned on the CPU.
    `seed_with`: what seeds the generators (torch.manual_seed where None)."""
    (seed_with or torch.manual_seed)(seed)
    with batch_size_set(mod, batch_size):
        make = mod.get_input_variants()[variant] if variant else mod.get_inputs
        inputs = list(make())
    return [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in inputs]


def to_device(values: list, device: torch.device) -> list:
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in values]


def copies(values: list) -> list:
    """Fresh copies of the inputs: on the CPU `.to(device)` returns the very tensor, and a
    forward that writes into its inputs must not change what the next forward sees."""
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in values]


def to_host(out, *, keep_device: bool = False, strict: bool = False) -> tuple:
    """Outputs as plain CPU tensors (subclasses stripped: the harness unpickles them safely),
    or with `keep_device` as plain copies where they are (a device-resident regime's). With
    `strict` (a candidate's outputs) a tensor subclass is not taken at all: it could run its
    own code when copied (a lazy output); it becomes an unsupported output, found by type()
    alone, without touching it; so does a plain tensor that is not dense (compare.dense).

    Any other output that is not a plain Python number / string / None (a numpy array, a custom
    object, a lambda) is replaced by `compare.unsupported_output(value)`: the harness could not
    unpickle it, and compare_outputs reports it as an `output_type` finding.
    """
    from ..compare import PLAIN_OUTPUT_TYPES, as_tuple, dense, unsupported_output, unsupported_type
    if strict:  # a subclass is not touched; a plain tensor without dense elements not read
        out = tuple(unsupported_output(t) if isinstance(t, torch.Tensor)
                    and (type(t) is not torch.Tensor or not dense(t)) else t
                    for t in as_tuple(out))
    return tuple((t.detach().as_subclass(torch.Tensor).clone() if keep_device else
                  t.detach().as_subclass(torch.Tensor).cpu().clone())
                 if isinstance(t, torch.Tensor)
                 else t if type(t) in PLAIN_OUTPUT_TYPES or unsupported_type(t)
                 else unsupported_output(t)
                 for t in as_tuple(out))


def nbytes(values) -> int:
    """Bytes of the tensors among `values` (anything else counts nothing)."""
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(dev: torch.device) -> str:
    """The device's name: the GPU's model, or the CPU's (the reference cache keys on it)."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    from ..results import cpu_name
    return cpu_name()


def usable(dev: torch.device) -> bool:
    """False after a sticky CUDA error (e.g. an illegal address): every later call would fail."""
    if dev.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(dev)
        return True
    except Exception:  # noqa: BLE001
        return False


def release(device: torch.device) -> None:
    """Return cached device memory between phases, so one phase's peak cannot starve the next.
    Nothing to do on the CPU. On CUDA a full gc.collect() (which frees tensors held only by
    reference cycles, e.g. a dropped model's) runs only while more than RELEASE_GC_BYTES stay
    allocated: it costs ~0.1-0.5 s with torch._dynamo loaded, and small problems need none."""
    if device.type == "cuda":
        import gc
        gc.collect(1)
        if torch.cuda.memory_allocated(device) > RELEASE_GC_BYTES:
            gc.collect()
        torch.cuda.empty_cache()


RELEASE_GC_BYTES = 1 << 30


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state
