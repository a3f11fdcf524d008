"""Compare one output tensor with the reference's, element by element, and say where and how
much they differ: `diff_tensors` (allclose, NaN/inf positions, the perturbed-reference envelope
where one applies), `degenerate` (zero or row-constant outputs) and `envelope_accepts`.

No candidate code runs here. The comparison runs on the device of the tensors it is given, CPU
or GPU, in chunks of CHUNK_ELEMENTS, so that outputs of several GB can be compared without
float64 copies of them. compare.py judges a forward's outputs as a whole with these.
"""
from __future__ import annotations

import math

import torch

from .report import Finding, TensorDiff


def _fmt_index(flat: int, shape: torch.Size) -> str:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return "[" + ", ".join(str(i) for i in reversed(idx)) + "]"


# Elements per chunk of `diff_tensors` (and `_close`): its float64 temporaries (about ten per
# chunk, plus two running bounds in `envelope_accepts`) scale with this, not with the tensor.
# 1 << 24 float64 elements are 128 MiB per temporary.
CHUNK_ELEMENTS = 1 << 24

_LABELS = ("NaN", "+inf", "-inf")


def _step() -> int:
    return max(1, int(CHUNK_ELEMENTS))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, chunk by chunk on a's device when b lives elsewhere (shapes and dtypes
    equal)."""
    if a.device == b.device:
        return torch.equal(a, b)
    a, b, step = a.detach().reshape(-1), b.detach().reshape(-1), _step()
    return all(torch.equal(a[s:s + step], b[s:s + step].to(a.device))
               for s in range(0, a.numel(), step))


def _first(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, index of the first True; 0 when none) of a flat bool mask, on its device."""
    return mask.sum(), mask.to(torch.uint8).argmax()


def _at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """t[i] for a 0-d index tensor, without a device sync (t[i] would call i.item())."""
    return t.index_select(0, i.view(1))[0]


def _parts(t: torch.Tensor, dev, cplx: bool) -> torch.Tensor:
    """A flat chunk as float64 of shape (n, P) on dev: P = 2 (real and imaginary parts) where
    the comparison is complex, else P = 1. A complex tensor never goes through
    `.to(torch.float64)`, which keeps its real part alone (until 2026-12-05 the imaginary part
    of a complex output was never compared: red team)."""
    out = _float64(t, dev, cplx)
    return out if cplx else out.unsqueeze(-1)


def _mag(x: torch.Tensor) -> torch.Tensor:
    """|x| per element of an (n, P) chunk from `_parts`: the modulus of a complex value."""
    return x[:, 0].abs() if x.shape[-1] == 1 else torch.hypot(x[:, 0], x[:, 1])


