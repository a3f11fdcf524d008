"""The perturbed-reference envelope accepts rounding-level flips of ill-conditioned elements,
and nothing that allclose alone would reject on well-conditioned ones."""
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch

import fastelbo
from fastelbo.backends import torch_ref
from fastelbo.harness.check.check import run_check
from fastelbo.harness.compare import PERTURB_RUNS, assert_outputs_match, compare_outputs, perturbed
from fastelbo.harness.guard import envelopes, loader
from fastelbo.params import VAEParams


def _case(dims, scale, batch):
    torch.manual_seed(0)
    p = VAEParams(*(t.detach() * scale for t in fastelbo.ModelNew(*dims).vae_params()))
    return p, torch.rand(batch, dims[0]), torch.randn(batch, dims[2])


def _runs(x, p, eps, n=PERTURB_RUNS):
    g = torch.Generator().manual_seed(0)
    return [torch_ref.forward(x, p, eps)] + [
        torch_ref.forward(x, VAEParams(*perturbed(p, g)), eps) for _ in range(n)]


def test_rounding_level_flip_in_saturation_is_accepted():
    """Parameters x4 (the harness's saturation regime): another implementation whose rounding
    differs by 2**-21 relative flips one BCE term between ~-16.6 (sigmoid just below 1) and the
    -100 clamp (sigmoid rounded to 1), a jump of ~42 in recon that allclose rejects."""
    p, x, eps = _case((784, 256, 32), 4.0, 1000)
    runs = _runs(x, p, eps)
    assert all(torch.isfinite(t).all() for t in runs[0])
    other = torch_ref.forward(x, VAEParams(*perturbed(p, torch.Generator().manual_seed(123),
                                                      2.0 ** -21)), eps)
    assert assert_outputs_match(tuple(runs[0]), runs, 1e-4, 1e-4) == 0
    with pytest.raises(AssertionError, match="output 1"):  # allclose alone rejects it...
        assert_outputs_match(other, runs[:1], 1e-4, 1e-4)
    assert assert_outputs_match(other, runs, 1e-4, 1e-4) > 0  # ...the envelope explains it


def test_real_errors_are_still_rejected():
    p, x, eps = _case((64, 48, 2), 1.0, 50)
    runs = _runs(x, p, eps, n=4)
    elbo, recon, kl = runs[0]
    off = (elbo * (1 + 3e-4), recon, kl)  # a 3e-4 relative error: allclose rejects it
    with pytest.raises(AssertionError, match="output 0"):
        assert_outputs_match(off, runs, 1e-4, 1e-4)
    with pytest.raises(AssertionError, match="NaN"):
        assert_outputs_match((elbo, recon.clone().fill_(float("nan")), kl), runs, 1e-4, 1e-4)


def test_elements_nonfinite_in_only_some_runs_are_fragile_not_judged():
    """An overflow whose outcome depends on the summation order (the spec NaN on one device,
    finite on another): the element is not judged; every other element still is."""
    ref = (torch.tensor([-float("inf"), 1.0]), torch.tensor([41200.0, 2.0]))
    other_order = (torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 2.0]))
    got = (torch.tensor([-float("inf"), 1.0]), torch.tensor([40800.0, 2.0]))
    with pytest.raises(AssertionError, match="output 1"):
        assert_outputs_match(got, [ref], 1e-4, 1e-4)
    assert assert_outputs_match(got, [ref, other_order], 1e-4, 1e-4) == 1
    with pytest.raises(AssertionError, match="output 1"):  # the finite element is still judged
        assert_outputs_match((got[0], torch.tensor([40800.0, 2.1])), [ref, other_order], 1e-4,
                             1e-4)


# --- The envelope inside `fastelbo check`: one comparison path, used in scale regimes only. ---

def test_compare_outputs_accepts_inside_the_envelope_and_counts_it():
    ref = torch.tensor([1.0, -16.6, 2.0])
    lo, hi = torch.tensor([1.0, -100.0, 2.0]), torch.tensor([1.0, -16.6, 2.0])
    got = torch.tensor([1.0, -100.0, 2.0])  # one flip, as in a saturated BCE term
    assert not compare_outputs((ref,), (got,), 1e-4, 1e-4).ok  # strict: rejected
    cmp = compare_outputs((ref,), (got,), 1e-4, 1e-4, runs=[(lo,), (hi,)])
    assert cmp.ok and cmp.diffs[0].n_envelope == 1 and cmp.diffs[0].n_bad == 0
    assert cmp.diffs[0].max_abs == pytest.approx(83.4, abs=1e-3)  # the diff is still reported


