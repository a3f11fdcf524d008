"""The Dask engine in its local mode (a LocalCluster of in-process workers, several of them):
the same results as the local engine, GPU jobs declaring {"GPU": 1} and each worker on its own
device, and with real sessions the verdicts of the local engine, nothing left running."""
from __future__ import annotations

import uuid

import pytest

import batch_fakes
from batch_fakes import FakeSession, write_run
from fastelbo.harness.batch.engine import DaskEngine
from fastelbo.harness.batch.layout import read_run
from fastelbo.harness.batch.run import Run, Settings
from fastelbo.harness.batch.slot import CHECK, Job, SlotConfig
from test_harness_batch_faults import (
    SAMPLES,
    judge,
    stored,
    verdict,
    wait_untagged,
    write_manifest,
)

pytest.importorskip("distributed")

MARKS = {(1, 0): "# ms: 2.5", (1, 1): "# verdict: incorrect", (2, 0): "# verdict: error",
         (2, 1): "# ms: 4.5", (3, 0): "# ms: 1.0", (3, 1): "# ms: 8.0"}


def _judge(root, out, engine: str):
    probs, run = write_run(root, MARKS)
    job = Run(read_run(run, probs), Settings(out=out, timing="quick", engine=engine,
                                            devices=("cpu", "cpu"), seed=1),
              FakeSession, warn=[].append)
    try:
        outcome = job.run()
        from fastelbo.harness.batch import analysis
        return outcome, analysis.records(job.store)
    finally:
        job.store.close()


def test_the_dask_engine_gives_the_local_engines_results_on_two_workers(tmp_path):
    batch_fakes.SESSIONS.clear()
    outcome, recs = _judge(tmp_path / "r", tmp_path / "dask", "dask")
    sessions = list(batch_fakes.SESSIONS)
    local, want = _judge(tmp_path / "r", tmp_path / "local", "local")
    assert recs == want
    assert (outcome.checked, outcome.timed) == (local.checked, local.timed) == (6, 4)
    # one slot (session) per worker, both used, all closed with the cluster
    assert len(sessions) == 2 and all(s.closed for s in sessions)


def test_gpu_jobs_declare_the_gpu_and_each_local_worker_has_its_own(tmp_path):
    """A job on CUDA is a task with resources {"GPU": 1}; in the local cluster, worker i runs
    its jobs on cuda:gpus[i] (the sessions are fakes: no GPU is touched)."""
    cand = tmp_path / "c.py"
    cand.write_text("# ms: 1.0\n")
    config = SlotConfig("cuda", (("seed", 1),), FakeSession)
    batch_fakes.CALLS.clear()
    engine = DaskEngine(config, workers=2, gpus=(3, 5))
    try:
        assert engine.resources == {"GPU": 1}
        assert {w["resources"].get("GPU") for w in
                engine.client.scheduler_info()["workers"].values()} == {1}
        for i in range(8):
            engine.submit(Job(CHECK, str(cand), (str(cand),), i), (0, 1, i))
        results = []
        while engine.pending():
            got = engine.next_result(timeout=1.0)
            if got is not None:
                results.append(got)
    finally:
        engine.close()
    assert len(results) == 8 and all("report" in r for _, r in results)
    assert {device for _, device, _ in batch_fakes.CALLS} <= {"cuda:3", "cuda:5"}
    assert {r["report"]["device"] for _, r in results} <= {"cuda:3", "cuda:5"}


@pytest.mark.slow
def test_real_sessions_on_dask_give_the_local_engines_verdicts(tmp_path):
    samples = {k: SAMPLES[k] for k in ("honest", "wrong", "syntax", "exit")}
    results = {}
    for engine in ("dask", "local"):
        root = tmp_path / engine
        root.mkdir()
        manifest = write_manifest(root, samples)
        tag = uuid.uuid4().hex
        proc = judge(manifest, tag, "--engine", engine, "--workers", "2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert wait_untagged(tag) == []
        assert f"engine {engine}, 2 pool(s): 4 checked now" in proc.stdout
        results[engine] = {n: {**verdict(r), "reasons": [line.replace(str(root), "RUN")
                                                         for line in verdict(r)["reasons"]]}
                           for n, r in stored(root).items() if n in samples}
    assert results["dask"] == results["local"]
    assert [results["dask"][n]["exit_code"] for n in samples] == [0, 1, 2, 2]
