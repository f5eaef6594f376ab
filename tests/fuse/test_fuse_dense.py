"""Dense training data for the fuser (kvwire.fuse.dense): (context, response) pairs from the running
Python, split by module, the benchmark's modules left out, every answer checkable against Python itself."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from kvwire.errors import FuserDataError
from kvwire.fuse import dense
from kvwire.fuse.stdlib_qa import Example


def test_every_kind_is_built_deterministically_from_the_stdlib():
    modules = ["textwrap", "colorsys", "string", "heapq"]
    first = dense.build(seed=3, modules=modules)
    assert first == dense.build(seed=3, modules=modules)  # same seed, same Python: the same examples
    assert first != dense.build(seed=4, modules=modules)  # another seed: another order (and windows)
    assert set(dense.mix(first)) == set(dense.KINDS)
    assert all(ex.prompt.strip() and ex.answer.strip() for ex in first)


def test_knowledge_answers_are_what_python_says():
    examples = dense.build(modules=["textwrap", "colorsys", "string"], kinds=["signature", "doc", "call", "constant"])
    signature = next(ex for ex in examples if ex.kind == "signature" and ex.subject == "textwrap.dedent")
    assert signature.answer == f"`textwrap.dedent{inspect.signature(importlib.import_module('textwrap').dedent)}`"
    doc = next(ex for ex in examples if ex.kind == "doc" and ex.subject == "textwrap.dedent")
    assert doc.answer.startswith("Remove any common leading whitespace")
    constant = next(ex for ex in examples if ex.kind == "constant" and ex.subject == "string.digits")
    assert constant.answer == "`'0123456789'`"
    calls = [ex for ex in examples if ex.kind == "call"]
    assert calls
    for ex in calls:  # each "What does `m.f(args)` return?" is answered with what the call returns here
        expression = ex.prompt.split("`")[1]
        module, call = expression.split(".", 1)
        value = eval(call, vars(importlib.import_module(module)))  # noqa: S307 -- our own generated text
        assert ex.answer == f"`{value!r}` (a `{type(value).__name__}`)"


def test_calls_never_see_arguments_changed_by_an_earlier_call():
    # operator.setitem / delitem change the list they get: each call must get a fresh copy
    calls = [ex for ex in dense.build(modules=["operator"], kinds=["call"])]
    shown = {ex.prompt for ex in calls}
    assert not any("3, 3, 3" in text for text in shown)


def test_a_continuation_is_the_source_that_follows():
    [ex] = dense.continuation("textwrap", 1, seed=0)
    source = Path(dense.source_path("textwrap")).read_text(encoding="utf-8").splitlines()
    start = int(ex.subject.split("@")[1]) - 1
    shown = "\n".join(source[start: start + dense.CONTEXT_LINES])
    assert shown in ex.prompt
    assert ex.answer == "\n".join(source[start + dense.CONTEXT_LINES: start + dense.CONTEXT_LINES
                                         + dense.RESPONSE_LINES])
    assert dense.module_of(ex) == "textwrap"
    assert dense.continuation("math", 3) == []  # a C module has no source to continue


def test_splits_are_by_module_and_leave_the_benchmark_out():
    train, val = dense.dataset(seed=0, kinds=["module", "signature"], modules=["textwrap", "heapq", "colorsys",
                                                                                 "shlex", "fnmatch", "wave",
                                                                                 "zipfile", "sched", "gzip"])
    train_modules = {dense.module_of(ex) for ex in train}
    val_modules = {dense.module_of(ex) for ex in val}
    assert train_modules and not train_modules & val_modules
    benchmark = dense.benchmark_modules()
    assert {"textwrap", "heapq"} <= benchmark  # the bundled questions ask about them
    assert not (train_modules | val_modules) & benchmark
    assert dense.check_disjoint(train, val) == sorted(train_modules)


def test_overlapping_modules_are_refused():
    a = Example("What does `shlex.split` do?", "Split a string.", "doc", "shlex.split")
    b = Example("What is the signature of `shlex.split`?", "`shlex.split(s)`", "signature", "shlex.split")
    with pytest.raises(FuserDataError, match="training and validation share modules: shlex"):
        dense.check_disjoint([a], [b])


def test_unknown_kinds_are_refused():
    with pytest.raises(FuserDataError, match="unknown example kinds"):
        dense.build(kinds=["trivia"])