def test_envelope_never_excuses_nonfinite_or_outside_values():
    ref = torch.tensor([1.0, -16.6, 2.0, 3.0])
    runs = [(torch.tensor([1.0, -100.0, 2.0, 3.0]),), (torch.tensor([1.0, -16.6, 2.0, 3.0]),)]
    nan = compare_outputs((ref,), (torch.tensor([1.0, float("nan"), 2.0, 3.0]),), 1e-4, 1e-4,
                          runs=runs)
    assert [f.category for f in nan.findings] == ["nonfinite"]
    off = compare_outputs((ref,), (torch.tensor([1.0, -100.0, 2.1, 3.0]),), 1e-4, 1e-4,
                          runs=runs)
    assert [f.category for f in off.findings] == ["mismatch"]
    assert off.diffs[0].n_envelope == 1 and off.diffs[0].n_bad == 1
    # The worst element named is the real error, not the accepted flip.
    assert "and the perturbed-reference envelope" in off.findings[0].message
    assert "worst |diff| 0.1 at [2]" in off.findings[0].message


def test_reference_envelope_is_deterministic_and_restores_parameters():
    model = torch.nn.Linear(4, 3)
    weights = [p.detach().clone() for p in model.parameters()]
    x = [torch.randn(5, 4)]
    ref = model(*x).detach()
    (lo, hi), fragile = envelopes.perturbed_envelope(model, x, 7, torch.device("cpu"), 4, "",
                                                     (ref,))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert not bool(fragile[0].any())  # finite everywhere, in every run
    assert bool((lo[0] <= hi[0]).all() and (lo[0] < hi[0]).any())  # perturbed, ...
    for bound in (lo[0], hi[0]):  # ...by rounding-level amounts only: 2**-18 of |w|*|x|
        torch.testing.assert_close(bound, ref, rtol=0, atol=5e-5)  # summed over 4 terms
    (lo2, hi2), _ = envelopes.perturbed_envelope(model, x, 7, torch.device("cpu"), 4)
    assert torch.equal(lo2[0], lo[0]) and torch.equal(hi2[0], hi[0])


class _Refuses(torch.nn.Linear):
    """A Linear whose forward raises on the calls numbered in `refuse` (0-based), as the spec's
    BCE refuses a NaN its own perturbed forward made; `kill` also marks the device dead."""

    def __init__(self, refuse, kill=False):
        super().__init__(4, 3)
        self.calls, self.refuse, self.kill = 0, set(refuse), kill

    def forward(self, x):
        self.calls += 1
        if self.calls - 1 in self.refuse:
            if self.kill:
                loader.usable = lambda device: False
            raise RuntimeError("all elements of input should be between 0 and 1 (stand-in)")
        return super().forward(x)


def _bounds(model, x, ref, **kw):
    (lo, hi), _ = envelopes.perturbed_envelope(model, x, 7, torch.device("cpu"), 4, "", (ref,),
                                               **kw)
    return lo[0], hi[0]


def test_a_perturbed_run_that_raises_is_left_out(monkeypatch):
    """The reference refusing its own perturbed forward: that run is left out (the envelope of
    the others, as if it had been skipped), never a wider one; with every run refused, the
    envelope is the plain outputs."""
    monkeypatch.setattr(loader, "usable", lambda device: True)
    torch.manual_seed(0)
    x = [torch.randn(5, 4)]
    model = _Refuses(refuse={1})
    ref = torch.nn.functional.linear(x[0], model.weight, model.bias).detach()
    got = _bounds(model, x, ref)
    want = _bounds(_copy(model, _Refuses(refuse=())), x, ref, skip={1})
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    full = _bounds(_copy(model, _Refuses(refuse=())), x, ref)
    assert bool((full[0] <= got[0]).all() and (got[1] <= full[1]).all())  # never wider
    lo, hi = _bounds(_copy(model, _Refuses(refuse=range(4))), x, ref)
    assert torch.equal(lo, ref) and torch.equal(hi, ref)


def test_a_perturbed_run_that_kills_the_device_says_which(monkeypatch):
    """A refusal that leaves the device unusable ends the envelope with DeviceLost naming the
    run (the check then reruns the trial in a fresh worker, skipping it), and nothing more is
    asked of the dead device (no parameter restore)."""
    monkeypatch.setattr(loader, "usable", lambda device: True)
    x = [torch.randn(5, 4)]
    model = _Refuses(refuse={2}, kill=True)
    ref = model(*x).detach()  # call 0: the plain run
    with pytest.raises(envelopes.DeviceLost) as lost:
        envelopes.perturbed_envelope(model, x, 7, torch.device("cpu"), 4, "", (ref,),
                                     lost_at={"regime": "scale=16", "trial": 1})
    assert lost.value.args[0] == {"regime": "scale=16", "trial": 1, "run": 1}
    assert model.calls == 3


