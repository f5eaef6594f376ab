"""Pages made at build time (mkdocs-gen-files), so none of them is kept by hand.

- ``reference/``: one page per public module of ``src/kvwire`` (walked now, so modules that move
  into subpackages move here too; private ``_*.py`` files and Python files in data folders are
  skipped, ``__init__`` is the package's page), rendered from the docstrings by mkdocstrings, and ``reference/SUMMARY.md``,
  the nav that mkdocs-literate-nav reads for them.
- ``index.md`` and ``benchmarks.md``: the repository's README.md and BENCHMARKS.md as they are
  (docs/hooks.py maps their links into the site).
- ``benchmarks/results/*.png``: the plots BENCHMARKS.md shows.
"""

from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

nav = mkdocs_gen_files.Nav()
for path in sorted((SRC / "kvwire").rglob("*.py")):
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if any(part.startswith("_") and part != "__init__" for part in parts):
        continue  # private modules (and __main__)
    if not all((SRC.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
        continue  # not importable: a file in a data folder (kvwire/data), not a module
    if parts[-1] == "__init__":
        parts = parts[:-1]
        page = Path("reference", *parts, "index.md")
    else:
        page = Path("reference", *parts).with_suffix(".md")
    name = ".".join(parts)
    nav[tuple(parts)] = page.relative_to("reference").as_posix()
    with mkdocs_gen_files.open(page, "w") as out:
        out.write(f"::: {name}\n")
    mkdocs_gen_files.set_edit_path(page, path.relative_to(ROOT))

with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as out:
    out.writelines(nav.build_literate_nav())

for name, page in (("README.md", "index.md"), ("BENCHMARKS.md", "benchmarks.md")):
    with mkdocs_gen_files.open(page, "w") as out:
        out.write((ROOT / name).read_text(encoding="utf-8"))

for png in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
    with mkdocs_gen_files.open(png.relative_to(ROOT).as_posix(), "wb") as out:
        out.write(png.read_bytes())
