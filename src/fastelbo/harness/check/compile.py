"""`fastelbo compile`: import a candidate in a worker; errors at candidate lines, or resources.

torch.utils.cpp_extension.load_inline writes the inline sources into a build directory
(main.cpp, cuda.cu) after a few #include lines of its own, so compiler errors name lines of
those generated files. We map them back by locating the generated line in the candidate file,
using the surrounding lines to pick among repeats. On success we list registers, shared memory
and spills per kernel of each extension the candidate built or loaded (not the modules of Python
or of its installed packages), read with `cuobjdump`.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..files import candidate_path, read_source
from ..guard import sandbox
from ..guard.supervisor import Worker, WorkerPool
from ..task_specs import import_only

# nvcc: "/x/cuda.cu(12): error: ..."; gcc/clang: "/x/main.cpp:12:5: error: ..."
_ERROR_LINE = re.compile(r"(?P<file>[^\s:()\"']+\.(?:cu|cpp|cc|cuh|h))"
                         r"(?:\((?P<l1>\d+)\)|:(?P<l2>\d+)(?::\d+)?):\s*(?P<msg>.*)")
CONTEXT = 3  # lines either side used to disambiguate repeated lines


@dataclass
class MappedError:
    generated: str        # generated file as the compiler named it
    generated_line: int
    message: str
    candidate_line: int | None   # None when the line could not be located in the candidate

    def format(self, candidate: Path) -> str:
        where = (f"{candidate}:{self.candidate_line}" if self.candidate_line
                 else f"{self.generated}:{self.generated_line} (not found in {candidate.name})")
        return f"{where}: {self.message}"


def _norm(line: str) -> str:
    return " ".join(line.split())


def locate(generated: list[str], line: int, candidate: list[str]) -> int | None:
    """1-based candidate line holding generated line `line`, chosen by the best-matching context.

    The text must match exactly (whitespace-normalised) and be non-empty; among repeats the one
    whose neighbours agree with the generated file's neighbours wins.
    """
    if not 1 <= line <= len(generated) or not _norm(generated[line - 1]):
        return None
    target = _norm(generated[line - 1])
    best, best_score = None, -1
    for i, text in enumerate(candidate):
        if _norm(text) != target:
            continue
        score = sum(1 for k in range(-CONTEXT, CONTEXT + 1)
                    if 0 <= line - 1 + k < len(generated) and 0 <= i + k < len(candidate)
                    and _norm(generated[line - 1 + k]) == _norm(candidate[i + k]))
        if score > best_score:
            best, best_score = i + 1, score
    return best


def map_compiler_errors(text: str, candidate: Path) -> list[MappedError]:
    """Every `file(line)` / `file:line:` diagnostic in `text`, mapped to the candidate file."""
    cand_lines = Path(candidate).read_text().splitlines()
    cache: dict[str, list[str] | None] = {}
    out, seen = [], set()
    for raw in text.splitlines():
        m = _ERROR_LINE.search(raw)
        if not m or not re.search(r"\b(error|warning)\b", m["msg"]):
            continue
        gen, line = m["file"], int(m["l1"] or m["l2"])
        if (gen, line, m["msg"]) in seen:
            continue
        seen.add((gen, line, m["msg"]))
        if gen not in cache:
            p = Path(gen)
            cache[gen] = p.read_text(errors="replace").splitlines() if p.is_file() else None
        where = locate(cache[gen], line, cand_lines) if cache[gen] is not None else None
        out.append(MappedError(gen, line, m["msg"].strip(), where))
    return out


@dataclass
class KernelResources:
    name: str
    registers: int | None
    shared_bytes: int | None
    local_bytes: int | None   # spills and stack live in local memory
    stack_bytes: int | None


def parse_resource_usage(text: str) -> list[KernelResources]:
    """Parse `cuobjdump --dump-resource-usage` output (one REG/SHARED/LOCAL line per function)."""
    kernels, name = [], None
    for line in text.splitlines():
        m = re.search(r"Function\s+([^\s:]+)\s*:", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            vals = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
            kernels.append(KernelResources(name, vals.get("REG"), vals.get("SHARED"),
                                           vals.get("LOCAL"), vals.get("STACK")))
            name = None
    for kernel, plain in zip(kernels, _demangle([k.name for k in kernels])):
        kernel.name = plain
    return kernels


def _demangle(names: list[str]) -> list[str]:
    """`names` demangled by one c++filt (one name a line on its stdin), under TOOL_TIMEOUT;
    as they are where it is missing or fails. (A c++filt per kernel: a library of very many
    kernels held the harness's process, red team 2026-12-05.)"""
    if not names or shutil.which("c++filt") is None:
        return names
    try:
        res = subprocess.run(["c++filt"], input="\n".join(names) + "\n", capture_output=True,
                             text=True, check=False, timeout=TOOL_TIMEOUT)
    except subprocess.TimeoutExpired:
        return names
    plain = res.stdout.splitlines()
    return [p.strip() or n for p, n in zip(plain, names)] if len(plain) == len(names) else names


NO_CUOBJDUMP = "cuobjdump not found on PATH: resource usage unavailable"
# The libraries a candidate's worker lists are the candidate's to shape (a module's __file__,
# any file under its build root): this process reads at most MAX_LIBRARIES of them, regular
# files only, each tool run within TOOL_TIMEOUT. A FIFO listed so held `fastelbo compile`, and
# a session's job lock with it, forever (red team 2026-12-05, exploit_compile_fifo.py).
MAX_LIBRARIES = 64
TOOL_TIMEOUT = 120.0


def cuobjdump() -> str | None:
    return shutil.which("cuobjdump")


def resource_usage(library: str, tool: str | None = None) -> tuple[list[KernelResources], str]:
    """(kernels, note); the note says why nothing could be read. `tool`: cuobjdump's path
    (default: looked up on PATH)."""
    tool = tool or cuobjdump()
    if tool is None:
        return [], NO_CUOBJDUMP
    try:
        regular = stat.S_ISREG(os.stat(library).st_mode)
    except OSError as exc:
        return [], f"cannot be read: {exc.strerror}"
    if not regular:  # a FIFO would hold cuobjdump (and this process) forever
        return [], "not a regular file: not read"
    try:
        res = subprocess.run([tool, "--dump-resource-usage", library], capture_output=True,
                             text=True, check=False, timeout=TOOL_TIMEOUT)
    except subprocess.TimeoutExpired:
        return [], f"cuobjdump did not finish within {TOOL_TIMEOUT:g} s"
    if res.returncode != 0:
        return [], f"cuobjdump failed: {res.stderr.strip()[-300:]}"
    kernels = parse_resource_usage(res.stdout)
    return kernels, "" if kernels else "no device kernels in this library"


@dataclass
class CompileReport:
    candidate: str
    exit_code: int = 2
    reason: str = ""
    errors: list[MappedError] = field(default_factory=list)
    extensions: dict[str, tuple[list[KernelResources], str]] = field(default_factory=dict)
    # extensions of Python and its installed packages the import loaded too (not inspected)
    installed: list[str] = field(default_factory=list)
    output_tail: str = ""
    unread: int = 0  # extensions the worker listed past MAX_LIBRARIES: counted, not read

    def format(self) -> str:
        if self.exit_code:
            lines = [f"compile {self.candidate}: FAILED"]
            lines += [e.format(Path(self.candidate)) for e in self.errors]
            lines.append(self.reason)
            return "\n".join(lines)
        lines = [f"compile {self.candidate}: OK"]
        if not self.extensions:
            lines.append("no compiled extension loaded by the import (JIT kernels, e.g. Triton, "
                         "compile on first call)")
        for lib, (kernels, note) in self.extensions.items():
            lines.append(f"{lib}:")
            if note and note != NO_CUOBJDUMP:  # that one is said once, below
                lines.append(f"  {note}")
            for k in kernels:
                lines.append(f"  {k.name}: {k.registers} registers, {k.shared_bytes} B shared, "
                             f"{k.local_bytes} B local (spills), {k.stack_bytes} B stack")
        if self.unread:
            lines.append(f"({self.unread} more extensions listed, not read: at most "
                         f"{MAX_LIBRARIES} are)")
        if any(note == NO_CUOBJDUMP for _, note in self.extensions.values()):
            lines.append(f"({NO_CUOBJDUMP})")
        return "\n".join(lines)


def run_compile(candidate: str | Path, timeout: float = 600.0,
                pool: WorkerPool | None = None) -> CompileReport:
    """Exit code 0 when the candidate imports (and builds), 2 otherwise, with the reason.
    `pool`: take the worker from there (and refill it once done) instead of starting one."""
    report = CompileReport(str(candidate))
    try:
        path = candidate_path(candidate)
    except FileNotFoundError as exc:
        report.reason = str(exc)
        return report
    report.candidate = str(path)
    source, bad = read_source(path)  # read once: parsed, and what the worker must find there
    if bad is not None:  # no worker needed to say so
        report.reason = bad
        return report
    # the candidate's import runs confined, as in a check (as the pool's spares are)
    confine = pool.confine if pool is not None and pool.confine else \
        sandbox.for_candidates(reads=[path])
    worker = pool.take(confine) if pool is not None else Worker(confine=confine)
    try:
        outcome = worker.run(import_only, {"candidate": str(path),
                                               "sha256": hashlib.sha256(source).hexdigest()},
                             timeout=timeout)
    finally:
        worker.close()
        if pool is not None:
            pool.fill()
    report.output_tail = outcome.output_tail
    if not outcome.ok:
        report.reason = outcome.reason
        report.errors = map_compiler_errors(outcome.reason + "\n" + outcome.output_tail, path)
        return report
    report.exit_code = 0
    report.installed = outcome.result.get("installed", [])
    tool = cuobjdump()  # looked up once: without it, one note for every extension
    listed = outcome.result.get("extensions")
    listed = listed if type(listed) is list else []
    report.unread = max(len(listed) - MAX_LIBRARIES, 0)
    for lib in listed[:MAX_LIBRARIES]:
        if type(lib) is str:
            report.extensions[lib] = resource_usage(lib, tool) if tool else ([], NO_CUOBJDUMP)
    return report
