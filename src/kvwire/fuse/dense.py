"""Dense training data for the fuser: (context, response) pairs whose every response token is trained.

The fuser of fuse mode learns from the receiver's cross-entropy on a response read
after the fused context. A response of one option letter teaches a letter prior; a
response of many tokens whose content the sharer knows and the receiver does not is
what makes reading the sharer's cache pay. Everything here comes from the running
Python itself -- nothing is downloaded -- and is deterministic for a seed and a Python
version (:func:`corpus_id` names it). Kinds of example (:data:`KINDS`):

- ``signature``: "What is the signature of `textwrap.indent`?" ->
  "`textwrap.indent(text, prefix, predicate=None)`" (:func:`inspect.signature`);
- ``doc``: "What does `heapq.heappush` do?" -> the docstring's first paragraph;
- ``module``: "Which module of the Python standard library defines `Counter`?" ->
  "`Counter` is defined in the `collections` module.";
- ``constant``: "What is the value of `string.digits`?" -> "`'0123456789'`" (its ``repr``);
- ``call``: "What does `math.gcd(12, 18)` return?" -> "`6` (an `int`)": calls executed
  here, only of functions of modules without side effects (:data:`CALL_MODULES`);
- ``continuation``: a window of a module's source as the context, the lines that follow
  as the response.

**Splits are by module** (:func:`split`): a module's examples are all in training or all in
validation, so validation measures modules the fuser never saw. The modules that the
bundled benchmark questions are about (their ``topic``) are in neither
(:func:`benchmark_modules`): the benchmark stays unseen.

Sharer-written responses (distillation) are a third source, on top of these:
:mod:`kvwire.fuse.distill` (``kvwire fuser-data --distill SHARER``) replaces each training
knowledge question's answer with the sharer's own greedy one.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import inspect
import io
import random
import re
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import FuserDataError
from .stdlib_qa import MODULES, Example, public_names

KINDS: tuple[str, ...] = ("signature", "doc", "module", "constant", "call", "continuation")
KNOWLEDGE_KINDS = KINDS[:-1]
# what `kvwire train-fuser --data dense` trains on: constants are left out, their values (``locale.T_FMT_AMPM``
# is ``131115``) are trivia that neither model can know, so they teach nothing about reading the sharer
RECIPE_KINDS: tuple[str, ...] = ("signature", "doc", "module", "call", "continuation")

# modules whose functions are pure: a call changes nothing outside it and gives the same
# answer on every machine (no clock, no file system, no randomness, no environment)
CALL_MODULES: tuple[str, ...] = ("math", "cmath", "operator", "statistics", "colorsys", "textwrap", "html",
                                 "string", "keyword", "unicodedata", "binascii", "zlib", "bisect", "heapq",
                                 "fnmatch", "posixpath", "base64", "fractions", "decimal", "difflib", "shlex",
                                 "ipaddress", "struct")
_NO_CALL = re.compile(r"^(set|get)(default|locale|context|recursionlimit)|^(open|exit|run|system|remove|unlink|"
                      r"mkdir|rmdir|rename|kill|sleep|input|print|pr[a-z]+|register|install|patch|main|test|help)")
_SAMPLE_ARGS: tuple[tuple[Any, ...], ...] = (
    (12, 18), (10,), (2.5,), ("hello world",), ([3, 1, 2],), ("abc", 2), ([1, 2, 4, 8], 3), (0.25, 0.5, 0.75),
    ("*.py", "setup.py"), ("Hello, World",), (b"kvwire",), ("a/b/c.txt",), (2024, 2), ("<i>",), (3, 4),
)
_MAX_REPR = 80
CONTEXT_LINES = 16
RESPONSE_LINES = 6


def corpus_id() -> str:
    """What the examples were built from: ``"python-3.11.7-dense-v1"``."""
    v = sys.version_info
    return f"python-{v.major}.{v.minor}.{v.micro}-dense-v1"


def module_of(example: Example) -> str:
    """The module an example is about: its subject up to the last dot (``"os.path.join"`` -> ``"os.path"``)."""
    return example.subject.rsplit(".", 1)[0] if "." in example.subject else example.subject


def benchmark_modules() -> frozenset[str]:
    """Modules the bundled benchmark questions are about (their topics that name a module)."""
    from ..evals import load

    topics = {q.topic for q in load()}
    return frozenset(m for m in MODULES if m in topics or m.split(".")[0] in topics)


def build(seed: int = 0, modules: Sequence[str] = MODULES, kinds: Sequence[str] = KINDS,
          windows: int = 6) -> list[Example]:
    """Every example the listed modules give, in a stable shuffled order.

    ``windows``: code-continuation examples per module (fewer where its source is short).

    Example: ``build(modules=["textwrap"], kinds=["signature"])`` -> one example per public
    function or class of :mod:`textwrap` with a signature, e.g. ``dedent``:
    ``Example("What is the signature of `textwrap.dedent`?", "`textwrap.dedent(text)`", ...)``.
    """
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        raise FuserDataError(f"unknown example kinds {bad}", f"choose from {', '.join(KINDS)}")
    examples: list[Example] = []
    with warnings.catch_warnings():  # reading docstrings touches deprecated aliases (typing.io, typing.re)
        warnings.simplefilter("ignore")
        for module in modules:
            examples += _knowledge(module, [k for k in kinds if k in KNOWLEDGE_KINDS])
            if "continuation" in kinds:
                examples += continuation(module, windows, seed)
    random.Random(seed).shuffle(examples)
    return examples


def _knowledge(module: str, kinds: Sequence[str]) -> list[Example]:
    out = []
    for entry in public_names(module):
        subject, obj = entry.subject, entry.obj
        what = "class" if inspect.isclass(obj) else "function"
        if "signature" in kinds and (sig := _signature(obj)) is not None:
            out.append(Example(f"What is the signature of the {what} `{subject}`?", f"`{subject}{sig}`",
                               "signature", subject))
        if "doc" in kinds and (doc := first_paragraph(obj, entry.name)) is not None:
            out.append(Example(f"What does the {what} `{subject}` do?", doc, "doc", subject))
        if "module" in kinds and module != "builtins":
            out.append(Example(f"Which module of the Python standard library defines the {what} `{entry.name}`?",
                               f"`{entry.name}` is defined in the `{module}` module.", "module", subject))
        if "call" in kinds and module in CALL_MODULES and (call := _call(obj, entry.name)) is not None:
            expression, value = call
            out.append(Example(f"What does `{module}.{expression}` return?", value, "call", subject))
    if "constant" in kinds:
        out += _constants(module)
    return out


def _signature(obj: Any) -> str | None:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    if sig in ("(*args, **kwargs)", "(self, /, *args, **kwargs)") or len(sig) > 160 or " at 0x" in sig:
        return None
    return sig


def first_paragraph(obj: Any, name: str, limit: int = 400) -> str | None:
    """The docstring's first paragraph, lines joined; None if it is short, empty or only a signature.

    Example: ``first_paragraph(textwrap.dedent, "dedent")`` -> "Remove any common leading
    whitespace from every line in `text`."
    """
    doc = inspect.getdoc(obj) or ""
    lines = [ln.strip() for ln in doc.splitlines()]
    while lines and (not lines[0] or re.match(rf"^[\w.]*{re.escape(name)}\s*\(", lines[0])):
        lines.pop(0)  # C functions open with their signature
    paragraph = " ".join(lines[: lines.index("")] if "" in lines else lines).strip()
    if len(paragraph) < 24 or " at 0x" in paragraph:
        return None
    if len(paragraph) > limit:
        cut = paragraph[:limit].rsplit(". ", 1)[0]
        paragraph = cut + "." if len(cut) >= 24 else paragraph[:limit].rsplit(" ", 1)[0] + " ..."
    return paragraph


def _call(obj: Any, name: str) -> tuple[str, str] | None:
    """``(expression, answer)`` for the first sample arguments the function accepts, or None."""
    if inspect.isclass(obj) or _NO_CALL.match(name) or not callable(obj):
        return None
    for args in _SAMPLE_ARGS:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                value = obj(*copy.deepcopy(args))  # a fresh copy: some functions change their arguments
        except Exception:  # noqa: BLE001 -- trying sample arguments: any failure means "not these"
            continue
        if callable(value) or inspect.isgenerator(value) or type(value).__module__ not in ("builtins", "fractions",
                                                                                           "decimal"):
            return None  # an iterator or an object without a stable repr says nothing checkable
        text = repr(value)
        if len(text) > _MAX_REPR or " at 0x" in text:
            return None
        shown = ", ".join(repr(a) for a in args)
        return f"{name}({shown})", f"`{text}` (a `{type(value).__name__}`)"
    return None


def _constants(module_name: str) -> list[Example]:
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    out = []
    for name, value in sorted(vars(module).items()):
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name) or not (name.isupper() or module_name == "string"):
            continue
        if type(value) not in (int, float, str, bytes, tuple, frozenset) or isinstance(value, bool):
            continue
        text = repr(value)
        if len(text) > _MAX_REPR or not text.strip("'\"b"):
            continue
        out.append(Example(f"What is the value of `{module_name}.{name}`?", f"`{text}`", "constant",
                           f"{module_name}.{name}"))
    return out


def source_path(module: str) -> Path | None:
    """The ``.py`` file a module is read from (a package's ``__init__.py``), or None (C modules)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    return Path(origin) if origin and origin.endswith(".py") and Path(origin).is_file() else None


def continuation(module: str, count: int, seed: int = 0, context_lines: int = CONTEXT_LINES,
                 response_lines: int = RESPONSE_LINES) -> list[Example]:
    """``count`` windows of the module's source: ``context_lines`` lines shown, the next
    ``response_lines`` as the response (windows that do not overlap, at stable random places).

    Example: ``continuation("textwrap", 1)`` -> one example whose prompt shows 16 lines of
    ``textwrap.py`` and asks for the next 6, and whose answer is those 6 lines.
    """
    path = source_path(module)
    if path is None or count < 1:
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    span = context_lines + response_lines
    starts = list(range(0, len(lines) - span, span))
    rng = random.Random(f"{seed}:{module}")
    rng.shuffle(starts)
    out = []
    for start in starts:
        shown, rest = lines[start: start + context_lines], lines[start + context_lines: start + span]
        if sum(1 for ln in rest if ln.strip()) < response_lines // 2 or sum(len(ln) for ln in shown) < 200:
            continue
        body = "\n".join(shown)
        prompt = (f"Here are {context_lines} lines of the Python standard library module `{module}`:\n\n"
                  f"```python\n{body}\n```\n\nWrite the {response_lines} lines that follow, as code only.")
        out.append(Example(prompt, "\n".join(rest), "continuation", f"{module}.@{start + 1}"))
        if len(out) == count:
            break
    return out


def _held(module: str, seed: int, share: float) -> bool:
    digest = hashlib.blake2b(f"{seed}:{module}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def split(examples: Iterable[Example], held_out: float = 0.15, seed: int = 0,
          exclude: Iterable[str] = ()) -> tuple[list[Example], list[Example]]:
    """(train, validation) by module (a stable hash), with the modules in ``exclude`` in neither.

    Example: ``held_out=0.15`` puts about one module in seven, with every example about it, in
    validation.
    """
    excluded = set(exclude)
    train, val = [], []
    for ex in examples:
        module = module_of(ex)
        if module in excluded or module.split(".")[0] in excluded:
            continue
        (val if _held(module, seed, held_out) else train).append(ex)
    return train, val


def check_disjoint(train: Iterable[Example], val: Iterable[Example]) -> list[str]:
    """The modules in training, sorted; raises if any of them is also in validation."""
    train_modules = {module_of(ex) for ex in train}
    overlap = sorted(train_modules & {module_of(ex) for ex in val})
    if overlap:
        raise FuserDataError(f"training and validation share modules: {', '.join(overlap[:8])}"
                             + (f" and {len(overlap) - 8} more" if len(overlap) > 8 else ""),
                             "split by module (kvwire fuser-data does), so validation measures unseen modules")
    return sorted(train_modules)


def dataset(seed: int = 0, held_out: float = 0.15, kinds: Sequence[str] = KINDS, windows: int = 6,
            modules: Sequence[str] = MODULES) -> tuple[list[Example], list[Example]]:
    """(train, validation): :func:`build`, split by module, the benchmark's modules excluded."""
    train, val = split(build(seed, modules, kinds, windows), held_out, seed, benchmark_modules())
    check_disjoint(train, val)
    return train, val


def mix(examples: Sequence[Example]) -> dict[str, int]:
    """How many examples of each kind: ``{"doc": 310, "continuation": 270, ...}``."""
    counts: dict[str, int] = {}
    for ex in examples:
        counts[ex.kind] = counts.get(ex.kind, 0) + 1
    return dict(sorted(counts.items()))
