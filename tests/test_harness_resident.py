"""Device-resident regimes: the reference's worker keeps the trial tensors and judges there.

On the GPU a regime goes resident when its trial tensors are large
(reference_tasks.RESIDENT_BYTES); here FASTELBO_RESIDENT_BYTES=0 makes every regime resident on
the CPU (the tensors then travel as memory-mapped files instead of CUDA IPC handles), so the
whole protocol runs in CI: inputs shared with the candidate, outputs shared back, judged by the
reference's worker while the candidate runs on, envelopes computed there. Its verdicts must be
the ones of the ordinary path.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fastelbo.harness import regimes
from fastelbo.harness.check import check
from fastelbo.harness.check.check import run_check
from fastelbo.harness.compare import PERTURB_RUNS
from fastelbo.harness.guard import shared
from fastelbo.harness.guard.reference_tasks import RESIDENT_ENV
from fastelbo.harness.guard.supervisor import WorkerOutcome
from fastelbo.harness.task_specs import judge_pass

HERE = Path(__file__).parent
TINY = HERE / "problems" / "tiny_vae.py"
STEP = HERE / "problems" / "step.py"
RELU = HERE / "problems" / "relu.py"
CANDIDATES = HERE / "candidates"

# candidate -> (exit code, the category reported, scales): every finding the judge makes itself
CORPUS = {
    "reference_as_candidate": (0, None, (4.0,)),
    "kl_sign_flipped": (1, "mismatch", ()),
    "bce_unclamped": (1, "nonfinite", (16.0,)),
    "extra_rng_draw": (1, "rng", ()),
    "cached_outputs": (1, "cached", ()),
    "input_mutation": (1, "input_mutated", ()),
    "zeros_output": (1, "zero_output", ()),
    "wrong_shape": (1, "shape", ()),
    "numpy_output": (1, "output_type", ()),
    "raises": (2, "exception", ()),
}


def _check(name: str, root: Path, problem: Path = TINY, scales=None, candidate=None):
    return run_check(problem, candidate or CANDIDATES / f"{name}.py", trials=2,
                     batch_sizes=[1, 5], scales=CORPUS[name][2] if scales is None else scales,
                     timeout=300.0, build_timeout=300.0, forward_timeout=120.0,
                     cache=root / name, seed=0)


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    """Every corpus check with every regime resident, and, for the parity test, the same
    checks on the ordinary path."""
    root = tmp_path_factory.mktemp("resident")
    old = os.environ.get(RESIDENT_ENV)
    os.environ[RESIDENT_ENV] = "0"
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            reports = dict(zip(CORPUS, pool.map(lambda n: _check(n, root / "on"), CORPUS)))
    finally:
        os.environ.pop(RESIDENT_ENV) if old is None else os.environ.update({RESIDENT_ENV: old})
    return reports, root


@pytest.mark.parametrize("name", list(CORPUS))
def test_resident_verdicts(resident, name):
    reports, root = resident
    report = reports[name]
    code, category, _ = CORPUS[name]
    assert report.exit_code == code, report.format()
    if category:
        assert category in report.categories, report.format()
    # Resident regimes never reach the reference cache: only the problem's entry is there.
    assert not list((root / "on" / name).rglob("*.ref.pt")), "a regime was cached, not resident"


@pytest.mark.parametrize("name", ["kl_sign_flipped", "bce_unclamped", "cached_outputs"])
def test_resident_reports_equal_the_ordinary_path(resident, tmp_path, name):
    reports, _ = resident
    ordinary = _check(name, tmp_path)
    assert list((tmp_path / name).rglob("*.ref.pt")), "the ordinary path caches its regimes"
    keep = ("status", "note", "trials", "envelope_runs", "name", "batch_size")
    got = [{k: r[k] for k in keep} for r in reports[name].to_dict()["regimes"]]
    want = [{k: r[k] for k in keep} for r in ordinary.to_dict()["regimes"]]
    assert got == want


def test_resident_envelope_is_computed_by_the_judge(tmp_path, monkeypatch):
    """The step problem's rounding flip: wrong on default inputs, accepted in the scaled regime
    only through the envelope, which the judge computes for the trials that missed. Resident
    for real: every regime is judged by the reference's worker (judge_pass, with the envelope
    for the scaled one), none goes through the cache or the check's own envelope pass."""
    monkeypatch.setenv(RESIDENT_ENV, "0")
    calls = []

    class Recorded(check.Worker):
        def run(self, task, kwargs, **limits):
            calls.append((task.name, kwargs.get("name"), kwargs.get("envelope")))
            return super().run(task, kwargs, **limits)
    monkeypatch.setattr(check, "Worker", Recorded)
    cand = tmp_path / "rounds_down.py"
    cand.write_text("import torch\nfrom fastelbo.problems import load_module\n"
                    f"Model = load_module({str(STEP)!r}).Model\n\n\n"
                    "class ModelNew(Model):\n    def forward(self, x):\n"
                    "        return torch.floor(x @ self.w - 1e-6)\n")
    report = run_check(STEP, cand, trials=2, batch_sizes=[], scales=(4.0,), timeout=120.0,
                       cache=tmp_path / "cache")
    default, scaled = report.regime("default"), report.regime("scale=4")
    assert default.status == "FAIL" and default.envelope_runs == 0, report.format()
    assert scaled.status == "PASS" and scaled.envelope_runs == PERTURB_RUNS, report.format()
    assert [t.ill_conditioned for t in scaled.trials] == [16, 16]
    assert all(t.envelope for t in scaled.trials)
    assert sorted(c for c in calls if c[0] == "judge_pass") == [
        ("judge_pass", "default", False), ("judge_pass", "scale=4", True)], calls
    assert not [c for c in calls if c[0] == "envelope_pass"], calls
    assert not list((tmp_path / "cache").rglob("*.ref.pt")), "a regime was cached, not resident"


