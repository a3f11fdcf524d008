"""Files passed between the harness and a worker's scratch directory, which the candidate's code
can write: the harness never writes through, nor reads from, anything there but a regular file
it names itself. Imports no torch.

Why (found on 2026-12-05, on the CPU under Landlock): a candidate may put a symbolic link, a
hard link or a FIFO where the harness is about to write or read. A link named `init.pt` made
the check's own copy of the weights overwrite a reference entry it had memory-mapped, so the
judge compared the candidate's outputs with bytes the candidate chose, and passed them; a FIFO
named in a result message blocked the parent's read, and with it every time limit. So:

- `write_new` writes a new file under a name no one can guess in advance (O_CREAT | O_EXCL,
  which fails on any existing entry and follows no link);
- `open_regular` opens only a regular file with one link, directly inside the directory it
  must be in, without following a link or blocking on a FIFO or device.
- `open_result` opens a worker's result so (a torch.save archive) once: it takes the file away
  as it opens it, and refuses an archive with a record that is not stored as it is. On
  2026-12-05 (red team) a candidate named one deflated archive of 256 KB four times on its
  worker's channel, and the check's process, which loaded each and kept them, grew by 1 GiB
  (a factor of the candidate's choosing); now the harness holds at most the bytes written.
"""
from __future__ import annotations

import os
import secrets
import shutil
import stat
import zipfile
from pathlib import Path

_CHUNK = 1 << 20


def write_new(directory: str | Path, name: str, data: bytes | None = None, *,
              source: str | Path | None = None) -> Path:
    """A new file in `directory` named `<stem>.<random>.<suffix>` (from `name`) holding `data`
    or a copy of the file `source` (the harness's own, read as it is); its path."""
    stem, dot, suffix = name.partition(".")
    path = Path(directory) / f"{stem}.{secrets.token_hex(8)}{dot}{suffix}"
    # the mode open() gives a new file (umask applied), as before: a worker that runs as
    # another user (sandbox's `user` kind) reads what the harness hands it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o666)
    with os.fdopen(fd, "wb") as out:
        if source is not None:
            with open(source, "rb") as src:
                shutil.copyfileobj(src, out, _CHUNK)
        if data is not None:
            out.write(data)
    return path


class NotAHandoff(OSError):
    """What a worker named is not a plain file of its own directory."""


def open_regular(path: str | Path, within: str | Path):
    """`path` opened for binary reading where it is a regular file with a single link directly
    inside `within` (not a link, FIFO, device or directory); NotAHandoff otherwise."""
    path = Path(path)
    if path.parent != Path(within) or path.name in ("", ".", ".."):
        raise NotAHandoff(f"{path} is not a file of the worker's own directory {within}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:  # ELOOP: a symbolic link
        raise NotAHandoff(f"{path} cannot be opened as a plain file: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        kind = "a regular file with other links" if stat.S_ISREG(st.st_mode) else "not a file"
        raise NotAHandoff(f"{path} is {kind}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def open_result(path: str | Path, within: str | Path):
    """`path` as `open_regular` opens it, where it is a zip archive (what torch.save writes)
    whose every record is stored as it is (never compressed) within the file's own size, so
    that loading it takes no more memory than the file holds; the file is unlinked as it is
    opened (read once: a name sent twice is not there the second time). NotAHandoff otherwise.
    """
    f = open_regular(path, within)
    try:
        os.unlink(path)  # the open file stays readable; the name is gone
        size = os.fstat(f.fileno()).st_size
        with zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
        stored = sum(i.file_size for i in infos)
        bad = next((i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED
                    or i.compress_size != i.file_size), None)
        if bad is not None or stored > size:
            what = f"its record {bad!r} is compressed" if bad is not None else \
                f"its records claim {stored} bytes, more than its {size}"
            raise NotAHandoff(f"{path} is not an archive as torch.save writes it ({what})")
        f.seek(0)
        return f
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
        f.close()
        if isinstance(exc, NotAHandoff):
            raise
        raise NotAHandoff(f"{path} is not an archive as torch.save writes it "
                          f"({type(exc).__name__}: {exc})") from None


def tail(path: str | Path, within: str | Path, chars: int) -> str:
    """The last `chars` characters (about) of the regular file `path` in `within`; "" where it
    is not one (open_regular) or cannot be read."""
    try:
        with open_regular(path, within) as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 4 * chars))  # UTF-8: at most 4 bytes a character
            return f.read().decode(errors="replace")[-chars:]
    except OSError:
        return ""
