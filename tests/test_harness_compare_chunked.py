"""tensor_diff.diff_tensors in chunks: the same TensorDiff and findings as in one piece, and as
the pre-chunking implementation (`_reference_diff_tensors`, kept here as the spec: verbatim but
for max_rel's elements, |ref| > atol since issue #37)."""
from __future__ import annotations

import math

import pytest
import torch

from fastelbo.harness import tensor_diff
from fastelbo.harness.report import Finding, TensorDiff
from fastelbo.harness.tensor_diff import _fmt_index, degenerate, diff_tensors, envelope_accepts

INF, NAN = float("inf"), float("nan")
ATOL, RTOL = 1e-4, 1e-4


# --- The implementation before chunking, copied unchanged (only renamed): the spec. ----------

def _reference_envelope_accepts(runs, got, atol, rtol):
    stack = torch.stack([r.detach().double().cpu() for r in runs])
    g = got.detach().double().cpu()
    lo, hi = stack.min(0).values, stack.max(0).values
    lo = lo - (atol + rtol * lo.abs())
    hi = hi + (atol + rtol * hi.abs())
    return torch.isfinite(stack).all(0) & torch.isfinite(g) & (g >= lo) & (g <= hi)


def _reference_diff_tensors(ref, got, atol, rtol, index=0, runs=None, fragile=None):
    name = f"output {index}"
    if tuple(ref.shape) != tuple(got.shape):
        msg = f"{name}: shape {tuple(got.shape)}, reference {tuple(ref.shape)}"
        return TensorDiff(index, False, message=msg), [Finding("shape", msg)]
    if ref.dtype == got.dtype and torch.equal(ref, got):
        return TensorDiff(index, True), []
    findings = []
    if ref.dtype != got.dtype:
        findings.append(Finding("dtype", f"{name}: dtype {got.dtype}, reference {ref.dtype}"))
    r, g = ref.detach().double().cpu(), got.detach().double().cpu()
    judged = torch.ones(r.shape, dtype=torch.bool)
    if fragile is not None and tuple(fragile.shape) == tuple(r.shape):
        judged = ~fragile.cpu()
    masks = {"NaN": (torch.isnan(r), torch.isnan(g)),
             "+inf": (torch.isposinf(r), torch.isposinf(g)),
             "-inf": (torch.isneginf(r), torch.isneginf(g))}
    differs = torch.zeros(r.shape, dtype=torch.bool)
    for label, (mr, mg) in masks.items():
        differs |= mr != mg
        mr, mg = mr & judged, mg & judged
        if not torch.equal(mr, mg):
            where = (mr != mg).flatten().nonzero()
            first = int(where[0])
            findings.append(Finding(
                "nonfinite", f"{name}: {label} positions differ at {len(where)} element(s), first "
                f"{_fmt_index(first, ref.shape)}: candidate {g.flatten()[first].item():.6g}, "
                f"reference {r.flatten()[first].item():.6g}"))
    finite = torch.isfinite(r) & torch.isfinite(g)
    absdiff = (g - r).abs()
    beyond = finite & (absdiff > atol + rtol * r.abs())
    err = torch.where(finite & judged, absdiff, torch.zeros((), dtype=torch.float64))
    # since issue #37: |diff| / |ref| only where |ref| > atol (was: over every element)
    big = r.abs() > atol
    rel = torch.where(big, err / torch.where(big, r.abs(), 1.0), 0.0)
    outside = beyond & judged
    env = outside & _reference_envelope_accepts([ref, *runs], got, atol, rtol) if runs else \
        torch.zeros_like(outside)
    env |= ~judged & (differs | beyond)
    bad = outside & ~env
    diff = TensorDiff(index, True,
                      max_abs=float(err.max()) if err.numel() else 0.0,
                      max_rel=float(rel.max()) if rel.numel() else 0.0,
                      n_bad=int(bad.sum()), n_envelope=int(env.sum()))
    if diff.n_bad:
        first = int(bad.flatten().nonzero()[0])
        worst = int(torch.where(env, 0.0, err).flatten().argmax())
        beyond = " and the perturbed-reference envelope" if runs else ""
        findings.append(Finding(
            "mismatch", f"{name}: {diff.n_bad}/{r.numel()} element(s) outside atol+rtol*|ref|"
            f"{beyond}; first {_fmt_index(first, ref.shape)}: candidate "
            f"{g.flatten()[first].item():.6g}, reference {r.flatten()[first].item():.6g}; worst "
            f"|diff| {float(err.flatten()[worst]):.3g} at {_fmt_index(worst, ref.shape)}"))
    diff.ok = not findings
    diff.message = "; ".join(f.message for f in findings)
    return diff, findings


