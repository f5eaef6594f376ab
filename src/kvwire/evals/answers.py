"""The code or answer in a final reply, and the verdict on it (:func:`judge`), for a :class:`~.tasks.Task`.

**Judging** (:func:`judge`):

- ``exact``: the answer, stripped, equals the whole reply stripped, or the reply's last non-empty
  line stripped. Nothing else is forgiven (case, ``**5050**``, ``5050.``, ``The answer is 5050``):
  say in ``input`` how the reply must end, or use ``regex``.
- ``regex``: ``re.search(answer, reply)`` over the whole reply, no flags (write ``(?i)`` for them).
- ``tests``: the reply's code (:func:`extract_code`) is assembled with the prompt and the tests into
  one program (:func:`program`) and run in the sandbox: it passes when it exits 0, within the limits,
  having run to its last line (an answer that calls ``sys.exit(0)`` first does not pass).
"""

from __future__ import annotations

import ast
import re
import secrets
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from .sandbox import Limits, run_program
from .tasks import Task, _def_of, _ending_newline

PYTHON_TAGS = frozenset({"", "python", "py", "python3", "py3"})  # fence info strings taken as Python


@dataclass(frozen=True)
class Verdict:
    """The judgement of one reply."""

    passed: bool
    reason: str  # one line: how it passed, or why not
    seconds: float  # the sandbox's wall time; 0.0 for an answer task (nothing is run)
    answer: str  # tests: the code extracted from the reply; answer: the text matched (exact: compared)


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
    never taken, nor blocks that hold nothing. A fence still open at the end (a reply cut at max tokens) holds
    everything after it; where every fence holds nothing -- a closing fence after code that was never opened,
    as a judge writes ``Candidate: 1``, its function, then a lone fence -- the reply less its fence lines is the
    code if it defines something, and there is no code if not (prose and an empty block). Leading blank lines
    and trailing whitespace are dropped; indentation is kept (a bare completion is indented).

    Example: prose, a block tagged python holding a bare completion (no ``def``), then an untagged block of
    its output -> the completion (rule 3): output or usage shown after the code is not the code.
    """
    reply = reply.replace("\r\n", "\n")
    blocks = [block for block in _blocks(reply) if block.code.strip()]
    python = [block for block in blocks if block.tag in PYTHON_TAGS]
    rules = [lambda block: bool(_DEFINES.search(block.code)), lambda block: block.tag != "",
             lambda block: True]
    if entry_point:
        rules.insert(0, lambda block: _defines(block.code, entry_point))
    for rule in rules:
        for block in reversed(python):
            if rule(block):
                return _trim(block.code)
    lines = reply.split("\n")
    unfenced = "\n".join(line for line in lines if not _FENCE.match(line))
    if not blocks and len(unfenced) < len(reply):  # only fences holding nothing: the code around them if it defines
        return _trim(unfenced) if _DEFINES.search(unfenced) else ""  # something (a stray closing fence), else none
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