def _chunk_stats(r: torch.Tensor, g: torch.Tensor, judged: torch.Tensor, runs: list,
                 atol: float, rtol: float) -> list[float]:
    """The per-chunk quantities `diff_tensors` merges, as one list (a single device sync).

    r, g: float64 chunks of shape (n, P) (`_parts`: P = 2 for complex outputs, whose NaN/inf
    positions are judged in both parts and whose differences are moduli |g - r|, as
    torch.isclose measures complex values); runs: the same chunk of each perturbed run, alike.
    For each label of _LABELS then for `bad`: count, first index, and the P parts of the
    candidate's then the reference's value there; then n_envelope, max err, max rel, and the
    worst element's where(env, 0, err) value, index and err.
    """
    out = []
    masks = {"NaN": (torch.isnan(r), torch.isnan(g)),
             "+inf": (torch.isposinf(r), torch.isposinf(g)),
             "-inf": (torch.isneginf(r), torch.isneginf(g))}
    differs = torch.zeros(judged.shape, dtype=torch.bool, device=r.device)
    each = judged.unsqueeze(-1)
    for label in _LABELS:
        mr, mg = masks[label]
        differs |= (mr != mg).any(-1)
        count, first = _first(((mr & each) != (mg & each)).any(-1))
        out += [count, first, *_at(g, first), *_at(r, first)]
    finite = torch.isfinite(r).all(-1) & torch.isfinite(g).all(-1)
    absdiff, rabs = _mag(g - r), _mag(r)
    beyond = finite & (absdiff > atol + rtol * rabs)
    err = torch.where(finite & judged, absdiff, torch.zeros((), dtype=torch.float64,
                                                            device=r.device))
    # |diff| / |ref| only where |ref| > atol: nearer zero atol alone bounds the difference, and
    # the ratio there (0.2 for a passing 1e-6 at an element of 5e-6) says nothing. Shown only.
    big = rabs > atol
    rel = torch.where(big, err / torch.where(big, rabs, 1.0), 0.0)
    outside = beyond & judged
    # envelope_accepts only matters where `outside` holds; skipping it elsewhere saves moving
    # every run's chunk to the device. Complex parts must each lie inside their envelope.
    env = outside & envelope_accepts([r, *runs], g, atol, rtol).all(-1) \
        if runs and bool(outside.any()) else torch.zeros_like(outside)
    # Fragile elements are never judged; those where the candidate differs count as accepted.
    env |= ~judged & (differs | beyond)
    bad = outside & ~env
    count, first = _first(bad)
    out += [count, first, *_at(g, first), *_at(r, first), env.sum(), err.max(), rel.max()]
    masked = torch.where(env, 0.0, err)
    worst = masked.argmax()
    out += [_at(masked, worst), worst, _at(err, worst)]
    return torch.stack([t.to(torch.float64) for t in out]).tolist()


def _exact_stats(r: torch.Tensor, g: torch.Tensor) -> tuple[list[int], list[float]]:
    """Integer or bool chunks (one dtype): ([count, first index, candidate and reference value
    there, worst index], [its |diff|, max |diff|, max |diff| / |ref|]). The verdict is r != g
    in their own dtype; the differences (int64, as float64) are for the report only."""
    ne = r != g
    count, first = _first(ne)
    g64, r64 = g.to(torch.int64), r.to(torch.int64)
    step = g64 - r64  # exact, unless it wraps past int64: then the float64 difference
    d = torch.where((g64 >= r64) == (step >= 0), step.abs().double(),
                    (g64.double() - r64.double()).abs())
    d = torch.where(ne, d, 0.0)
    worst = d.argmax()
    ra = r64.double().abs()
    rel = torch.where(ne & (ra > 0), d / torch.where(ra > 0, ra, 1.0), 0.0)
    ints = torch.stack([count, first, _at(g64, first), _at(r64, first), worst]).tolist()
    return ints, torch.stack([_at(d, worst), d.max(), rel.max()]).tolist()


def _diff_exact(r_all: torch.Tensor, g_all: torch.Tensor, shape: torch.Size, index: int,
                findings: list[Finding]) -> tuple[TensorDiff, list[Finding]]:
    """`diff_tensors` for integer and bool outputs: equal or wrong, no tolerance (an rtol let a
    count of ~32,768 be off by 3: red team, 2026-12-05), chunk by chunk in their own dtype."""
    name, numel, step, dev = f"output {index}", r_all.numel(), _step(), r_all.device
    dtype = torch.promote_types(r_all.dtype, g_all.dtype)
    n_bad, first, worst, max_abs, max_rel = 0, None, None, 0.0, 0.0
    for start in range(0, numel, step):
        part = slice(start, min(start + step, numel))
        ints, floats = _exact_stats(r_all[part].to(dev, dtype), g_all[part].to(dev, dtype))
        count, at, cand, refv, worst_at = ints
        if count and first is None:
            first = (start + at, cand, refv)
        if count and (worst is None or floats[0] > worst[0]):
            worst = (floats[0], start + worst_at)
        n_bad += count
        max_abs, max_rel = max(max_abs, floats[1]), max(max_rel, floats[2])
    diff = TensorDiff(index, True, max_abs=max_abs, max_rel=max_rel, n_bad=n_bad)
    if n_bad:
        at, cand, refv = first
        findings.append(Finding(
            "mismatch", f"{name}: {n_bad}/{numel} element(s) differ (integer outputs are "
            f"compared exactly); first {_fmt_index(at, shape)}: candidate {cand}, reference "
            f"{refv}; worst |diff| {worst[0]:.6g} at {_fmt_index(worst[1], shape)}"))
    diff.ok = not findings
    diff.message = "; ".join(f.message for f in findings)
    return diff, findings


