"""The bundled multiple-choice question set: its schema, the loader that refuses malformed items,
the checker that runs every checkable item and asserts its keyed answer, and the statistics."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvwire.errors import QuestionSetError
from kvwire.evals import accuracy, load, paired_difference, wilson
from kvwire.evals.check import check_question
from kvwire.evals.questions import Question, parse

SRC = Path(__file__).resolve().parents[2] / "src"


def item(**changes):
    data = {"id": "builtins-divmod", "topic": "builtins", "question": "Which built-in returns quotient and remainder?",
            "options": ["quotrem", "divmod", "divide", "modulo"], "answer": "B",
            "check": "eval(option)(17, 5) == (3, 2)"}
    data.update(changes)
    return {k: v for k, v in data.items() if v is not None}


def test_the_bundled_set_is_large_balanced_and_mostly_checkable():
    questions = load()
    assert len(questions) >= 150
    letters = Counter(q.answer_letter for q in questions if len(q.options) == 4)
    assert all(0.2 <= n / len(questions) <= 0.3 for n in letters.values()), letters  # no letter is a free lunch
    assert sum(q.checkable for q in questions) >= 0.95 * len(questions)
    assert all(q.checkable or q.note for q in questions)
    assert len({q.topic for q in questions}) >= 20


def test_every_checkable_key_verifies():
    """Runs the checker in its own process (the checks start threads, subprocesses, temp files)."""
    result = subprocess.run([sys.executable, "-m", "kvwire.evals.check"], capture_output=True, text=True,
                            timeout=600,
                            env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert summary["failing"] == [] and summary["checkable"] >= 300


def test_the_checker_catches_a_wrong_key_and_a_second_right_answer():
    wrong = Question.from_json(item(answer="A"))
    assert any("keyed option A ('quotrem') does not verify" in p for p in check_question(wrong).problems)
    assert any("option B ('divmod') also verifies" in p for p in check_question(wrong).problems)
    both = Question.from_json(item(options=["divmod", "quotrem", "divide", "modulo"], answer="A",
                                   check="option in ('divmod', 'divide')"))
    assert check_question(both).problems == ["option C ('divide') also verifies, but the key is A"]
    claims = Question.from_json(item(check=None, claims=[None, "divmod(17, 5) == (3, 2)", "1 / 0", None]))
    outcome = check_question(claims)
    assert outcome.ok and outcome.verdicts == [None, True, False, None]


@pytest.mark.parametrize("line, message", [
    ("{not json", "set.jsonl:1: not valid JSON"),
    (json.dumps(item(answer="E")), "answer 'E' is not one of"),
    (json.dumps(item(options=["a", "a", "b", "c"])), "options repeat"),
    (json.dumps(item(options=["only"])), "1 options"),
    (json.dumps(item(question=None)), "missing fields \\['question'\\]"),
    (json.dumps(item(colour="red")), "unknown fields \\['colour'\\]"),
    (json.dumps(item(id="Has Spaces")), "id must match"),
    (json.dumps(item(check="eval(option")), "check is not valid Python"),
    (json.dumps(item(check=None)), "needs a note"),
    (json.dumps(item(check=None, claims=["1", None, "0", "0"])), "keyed option's claim is null"),
    (json.dumps(item(claims=["1", "1", "0", "0"])), "either check or claims"),
])
def test_malformed_items_are_refused_with_their_line(line, message):
    with pytest.raises(QuestionSetError, match=message):
        parse([line], "set.jsonl")


def test_duplicate_ids_and_empty_files_are_refused(tmp_path):
    with pytest.raises(QuestionSetError, match="already used on line 1"):
        parse([json.dumps(item()), json.dumps(item())])
    path = tmp_path / "empty.jsonl"
    path.write_text("// nothing here\n\n")
    with pytest.raises(QuestionSetError, match="holds no questions"):
        load(path)
    with pytest.raises(QuestionSetError, match="cannot read"):
        load(tmp_path / "missing.jsonl")


def test_the_prompt_text_lists_lettered_options():
    question = Question.from_json(item(code="print(divmod(7, 2))"))
    text = question.text()
    assert text.startswith("Which built-in returns quotient and remainder?\n\n```python\nprint(divmod(7, 2))\n```")
    assert "\nA. quotrem\nB. divmod\nC. divide\nD. modulo\n" in text
    assert question.text(with_options=False) == question.stem() and "A." not in question.stem()
    assert question.layout("list").endswith("\n- quotrem\n- divmod\n- divide\n- modulo\n\n"
                                            "Answer with the correct option only.")
    assert question.layout("letters") == text and question.layout("none") == question.stem()
    with pytest.raises(QuestionSetError, match="unknown option layout"):
        question.layout("table")


def test_wilson_intervals():
    low, high = wilson(81, 263)  # Newcombe (1998), Statistics in Medicine 17:857, example (a)
    assert round(low, 4) == 0.2553 and round(high, 4) == 0.3662
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    assert wilson(50, 100)[1] - wilson(50, 100)[0] > wilson(500, 1000)[1] - wilson(500, 1000)[0]
    acc = accuracy([True, False, True, True])
    assert (acc.correct, acc.total, acc.value) == (3, 4, 0.75) and acc.low < 0.75 < acc.high
    with pytest.raises(ValueError):
        wilson(5, 4)


def test_paired_differences():
    assert paired_difference([True] * 10, [True] * 10) == (0.0, 0.0, 0.0)
    diff, low, high = paired_difference([True] * 30 + [False] * 10, [False] * 40)
    assert diff == 0.75 and low < 0.75 < high and low > 0.5
