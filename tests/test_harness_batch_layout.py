"""harness.batch.layout: KernelBench's run layout and the manifest, as pairs; a malformed name
costs one line and the rest goes on; only an unreadable run raises."""
from __future__ import annotations

from pathlib import Path

import pytest

from fastelbo.harness.batch.layout import LayoutError, Pair, parse_ranges, read_run
from fastelbo.problems import BUILTIN


def _touch(path: Path, text: str = "x = 1\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def kb(tmp_path):
    """A KernelBench-style level: problems 1, 2, 19 (and a stray file), a run's samples."""
    probs, run = tmp_path / "level1", tmp_path / "runs" / "r"
    for name in ("1_Square_matrix_multiplication_.py", "2_Standard.py", "19_ReLU.py",
                 "README.md", "notes.py"):
        _touch(probs / name)
    for pid, sid in ((1, 0), (1, 1), (2, 0), (19, 0), (19, 3), (7, 0)):
        _touch(run / f"level_1_problem_{pid}_sample_{sid}_kernel.py")
    _touch(run / "eval_results.json", "{}")
    _touch(run / "level_1_problem_x_sample_0_kernel.py")  # malformed
    _touch(run / "helper.py")  # malformed
    return probs, run


def _ids(pairs: list[Pair]) -> list[tuple[int, int]]:
    return [(p.problem_id, p.sample_id) for p in pairs]


def test_kernelbench_layout_pairs_each_sample_with_its_problem(kb):
    probs, run = kb
    lines = []
    pairs = read_run(run, probs, warn=lines.append)
    assert _ids(pairs) == [(1, 0), (1, 1), (2, 0), (19, 0), (19, 3)]
    assert pairs[3].problem == (probs / "19_ReLU.py").resolve()
    assert pairs[3].candidate.name == "level_1_problem_19_sample_0_kernel.py"
    assert {p.level for p in pairs} == {1}
    # one line per thing left out, the rest judged: two malformed names, a sample whose
    # problem (7) is not in the level; eval_results.json and the README are not samples
    assert len(lines) == 3, lines
    assert sum("not a sample's name" in line for line in lines) == 2
    assert any("level_1_problem_7_sample_0_kernel.py: no problem 7_<Name>.py" in line
               for line in lines)


def test_filters_sort_and_limit(kb):
    probs, run = kb
    quiet = [].append
    assert _ids(read_run(run, probs, problems=parse_ranges("1-2", "--problems"),
                         warn=quiet)) == [(1, 0), (1, 1), (2, 0)]
    assert _ids(read_run(run, probs, samples=parse_ranges("1-3", "--samples"),
                         warn=quiet)) == [(1, 1), (19, 3)]
    assert _ids(read_run(run, probs, problems=parse_ranges("19,1", "--problems"), limit=2,
                         warn=quiet)) == [(1, 0), (1, 1)]


def test_a_problem_id_two_files_claim_is_left_out_with_one_line(kb):
    probs, run = kb
    _touch(probs / "2_Another.py")
    lines = []
    pairs = read_run(run, probs, warn=lines.append)
    assert (2, 0) not in _ids(pairs) and (1, 0) in _ids(pairs)
    assert any("skipping problem 2: 2 files claim it" in line for line in lines)


def test_several_levels_need_a_choice(kb):
    probs, run = kb
    _touch(run / "level_2_problem_1_sample_0_kernel.py")
    with pytest.raises(LayoutError, match="levels 1, 2: choose one"):
        read_run(run, probs, warn=[].append)
    assert _ids(read_run(run, probs, level=2, warn=[].append)) == [(1, 0)]


def test_manifest_lines_relative_paths_comments_and_bad_lines(tmp_path):
    _touch(tmp_path / "p" / "relu.py")
    _touch(tmp_path / "p" / "gemm.py")
    for name in ("a.py", "b.py", "c.py"):
        _touch(tmp_path / "c" / name)
    manifest = _touch(tmp_path / "pairs.csv", "\n".join([
        "problem,candidate", "# a comment", "", "p/relu.py,c/a.py", "p/gemm.py, c/b.py",
        "p/relu.py,c/c.py", "just-one-field", "p/missing.py,c/a.py", "p/relu.py,c/missing.py",
        f"vae_elbo,{tmp_path / 'c' / 'a.py'}"]) + "\n")
    lines = []
    pairs = read_run(manifest, warn=lines.append)
    # problems numbered by first appearance (their names carry no ID), samples by rank
    assert [(p.problem_id, p.sample_id, p.problem.name, p.candidate.name) for p in pairs] == [
        (1, 0, "relu.py", "a.py"), (1, 1, "relu.py", "c.py"), (2, 0, "gemm.py", "b.py"),
        (3, 0, "vae_elbo.py", "a.py")]
    assert pairs[3].problem == BUILTIN["vae_elbo"].resolve()
    assert len(lines) == 3 and all(line.startswith(f"{manifest}:") for line in lines), lines
    assert ":7: skipping: not a `problem,candidate` line" in lines[0]


def test_manifest_keeps_kernelbench_ids_where_the_names_carry_them(tmp_path):
    _touch(tmp_path / "19_ReLU.py")
    _touch(tmp_path / "1_Matmul.py")
    for n in ("level_1_problem_19_sample_4_kernel.py", "level_1_problem_1_sample_2_kernel.py"):
        _touch(tmp_path / n)
    manifest = _touch(tmp_path / "m.txt", "19_ReLU.py,level_1_problem_19_sample_4_kernel.py\n"
                                          "1_Matmul.py,level_1_problem_1_sample_2_kernel.py\n")
    assert _ids(read_run(manifest)) == [(1, 2), (19, 4)]


def test_a_run_that_cannot_be_read_raises(tmp_path, kb):
    probs, run = kb
    with pytest.raises(LayoutError, match="give the directory of its problems"):
        read_run(run)
    with pytest.raises(LayoutError, match="neither a directory of samples nor a manifest"):
        read_run(tmp_path / "nowhere")
    with pytest.raises(LayoutError, match="is not a directory"):
        read_run(run, tmp_path / "nowhere")
    manifest = _touch(tmp_path / "m.csv", "a,b\n")
    with pytest.raises(LayoutError, match="give no problem directory"):
        read_run(manifest, probs)


@pytest.mark.parametrize("text, want", [("1-20", ((1, 20),)), ("3", ((3, 3),)),
                                        ("1-2, 5 ,9-9", ((1, 2), (5, 5), (9, 9)))])
def test_ranges(text, want):
    assert parse_ranges(text, "--problems") == want


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-2", "1,,2", "1-2-3"])
def test_bad_ranges_name_the_option(text):
    with pytest.raises(LayoutError, match="--samples takes IDs and ranges like 1-20,25"):
        parse_ranges(text, "--samples")
