"""One trial's verdict from the reference's and the candidate's outputs, wherever both are.

For small problems the check's own process judges, on the CPU, what the workers sent back. For
a large one (device-resident regimes, see reference_tasks.py) the reference's worker judges on
the device,
with the candidate's outputs opened by reference (shared.py), and sends back only the verdicts:
`trial_to_dict` / `trial_from_dict` carry a TrialReport across as plain data.

What the candidate's worker hands over is the candidate's to forge (its own process), so
`record_problem` checks each regime's record against what candidate_tasks.check_candidate
writes before anything here iterates or formats it: a record of any other shape is wrong
("malformed").
"""
from __future__ import annotations

from dataclasses import asdict

from .report import Finding, TensorDiff, TrialReport

ENVELOPE_CATEGORIES = ("mismatch", "nonfinite")  # what the perturbed-reference envelope can excuse

# Bounds on a candidate worker's record (candidate_tasks.check_candidate keeps within them):
# each string is formatted into a finding or the report, each list item makes a finding.
MAX_TAMPERED, TEXT_CHARS, ERROR_CHARS = 32, 500, 4000
MAX_OUTPUTS = 4096     # outputs per trial, unless the reference's own are more
RNG_BYTES = 1 << 16    # a generator's state: 5,056 bytes for the CPU's, 16 for a GPU's
RECORD_KEYS = {"name", "weights", "trials", "error"}
TRIAL_KEYS = {"outputs", "rng", "mutated", "aliased", "tampered"}


# A reference refused device memory (torch.OutOfMemoryError) was denied it by what others held
# where its request would have fit in the memory free then plus the memory held outside its own
# allocator, less CONTEXT_BYTES for its own CUDA context (counted in what is held outside; about
# 0.5 GiB on an H100): a fact about that moment, on any card. Where the refusal does not say its
# size, where others held STARVED_BYTES or more. (Until 2026-12-07 the threshold alone, checked
# only for regimes after the default: on an 80 GB H100 the exploit's starvation hit the default
# regime, and read as "the reference could not run".)
CONTEXT_BYTES, STARVED_BYTES = 1 << 30, 4 << 30


def denied_by_others(requested: int | None, free: int | None, held: int | None) -> bool:
    """Whether the reference was refused `requested` bytes (None: not said) because of the
    `held` bytes outside its allocator (None: unknown, as on a CPU: never), `free` bytes being
    free (None: unknown)."""
    if held is None:
        return False
    if requested is None or free is None:
        return held >= STARVED_BYTES
    return requested <= free + held - CONTEXT_BYTES


def denial(requested: int | None, free: int | None, held: int | None) -> str:
    """What the reference was denied, in words, for a report."""
    asked = "" if requested is None else f"asked for {requested / 2**30:.2f} GiB" + (
        "" if free is None else f" with {free / 2**30:.2f} GiB free")
    return (f"the reference ran out of device memory{f' ({asked})' if asked else ''} while "
            f"{(held or 0) / 2**30:.1f} GiB of it were held outside its worker (the candidate's "
            "worker among them)")


def capped(texts: list[str]) -> list[str]:
    """At most MAX_TAMPERED strings of at most TEXT_CHARS: the last one says how many more."""
    texts = [t[:TEXT_CHARS] for t in texts]
    if len(texts) <= MAX_TAMPERED:
        return texts
    return texts[:MAX_TAMPERED - 1] + [f"and {len(texts) - MAX_TAMPERED + 1} more"]


def texts(value, most: int, chars: int = TEXT_CHARS) -> bool:
    """Whether `value` is a list of at most `most` strings of at most `chars` characters (its
    length checked before any item is looked at)."""
    return type(value) is list and len(value) <= most and all(
        type(t) is str and len(t) <= chars for t in value)


def regime_of(record) -> str | None:
    """The regime a record from the candidate's worker names, when it is a dict naming one by a
    plain string (the key the check files it under); else None."""
    name = record.get("name") if type(record) is dict else None
    return name if type(name) is str and len(name) <= TEXT_CHARS else None


def record_problem(record, ref_trials: list[dict], resident: bool) -> str | None:
    """Why a regime's record from the candidate's worker is not one candidate_tasks.check_candidate
    writes, or None. Its trials are checked against the reference's (`ref_trials`, each with
    the count of its inputs); `resident`: outputs are descriptions of shared tensors (opened by
    the reference's worker). Checks types and sizes only, touching no element: a list whose
    length the candidate chose, or a tensor in its place (Tensor.__iter__ unbinds each of its
    rows), is never iterated here (2026-12-05, red team: a 1.5 KB record held the check's own
    process two minutes and 4 GB, growing with a number the candidate picked)."""
    try:
        return _record_problem(record, ref_trials, resident)
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is not the worker's record
        return f"the regime's record could not be read ({type(exc).__name__})"


def _record_problem(record, ref_trials: list[dict], resident: bool) -> str | None:
    if type(record) is not dict or len(record) != len(RECORD_KEYS) or set(record) != RECORD_KEYS:
        return "the regime's record is not a dict of name, weights, trials and error"
    if regime_of(record) is None:
        return "its name is not a plain string"
    if type(record["weights"]) is not str or len(record["weights"]) > TEXT_CHARS:
        return f"its weights note is not a string of at most {TEXT_CHARS} characters"
    error = record["error"]
    if error is not None and not (type(error) is dict and len(error) == 2
                                  and set(error) == {"where", "message"}
                                  and all(type(v) is str and len(v) <= ERROR_CHARS
                                          for v in error.values())):
        return "its error is not None or {where, message} in strings of at most " \
               f"{ERROR_CHARS} characters"
    trials = record["trials"]
    if type(trials) is not list or len(trials) > len(ref_trials):
        return f"its trials are not a list of at most {len(ref_trials)}"
    for t, (trial, ref) in enumerate(zip(trials, ref_trials)):
        why = _trial_problem(trial, ref, resident)
        if why:
            return f"trial {t}: {why}"
    return None


