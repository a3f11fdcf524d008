"""A static scan of a candidate file: what looks like a way around the harness, reported only.

As KernelBench's kernel_static_checker and GPU MODE's kernelguard do, the candidate's source is
read (never run) and each construct an honest kernel rarely needs is flagged with its line:
threads and processes (affinity and priority too), ctypes, signals, file access and raw file
descriptors, introspection of frames and the garbage collector, audit hooks, edits of
sys.modules, assignments to torch's attributes, kernels registered on torch's own operators,
CUDA streams, imports of the harness's own modules, and a coding cookie naming a codec other
than UTF-8 (the scan reads the text as Python does, by that codec and without a BOM: until
2026-12-05 it read UTF-8, so a `# coding: utf-7` file ran an `import ctypes` that its scan saw
as a comment, and a file that began with a BOM did not parse and had no flag at all).
A flag is
not a verdict (a candidate may use a stream well); it tells a reviewer where to look, and the
confinement (sandbox.py) and the checks of outputs and timers are what reject a cheat.

check reports the flags of the bytes it runs (CheckReport.scan); bench reports them on each of
a candidate's rows (`scan_rows`: `scan`, and a note), read as check reads a candidate.
"""
from __future__ import annotations

import ast
import codecs
import io
import tokenize
from pathlib import Path

# module imported -> category
_MODULES = {
    "threading": "threads", "_thread": "threads", "concurrent": "threads",
    "multiprocessing": "processes", "subprocess": "processes", "pty": "processes",
    "ctypes": "ctypes", "cffi": "ctypes", "signal": "signal", "gc": "introspection",
    "inspect": "introspection", "socket": "network", "pickle": "pickle", "shutil": "file_access",
    "glob": "file_access", "tempfile": "file_access", "mmap": "file_access",
}
# a builtin called by its bare name -> category
_BUILTINS = {"open": "file_access", "exec": "dynamic_code", "eval": "dynamic_code",
             "compile": "dynamic_code", "__import__": "dynamic_code", "globals": "introspection",
             "setattr": "attribute_patch", "delattr": "attribute_patch"}
# a called attribute (its last two dotted parts, or its last) -> category
_CALLS = {
    "Path.open": "file_access", "read_text": "file_access",
    "read_bytes": "file_access", "listdir": "file_access", "scandir": "file_access",
    "walk": "file_access", "rglob": "file_access", "iterdir": "file_access",
    "torch.load": "file_access", "os.fork": "processes", "os.system": "processes",
    "os.popen": "processes", "os.kill": "signal", "os.setsid": "processes",
    "os.execv": "processes", "os.execvp": "processes", "os._exit": "processes",
    "os.write": "file_descriptors", "os.fdopen": "file_descriptors", "os.dup": "file_descriptors",
    "os.dup2": "file_descriptors", "os.open": "file_access",
    "sys._getframe": "introspection", "sys.settrace": "introspection",
    "sys.setprofile": "introspection", "sys.addaudithook": "hooks",
    "os.sched_setaffinity": "processes", "os.setpriority": "processes",
    "cuda.Stream": "streams", "cuda.stream": "streams", "torch.cuda.Stream": "streams",
    "Stream": "streams", "set_stream": "streams", "cuda.set_stream": "streams",
}
_ATTRS = {"f_back": "introspection", "f_globals": "introspection", "f_locals": "introspection",
          "gi_frame": "introspection", "tb_frame": "introspection", "__code__": "introspection",
          "modules": "sys_modules"}
# flags listed in a report; a last one counts the rest (a source of 400,000 `import gc` lines
# made a report of 30 MB)
MAX_FLAGS = 100
# the harness's own modules: the worker that times a candidate runs them in its process, and
# its result channel is a file descriptor there (what a candidate would impersonate)
_HARNESS = "fastelbo.harness"
# torch.library's registrations (Library, impl, register_kernel, ...) on torch's own operators:
# a kernel of the candidate's would run inside the harness's own torch calls (an op of its own
# namespace is fine)
_REGISTRATIONS = {"Library", "impl", "register_kernel", "register_fake", "register_autograd",
                  "_impl", "fallthrough_kernel"}
_TORCH_OPS = ("aten", "prim", "prims")
# what a torch attribute assignment may legitimately set: numerics switches
_TORCH_SETTINGS = ("torch.backends.", "torch._inductor.config", "torch._dynamo.config")


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    elif isinstance(node, ast.Call):
        parts.append(_dotted(node.func) + "()")
    return ".".join(reversed(parts))


