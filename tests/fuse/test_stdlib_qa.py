"""Training questions built from Python's standard library: deterministic, decontaminated, split by module."""

from __future__ import annotations

import collections
import json

import pytest

from kvwire.errors import FuserDataError
from kvwire.fuse import stdlib_qa

MODULES = ("heapq", "bisect", "statistics", "textwrap", "fnmatch", "colorsys")


def test_questions_are_deterministic_and_answers_spread_over_the_letters():
    first, again = stdlib_qa.build(0, MODULES), stdlib_qa.build(0, MODULES)
    assert first == again and len(first) > 50
    assert first != stdlib_qa.build(1, MODULES)
    letters = collections.Counter(ex.answer for ex in first)
    assert set(letters) == set("ABCD") and min(letters.values()) > len(first) / 8
    assert {ex.kind for ex in first} == set(stdlib_qa.KINDS)


def test_each_question_has_four_options_and_one_is_true():
    for ex in stdlib_qa.build(0, MODULES):
        lines = ex.prompt.split("\n")
        options = [line[3:] for line in lines if line[:3] in ("A. ", "B. ", "C. ", "D. ")]
        assert len(options) == 4 and len(set(options)) == 4, ex.prompt
        module, name = ex.subject.rsplit(".", 1)
        keyed = options["ABCD".index(ex.answer)]
        if ex.kind == "module":
            assert keyed == module
        elif ex.kind in ("name", "member"):
            assert keyed == name
        assert lines[-1] == stdlib_qa.INSTRUCTION


def test_decontamination_drops_questions_about_anything_the_evaluation_names():
    examples = stdlib_qa.build(0, MODULES)
    kept = stdlib_qa.decontaminate(examples, ["Which function pushes onto a heap?", "heapq.heappush", "```insort```"])
    assert {ex.subject for ex in examples} - {ex.subject for ex in kept} == {"heapq.heappush", "bisect.insort"}
    assert len(kept) < len(examples)


def test_validation_holds_out_whole_modules():
    examples = stdlib_qa.build(0, MODULES)
    train, val = stdlib_qa.split(examples, held_out=0.5, seed=3)
    module = lambda ex: ex.subject.rsplit(".", 1)[0]  # noqa: E731
    assert train and val and len(train) + len(val) == len(examples)
    assert not {module(ex) for ex in train} & {module(ex) for ex in val}


def test_examples_round_trip_through_jsonl_and_bad_lines_are_refused(tmp_path):
    examples = stdlib_qa.build(0, MODULES)
    path = stdlib_qa.save(examples, tmp_path / "data.jsonl")
    assert stdlib_qa.load(path) == examples
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(FuserDataError, match="bad.jsonl:1"):
        stdlib_qa.load(tmp_path / "bad.jsonl")
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    with pytest.raises(FuserDataError, match="not JSON"):
        stdlib_qa.load(tmp_path / "junk.jsonl")
    with pytest.raises(FuserDataError, match="unknown question kinds"):
        stdlib_qa.build(0, MODULES, kinds=("trivia",))