def _value(parts: list[float]) -> str:
    return f"{parts[0]:.6g}" if len(parts) == 1 else f"{complex(*parts):.6g}"


def _chunked(r_all: torch.Tensor, g_all: torch.Tensor, runs_all: list, f_all, dev, cplx: bool,
             atol: float, rtol: float) -> tuple:
    """`diff_tensors`' pass over flat float outputs in chunks of CHUNK_ELEMENTS (_chunk_stats),
    merged: (firsts, elements accepted by the envelope, each chunk's max |diff|, each chunk's max
    rel, the worst element as (masked value, index, err)). `firsts`, per label of _LABELS and
    for `bad`: [count, first global index, candidate value, reference value]."""
    numel, step = r_all.numel(), _step()
    width = 2 if cplx else 1  # float64 parts per element (_parts)
    firsts = {label: [0, None, [0.0], [0.0]] for label in (*_LABELS, "bad")}
    n_env, max_abs, max_rel, worst = 0, [], [], None
    rec_len = 2 + 2 * width
    for start in range(0, numel, step):
        part = slice(start, min(start + step, numel))
        r = _parts(r_all[part], dev, cplx)
        g = _parts(g_all[part], dev, cplx)
        judged = ~f_all[part].to(dev) if f_all is not None else \
            torch.ones(r.shape[0], dtype=torch.bool, device=dev)
        stats = _chunk_stats(r, g, judged, [_parts(run[part], dev, cplx) for run in runs_all],
                             atol, rtol)
        for k, label in enumerate((*_LABELS, "bad")):
            rec = stats[rec_len * k:rec_len * (k + 1)]
            count, first = rec[0], rec[1]
            cand, refv = rec[2:2 + width], rec[2 + width:]
            kept = firsts[label]
            if count and kept[1] is None:
                kept[1:] = [start + int(first), cand, refv]
            kept[0] += int(count)
        tail = stats[rec_len * 4:]
        n_env += int(tail[0])
        max_abs.append(tail[1])
        max_rel.append(tail[2])
        value, at, err_at = tail[3:6]
        # Global argmax as torch.argmax over the whole tensor: NaN is the maximum, ties go to
        # the smallest index (this chunk's argmax is its first maximum, earlier chunks win).
        if worst is None or value > worst[0] or (math.isnan(value) and not math.isnan(worst[0])):
            worst = (value, start + int(at), err_at)
    return firsts, n_env, max_abs, max_rel, worst


