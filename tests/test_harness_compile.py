"""`fastelbo compile`: errors mapped to candidate lines, import failures exit 2, resources parse."""
from __future__ import annotations

import runpy
from pathlib import Path

from fastelbo.harness.check import compile as compile_mod
from fastelbo.harness.check.compile import (
    CompileReport,
    KernelResources,
    locate,
    map_compiler_errors,
    parse_resource_usage,
    run_compile,
)

CANDIDATES = Path(__file__).parent / "candidates"
INLINE = CANDIDATES / "inline_cuda.py"

# What torch.utils.cpp_extension.load_inline prepends to the inline sources.
CUDA_PRELUDE = "#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n"
CPP_PRELUDE = "#include <torch/extension.h>\n"


def _line_of(text: str) -> int:
    lines = INLINE.read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if text in line)


def _build_dir(tmp_path: Path) -> tuple[Path, Path]:
    ns = runpy.run_path(str(INLINE))
    cu, cpp = tmp_path / "cuda.cu", tmp_path / "main.cpp"
    cu.write_text(CUDA_PRELUDE + ns["cuda_src"])
    cpp.write_text(CPP_PRELUDE + ns["cpp_src"])
    return cu, cpp


def _generated_line(path: Path, text: str) -> int:
    return next(i + 1 for i, line in enumerate(path.read_text().splitlines()) if text in line)


def test_nvcc_error_maps_to_the_candidate_line(tmp_path):
    cu, _ = _build_dir(tmp_path)
    gen = _generated_line(cu, "undefined_offset")
    log = (f"[1/3] nvcc ... -c {cu} -o cuda.cuda.o\nFAILED: cuda.cuda.o\n"
           f'{cu}({gen}): error: identifier "undefined_offset" is undefined\n\n'
           f"1 error detected in the compilation of \"{cu}\".\n")
    (err,) = map_compiler_errors(log, INLINE)
    assert err.candidate_line == _line_of("undefined_offset")
    assert err.generated_line == gen
    assert f"{INLINE}:{err.candidate_line}: error: identifier" in err.format(INLINE)


def test_gcc_error_maps_to_the_candidate_line(tmp_path):
    _, cpp = _build_dir(tmp_path)
    gen = _generated_line(cpp, "missing_symbol")
    log = f"{cpp}:{gen}:40: error: 'missing_symbol' was not declared in this scope\n"
    (err,) = map_compiler_errors(log, INLINE)
    assert err.candidate_line == _line_of("missing_symbol")


def test_repeated_lines_are_told_apart_by_their_context(tmp_path):
    cu, _ = _build_dir(tmp_path)
    generated = cu.read_text().splitlines()
    repeated = "    int i = blockIdx.x * blockDim.x + threadIdx.x;"
    first, second = [i + 1 for i, s in enumerate(generated) if s == repeated]
    cand = INLINE.read_text().splitlines()
    assert locate(generated, second, cand) > locate(generated, first, cand)
    assert locate(generated, second, cand) == _line_of("undefined_offset") - 1


def test_missing_generated_file_keeps_the_generated_location():
    (err,) = map_compiler_errors("/nowhere/cuda.cu(7): error: bad\n", INLINE)
    assert err.candidate_line is None
    assert "/nowhere/cuda.cu:7" in err.format(INLINE)


def test_syntax_error_exits_2_with_file_and_line(syntax_error_candidate):
    report = run_compile(syntax_error_candidate, timeout=60)
    assert report.exit_code == 2
    assert "syntax_error.py:6: SyntaxError" in report.format()


def test_import_error_exits_2_with_file_and_line():
    report = run_compile(CANDIDATES / "import_error.py", timeout=60)
    assert report.exit_code == 2
    assert "import_error.py:2:" in report.format()
    assert "fastelbo_no_such_module" in report.format()


def test_plain_python_candidate_compiles_without_extensions():
    report = run_compile(CANDIDATES / "reference_as_candidate.py", timeout=60)
    assert report.exit_code == 0, report.format()
    assert "no compiled extension" in report.format()


# Extension modules of the standard library (lib-dynload) that torch and the harness do not
# import: a candidate importing them loads a .so it did not build.
STDLIB_EXTENSIONS = ("_statistics", "_zoneinfo", "syslog", "termios", "_testbuffer", "xxlimited")


