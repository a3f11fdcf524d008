"""harness/guard/handoff.py: the harness writes into a worker's directory (which the candidate's
code can write) only as new files under names no one can guess, and reads back only regular files
with one link directly inside it. On 2026-12-05 a candidate's link named `init.pt` made the check's
copy of the weights overwrite a reference entry (and pass), and a FIFO named as a result hung the
check."""
from __future__ import annotations

import os
import threading

import pytest

from fastelbo.harness.guard import handoff


def test_a_new_file_never_writes_through_what_is_there(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"reference")
    made = handoff.write_new(tmp_path, "init.pt", b"weights")
    assert made.parent == tmp_path and made.name.startswith("init.") and made.suffix == ".pt"
    umask = os.umask(0)
    os.umask(umask)
    assert made.read_bytes() == b"weights" and made.stat().st_mode & 0o777 == 0o666 & ~umask
    assert handoff.write_new(tmp_path, "init.pt", b"w") != made  # a new name each time
    # Were the name guessed, the link planted there is refused, not followed.
    monkeypatch.setattr(handoff.secrets, "token_hex", lambda n: "guessed")
    (tmp_path / "init.guessed.pt").symlink_to(victim)
    with pytest.raises(FileExistsError):
        handoff.write_new(tmp_path, "init.pt", b"weights")
    assert victim.read_bytes() == b"reference"


def test_a_copy_holds_the_source(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(3 << 20))
    made = handoff.write_new(tmp_path / ".", "regime0.inputs.pt", source=source)
    assert made.read_bytes() == source.read_bytes() and made.name.endswith(".inputs.pt")


def test_only_a_plain_file_of_the_directory_is_read(tmp_path):
    worker, elsewhere = tmp_path / "worker", tmp_path / "reference"
    worker.mkdir()
    elsewhere.mkdir()
    secret = elsewhere / "answers.pt"
    secret.write_bytes(b"answers")
    plain = worker / "partial1.pt"
    plain.write_bytes(b"result")
    with handoff.open_regular(plain, worker) as f:
        assert f.read() == b"result"
    (worker / "link.pt").symlink_to(secret)
    os.link(secret, worker / "hard.pt")
    os.mkfifo(worker / "partial.fifo")
    (worker / "sub").symlink_to(elsewhere, target_is_directory=True)
    refused = {"link.pt": "cannot be opened", "hard.pt": "other links",
               "partial.fifo": "not a file", "sub/answers.pt": "not a file of the worker's"}
    for name, why in refused.items():
        with pytest.raises(handoff.NotAHandoff, match=why):
            handoff.open_regular(worker / name, worker)
    with pytest.raises(handoff.NotAHandoff, match="not a file of the worker's"):
        handoff.open_regular(secret, worker)


def test_a_fifo_does_not_block_the_reader(tmp_path):
    os.mkfifo(tmp_path / "partial.fifo")
    done = threading.Event()

    def read():
        with pytest.raises(handoff.NotAHandoff):
            handoff.open_regular(tmp_path / "partial.fifo", tmp_path)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(60), "open_regular blocked on a FIFO"


def test_the_tail_reads_the_end_of_a_plain_file_only(tmp_path):
    log = tmp_path / "output.log"
    log.write_text("x" * 100_000 + "the end")
    assert handoff.tail(log, tmp_path, 7) == "the end"
    secret = tmp_path / "secret"
    secret.write_text("answers")
    log.unlink()
    log.symlink_to(secret)
    assert handoff.tail(log, tmp_path, 100) == ""


def test_a_forged_error_result_is_read_as_bounded_text(tmp_path):
    """A candidate that impersonates its worker may write {"worker_error": ..., "category": ...}
    of any type and size: the harness keeps short text only (the category ends up in the
    report, the reason in its message)."""
    import torch

    from fastelbo.harness.guard import supervisor
    huge = torch.zeros(1, dtype=torch.int64).expand(10 ** 12)
    for error, category, want in ((huge, ["x"] * 10, ("exception", "a malformed error")),
                                  ("e" * 10 ** 6, "c" * 10 ** 4, ("c" * 40, "e" * 16000))):
        path = tmp_path / "result.pt"
        torch.save({"worker_error": error, "category": category}, path)
        outcome = supervisor.WorkerOutcome(result=None)
        supervisor._read_result(outcome, path, tmp_path)
        assert (outcome.category, outcome.reason) == want


def _archive(path, method: int) -> None:
    """A torch.save archive of 64 MiB of zeros, its records written with zip's `method`."""
    import io
    import zipfile

    import torch
    buf = io.BytesIO()
    torch.save({"pad": torch.zeros(64 << 20, dtype=torch.uint8)}, buf)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            out.writestr(info.filename, src.read(info.filename), compress_type=method)


def test_a_result_is_read_once_and_only_as_stored(tmp_path):
    """What the harness loads from a worker holds no more than the bytes the worker wrote: a
    deflated record (64 MiB from 64 KB here) is refused, and so is a name sent again (each
    load was kept: 2026-12-05, red team, exploit_result_zip_bomb.py grew the check's process
    by 1 GiB from 256 KB)."""
    import zipfile

    from fastelbo.harness.guard.supervisor import _load
    plain, bomb, text = tmp_path / "partial1.pt", tmp_path / "bomb.pt", tmp_path / "text.pt"
    _archive(plain, zipfile.ZIP_STORED)
    _archive(bomb, zipfile.ZIP_DEFLATED)
    assert bomb.stat().st_size < (1 << 20) < plain.stat().st_size
    assert _load(plain, tmp_path)["pad"].numel() == 64 << 20
    with pytest.raises(handoff.NotAHandoff, match="cannot be opened"):
        _load(plain, tmp_path)  # read once: the name is gone
    with pytest.raises(handoff.NotAHandoff, match="is compressed"):
        _load(bomb, tmp_path)
    text.write_bytes(b"not an archive")
    with pytest.raises(handoff.NotAHandoff, match="not an archive"):
        _load(text, tmp_path)
