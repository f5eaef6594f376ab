"""Run the code of checkable questions and assert their keyed answers.

For each item with a ``check`` or ``claims`` (schema in :mod:`.questions`), and for each of
its options: run ``setup`` in a fresh namespace, then evaluate the option's expression.
The keyed option must come out true; every other option false or raising. An item whose
setup fails, or whose key does not verify, is reported with what was found.

This executes the question set's code: run it only on sets you trust (the bundled one,
your own). It is meant to run in its own process -- checks import modules, start
threads and subprocesses, touch temporary files::

    python -m kvwire.evals.check [PATH]     # exit 0: every checkable key verified

prints one line per problem and a summary, and ends with one JSON line.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .questions import Question, load

_MODULE = "kvwire_question_check"


def raised(fn: Callable[[], Any]) -> str | None:
    """The name of the exception type ``fn()`` raises, or None if it returns."""
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 -- SystemExit and KeyboardInterrupt are answers here
        return type(err).__name__
    return None


@dataclass
class Outcome:
    """What checking one question found: per option True / False / None (no claim), and problems."""

    id: str
    verdicts: list[bool | None] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_question(question: Question) -> Outcome:
    """Evaluate every option of one checkable question (see the module docstring)."""
    outcome = Outcome(question.id)
    if not question.checkable:
        return outcome
    for index, option in enumerate(question.options):
        expression = question.check if question.check is not None else question.claims[index]  # type: ignore[index]
        if expression is None:
            outcome.verdicts.append(None)
            continue
        namespace = _fresh_module()
        try:
            _quietly(lambda: exec(question.setup or "", namespace))  # noqa: S102 -- trusted question sets only
        except BaseException as err:  # noqa: BLE001 -- report, do not stop the other items
            outcome.problems.append(f"setup raised {type(err).__name__}: {err}")
            return outcome
        namespace["option"] = option
        try:
            verdict = bool(_quietly(lambda: eval(expression, namespace)))  # noqa: S307 -- trusted question sets only
            error = None
        except BaseException as err:  # noqa: BLE001
            verdict, error = False, f"{type(err).__name__}: {err}"
        outcome.verdicts.append(verdict)
        letter = question.letters[index]
        if index == question.answer and not verdict:
            outcome.problems.append(f"the keyed option {letter} ({option!r}) does not verify"
                                    + (f" (raised {error})" if error else ""))
        elif index != question.answer and verdict:
            outcome.problems.append(f"option {letter} ({option!r}) also verifies, but the key is "
                                    f"{question.answer_letter}")
    return outcome


def check_all(questions: list[Question]) -> list[Outcome]:
    return [check_question(q) for q in questions]


def _fresh_module() -> dict[str, Any]:
    """A new, registered module's namespace: classes defined there (dataclasses) find their module."""
    module = types.ModuleType(_MODULE)
    sys.modules[_MODULE] = module
    module.raised = raised  # type: ignore[attr-defined]
    return module.__dict__


def _quietly(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return fn()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    questions = load(args[0] if args else None)
    outcomes = check_all(questions)
    failed = [o for o in outcomes if not o.ok]
    for outcome in failed:
        for problem in outcome.problems:
            print(f"{outcome.id}: {problem}")
    checkable = sum(q.checkable for q in questions)
    fully = sum(q.checkable and None not in o.verdicts for q, o in zip(questions, outcomes))
    print(f"{len(questions)} questions, {checkable} checkable ({fully} with every option checked), "
          f"{len(failed)} failing")
    print(json.dumps({"questions": len(questions), "checkable": checkable, "all_options_checked": fully,
                      "failing": [o.id for o in failed]}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