# --- Cases. ------------------------------------------------------------------------------------

def _planted(shape, seed, *, runs=True, fragile=True, got_dtype=torch.float32):
    """ref, got, runs, fragile with every kind of difference planted at random positions."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, torch.Size(shape).numel())

    def pick(k):
        return torch.randperm(n, generator=gen)[:min(k, n)]

    ref = torch.randn(n, generator=gen, dtype=torch.float64).float() * 3
    got = ref.double() + (torch.rand(n, generator=gen, dtype=torch.float64) - 0.5) * 1e-5
    got = got.float()
    k = max(1, n // 10)
    for value in (NAN, INF, -INF):  # the same non-finite value on both sides: no finding
        i = pick(1)
        ref[i], got[i] = value, value
    for ref_value, got_value in ((NAN, 1.0), (1.0, NAN), (INF, 2.0), (-3.0, INF), (INF, -INF),
                                 (-INF, NAN), (-INF, 0.5)):
        i = pick(max(1, k // 4))
        ref[i], got[i] = ref_value, got_value
    i = pick(k)  # plain mismatches, of random size
    got[i] = ref[i] + torch.randn(len(i), generator=gen) * 0.1
    ref_runs = None
    if runs:
        ref_runs = [ref.clone() for _ in range(3)]
        i = pick(k)  # the envelope widens here: some of the mismatches above become accepted
        for run in ref_runs:
            run[i] += torch.randn(len(i), generator=gen) * 0.2
        ref_runs[1][pick(1)] = NAN  # a non-finite run excludes its element from the envelope
        ref_runs[2][pick(1)] = INF
        ref_runs = [run.reshape(shape) for run in ref_runs]
    mask = None
    if fragile:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[pick(max(1, n // 5))] = True
        mask = mask.reshape(shape)
    return ref.reshape(shape), got.to(got_dtype).reshape(shape), ref_runs, mask


SHAPES = [(), (1,), (7,), (13,), (64,), (5, 11), (3, 5, 7), (2, 9, 17)]
CASES = [(shape, seed, runs, fragile) for shape in SHAPES for seed in range(3)
         for runs in (False, True) for fragile in (False, True)]


def _key(result):
    """A result as comparable data: NaN == NaN (a NaN in max_abs or max_rel compares equal)."""
    diff, findings = result
    fields = {k: "nan" if isinstance(v, float) and math.isnan(v) else v
              for k, v in diff.to_dict().items()}
    return fields, [(f.category, f.message) for f in findings]


def _both(monkeypatch, chunk, *args, **kwargs):
    monkeypatch.setattr(tensor_diff, "CHUNK_ELEMENTS", chunk)
    return diff_tensors(*args, **kwargs)


def _assert_same(monkeypatch, ref, got, runs=None, fragile=None, chunks=(1, 2, 7, 64),
                 atol=ATOL, rtol=RTOL):
    want = _reference_diff_tensors(ref, got, atol, rtol, 3, runs, fragile)
    whole = _both(monkeypatch, 1 << 62, ref, got, atol, rtol, 3, runs, fragile)
    assert _key(whole) == _key(want)
    for chunk in chunks:
        got_chunked = _both(monkeypatch, chunk, ref, got, atol, rtol, 3, runs, fragile)
        assert _key(got_chunked) == _key(want), chunk
    return want


@pytest.mark.parametrize("shape,seed,runs,fragile", CASES)
def test_chunked_equals_whole_and_reference(monkeypatch, shape, seed, runs, fragile):
    ref, got, ref_runs, mask = _planted(shape, 1000 * len(shape) + seed, runs=runs,
                                        fragile=fragile)
    _assert_same(monkeypatch, ref, got, ref_runs, mask)


def test_the_planted_cases_cover_every_finding(monkeypatch):
    """The cases above are not vacuous: between them they hit every finding and counter."""
    seen, n_env = set(), 0
    for shape, seed, runs, fragile in CASES:
        ref, got, ref_runs, mask = _planted(shape, 1000 * len(shape) + seed, runs=runs,
                                            fragile=fragile)
        diff, findings = _reference_diff_tensors(ref, got, ATOL, RTOL, 0, ref_runs, mask)
        seen |= {f.message.split(": ")[1].split(" ")[0] if f.category == "nonfinite"
                 else f.category for f in findings}
        n_env += diff.n_envelope
    assert seen == {"NaN", "+inf", "-inf", "mismatch"} and n_env > 0


@pytest.mark.parametrize("seed", range(4))
def test_other_dtypes(monkeypatch, seed):
    ref, got, runs, mask = _planted((6, 7), 77 + seed)
    _assert_same(monkeypatch, ref, got.double(), runs, mask)           # dtype finding too
    _assert_same(monkeypatch, ref.double(), got.double(), runs, mask)  # float64 on both sides
    _assert_same(monkeypatch, ref.half(), got.half(), None, mask)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-5, 5, (4, 9), generator=gen)
    b = a.clone()
    b[torch.rand(a.shape, generator=gen) < 0.3] += 1
    _assert_same(monkeypatch, a, b.float())  # integer vs float: the float path, as before
    # integer and bool on both sides: exact, the same in every chunking (test_integer_*)
    for x, y in ((a, b), (a > 0, b > 0)):
        whole = _key(_both(monkeypatch, 1 << 62, x, y, ATOL, RTOL, 3))
        assert whole[0]["n_bad"] == int((x != y).sum())
        for chunk in (1, 2, 7, 64):
            assert _key(_both(monkeypatch, chunk, x, y, ATOL, RTOL, 3)) == whole, chunk


def test_special_inputs(monkeypatch):
    ref, got, runs, mask = _planted((5, 9), 5)
    _assert_same(monkeypatch, ref, ref.clone())                         # the fast path
    nan = torch.tensor([1.0, NAN, 3.0] * 5)
    assert _assert_same(monkeypatch, nan, nan.clone())[0].ok            # NaN = NaN, no fast path
    _assert_same(monkeypatch, torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.float64))
    _assert_same(monkeypatch, ref, got[:4])                             # shape finding
    _assert_same(monkeypatch, ref, got, runs, torch.zeros(3, dtype=torch.bool))  # ignored mask
    _assert_same(monkeypatch, ref, got, [], mask)                       # no runs after all
    _assert_same(monkeypatch, ref, got, runs, torch.ones(ref.shape, dtype=torch.bool))
    _assert_same(monkeypatch, ref, got, runs, mask, atol=0.0, rtol=0.0)
    _assert_same(monkeypatch, ref, got, runs, mask, atol=1e9, rtol=0.0)


def test_worst_and_first_in_a_later_chunk(monkeypatch):
    ref = torch.arange(30, dtype=torch.float32)
    got = ref.clone()
    got[23] += 0.5     # first bad, in chunk 3 of 7-element chunks
    got[29] += 2.0     # worst, in the last (short) chunk
    got[25] = NAN      # non-finite, first in chunk 3 too
    got[27] = NAN
    diff, findings = _assert_same(monkeypatch, ref, got)
    assert diff.n_bad == 2 and diff.max_abs == 2.0
    assert "first [25]: candidate nan" in findings[0].message
    assert "first [23]" in findings[1].message and "worst |diff| 2 at [29]" in findings[1].message
    # 3-D: the global flat index is formatted against the full shape.
    diff, findings = _assert_same(monkeypatch, ref.reshape(2, 3, 5), got.reshape(2, 3, 5))
    assert "first [1, 1, 3]" in findings[1].message and "at [1, 2, 4]" in findings[1].message


def test_ties_across_chunks_go_to_the_smallest_index(monkeypatch):
    ref = torch.zeros(40)
    got = ref.clone()
    for i in (33, 9, 16):  # equal |diff| in chunks 4, 1 and 2 of 7-element chunks
        got[i] = -1.5 if i == 16 else 1.5
    got[3] = 1.0
    diff, findings = _assert_same(monkeypatch, ref, got)
    assert "first [3]" in findings[0].message and "worst |diff| 1.5 at [9]" in findings[0].message
    # An envelope-accepted element with a larger |diff| in an earlier chunk is not the worst.
    runs = [ref.clone(), ref.clone()]
    runs[1][2] = 5.0
    got[2] = 4.0
    diff, findings = _assert_same(monkeypatch, ref, got, runs)
    assert diff.n_envelope == 1 and diff.max_abs == 4.0 and "at [9]" in findings[0].message


def test_mismatched_runs_are_an_error(monkeypatch):
    ref, got, runs, _ = _planted((4, 5), 9)
    with pytest.raises(ValueError, match=r"perturbed run 1 has shape \(20,\)"):
        _both(monkeypatch, 7, ref, got, ATOL, RTOL, 0, [runs[0], runs[1].reshape(-1)])


@pytest.mark.parametrize("seed", range(5))
def test_envelope_accepts_equals_the_stacked_version(seed):
    ref, got, runs, _ = _planted((3, 17), 300 + seed)
    runs = [ref, *runs]
    assert torch.equal(envelope_accepts(runs, got, ATOL, RTOL),
                       _reference_envelope_accepts(runs, got, ATOL, RTOL))
    assert torch.equal(envelope_accepts(runs[:1], got, ATOL, RTOL),
                       _reference_envelope_accepts(runs[:1], got, ATOL, RTOL))


@pytest.mark.parametrize("chunk", [1, 3, 1 << 62])
def test_degenerate_in_blocks_of_rows(monkeypatch, chunk):
    monkeypatch.setattr(tensor_diff, "CHUNK_ELEMENTS", chunk)
    ref = torch.linspace(-1, 1, 24).reshape(8, 3)
    zeros, rows = torch.zeros(8, 3), ref[:1].expand(8, 3).clone()
    assert [f.category for f in degenerate(ref, zeros, 0)] == ["zero_output"]
    assert [f.category for f in degenerate(ref, rows, 0)] == ["constant_output"]
    # The reference itself is zero (row-constant) within the tolerance: the candidate passes.
    assert degenerate(ref * 1e-3, zeros, 0, atol=1e-2) == []
    assert degenerate(ref[:1] + ref * 1e-3, rows, 0, atol=1e-2) == []
    # One row far from the others, in the last block: not constant.
    near = ref[:1] + ref * 1e-3
    near[7, 2] = 5.0
    assert [f.category for f in degenerate(near, rows, 0, atol=1e-2)] == ["constant_output"]
    # _close itself: b with a's rows is taken block by block with a; NaN equals NaN.
    other = near.clone()
    other[5, 1] = NAN
    near[5, 1] = NAN
    assert tensor_diff._close(near, other, 0.0, 0.0)
    other[6, 0] += 1e-3
    assert not tensor_diff._close(near, other, 1e-4, 0.0)
    assert degenerate(torch.tensor(0.5), torch.tensor(0.0), 0) == [
        Finding("zero_output", "output 0 is all zeros; the reference's is not")]


def _complex(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))


def _chunkings(monkeypatch, ref, got, runs=None):
    """diff_tensors' result, the same in every chunking."""
    whole = _both(monkeypatch, 1 << 62, ref, got, ATOL, RTOL, 3, runs)
    for chunk in (1, 2, 7, 64):
        assert _key(_both(monkeypatch, chunk, ref, got, ATOL, RTOL, 3, runs)) == _key(whole)
    return whole