def _copy(src, dst):
    dst.load_state_dict(src.state_dict())
    return dst


def test_envelope_marks_elements_whose_finiteness_is_fragile():
    """exp(w * x) with w * x at the float32 overflow edge: perturbed runs disagree on inf."""
    class Edge(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))

        def forward(self, x):
            return (torch.exp(self.w * x),)

    model = Edge()
    edge = float(torch.log(torch.tensor(torch.finfo(torch.float32).max)))  # ~88.72
    x = [torch.tensor([1.0, edge, 200.0])]
    ref = model(*x)[0].detach()
    _, fragile = envelopes.perturbed_envelope(model, x, 3, torch.device("cpu"), 16, "", (ref,))
    assert fragile[0].tolist() == [False, True, False]  # 200 overflows in every run


def test_fragile_positions_are_not_judged_robust_ones_are():
    ref = (torch.tensor([1.0, float("inf"), float("inf"), 2.0]),)
    fragile = [torch.tensor([False, True, False, False])]
    lohi = [(torch.tensor([1.0, 3e38, float("inf"), 2.0]),),
            (torch.tensor([1.0, float("inf"), float("inf"), 2.0]),)]
    ok = compare_outputs(ref, (torch.tensor([1.0, 3.3e38, float("inf"), 2.0]),), 1e-4, 1e-4,
                         runs=lohi, fragile=fragile)
    assert ok.ok and ok.diffs[0].n_envelope == 1
    moved = compare_outputs(ref, (torch.tensor([1.0, float("inf"), 3e38, 2.0]),), 1e-4, 1e-4,
                            runs=lohi, fragile=fragile)
    assert [f.category for f in moved.findings] == ["nonfinite"]  # the robust inf moved


STEP = Path(__file__).parent / "problems" / "step.py"
STEP_CANDIDATES = {
    # floor(x @ w) where x @ w is an exact integer: summing w a hair low gives n - 1 everywhere.
    "rounds_down": "torch.floor(x @ (self.w * (1 - 2.0 ** -20)))",
    "off_by_half": "torch.floor(x @ self.w) + 0.5",   # a real error: outside [n - 1, n]
}


def _step_check(tmp_path, name):
    path = tmp_path / f"{name}.py"
    path.write_text(f"import torch\nfrom fastelbo.problems import load_module\n"
                    f"Model = load_module({str(STEP)!r}).Model\n\n\n"
                    f"class ModelNew(Model):\n    def forward(self, x):\n"
                    f"        return {STEP_CANDIDATES[name]}\n")
    return run_check(STEP, path, trials=2, batch_sizes=[], scales=(4.0,), timeout=120.0)


@pytest.fixture(scope="module")
def step_reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(STEP_CANDIDATES, pool.map(partial(_step_check, tmp), STEP_CANDIDATES)))


def test_rounding_flip_passes_scale_regime_through_the_envelope_only(step_reports):
    report = step_reports["rounds_down"]
    default, scaled = report.regime("default"), report.regime("scale=4")
    assert default.status == "FAIL" and default.envelope_runs == 0  # strict where no saturation
    assert {f.category for t in default.trials for f in t.findings} == {"mismatch"}
    assert scaled.status == "PASS" and scaled.envelope_runs == PERTURB_RUNS, report.format()
    assert [t.ill_conditioned for t in scaled.trials] == [16, 16]  # every element flipped
    assert "ill-conditioned: 16, 16" in report.format()
    data = report.to_dict()["regimes"][1]
    assert data["envelope_runs"] == PERTURB_RUNS
    assert [t["ill_conditioned"] for t in data["trials"]] == [16, 16]
    assert data["trials"][0]["diffs"][0]["n_envelope"] == 16


def test_real_error_fails_scale_regime_despite_the_envelope(step_reports):
    report = step_reports["off_by_half"]
    assert report.regime("scale=4").status == "FAIL" and report.exit_code == 1
    found = [f for t in report.regime("scale=4").trials for f in t.findings]
    assert {f.category for f in found} == {"mismatch"}
    assert "perturbed-reference envelope" in found[0].message


def test_an_envelopes_forwards_on_a_cpu_run_on_one_thread():
    """The perturbed forwards run on ENVELOPE_THREADS intra-op threads on a CPU (a team waited
    on a descheduled thread at every op: a wrong candidate's check 2.8x a right one's on a
    loaded host), and the worker's own count is restored after."""
    seen = []

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            seen.append(torch.get_num_threads())
            return (x * self.w,)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        envelopes.perturbed_envelope(Counting(), [torch.ones(3)], 7, torch.device("cpu"), 4)
        assert seen == [envelopes.ENVELOPE_THREADS] * 4 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
