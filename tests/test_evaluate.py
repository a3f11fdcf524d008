"""`fastelbo evaluate`: report fields, invariance to batching, 2 gloo ranks == 1 process."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fastelbo import cli, data
from fastelbo.evaluate import load_model
from fastelbo.iwae import iwae_log_likelihood
from reference import twins


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    rng = np.random.default_rng(1)
    protos = rng.random((4, 16)) > 0.5
    x = (protos[rng.integers(0, 4, 150)] ^ (rng.random((150, 16)) < 0.1)).astype(np.float32)
    root = tmp_path_factory.mktemp("eval")
    np.savez(root / "tiny.npz", x_train=x[:128], x_test=x[128:])  # 22 test images
    assert cli.main(["train", "--data", str(root / "tiny.npz"), "--out", str(root / "run"),
                     "--dims", "16,8,2", "--batch-size", "32", "--lr", "0.01",
                     "--max-steps", "8", "--no-plots"]) == 0
    return root / "run"


def evaluate(run_dir, out, *extra):
    assert cli.main(["evaluate", str(run_dir), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_report(run_dir, tmp_path):
    r = evaluate(run_dir, tmp_path / "r.json", "--samples", "300")
    assert r["images"] == 22 and r["samples"] == 300 and r["world_size"] == 1
    ll, el = r["log_likelihood"], r["elbo"]
    assert ll["stderr"] > 0 and el["stderr"] > 0
    assert ll["mean"] >= el["mean"] - 3 * el["stderr"]  # the IWAE bound is the tighter one
    assert np.isfinite(ll["mean"]) and ll["mean"] < 0


def test_matches_the_estimator_and_ignores_batch_size(run_dir, tmp_path):
    r1 = evaluate(run_dir, tmp_path / "a.json", "--samples", "64", "--batch-size", "5")
    r2 = evaluate(run_dir, tmp_path / "b.json", "--samples", "64", "--batch-size", "22")
    assert r1["log_likelihood"]["mean"] == pytest.approx(r2["log_likelihood"]["mean"], rel=1e-6)
    assert r1["elbo"]["mean"] == pytest.approx(r2["elbo"]["mean"], rel=1e-6)
    model, _ = load_model(run_dir, "cpu")
    x = data.load(str(run_dir.parent / "tiny.npz")).test
    direct = iwae_log_likelihood(model.vae_params(), x, 64, seed=0).detach()
    assert r1["log_likelihood"]["mean"] == pytest.approx(float(direct.double().mean()), rel=1e-6)


def test_only_the_torch_backend_for_now(run_dir, tmp_path):
    with pytest.raises(NotImplementedError, match="triton"):
        evaluate(run_dir, tmp_path / "x.json", "--backend", "triton")


def test_load_model_reads_reference_weights(run_dir):
    model, meta = load_model(run_dir / "checkpoint.safetensors", "cpu")
    ref, _ = twins((16, 8, 2))
    ref.load_state_dict(model.state_dict())  # the reference Model's keys and shapes
    assert meta["step"] == 8


def test_two_gloo_ranks_equal_one(run_dir, tmp_path):
    one = evaluate(run_dir, tmp_path / "one.json", "--samples", "200", "--batch-size", "4")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fastelbo.cli", "evaluate", str(run_dir), "--samples", "200",
           "--batch-size", "4", "--json", str(tmp_path / "two.json")]
    proc = subprocess.run(cmd, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and two["images"] == 22
    for key in ("log_likelihood", "elbo"):
        for stat in ("mean", "stderr"):
            assert two[key][stat] == pytest.approx(one[key][stat], rel=1e-6), (key, stat)