def test_complex_outputs_are_judged_on_both_parts(monkeypatch):
    """Until 2026-12-05 `.to(float64)` dropped the imaginary part: a candidate right in its real
    part alone passed (candidates/exploit_complex_real_part_only.py)."""
    ref = _complex((6, 5), 1)
    got = torch.complex(ref.real, ref.imag + 1.0)
    diff, findings = _chunkings(monkeypatch, ref, got)
    assert diff.n_bad == 30 and [f.category for f in findings] == ["mismatch"]
    assert "j, reference" in findings[0].message and diff.max_abs == pytest.approx(1.0)
    # The tolerance is torch.isclose's for complex values: |got - ref| <= atol + rtol * |ref|.
    got = ref.clone()
    got[1, 2] += 0.05j   # far from a small imaginary part, close to the modulus of 1e3 + x j
    got[2, 3] += 0.05j
    ref = ref.clone()
    ref[1, 2] = complex(1e3, 1e-3)
    got[1, 2] = complex(1e3, 1e-3 + 0.05)
    want = int((~torch.isclose(got.cdouble(), ref.cdouble(), RTOL, ATOL)).sum())
    diff, findings = _chunkings(monkeypatch, ref, got)
    assert diff.n_bad == want == 1 and "first [2, 3]" in findings[0].message
    # A real candidate for a complex reference: its dtype, and its missing imaginary part.
    diff, findings = _chunkings(monkeypatch, ref, ref.real.clone())
    assert [f.category for f in findings] == ["dtype", "mismatch"]