def test_extra_batch_regime_is_sized_to_the_budget():
    assert regimes.default_batch_sizes(16) == [1, 33]
    assert regimes.default_batch_sizes(16, row_bytes=1024) == [1, 33]  # well within it
    layernorm = 64 * 256 * 256 * 4  # KernelBench's level1/40_LayerNorm: 16.8 MB per row
    assert regimes.default_batch_sizes(16, layernorm) == [1, 17]  # just above the default
    assert regimes.default_batch_sizes(15, layernorm) == [1, 17]  # odd, above 15
    relu = 393216 * 4  # level1/19_ReLU: 4097 rows would be 6.4 GB: tails only, within budget
    assert regimes.default_batch_sizes(4096, relu) == [1, 41]
    assert 41 * relu <= regimes.EXTRA_BATCH_BYTES < 43 * relu
    huge = regimes.ABOVE_BATCH_BYTES  # one row over every budget: the smallest odd tail
    assert regimes.default_batch_sizes(64, huge) == [1, 3]
    assert regimes.default_batch_sizes(41, 45 << 20) == [1, 3]  # 43 rows: 1.9 GiB


def test_the_odd_batch_is_drawn_from_the_seed():
    """A check's seed (secret by default) draws the odd size among those above the default up
    to 2 * default + 1: no size is known in advance. The same seed draws the same size."""
    drawn = {regimes.default_batch_sizes(16, seed=s)[1] for s in range(200)}
    assert drawn == set(range(17, 34, 2))
    assert {regimes.default_batch_sizes(15, seed=s)[1] for s in range(200)} == \
        set(range(17, 32, 2))
    assert regimes.default_batch_sizes(16, seed=7) == regimes.default_batch_sizes(16, seed=7)
    assert regimes.default_batch_sizes(1, seed=3) == [1, 3]
    layernorm = 64 * 256 * 256 * 4  # over the budget: the smallest odd above, whatever the seed
    assert {regimes.default_batch_sizes(16, layernorm, seed=s)[1] for s in range(50)} == {17}
    planned, _ = regimes.plan(16, [], None, (), seed=7)
    assert [g.name for g in planned] == ["default", "batch=1",
                                         f"batch={regimes.default_batch_sizes(16, seed=7)[1]}"]