def diff_tensors(ref: torch.Tensor, got: torch.Tensor, atol: float, rtol: float,
                 index: int = 0, runs: list[torch.Tensor] | None = None,
                 fragile: torch.Tensor | None = None) -> tuple[TensorDiff, list[Finding]]:
    """allclose(got, ref) plus identical NaN/inf positions, with the worst element named.

    `runs`, when given, are the perturbed reference's outputs for this tensor (see
    `envelope_accepts`): an element outside allclose but inside their envelope is accepted and
    counted in `n_envelope`. NaN/inf positions are compared with `ref` alone, except at
    `fragile` elements (finite in only some perturbed runs: overflow there is an accident of
    rounding), which are not judged; those that differ are counted in `n_envelope` too.
    Differences are measured in float64 so that the tolerance, not the comparison, decides;
    where either output is complex, in complex128: both parts' NaN/inf positions, and the
    modulus of the difference against atol + rtol * |ref|. Integer and bool outputs (neither
    side floating or complex) are compared exactly, in their own dtype: tolerances are for
    floating-point rounding.

    Runs on ref's device (got, runs and fragile are moved there chunk by chunk), over the
    flattened tensors in chunks of CHUNK_ELEMENTS, so that its float64 temporaries are bounded
    by the chunk; the result is the same as over the whole tensor at once.
    """
    name = f"output {index}"
    if tuple(ref.shape) != tuple(got.shape):
        msg = f"{name}: shape {tuple(got.shape)}, reference {tuple(ref.shape)}"
        return TensorDiff(index, False, message=msg), [Finding("shape", msg)]
    if ref.dtype == got.dtype and _equal(ref, got):
        # Bit-identical and NaN-free (torch.equal is False wherever a NaN is): nothing to
        # measure. The common case for the reference's determinism check, and it skips ~30
        # elementwise passes in float64 over every output.
        return TensorDiff(index, True), []
    for i, run in enumerate(runs or []):
        if tuple(run.shape) != tuple(ref.shape):
            raise ValueError(f"{name}: perturbed run {i} has shape {tuple(run.shape)}, "
                             f"reference {tuple(ref.shape)}")
    findings = []
    if ref.dtype != got.dtype:
        findings.append(Finding("dtype", f"{name}: dtype {got.dtype}, reference {ref.dtype}"))
    numel = ref.numel()
    r_all, g_all = ref.detach().reshape(-1), got.detach().reshape(-1)
    cplx = ref.is_complex() or got.is_complex()
    if not (cplx or ref.is_floating_point() or got.is_floating_point()):
        return _diff_exact(r_all, g_all, ref.shape, index, findings)
    runs_all = [run.detach().reshape(-1) for run in runs] if runs else []
    f_all = fragile.detach().reshape(-1) \
        if fragile is not None and tuple(fragile.shape) == tuple(ref.shape) else None
    firsts, n_env, max_abs, max_rel, worst = _chunked(r_all, g_all, runs_all, f_all, ref.device,
                                                      cplx, atol, rtol)
    diff = TensorDiff(index, True,
                      max_abs=float(torch.tensor(max_abs, dtype=torch.float64).max())
                      if numel else 0.0,
                      max_rel=float(torch.tensor(max_rel, dtype=torch.float64).max())
                      if numel else 0.0,
                      n_bad=firsts["bad"][0], n_envelope=n_env)
    for label in _LABELS:
        count, first, cand, refv = firsts[label]
        if count:
            findings.append(Finding(
                "nonfinite", f"{name}: {label} positions differ at {count} element(s), first "
                f"{_fmt_index(first, ref.shape)}: candidate {_value(cand)}, reference "
                f"{_value(refv)}"))
    if diff.n_bad:
        _, first, cand, refv = firsts["bad"]
        _, at, err_at = worst
        beyond = " and the perturbed-reference envelope" if runs else ""
        findings.append(Finding(
            "mismatch", f"{name}: {diff.n_bad}/{numel} element(s) outside atol+rtol*|ref|"
            f"{beyond}; first {_fmt_index(first, ref.shape)}: candidate {_value(cand)}, "
            f"reference {_value(refv)}; worst |diff| {err_at:.3g} at "
            f"{_fmt_index(at, ref.shape)}"))
    diff.ok = not findings
    diff.message = "; ".join(f.message for f in findings)
    return diff, findings


