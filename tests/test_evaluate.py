"""`fastelbo evaluate`: report fields, invariance to batching, 2 gloo ranks == 1 process, the
backend switch; the Triton path runs in a TRITON_INTERPRET=1 child (as in test_triton_iwae.py:
Triton picks interpreter or compiler at import)."""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastelbo import cli, data
from fastelbo.commands import EVALUATE_BATCH as BATCH
from fastelbo.evaluate import PROGRESS_STEPS, load_model
from fastelbo.ops.iwae import iwae_log_likelihood
from interpret import IN_CHILD, child_only, parent_only, run_children
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
    # auto is the fused kernel on CUDA only; on CPU it is torch, with torch's batch default
    # (capped so that its progress bar moves at least PROGRESS_STEPS times)
    assert r["backend"] == "torch" and r["backend_requested"] == "auto"
    assert r["batch_size"] == min(BATCH["torch"], math.ceil(22 / PROGRESS_STEPS)) == 1
    t = r["timings"]
    assert 0 < t["iwae_s"] < t["total_s"] and t["iwae_s_per_rank"] == [t["iwae_s"]]
    assert r["images_per_s"] == pytest.approx(22 / t["iwae_s"])
    assert "per_image" not in r
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
    direct = iwae_log_likelihood(x, model.vae_params(), 64, seed=0).detach()
    assert r1["log_likelihood"]["mean"] == pytest.approx(float(direct.double().mean()), rel=1e-6)


def refused(capsys, argv) -> str:
    """The one line `fastelbo` prints for a command it refuses with exit 2."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fastelbo: error: "), err
    return err


def test_unknown_backend_is_refused(run_dir, capsys):
    err = refused(capsys, ["evaluate", str(run_dir), "--backend", "mojo"])
    assert "--backend: invalid choice: 'mojo'" in err and "triton" in err and "cuda" in err, err


def test_cuda_off_gpu_says_why(run_dir, capsys):
    err = refused(capsys, ["evaluate", str(run_dir), "--backend", "cuda", "--device", "cpu"])
    assert re.search("--backend cuda: .*cannot run on cpu.*CUDA devices only", err), err


@pytest.mark.skipif(IN_CHILD, reason="in the interpreter triton does run on CPU")
def test_triton_off_gpu_says_why(run_dir, capsys):
    import triton  # noqa: F401  a declared extra: a broken install fails, never skips
    err = refused(capsys, ["evaluate", str(run_dir), "--backend", "triton", "--device", "cpu"])
    assert re.search("--backend triton: .*CUDA device.*backend='torch' runs everywhere", err), err


def test_per_image_values(run_dir, tmp_path):
    r = evaluate(run_dir, tmp_path / "p.json", "--samples", "20", "--limit", "7", "--per-image")
    ll = np.array(r["per_image"]["log_likelihood"])
    assert ll.shape == (7,) and len(r["per_image"]["elbo"]) == 7
    assert r["log_likelihood"]["mean"] == pytest.approx(ll.mean(), rel=1e-12)


@pytest.mark.slow
@parent_only
def test_triton_backend_in_interpreter():
    out = run_children(__file__, "-m", "not gpu", "-k", "interpreted", timeout=600)
    assert "2 passed" in out, out


@child_only
def test_interpreted_triton_equals_the_kernel_in_any_batch(run_dir, tmp_path):
    """`evaluate --backend triton` is the kernel with the images' own indices as noise keys: the
    same per-image values in batches of 2 as the kernel gives for all 5 at once."""
    from fastelbo.backends.triton import iwae as tiwae
    r = evaluate(run_dir, tmp_path / "t.json", "--backend", "triton", "--samples", "40",
                 "--limit", "5", "--batch-size", "2", "--per-image")
    assert r["backend"] == "triton" and r["images"] == 5
    model, _ = load_model(run_dir, "cpu")
    params = [p.detach() for p in model.vae_params()]
    x = data.load(str(run_dir.parent / "tiny.npz")).test[:5]
    want = tiwae.iwae_log_likelihood(x, params, 40, seed=0, indices=range(5))
    got = torch.tensor(r["per_image"]["log_likelihood"], dtype=torch.float64)
    torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=0)
    with torch.no_grad():
        public = iwae_log_likelihood(x, params, 40, seed=0, backend="triton")
        torch.testing.assert_close(public, want, rtol=1e-6, atol=0)
        # auto stays torch off CUDA even though the interpreter could run the kernel here
        torch_ll = iwae_log_likelihood(x, params, 40, seed=0)
    assert torch.equal(torch_ll, iwae_log_likelihood(x, params, 40, seed=0, backend="torch"))
    assert not torch.equal(torch_ll, public)  # other noise stream: same estimator, other draw


@child_only
def test_interpreted_triton_two_gloo_ranks_equal_one(run_dir, tmp_path):
    common = ["--backend", "triton", "--samples", "40", "--limit", "5", "--per-image"]
    one = evaluate(run_dir, tmp_path / "one.json", *common)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fastelbo.cli", "evaluate", str(run_dir), *common,
           "--json", str(tmp_path / "two.json")]
    proc = subprocess.run(cmd, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and two["backend"] == "triton"
    assert len(two["timings"]["iwae_s_per_rank"]) == 2
    np.testing.assert_allclose(two["per_image"]["log_likelihood"],
                               one["per_image"]["log_likelihood"], rtol=1e-6, atol=0)


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
