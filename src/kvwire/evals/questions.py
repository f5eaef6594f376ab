"""Multiple-choice questions: the schema, a validating loader, and the text a model is asked.

**Schema.** A question set is a UTF-8 JSON-lines file, one question per line (blank lines
and lines starting with ``//`` are skipped)::

    {"id":       "itertools-pairwise",        unique, [a-z0-9._-]+
     "topic":    "itertools",                 free text, for per-topic breakdowns
     "question": "Which itertools function ...?",
     "code":     "for a, b in ...",           optional: a snippet shown under the question
     "options":  ["windowed", "pairwise", "pairs", "sliding"],   2..8 distinct, non-empty
     "answer":   "B",                         the letter of the one correct option
     "setup":    "import itertools",          optional: Python statements run before checking
     "check":    "list(getattr(itertools, option)('abc')) == [('a', 'b'), ('b', 'c')]",
     "claims":   [...],                       optional instead of check, see below
     "note":     "..."}                       required when there is neither check nor claims

How an item proves its key (:mod:`kvwire.evals.check` runs it; loading never does):

- ``check`` is one Python expression evaluated once per option with the name ``option``
  bound to that option's text (after ``setup``, in a fresh namespace each time). It must
  be true for the keyed option and false -- or raise -- for every other one.
- ``claims`` is one expression per option (or ``null`` where an option's claim cannot be
  executed): each says "this option is right". The keyed option's claim must be present
  and true, every other present claim false or raising.
- Items with neither are documentation facts; ``note`` says where the fact comes from.

Checks may call ``raised(fn)``: the name of the exception type ``fn()`` raises, or None.

Every problem found while loading raises :class:`~kvwire.errors.QuestionSetError` naming
the file, the line and the item.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from ..errors import QuestionSetError, reason

DEFAULT_SET = "python_mc.jsonl"  # in kvwire/data
LETTERS = "ABCDEFGH"
MAX_OPTIONS = len(LETTERS)

_ID = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str, "topic": str, "question": str, "code": str, "options": list, "answer": str,
    "setup": str, "check": str, "claims": list, "note": str,
}
_REQUIRED = ("id", "topic", "question", "options", "answer")

#: the instruction under the options when the model answers with a letter
LETTER_INSTRUCTION = "Answer with the letter of the correct option only."
#: the instruction under the options when the model answers with the option itself
LIST_INSTRUCTION = "Answer with the correct option only."

Layout = Literal["letters", "list", "none"]  # how the options appear in the question text


@dataclass(frozen=True)
class Question:
    """One validated multiple-choice item (see the module docstring for the fields)."""

    id: str
    topic: str
    question: str
    options: tuple[str, ...]
    answer: int  # index into options
    code: str | None = None
    setup: str | None = None
    check: str | None = None
    claims: tuple[str | None, ...] | None = None
    note: str | None = None

    @property
    def letters(self) -> str:
        return LETTERS[: len(self.options)]

    @property
    def answer_letter(self) -> str:
        return LETTERS[self.answer]

    @property
    def checkable(self) -> bool:
        return self.check is not None or self.claims is not None

    def stem(self) -> str:
        """The question and its code, without the options (what option log-likelihoods are conditioned on)."""
        if self.code is None:
            return self.question
        return f"{self.question}\n\n```python\n{self.code}\n```"

    def text(self, with_options: bool = True) -> str:
        """The user message: the stem, then ``A. ...`` lines and the letter instruction
        (``with_options=False``: the stem alone). Same as ``layout("letters")`` / ``layout("none")``.

        Example: ``Which built-in ...?\\n\\nA. divmod\\nB. quotrem\\n...\\n\\nAnswer with the letter ...``
        """
        return self.layout("letters" if with_options else "none")

    def layout(self, layout: Layout) -> str:
        """The user message with the options laid out as ``layout``:

        - ``"letters"``: ``A. divmod`` lines, then :data:`LETTER_INSTRUCTION`
        - ``"list"``: ``- divmod`` lines, then :data:`LIST_INSTRUCTION` (the answer is the option itself)
        - ``"none"``: the stem alone
        """
        if layout == "none":
            return self.stem()
        if layout == "letters":
            lines = [f"{letter}. {option}" for letter, option in zip(self.letters, self.options)]
            return f"{self.stem()}\n\n" + "\n".join(lines) + f"\n\n{LETTER_INSTRUCTION}"
        if layout == "list":
            return (f"{self.stem()}\n\n" + "\n".join(f"- {option}" for option in self.options)
                    + f"\n\n{LIST_INSTRUCTION}")
        raise QuestionSetError(f"unknown option layout {layout!r}", "use 'letters', 'list' or 'none'")

    @classmethod
    def from_json(cls, data: Any, where: str = "question") -> Question:
        """Validate one decoded JSON object; raise :class:`QuestionSetError` naming ``where``."""
        if not isinstance(data, dict):
            raise QuestionSetError(f"{where}: expected a JSON object, got {type(data).__name__}")
        label = f"{where} ({data['id']})" if isinstance(data.get("id"), str) else where
        missing = [name for name in _REQUIRED if name not in data]
        unknown = sorted(set(data) - set(_FIELDS))
        if missing or unknown:
            raise QuestionSetError(f"{label}: missing fields {missing}, unknown fields {unknown}",
                                   "see the schema in kvwire/evals/questions.py")
        for name, value in data.items():
            if not isinstance(value, _FIELDS[name]):
                raise QuestionSetError(f"{label}: field {name!r} must be {_FIELDS[name].__name__}, "  # type: ignore[union-attr]
                                       f"got {type(value).__name__}")
        if not _ID.match(data["id"]):
            raise QuestionSetError(f"{label}: id must match {_ID.pattern}")
        for name in ("topic", "question"):
            if not data[name].strip():
                raise QuestionSetError(f"{label}: field {name!r} is empty")
        options = data["options"]
        if not 2 <= len(options) <= MAX_OPTIONS:
            raise QuestionSetError(f"{label}: {len(options)} options; a question has 2 to {MAX_OPTIONS}")
        if not all(isinstance(o, str) and o.strip() for o in options):
            raise QuestionSetError(f"{label}: every option must be a non-empty string")
        if len(set(options)) != len(options):
            raise QuestionSetError(f"{label}: options repeat: {options}")
        letters = LETTERS[: len(options)]
        if len(data["answer"]) != 1 or data["answer"] not in letters:
            raise QuestionSetError(f"{label}: answer {data['answer']!r} is not one of {list(letters)}")
        answer = letters.index(data["answer"])
        claims = data.get("claims")
        if "check" in data and claims is not None:
            raise QuestionSetError(f"{label}: give either check or claims, not both")
        if claims is not None:
            if len(claims) != len(options) or not all(c is None or (isinstance(c, str) and c.strip()) for c in claims):
                raise QuestionSetError(f"{label}: claims must hold one expression (or null) per option "
                                       f"({len(options)}), got {len(claims)} entries")
            if claims[answer] is None:
                raise QuestionSetError(f"{label}: the keyed option's claim is null; the key must be checkable")
        if "check" not in data and claims is None and not data.get("note", "").strip():
            raise QuestionSetError(f"{label}: an item without check or claims needs a note saying where the fact comes "
                                   "from")
        for name in ("setup", "check"):
            if name in data:
                _compiles(data[name], "exec" if name == "setup" else "eval", f"{label}: {name}")
        for claim in claims or ():
            if claim is not None:
                _compiles(claim, "eval", f"{label}: claim")
        return cls(id=data["id"], topic=data["topic"], question=data["question"], options=tuple(options),
                   answer=answer, code=data.get("code"), setup=data.get("setup"), check=data.get("check"),
                   claims=tuple(claims) if claims is not None else None, note=data.get("note"))


def load(path: str | Path | None = None) -> list[Question]:
    """Read and validate a question set (default: the bundled ``python_mc.jsonl``). Runs no item code."""
    if path is None:
        source = resources.files("kvwire") / "data" / DEFAULT_SET
        name = f"kvwire/data/{DEFAULT_SET}"
        try:
            text = source.read_text(encoding="utf-8")
        except OSError as err:
            raise QuestionSetError(f"the bundled question set is missing: {err}", "reinstall kvwire") from None
    else:
        path = Path(path)
        name = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise QuestionSetError(f"cannot read the question set {path}: {reason(err)}") from None
    return parse(text.splitlines(), name)


def parse(lines: Iterable[str], name: str = "<questions>") -> list[Question]:
    """Validate JSON lines (see :func:`load`); ids must be unique."""
    questions: list[Question] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        where = f"{name}:{number}"
        try:
            data = json.loads(line)
        except ValueError as err:
            raise QuestionSetError(f"{where}: not valid JSON: {err}") from None
        question = Question.from_json(data, where)
        if question.id in seen:
            raise QuestionSetError(f"{where}: id {question.id!r} already used on line {seen[question.id]}")
        seen[question.id] = number
        questions.append(question)
    if not questions:
        raise QuestionSetError(f"{name} holds no questions")
    return questions


def _compiles(source: str, mode: str, where: str) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # e.g. `is` with a literal, on purpose
            compile(source, where, mode)
    except SyntaxError as err:
        raise QuestionSetError(f"{where} is not valid Python ({mode}): {err.msg}") from None