def _rows_equal(t: torch.Tensor) -> bool:
    return t.dim() >= 1 and t.shape[0] > 1 and bool((t == t[:1]).all())


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    """allclose(a, b) in float64 (complex128 for a complex `a`: both parts; exactly, in a's
    own dtype, for an integer or bool `a`), NaN equal to NaN (b broadcasts), on a's device.

    a is taken a block of rows at a time (about CHUNK_ELEMENTS elements), so that the float64
    copies stay bounded; b is sliced alongside where it has a's rows, else it broadcasts
    against every block (a scalar, one row).
    """
    kind = torch.complex128 if a.is_complex() else \
        torch.float64 if a.is_floating_point() else a.dtype
    a, b = a.detach(), b.detach().to(a.device, kind)

    def close(x: torch.Tensor, y: torch.Tensor) -> bool:
        x = x.to(kind)
        if not (kind.is_floating_point or kind.is_complex):
            return bool((x == y.expand_as(x)).all())
        return bool(torch.isclose(x, y.expand_as(x), rtol=rtol, atol=atol, equal_nan=True).all())

    if a.dim() == 0:
        return close(a, b)
    by_row = b.dim() == a.dim() and b.shape[0] != 1
    rows = max(1, _step() // max(1, a[0].numel()))
    for start in range(0, a.shape[0], rows):
        other = b[start:start + rows] if by_row else b
        if not close(a[start:start + rows], other):
            return False
    return True


def degenerate(ref: torch.Tensor, got: torch.Tensor, index: int, atol: float = 0.0,
               rtol: float = 0.0) -> list[Finding]:
    """Zero or row-constant candidate output where the reference's is neither.

    A tolerance can admit such an output when the reference varies little; a real kernel never
    produces it, so it fails regardless of the tolerance -- unless the reference itself is zero
    (row-constant) within atol + rtol*|.|: then it varies only by rounding, and an exactly zero
    (constant) output is a legitimate, more exact answer.
    """
    if tuple(ref.shape) != tuple(got.shape) or got.numel() == 0:
        return []
    if not all(t.is_floating_point() or t.is_complex() for t in (ref, got)):
        atol = rtol = 0.0  # integer outputs: exact comparison
    if bool((got == 0).all()) and not _close(ref, torch.zeros(()), atol, rtol):
        return [Finding("zero_output", f"output {index} is all zeros; the reference's is not")]
    if _rows_equal(got) and not _rows_equal(ref) and not _close(ref, ref[:1], atol, rtol):
        return [Finding("constant_output",
                        f"output {index} has all {got.shape[0]} rows equal; the reference's vary")]
    return []


def envelope_accepts(runs: list[torch.Tensor], got: torch.Tensor, atol: float,
                     rtol: float) -> torch.Tensor:
    """Elements of `got` inside [min, max] of the reference runs, widened by atol + rtol*|ref|
    (complex values: each part inside its own such interval).

    runs[0] is the unperturbed reference; NaN/inf positions must match it exactly (that is
    checked elsewhere), so only elements finite in every run and in `got` can be accepted.
    Computed on got's device (runs are moved there one at a time), with running bounds: the
    same as min/max over the stacked runs, without the stack.
    """
    if not runs:
        raise ValueError("envelope_accepts needs at least one run (the reference)")
    cplx = got.is_complex() or any(run.is_complex() for run in runs)
    g = _float64(got.detach(), got.device, cplx)
    lo = hi = finite = None
    for i, run in enumerate(runs):
        if tuple(run.shape) != tuple(runs[0].shape):
            raise ValueError(f"envelope_accepts: run {i} has shape {tuple(run.shape)}, "
                             f"run 0 {tuple(runs[0].shape)}")
        r = _float64(run.detach(), g.device, cplx)
        # torch.minimum/maximum propagate NaN as stack.min/max do; those elements are
        # excluded through `finite` anyway.
        lo = r if lo is None else torch.minimum(lo, r)
        hi = r if hi is None else torch.maximum(hi, r)
        finite = torch.isfinite(r) if finite is None else finite & torch.isfinite(r)
    lo = lo - (atol + rtol * lo.abs())
    hi = hi + (atol + rtol * hi.abs())
    inside = finite & torch.isfinite(g) & (g >= lo) & (g <= hi)
    return inside.all(-1) if cplx else inside  # a complex value: both parts inside


def _float64(t: torch.Tensor, dev, cplx: bool) -> torch.Tensor:
    """t as float64 on dev; with `cplx`, as complex128 viewed as its parts (a trailing 2)."""
    if cplx:
        return torch.view_as_real(t.to(dev, torch.complex128))
    if t.is_complex():
        raise TypeError("a complex tensor in a real comparison would lose its imaginary part")
    return t.to(dev, torch.float64)
