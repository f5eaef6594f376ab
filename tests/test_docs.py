"""The docs stay true: the MkDocs site builds with --strict, the README stays one page, and
every relative link in README.md and docs/ points at a file that exists.

`mkdocs build --strict` fails on a broken link or anchor between pages, a page missing from
the nav, a link out of docs/ to a file that does not exist (docs/hooks.py) and a module the
API reference cannot load; mkdocs is a dev dependency, so `make test` always runs it.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def mkdocs_command() -> list[str] | None:
    """mkdocs next to this interpreter (a venv's bin/), else `python -m mkdocs`; None if absent."""
    if importlib.util.find_spec("mkdocs") is None:
        return None
    script = Path(sys.executable).parent / ("mkdocs.exe" if os.name == "nt" else "mkdocs")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "mkdocs"]


def test_mkdocs_build_strict(tmp_path):
    command = mkdocs_command()
    if command is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]' or '.[docs]'; make test does)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true")
    site = tmp_path / "site"
    proc = subprocess.run(command + ["build", "--strict", "--site-dir", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (exit {proc.returncode}):\n{output}"
    assert (site / "index.html").is_file(), output
    # the API reference is generated: at least the package page and the codec's
    assert (site / "reference" / "kvwire" / "index.html").is_file(), output
    assert (site / "reference" / "kvwire" / "codec" / "index.html").is_file() or any(
        site.joinpath("reference").rglob("codec/index.html")), output
    shutil.rmtree(site, ignore_errors=True)


def test_readme_is_one_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the detail to a page of docs/")
    # the first lines are the set-up-and-run and the set-up-and-test commands
    commands = [line for line in lines[:6] if line.startswith("make ")]
    assert [c.split()[1] for c in commands] == ["demo", "test"], lines[:6]


def relative_links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file, outside fenced code blocks, anchors removed."""
    targets, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
                continue  # a URL, or an anchor in the same page
            targets.append(target.partition("#")[0])
    return targets


MARKDOWN = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path):
    broken = [t for t in relative_links(path) if not (path.parent / t).exists()]
    assert not broken, f"{path.relative_to(ROOT)} links to files that do not exist: {broken}"