def _trial_problem(trial, ref: dict, resident: bool) -> str | None:
    import torch

    from .compare import PLAIN_OUTPUT_TYPES
    if type(trial) is not dict or len(trial) != len(TRIAL_KEYS) or set(trial) != TRIAL_KEYS:
        return "the record is not a dict of outputs, rng, mutated, aliased and tampered"
    outputs, n_ref = trial["outputs"], ref.get("outputs")
    most = max(MAX_OUTPUTS, len(n_ref) if isinstance(n_ref, tuple) else 0)
    if type(outputs) is not tuple or len(outputs) > most:
        return f"its outputs are not a tuple of at most {most}"
    if not resident and not all(_dense(o) or type(o) in PLAIN_OUTPUT_TYPES
                                or _type_name(o) for o in outputs):
        return "an output is neither a dense CPU tensor, a plain Python value nor a type's name"
    rng = trial["rng"]
    if type(rng) is not dict or not set(rng) <= {"cpu", "cuda"} or not all(
            _dense(v) and v.dtype == torch.uint8 and v.dim() == 1
            and v.numel() <= RNG_BYTES for v in rng.values()):
        return "its rng is not a dict of generator states (cpu, cuda)"
    for key, bound in (("mutated", ref["inputs"]), ("aliased", len(outputs))):
        idx = trial[key]
        if type(idx) is not list or len(idx) > bound or len(set(idx)) != len(idx) \
                or not all(type(i) is int and 0 <= i < bound for i in idx):
            return f"its {key} is not a list of distinct indices below {bound}"
    if not texts(trial["tampered"], MAX_TAMPERED):
        return f"its tampered is not a list of at most {MAX_TAMPERED} strings of at most " \
               f"{TEXT_CHARS} characters"
    return None


def judge_trial(index: int, ref: dict, got: dict, prev: tuple | None, atol: float,
                rtol: float, envelope: dict | None = None) -> TrialReport:
    """All findings for one trial; `prev` is the previous trial's (reference, candidate);
    `envelope` ({lo, hi, fragile}) the perturbed reference's bounds, when computed."""
    from .compare import compare_outputs, identical, shaped_as
    runs = [envelope["lo"], envelope["hi"]] if envelope else None
    cmp = compare_outputs(ref["outputs"], got["outputs"], atol, rtol, runs,
                          fragile=envelope["fragile"] if envelope else None)
    findings = list(cmp.findings)
    # Only outputs shaped as the reference's are compared with the previous trial's: a shape
    # is the candidate's to choose, and torch.zeros(1).expand(10**8, 10**8) (one float in a
    # file) kept torch.equal busy for weeks in the check's own process (2026-12-05, red team).
    if prev is not None and shaped_as(got["outputs"], ref["outputs"]) \
            and identical(got["outputs"], prev[1]["outputs"]) \
            and not identical(ref["outputs"], prev[0]["outputs"]):
        findings.append(Finding("cached", "outputs are bit-identical to the previous trial's "
                                "although the inputs changed (and the reference's outputs did): "
                                "a cached result?"))
    for i in got["mutated"]:
        findings.append(Finding("input_mutated", f"input {i} was modified by the forward"))
    for i in got.get("aliased", ()):
        findings.append(Finding("output_aliased", f"output {i} shares storage with an input "
                                "(outputs must be tensors of their own)"))
    for what in got.get("tampered", ()):
        findings.append(Finding("tampered", f"{what} (the harness's timers and output "
                                "readers must stay as they were)"))
    for gen in ("cpu", "cuda"):
        if gen in ref["rng"] and not identical((ref["rng"][gen],), (got["rng"].get(gen),)):
            findings.append(Finding("rng", f"RNG consumption differs: the {gen.upper()} generator "
                                    "state after the forward is not the reference's (extra or "
                                    "missing random draws)"))
    return TrialReport(index, ref["seed"], not findings, cmp.diffs, findings,
                       ill_conditioned=sum(d.n_envelope for d in cmp.diffs),
                       envelope=envelope is not None)


def needs_envelope(trial: TrialReport) -> bool:
    """Whether the perturbed-reference envelope could change this trial's verdict."""
    return any(f.category in ENVELOPE_CATEGORIES for f in trial.findings)


def trial_to_dict(trial: TrialReport) -> dict:
    return asdict(trial)


def trial_from_dict(data: dict) -> TrialReport:
    return TrialReport(**{**data, "diffs": [TensorDiff(**d) for d in data["diffs"]],
                          "findings": [Finding(**f) for f in data["findings"]]})


def _dense(value) -> bool:
    """A plain torch.Tensor as the worker's to_host leaves one: in the CPU's memory and dense
    (compare.dense: strided, neither quantized nor nested). A sparse or meta tensor is a
    torch.Tensor too, and one in a forged record made the comparison raise out of the check
    (no verdict; red team, 2026-12-05)."""
    import torch

    from .compare import dense
    return type(value) is torch.Tensor and value.device.type == "cpu" and dense(value)


def _type_name(value) -> bool:
    """compare.unsupported_output's record of an output the worker could not hand over."""
    from .compare import UNSUPPORTED_KEY
    name = value.get(UNSUPPORTED_KEY) if type(value) is dict and len(value) == 1 else None
    return type(name) is str and len(name) <= TEXT_CHARS
