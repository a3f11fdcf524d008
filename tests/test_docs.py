"""The docs stay a house a newcomer can find their way in: short, linked, and complete where a
reader looks something up (issue 53).

- README.md at most README_LINES lines of at most LINE_CHARS characters, benchmarks/PERF.md at
  most PERF_LINES (a record, not a log: history lives in git and benchmarks/results/);
- every relative link in README.md, docs/*.md and benchmarks/{README,PERF}.md reaches a file (and,
  into a Markdown file, a heading of it);
- every exploit candidate (tests/candidates/exploit_*.py) is named in docs/threat-model.md;
- the commands README.md shows are ones the CLI and dev.sh accept.
No torch: parsing the command line imports none.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README, PERF = ROOT / "README.md", ROOT / "benchmarks" / "PERF.md"
THREAT_MODEL = DOCS / "threat-model.md"
README_LINES, PERF_LINES, LINE_CHARS = 170, 250, 100

# [text](target), not an image's ![..](..) nor a link inside `code`
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), PERF, ROOT / "benchmarks" / "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown text's headings (outside fenced code)."""
    out, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """The relative links of `page` (its `text`, default its file's) that reach no file, or no
    heading of the Markdown file they name."""
    text = page.read_text() if text is None else text
    bad = []
    for line in text.splitlines():
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
                bad.append(f"{page.name}: {target} (no such heading)")
    return bad


def unnamed_exploits(text: str) -> list[str]:
    return [p.name for p in sorted((ROOT / "tests" / "candidates").glob("exploit_*.py"))
            if p.name not in text]


def test_readme_and_perf_stay_short():
    readme = README.read_text().splitlines()
    assert len(readme) <= README_LINES, f"README.md has {len(readme)} lines"
    long = [i + 1 for i, line in enumerate(readme) if len(line) > LINE_CHARS]
    assert not long, f"README.md lines over {LINE_CHARS} characters: {long}"
    perf = len(PERF.read_text().splitlines())
    assert perf <= PERF_LINES, f"benchmarks/PERF.md has {perf} lines: a record, not a log"


def test_every_relative_link_reaches_a_file():
    assert (DOCS / "check.md").exists() and len(_pages()) > 1
    bad = [b for page in _pages() for b in broken_links(page)]
    assert not bad, bad


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page.write_text("[ok](there.md) [ok](there.md#a-heading-with-code) [web](https://x.y/z)\n"
                    "`[in code](nowhere.md)` [self](#own) [gone](nowhere.md) "
                    "[bad](there.md#no-such)\n## Own\n")
    assert broken_links(page) == ["page.md: nowhere.md (no such file)",
                                  "page.md: there.md#no-such (no such heading)"]


def test_every_exploit_is_named_in_the_threat_model():
    text = THREAT_MODEL.read_text()
    assert "exploit_reads_cache.py" in text
    missing = unnamed_exploits(text)
    assert not missing, f"exploit candidates docs/threat-model.md does not name: {missing}"
    assert unnamed_exploits("")  # the corpus is there to be named


def shown_commands(text: str) -> list[str]:
    """The command lines of a Markdown text's code blocks (indented or fenced), comments cut."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            cmd = line.split("#", 1)[0].strip()
            if re.match(r"(\S*/)?fastelbo |\./dev\.sh ", cmd):
                out.append(cmd)
    return out


def refused(commands: list[str]) -> list[str]:
    """Those of `commands` that dev.sh or fastelbo's command line would refuse, with why."""
    from fastelbo.cli import build_parser
    cases = set(re.findall(r"^\s+(\w+)\)", (ROOT / "dev.sh").read_text(), re.MULTILINE))
    bad = []
    for cmd in commands:
        argv = shlex.split(cmd)
        if argv[0] == "./dev.sh":
            if len(argv) < 2 or argv[1] not in cases:
                bad.append(f"{cmd} (dev.sh takes {sorted(cases)})")
            continue
        try:
            build_parser().parse_args(argv[1:])
        except Exception as exc:  # noqa: BLE001 - argparse's complaint, raised (fastelbo.cli)
            bad.append(f"{cmd} ({exc})")
    return bad


def test_readme_shows_commands_that_are_accepted():
    commands = shown_commands(README.read_text())
    assert {c.split()[1] for c in commands if c.startswith("./dev.sh")} == {"demo", "test"}
    assert any(" check " in c for c in commands) and any(" train " in c for c in commands)
    assert not refused(commands), refused(commands)


def test_a_command_that_would_be_refused_is_found():
    text = ("    ./dev.sh lint\n    .venv/bin/fastelbo check vae_elbo x.py --frobnicate  # no\n"
            "```\nfastelbo bench vae_elbo --batch-sizes 1\n```\n")
    assert [c.split(" (")[0] for c in refused(shown_commands(text))] == [
        "./dev.sh lint", ".venv/bin/fastelbo check vae_elbo x.py --frobnicate"]