def test_scale_regimes_skipped_without_floating_parameters():
    planned, skipped = regimes.plan(8, [], None, (4.0, 16.0), float_params=0)
    assert [g.name for g in planned] == ["default", "batch=1", "batch=17"]
    assert skipped and skipped[0][0] == "scales"
    planned, _ = regimes.plan(8, [], None, (4.0,), float_params=3)
    assert [g.name for g in planned][-1] == "scale=4"
    planned, _ = regimes.plan(8, [], None, (4.0,))  # not known yet: planned
    assert [g.name for g in planned][-1] == "scale=4"


def test_relu_check_reports_skipped_scales(tmp_path):
    report = run_check(RELU, CANDIDATES / "relu_clamp.py", trials=1, cache=tmp_path)
    assert report.exit_code == 0, report.format()
    assert not any(r.scale != 1 for r in report.regimes)
    assert any(s.startswith("scales:") for s in report.skipped)


def test_one_module_serves_every_regime(tmp_path):
    """The candidate's module is built once (the build phase) and every regime starts from its
    state, restored: a workspace sized at the first call is caught at a larger batch."""
    report = run_check(RELU, CANDIDATES / "stale_workspace.py", trials=2, batch_sizes=[1, 33],
                       cache=tmp_path)
    assert report.exit_code == 1, report.format()
    status = {r.name: r.status for r in report.regimes}
    assert status == {"default": "PASS", "batch=1": "PASS", "batch=33": "FAIL"}, report.format()
    assert report.categories == ["mismatch"]