def test_complex_nonfinite_positions_in_either_part(monkeypatch):
    ref = _complex((12,), 2)
    ref[3] = complex(1.0, NAN)
    got = ref.clone()
    assert _chunkings(monkeypatch, ref, got)[0].ok  # NaN = NaN, in the imaginary part too
    got[3], got[8] = complex(1.0, 0.0), complex(INF, 0.0)
    findings = _chunkings(monkeypatch, ref, got)[1]
    assert [f.message.split(" positions")[0] for f in findings] == ["output 3: NaN",
                                                                    "output 3: +inf"]
    assert "first [3]: candidate 1+0j, reference 1+nanj" in findings[0].message
    with pytest.raises(TypeError, match="imaginary part"):
        tensor_diff._parts(ref, "cpu", False)


def test_complex_envelope_and_degenerate():
    ref = _complex((4, 3), 3)
    hi = ref + complex(0.5, 0.5)
    got = ref + complex(0.25, 0.0)
    assert envelope_accepts([ref, hi], got, ATOL, RTOL).all()
    assert not envelope_accepts([ref, hi], ref + complex(0.0, 0.75), ATOL, RTOL).any()
    assert envelope_accepts([ref, hi], got, ATOL, RTOL).shape == ref.shape
    zeros = torch.zeros_like(ref)
    assert [f.category for f in degenerate(ref, zeros, 0, ATOL, RTOL)] == ["zero_output"]
    assert degenerate(ref * 1e-6, zeros, 0, ATOL, RTOL) == []  # zero within the tolerance


