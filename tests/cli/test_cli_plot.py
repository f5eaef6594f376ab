"""kvwire plot: the file it writes is the one it names, and every bad input is one line saying which part is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_cli import assert_one_error_line, kvwire

SPLICE = Path(__file__).parents[2] / "benchmarks" / "results" / "splice-stdlib.json"


def rows() -> list[dict]:
    return json.loads(SPLICE.read_text().strip().splitlines()[-1])["rows"]


def test_plot_prints_the_file_it_wrote_and_no_warnings(tmp_path):
    """--out without a suffix wrote NAME.png but printed NAME; rows of one strategy warned about an empty legend."""
    proc = kvwire("plot", str(SPLICE), "--out", str(tmp_path / "curve"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "curve.png") and (tmp_path / "curve.png").is_file()
    assert not (tmp_path / "curve").exists()
    one = [r for r in rows() if r["strategy"] in ("both", "first-k")]  # the KL panel has no labelled line
    (tmp_path / "one.json").write_text(json.dumps({"rows": one}))
    quiet = kvwire("plot", str(tmp_path / "one.json"), "--out", str(tmp_path / "one.svg"))
    assert quiet.returncode == 0 and "Warning" not in quiet.stderr, quiet.stderr
    assert quiet.stdout.strip() == str(tmp_path / "one.svg") and (tmp_path / "one.svg").is_file()


def test_a_bad_out_is_a_usage_error_about_out_not_the_input(tmp_path):
    (tmp_path / "file").write_text("")
    for out, fragment in ((tmp_path / "curve.txt", "is not a .png, .svg, .pdf file"),
                          (tmp_path / "file" / "curve.png", "a file, not a folder")):
        proc = kvwire("plot", str(SPLICE), "--out", str(out))
        assert proc.returncode == 2 and "--out" in proc.stderr and fragment in proc.stderr, proc.stderr
        assert "not the JSON output" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def _with(change) -> dict:
    payload = {"rows": rows()}
    change(payload["rows"][2])
    return payload


@pytest.mark.parametrize("content, fragments", [
    ("", ["the file is empty"]),
    ("\n\n", ["the file is empty"]),
    ("{not json", ["its last line is not JSON"]),
    ("[1, 2]", ["not a JSON object with 'rows'"]),
    ('{"summary": {}}', ["has no 'rows'", "'summary'"]),
    (_with(lambda r: r.__setitem__("speedup", "fast")), ["row 3", "'speedup' is \"fast\", not a finite number"]),
    (_with(lambda r: r.__setitem__("agreement", None)), ["row 3", "'agreement' is null"]),
    (_with(lambda r: r.__setitem__("kl", float("nan"))), ["row 3", "'kl' is NaN"]),
    (_with(lambda r: r.__setitem__("ttft_speedup", True)), ["'ttft_speedup' is true"]),
    (_with(lambda r: r.pop("recomputed_share")), ["row 3 of 'rows' has no 'recomputed_share'"]),
    ({"rows": [r for r in rows() if r["strategy"] == "both"]}, ["no strategy to draw"]),
])
def test_plot_says_what_in_the_json_is_wrong(tmp_path, content, fragments):
    path = tmp_path / "bench.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    proc = kvwire("plot", str(path), "--out", str(tmp_path / "curve.png"))
    assert_one_error_line(proc, "bench.json is not the JSON output of benchmarks/splice.py", *fragments,
                          "benchmarks/splice.py --json")
    assert not (tmp_path / "curve.png").exists()