def test_a_regime_the_judge_could_not_judge_is_an_error_and_hides_no_failure(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv(RESIDENT_ENV, "0")

    class JudgeFailsAtBatch1(check.Worker):
        def run(self, task, kwargs, **limits):
            if task is judge_pass and kwargs["name"] == "batch=1":
                return WorkerOutcome(None, category="timeout", reason="stopped by the test")
            return super().run(task, kwargs, **limits)
    monkeypatch.setattr(check, "Worker", JudgeFailsAtBatch1)
    opts = {"trials": 2, "batch_sizes": [1, 33]}
    wrong = run_check(RELU, CANDIDATES / "stale_workspace.py", cache=tmp_path / "w", **opts)
    status = {r.name: r.status for r in wrong.regimes}
    assert status == {"default": "PASS", "batch=1": "ERROR", "batch=33": "FAIL"}, wrong.format()
    assert wrong.exit_code == 1
    right = run_check(RELU, CANDIDATES / "relu_clamp.py", cache=tmp_path / "r", **opts)
    assert right.exit_code == 2, right.format()
    assert any("regime batch=1: the reference's worker could not judge it: stopped by the test"
               in r for r in right.reasons), right.reasons


def test_shared_cpu_tensor_round_trip(tmp_path):
    g = torch.Generator().manual_seed(7)
    t = torch.randn(5, 3, generator=g)[:, 1]  # a strided view
    desc = shared.share(t, tmp_path)
    assert shared.is_shared(desc) and not shared.is_shared({"a": 1})
    back = shared.open_copy(desc, torch.device("cpu"))
    assert torch.equal(back, t) and back.is_contiguous()
    back.add_(1)  # a copy: the file and the original are untouched
    assert torch.equal(shared.open_copy(desc, torch.device("cpu")), t)
    assert shared.open_all([desc, 3, "x"], torch.device("cpu"))[1:] == [3, "x"]


def test_shared_descriptions_name_only_torch_dtypes(tmp_path):
    desc = shared.share(torch.zeros(2), tmp_path)
    with pytest.raises(TypeError, match="not a torch dtype"):
        shared.open_copy({**desc, "dtype": "Tensor"}, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown shared tensor kind"):
        shared.open_copy({**desc, shared.KIND: "tpu"}, torch.device("cpu"))


def test_device_copies_are_copies(tmp_path):
    t, other = torch.arange(6.0), "not a tensor"
    got = shared.device_copies([t, other, 3], torch.device("cpu"))
    assert got[1:] == [other, 3] and torch.equal(got[0], t)
    assert got[0].data_ptr() != t.data_ptr()  # the caller's tensor is never what is shared


def _segment(t: torch.Tensor, snapshot) -> int:
    """The address of the caching allocator's segment (one IPC mapping) that holds t."""
    ptr = t.data_ptr()
    (seg,) = [s["address"] for s in snapshot
              if s["address"] <= ptr < s["address"] + s["total_size"]]
    return seg


@pytest.mark.gpu
def test_a_shared_inputs_segment_holds_nothing_of_the_reference():
    """An input shared by IPC maps its whole allocator segment into the candidate's process.
    Control: in the default pool a 3 MB input and a 3 MB output made after it share one 20 MB
    segment (so a candidate could read the output through the input's handle). What the
    reference's worker shares is copied by shared.device_copies, into a pool of its own (and
    shared from there in the next test, whose every regime is resident)."""
    dev = torch.device("cuda")
    x = torch.randn(3 << 18)  # 3 MB: the large pool, carved from 20 MB segments
    torch.cuda.empty_cache()  # no cached free block elsewhere for the output to land in
    plain = x.to(dev, copy=True)
    out = plain * 2  # what a reference computes from it
    snap = torch.cuda.memory_snapshot()
    assert _segment(plain, snap) == _segment(out, snap), "control: the hole is not reproduced"
    del plain, out
    torch.cuda.empty_cache()
    (sealed,) = shared.device_copies([x], dev)
    outs = [sealed * 2, torch.empty(1 << 10, device=dev), torch.empty(3 << 18, device=dev)]
    snap = torch.cuda.memory_snapshot()
    assert {_segment(o, snap) for o in outs}.isdisjoint({_segment(sealed, snap)})
    assert torch.equal(sealed.cpu(), x)  # IPC from the pool: the next test's checks


@pytest.mark.gpu
def test_resident_cuda_regimes_pass_and_fail(tmp_path, monkeypatch):
    """On CUDA the tensors travel as IPC handles: a right and a wrong candidate."""
    monkeypatch.setenv(RESIDENT_ENV, "0")
    ok = run_check(RELU, CANDIDATES / "relu_clamp.py", device="cuda", trials=2,
                   cache=tmp_path / "ok")
    assert ok.exit_code == 0, ok.format()
    assert not list((tmp_path / "ok").rglob("*.ref.pt"))
    bad = run_check(TINY, CANDIDATES / "kl_sign_flipped.py", device="cuda", trials=2,
                    batch_sizes=[1, 5], scales=(4.0,), cache=tmp_path / "bad")
    assert bad.exit_code == 1, bad.format()
    assert {f.category for r in bad.regimes for t in r.trials for f in t.findings} == {"mismatch"}
    mutated = run_check(TINY, CANDIDATES / "input_mutation.py", device="cuda", trials=2,
                        batch_sizes=[], scales=(), cache=tmp_path / "mut")
    assert mutated.exit_code == 1, mutated.format()


def test_a_regime_is_judged_once_whatever_its_worker_hands_over(tmp_path, monkeypatch):
    """exploit_judge_queue.py hands over its default regime's record 200 times: the check
    queued a judge of each on the reference's worker and waited for them all, past --timeout
    (red team, 2026-12-05). A regime is judged once; a second record of it is forged."""
    monkeypatch.setenv(RESIDENT_ENV, "0")
    judged = []

    class Counting(check.Worker):
        def run(self, task, kwargs, **limits):
            if task is judge_pass:
                judged.append(kwargs["name"])
            return super().run(task, kwargs, **limits)
    monkeypatch.setattr(check, "Worker", Counting)
    report = run_check(RELU, CANDIDATES / "exploit_judge_queue.py", trials=2,
                       batch_sizes=[1], cache=tmp_path)
    assert sorted(judged) == ["batch=1", "default"], judged
    assert report.exit_code == 1 and "malformed" in report.categories, report.format()
    assert any("second record of regime default" in r for r in report.reasons), report.reasons
