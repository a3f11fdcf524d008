"""The PNGs of a run (reconstructions, prior samples, loss curves), drawn by a process of their
own so that matplotlib is off the run's critical path.

`Renderer()` starts `python -m fastelbo.training.render` as the run starts, before the run
imports torch: the child imports numpy and matplotlib and draws a throw-away figure (fonts,
Agg) while the run imports and trains (about 1 s of a 2-core CPU; drawing the three files in
the run itself cost 1.8 s of an 8 s `train --epochs 2` there), then waits on its stdin. Once
the last checkpoint is written the run hands over the pictures' data (`submit`: one .npz of
arrays made by training/plots.py), does its remaining work, and `wait`s for the three files;
each is written to a temp file and renamed, so a PNG is whole or absent.

Figures use matplotlib's object API (Figure, no pyplot): a Figure renders a .png with Agg.
The child imports no torch and nothing of fastelbo but this module and training/rundir.py.
"""
from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .rundir import PLOTS

RECONSTRUCTIONS, SAMPLES, CURVES = PLOTS
RECONSTRUCTIONS_SIZE, RECONSTRUCTIONS_TITLE = (10, 1.6), ("test images (top) and "
                                                         "reconstructions at z = mu (bottom)")
SAMPLES_SIZE, SAMPLES_TITLE = (6, 6), "64 samples, z ~ N(0, I)"
SRC = Path(__file__).resolve().parents[2]  # the folder holding this fastelbo package


class Renderer:
    """The drawing child of one run: start, `submit` once, `wait`; `close` (or the with-block's
    end) stops it if it is still running, e.g. after an error or Ctrl-C in the run."""

    def __init__(self):
        # The child imports the fastelbo that this process runs, wherever sys.path found it.
        path = [str(SRC), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
        # stderr goes to a file, not a pipe nobody reads while the run trains (a full pipe
        # would stall the child); its own session keeps the terminal's Ctrl-C for the run.
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - open as long as the child; close()
        self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=self._err, env=env,
                                      start_new_session=True)
        self._out: Path | None = None

    def submit(self, out: Path, **arrays) -> None:
        """Hand the child the pictures' data (numpy arrays, see `draw`); it writes into `out`."""
        import numpy as np

        buf = io.BytesIO()
        np.savez(buf, out=np.array(str(out)), **arrays)
        self._out = out
        try:
            self._proc.stdin.write(buf.getvalue())
            self._proc.stdin.close()
        except BrokenPipeError:  # the child has died; wait() reports why
            pass

    def wait(self) -> list[str]:
        """The names of the PNGs, once written; RuntimeError with the child's last line if not."""
        code = self._proc.wait()
        if code:
            self._err.seek(0)
            lines = self._err.read().decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"exit code {code}"
            raise RuntimeError(f"drawing the PNGs failed: {why}; --no-plots skips them")
        return list(PLOTS)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
            if self._out is not None:
                for name in PLOTS:
                    (self._out / _tmp_name(name)).unlink(missing_ok=True)
        if not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        self._err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tmp_name(name: str) -> str:
    return name + ".tmp"


def _image_shape(dim: int) -> tuple[int, int]:
    side = math.isqrt(dim)
    return (side, side) if side * side == dim else (1, dim)


def _grid(ax, images, rows: int, cols: int, title: str) -> None:
    import numpy as np

    h, w = _image_shape(images.shape[1])
    canvas = np.ones((rows * (h + 1), cols * (w + 1)), np.float32)
    for k, img in enumerate(images[:rows * cols]):
        r, c = divmod(k, cols)
        canvas[r * (h + 1):r * (h + 1) + h, c * (w + 1):c * (w + 1) + w] = img.reshape(h, w)
    ax.imshow(canvas, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title)
    ax.axis("off")


def draw(out: Path, pairs, samples, loss_curve, epochs) -> None:
    """The three PNGs in `out`. pairs: (2n, D) test images then their reconstructions; samples:
    (64, D) decoded prior draws; loss_curve: (k, 2) step, running -ELBO; epochs: (m, 3) step,
    train ELBO, test ELBO (values in [0, 1] for the images, D a square or drawn as one row).
    Margins are fixed, not tight_layout's: its extra layout pass was a third of the drawing.
    (Drawing two of them in forked copies of the child was tried: slower on 2 busy cores, the
    copies' page faults costing more than the parallel drawing saved.)"""
    _images(out / RECONSTRUCTIONS, pairs, 2, pairs.shape[0] // 2, RECONSTRUCTIONS_SIZE,
            RECONSTRUCTIONS_TITLE)
    _images(out / SAMPLES, samples, 8, 8, SAMPLES_SIZE, SAMPLES_TITLE)
    _curves(out / CURVES, loss_curve, epochs)


def _images(path: Path | None, images, rows: int, cols: int, size, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    top = 1 - 0.3 / size[1]  # room for the title: 0.3 inch
    _grid(fig.add_axes((0.01, 0.01, 0.98, top - 0.01)), images, rows, cols, title)
    _save(fig, path)


def _curves(path: Path | None, loss_curve, epochs) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_axes((0.11, 0.12, 0.86, 0.85))
    if len(loss_curve):
        ax.plot(loss_curve[:, 0], loss_curve[:, 1], lw=1, label="train loss -ELBO (running mean)")
    if len(epochs):
        ax.plot(epochs[:, 0], -epochs[:, 1], "o-", label="train -ELBO")
        ax.plot(epochs[:, 0], -epochs[:, 2], "s-", label="test -ELBO")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per image")
    ax.legend()
    _save(fig, path)


def _save(fig, path: Path | None) -> None:
    if path is None:  # the warm-up: drawn to memory
        fig.savefig(io.BytesIO(), dpi=100, format="png")
        return
    tmp = path.with_name(_tmp_name(path.name))
    fig.savefig(tmp, dpi=100, format="png")
    os.replace(tmp, path)


def _warm_up() -> None:
    """The three figures, drawn to memory from stand-in data: the first draw's costs (fonts,
    glyphs, colormaps, Agg, the PNG encoder) are paid while the run trains, not after it."""
    import numpy as np

    images = np.linspace(0, 1, 64 * 784, dtype=np.float32).reshape(64, 784)
    _images(None, images[:32], 2, 16, RECONSTRUCTIONS_SIZE, RECONSTRUCTIONS_TITLE)
    _images(None, images, 8, 8, SAMPLES_SIZE, SAMPLES_TITLE)
    curve = np.array([[25.0, 300.0], [50.0, 250.0]])
    _curves(None, curve, np.array([[31.0, -300.0, -250.0], [62.0, -250.0, -240.0]]))


def _child() -> int:
    """`python -m fastelbo.training.render`: warm up, read the data, draw, exit."""
    import numpy as np

    _warm_up()
    raw = sys.stdin.buffer.read()
    if raw:  # empty: the run ended before its pictures (an error, Ctrl-C): nothing to draw
        with np.load(io.BytesIO(raw), allow_pickle=False) as data:
            draw(Path(str(data["out"])), data["pairs"], data["samples"], data["loss_curve"],
                 data["epochs"])
    return 0


if __name__ == "__main__":
    code = _child()
    # Leave without the interpreter's teardown (0.3 s of a 2-core CPU with matplotlib loaded),
    # which the run would wait for; the PNGs are closed and renamed already.
    sys.stderr.flush()
    os._exit(code)