def test_a_pure_python_candidate_reports_no_extension_of_python_itself(tmp_path, monkeypatch):
    """Python's own extension modules (lib-dynload) that the import loads are not the
    candidate's: no extension listed, and no cuobjdump note about them (cuobjdump hidden)."""
    cand = tmp_path / "stdlib_user.py"
    cand.write_text("".join(f"try:\n    import {m}  # noqa: F401\nexcept ImportError:\n"
                            f"    pass\n" for m in STDLIB_EXTENSIONS)
                    + "from fastelbo.problems import load_problem\n\n"
                      "Model = load_problem('vae_elbo').Model\n\n\n"
                      "class ModelNew(Model):\n    pass\n")
    monkeypatch.setattr(compile_mod, "cuobjdump", lambda: None)
    report = run_compile(cand, timeout=120)
    assert report.exit_code == 0, report.format()
    assert report.extensions == {}, report.extensions
    assert any("lib-dynload" in p for p in report.installed), report.installed  # loaded, apart
    text = report.format()
    assert "no compiled extension" in text and "cuobjdump" not in text, text


def test_a_missing_cuobjdump_is_one_note_not_one_per_extension(monkeypatch):
    monkeypatch.setattr(compile_mod, "cuobjdump", lambda: None)
    libs = ["/b/one.so", "/b/two.so"]
    report = CompileReport("/c/cand.py", exit_code=0,
                           extensions={lib: compile_mod.resource_usage(lib) for lib in libs})
    report.extensions["/b/three.so"] = ([KernelResources("k", 32, 0, 0, 0)], "")
    lines = report.format().splitlines()
    assert [line for line in lines if "cuobjdump" in line] == [
        f"({compile_mod.NO_CUOBJDUMP})"], lines
    assert [line for line in lines if line.endswith(".so:")] == [f"{lib}:" for lib in
                                                                 (*libs, "/b/three.so")]
    assert "  k: 32 registers, 0 B shared, 0 B local (spills), 0 B stack" in lines


def test_parse_cuobjdump_resource_usage():
    text = """
Fatbin elf code:
================
arch = sm_90
code version = [1,7]
host = linux
compile_size = 64bit

Resource usage:
 Common:
  GLOBAL:0
 Function _Z12scale_kernelPKfPfi:
  REG:16 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:540 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z9vae_fusedPKfPfi:
  REG:255 STACK:48 SHARED:16384 LOCAL:48 CONSTANT[0]:400 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    k1, k2 = parse_resource_usage(text)
    assert k1.name.startswith("scale_kernel") and k1.registers == 16
    assert (k2.registers, k2.shared_bytes, k2.local_bytes, k2.stack_bytes) == (255, 16384, 48, 48)


def test_a_listed_library_that_is_a_fifo_is_not_read(tmp_path, monkeypatch):
    """exploit_compile_fifo.py lists a FIFO in /dev/shm as one of its libraries; the compile's
    own process ran cuobjdump on it without a limit and waited forever (a stand-in here, which
    reads the file it is given as cuobjdump does). Only regular files are read, each tool run
    under a limit: the FIFO is noted and the compile ends (red team, 2026-12-05)."""
    import glob
    import os
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as Late

    tool = tmp_path / "cuobjdump"
    tool.write_text('#!/bin/sh\nexec cat "$2" > /dev/null\n')
    tool.chmod(0o755)
    monkeypatch.setattr(compile_mod, "cuobjdump", lambda: str(tool))
    pool = ThreadPoolExecutor(1)
    job = pool.submit(run_compile, CANDIDATES / "exploit_compile_fifo.py", timeout=240)
    try:
        report = job.result(timeout=400)  # loose: it ends in seconds, or never
    except Late:
        report = None
    finally:
        for fifo in glob.glob("/dev/shm/fastelbo-exploit-*.so"):
            os.close(os.open(fifo, os.O_RDWR))  # a writer that leaves: a blocked reader ends
            os.unlink(fifo)
        pool.shutdown(wait=True)
    assert report is not None, "the compile's process was still reading the FIFO"
    assert report.exit_code == 0, report.format()
    notes = [note for _, note in report.extensions.values()]
    assert notes == ["not a regular file: not read"], report.extensions