def python_text(text: str) -> tuple[str, str | None]:
    """`text` as Python runs it, and the codec its coding cookie names where that is not UTF-8
    (else None). Python decodes a file's bytes by its cookie, and parsing a str ignores the
    cookie: text read as UTF-8 is re-read by that codec (its bytes are ASCII where UTF-7 or
    another codec hides code in a comment; where they are not, Python's text may differ)."""
    data = text.encode("utf-8", "surrogateescape")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:  # a codec Python does not know: it refuses the file (the check says so)
        return text, None
    if encoding == "utf-8-sig":  # a BOM: Python drops it, and a str holding it does not parse
        return text.removeprefix("\ufeff"), None
    if codecs.lookup(encoding).name == "utf-8":
        return text, None
    try:
        return data.decode(encoding), encoding
    except (UnicodeDecodeError, LookupError):
        return text, encoding


def scan_source(text: str) -> list[dict]:
    """Flags of `text` as Python reads it (python_text): [{line, category, text}], in line
    order, the first MAX_FLAGS and, past them, one of category `more_flags` counting the
    rest; [] if it does not parse."""
    text, codec = python_text(text)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    flags: list[tuple[int, str]] = []
    if codec is not None:  # the cookie is on line 1, or on line 2 below a comment
        flags.append((1 if "coding" in (lines[:1] or [""])[0] else 2, "source_encoding"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            flags += [(node.lineno, _MODULES[a.name.split(".")[0]]) for a in node.names
                      if a.name.split(".")[0] in _MODULES]
            flags += [(node.lineno, "harness_internals") for a in node.names
                      if a.name.startswith(_HARNESS)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if node.module.startswith(_HARNESS) or (node.module == "fastelbo" and any(
                    a.name == "harness" for a in node.names)):
                flags.append((node.lineno, "harness_internals"))
            if top in _MODULES:
                flags.append((node.lineno, _MODULES[top]))
            elif top == "sys" and any(a.name == "modules" for a in node.names):
                flags.append((node.lineno, "sys_modules"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in _BUILTINS:
                flags.append((node.lineno, _BUILTINS[node.func.id]))
        elif isinstance(node, ast.Call):  # a method or module function: torch.compile is none
            name = _dotted(node.func)
            for key in (name, ".".join(name.split(".")[-2:]), name.split(".")[-1]):
                if key in _CALLS:
                    flags.append((node.lineno, _CALLS[key]))
                    break
            first = node.args[0] if node.args else None
            if (name.split(".")[-1] in _REGISTRATIONS and isinstance(first, ast.Constant)
                    and isinstance(first.value, str) and first.value.startswith(_TORCH_OPS)):
                flags.append((node.lineno, "operator_override"))
        elif isinstance(node, ast.Attribute) and node.attr in _ATTRS:
            owner = _dotted(node.value)
            if node.attr != "modules" or owner == "sys":
                flags.append((node.lineno, _ATTRS[node.attr]))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                name = _dotted(t) if isinstance(t, (ast.Attribute, ast.Subscript)) else ""
                if isinstance(t, ast.Subscript):
                    name = _dotted(t.value)
                if name.startswith(("torch.", "time.", "sys.modules", "builtins.", "os.")) \
                        and not name.startswith(_TORCH_SETTINGS):
                    flags.append((t.lineno, "attribute_patch"))
    found = sorted(set(flags))
    out = [{"line": line, "category": category,
            "text": lines[line - 1].strip()[:120] if line <= len(lines) else ""}
           for line, category in found[:MAX_FLAGS]]
    if len(found) > MAX_FLAGS:
        out.append({"line": found[MAX_FLAGS][0], "category": "more_flags",
                    "text": f"{len(found) - MAX_FLAGS} more flag(s) from this line on"})
    return out


def summary(flags: list[dict]) -> str:
    """One line for a report: how many flags, and the first six's lines and categories."""
    return f"scan (reported, not judged): {len(flags)} flag(s): " + "; ".join(
        f"line {f['line']} {f['category']}" for f in flags[:6])


def scan_rows(rows: list[dict], paths: dict[str, str]) -> None:
    """bench's rows of each candidate in `paths` {row label: its file} get the file's scan:
    `scan` (its flags, [] for none) and, where it has flags, a note (`summary`). Each file is
    read once, as check reads a candidate (files.read_source: at most MAX_SOURCE_BYTES; one
    that cannot be read or does not parse has no flags, as in check, which runs none)."""
    from ..files import read_source
    flags = {}
    for label, path in paths.items():
        source, bad = read_source(path)
        flags[label] = scan_source(source.decode(errors="replace")) if bad is None else []
    for row in rows:
        found = flags.get(row.get("candidate"))
        if found is not None:
            row["scan"] = found
            if found:
                row.setdefault("notes", []).append(summary(found))


def scan_file(path: str | Path) -> list[dict]:
    try:
        return scan_source(Path(path).read_text(errors="replace"))
    except OSError:
        return []