def test_integer_outputs_are_compared_exactly(monkeypatch):
    """Counts of ~32,768 off by 3 passed atol + rtol * |ref| (~3.3) until 2026-12-05
    (candidates/exploit_int_within_rtol.py); int64 above 2**53 lost its last bits in float64."""
    ref = torch.full((5, 7), 32768, dtype=torch.int64)
    got = ref.clone()
    got[1, 2] -= 3
    got[4, 6] -= 2
    diff, findings = _chunkings(monkeypatch, ref, got)
    assert (diff.n_bad, diff.max_abs) == (2, 3.0)
    assert [f.category for f in findings] == ["mismatch"]
    assert ("2/35 element(s) differ (integer outputs are compared exactly); first [1, 2]: "
            "candidate 32765, reference 32768; worst |diff| 3 at [1, 2]") in findings[0].message
    big = torch.tensor([2 ** 60, 2 ** 60 + 2, 7])
    diff, findings = _chunkings(monkeypatch, big, big + torch.tensor([0, 1, 0]))
    assert diff.n_bad == 1 and f"candidate {2 ** 60 + 3}, reference {2 ** 60 + 2}" in \
        findings[0].message
    assert _chunkings(monkeypatch, big, big.clone())[0].ok
    # Another integer dtype: its dtype, and its values compared exactly after promotion.
    small = torch.tensor([1, 2, 3], dtype=torch.int32)
    diff, findings = _chunkings(monkeypatch, small, torch.tensor([1, 2, 4], dtype=torch.int16))
    assert [f.category for f in findings] == ["dtype", "mismatch"] and diff.n_bad == 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape,seed", [((2, 9, 17), 0), ((64,), 1), ((5, 11), 2)])
def test_on_cuda_equals_the_cpu_spec(monkeypatch, shape, seed):
    """ref and got on the GPU (a device-resident regime's judge), the envelope's runs and the
    fragile mask on the host (envelopes.envelope brings them there): the CPU spec's verdict."""
    ref, got, runs, fragile = _planted(shape, seed)
    want = _reference_diff_tensors(ref, got, ATOL, RTOL, 3, runs, fragile)
    for chunk in (7, 1 << 62):
        monkeypatch.setattr(tensor_diff, "CHUNK_ELEMENTS", chunk)
        result = diff_tensors(ref.cuda(), got.cuda(), ATOL, RTOL, 3, runs, fragile)
        assert _key(result) == _key(want), chunk
