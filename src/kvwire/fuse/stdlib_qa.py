"""Training questions about Python's standard library, built from the stdlib itself.

The learned fuser needs examples where the sharer (a code model) knows something
the receiver does not. A corpus that exists offline wherever kvwire runs is the
standard library of the running Python: its modules, the names they define, their
signatures and docstrings. This module turns them into short instruction-style
examples with one correct answer each::

    Which module of the Python standard library defines the class `Counter`?

    A. heapq
    B. collections
    C. bisect
    D. statistics

    Answer with the letter of the correct option only.     -> "B"

(the layout of kvwire's multiple-choice benchmark, :mod:`kvwire.evals.questions`).

Question kinds (:data:`KINDS`):

- ``module``: which module defines a name (distractors: modules that do not);
- ``name``: which function or class of a module does what a docstring's first
  sentence says (distractors: other names of the same module);
- ``doc``: what a function or class does (options: first docstring sentences, the
  name scrubbed from each);
- ``param``: which of four names is a parameter of a callable;
- ``member``: which of four names the module defines.

Everything is deterministic for a seed and a Python version (the stdlib differs a
little between versions; :func:`corpus_fingerprint` names what was used). Subjects
(``"module.name"``) can be excluded, so that the items of an evaluation set never
appear in training data, and whole modules can be held out for validation.
Importing the listed modules has no side effects; nothing else is imported.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import random
import re
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import FuserDataError

log = logging.getLogger(__name__)

Kind = Literal["module", "name", "doc", "param", "member"]
KINDS: tuple[Kind, ...] = ("module", "name", "doc", "param", "member")
LETTERS = "ABCD"

# Modules whose import has no side effects and whose public names are worth asking about.
MODULES: tuple[str, ...] = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "binascii", "bisect", "builtins", "calendar",
    "cmath", "codecs", "collections", "colorsys", "concurrent.futures", "configparser", "contextlib", "copy",
    "csv", "ctypes", "dataclasses", "datetime", "decimal", "difflib", "dis", "doctest", "email.utils", "enum",
    "errno", "filecmp", "fileinput", "fnmatch", "fractions", "functools", "gc", "getpass", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "http.server", "importlib",
    "inspect", "io", "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging", "math",
    "mimetypes", "mmap", "multiprocessing", "numbers", "operator", "os", "os.path", "pathlib", "pickle",
    "pkgutil", "platform", "plistlib", "pprint", "pstats", "queue", "random", "re", "reprlib", "sched",
    "secrets", "select", "selectors", "shlex", "shutil", "signal", "socket", "socketserver", "sqlite3", "ssl",
    "stat", "statistics", "string", "struct", "subprocess", "sys", "sysconfig", "tarfile", "tempfile",
    "textwrap", "threading", "time", "timeit", "token", "tokenize", "traceback", "types", "typing",
    "unicodedata", "unittest", "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings", "wave",
    "weakref", "xml.etree.ElementTree", "zipfile", "zlib", "zoneinfo",
)
INSTRUCTION = "Answer with the letter of the correct option only."


@dataclass(frozen=True)
class Example:
    """One training example: the user's message, the reply trained on, and what it is about."""

    prompt: str  # the user message (the shared context both models read)
    answer: str  # the assistant's reply; the loss covers these tokens only
    kind: str = "text"  # one of KINDS, or "text" for examples from elsewhere
    subject: str = ""  # "module.name" the question is about ("" if none)
    # a choice question: every option (the answer among them), each scored as a response to the
    # prompt; the decision objective (kvwire.fuse.choice) trains which one the receiver prefers
    options: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.options:
            del data["options"]
        else:
            data["options"] = list(self.options)
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "example") -> Example:
        if not isinstance(data, dict) or not isinstance(data.get("prompt"), str) \
                or not isinstance(data.get("answer"), str):
            raise FuserDataError(f"{where}: expected an object with string fields 'prompt' and 'answer'",
                                 "write one JSON object per line: {\"prompt\": ..., \"answer\": ...}")
        if not data["prompt"].strip() or not data["answer"].strip():
            raise FuserDataError(f"{where}: empty prompt or answer")
        options = data.get("options", [])
        if not isinstance(options, list) or not all(isinstance(o, str) and o.strip() for o in options) \
                or (options and (len(options) < 2 or len(set(options)) != len(options)
                                 or data["answer"] not in options)):
            raise FuserDataError(f"{where}: 'options' must be a list of two or more distinct, non-empty strings "
                                 "that includes the answer")
        return cls(data["prompt"], data["answer"], str(data.get("kind", "text")), str(data.get("subject", "")),
                   tuple(options))


@dataclass(frozen=True)
class _Entry:
    module: str
    name: str
    obj: Any

    @property
    def subject(self) -> str:
        return f"{self.module}.{self.name}"


def public_names(module_name: str) -> list[_Entry]:
    """Functions and classes a module defines itself (not re-exports), sorted by name."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
    own = {module.__name__, module.__name__.split(".")[-1], "_" + module.__name__.split(".")[-1]}
    entries = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
            continue
        origin = getattr(obj, "__module__", None) or ""
        if origin in own or origin.lstrip("_") in own or module_name == "builtins":
            entries.append(_Entry(module_name, name, obj))
    return entries


def first_sentence(obj: Any, name: str) -> str | None:
    """The first sentence of a docstring, with the object's own name scrubbed; None if unusable.

    Example: ``heapq.heappush`` -> "Push item onto heap, maintaining the heap invariant."
    """
    doc = inspect.getdoc(obj) or ""
    lines = [ln.strip() for ln in doc.splitlines()]
    # C functions start with their signature ("heappush(heap, item)"); skip signature-like lines
    while lines and (not lines[0] or re.match(rf"^[\w.]*{re.escape(name)}\s*\(", lines[0])):
        lines.pop(0)
    text = " ".join(ln for ln in lines[: lines.index("")] if ln) if "" in lines else " ".join(lines)
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = (match.group(1) if match else text).strip()
    if not 20 <= len(sentence) <= 160 or re.search(rf"\b{re.escape(name)}\b", sentence):
        return None
    if inspect.isclass(obj) and sentence.startswith(("Initialize self", "Create and return a new object")):
        return None
    return sentence


def parameters(obj: Any) -> list[str] | None:
    """Parameter names of a callable (``self``/``cls`` and ``*``-only markers dropped); None if unknown."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    names = [p.name for p in sig.parameters.values() if p.name not in ("self", "cls")]
    return [n for n in names if len(n) > 1] or None


def build(seed: int = 0, modules: Sequence[str] = MODULES, kinds: Sequence[str] = KINDS,
          exclude: Iterable[str] = ()) -> list[Example]:
    """Every question the listed modules give, options shuffled by ``seed``, in a stable order.

    ``exclude``: subjects (``"module.name"``) or bare names never asked about (an
    evaluation set's items). The answer letter is spread evenly over A-D.
    """
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        raise FuserDataError(f"unknown question kinds {bad}", f"choose from {', '.join(KINDS)}")
    with warnings.catch_warnings():  # reading docstrings touches deprecated aliases (typing.io, typing.re)
        warnings.simplefilter("ignore", DeprecationWarning)
        return _build(seed, modules, kinds, set(exclude))


def _build(seed: int, modules: Sequence[str], kinds: Sequence[str], excluded: set[str]) -> list[Example]:
    entries = {m: [e for e in public_names(m) if e.subject not in excluded and e.name not in excluded]
               for m in modules}
    names_by_module = {m: {e.name for e in public_names(m)} for m in modules}
    rng = random.Random(seed)
    examples: list[Example] = []
    all_entries = [e for m in modules for e in entries[m]]
    docs = {e.subject: s for e in all_entries if (s := first_sentence(e.obj, e.name))}
    params = {e.subject: p for e in all_entries if callable(e.obj) and (p := parameters(e.obj))}
    all_params = sorted({p for ps in params.values() for p in ps})
    for entry in all_entries:
        kind_rng = random.Random(f"{seed}:{entry.subject}")
        for kind in kinds:
            question = _question(kind, entry, modules, names_by_module, docs, params, all_params, kind_rng)
            if question is not None and len(question[2]) == 3:
                text, correct, wrong = question
                examples.append(_multiple_choice(text, correct, wrong, kind, entry.subject, kind_rng))
    rng.shuffle(examples)
    return examples


def _question(kind: str, entry: _Entry, modules: Sequence[str], names_by_module: dict[str, set[str]],
              docs: dict[str, str], params: dict[str, list[str]], all_params: list[str],
              rng: random.Random) -> tuple[str, str, list[str]] | None:
    what = "class" if inspect.isclass(entry.obj) else "function"
    if kind == "module":
        if entry.module == "builtins":
            return None
        others = [m for m in modules if entry.name not in names_by_module[m] and m != entry.module]
        return (f"Which module of the Python standard library defines the {what} `{entry.name}`?",
                entry.module, _sample(rng, others))
    if kind == "name":
        if entry.subject not in docs:
            return None
        sentence = docs[entry.subject]  # names that share the sentence (aliases) cannot be distractors
        kin = [e for e in names_by_module[entry.module]
               if e != entry.name and docs.get(f"{entry.module}.{e}") != sentence]
        if len(kin) < 3:
            return None
        where = "Python's built-ins" if entry.module == "builtins" else f"the `{entry.module}` module"
        return (f'Which {what} of {where} is described as "{docs[entry.subject]}"?',
                entry.name, _sample(rng, sorted(kin)))
    if kind == "doc":
        if entry.subject not in docs:
            return None
        others = sorted({s for s in docs.values() if s != docs[entry.subject]})
        return (f"What does the {what} `{entry.subject}` do?", docs[entry.subject], _sample(rng, others))
    if kind == "param":
        own = params.get(entry.subject)
        if not own or inspect.isclass(entry.obj):
            return None
        others = [p for p in all_params if p not in own]
        return (f"Which of these is a parameter of `{entry.subject}`?", rng.choice(own), _sample(rng, others))
    if kind == "member":
        if entry.module == "builtins":
            return None
        others = sorted({e for m, names in names_by_module.items() if m != entry.module for e in names}
                        - names_by_module[entry.module])
        return (f"Which of these names does the `{entry.module}` module define?", entry.name,
                _sample(rng, others))
    raise FuserDataError(f"unknown question kind {kind!r}")


def _sample(rng: random.Random, candidates: Sequence[str]) -> list[str]:
    """Three distractors, or fewer when there are not enough (the question is then skipped)."""
    return rng.sample(list(candidates), 3) if len(candidates) >= 3 else []


def _multiple_choice(question: str, correct: str, wrong: list[str], kind: str, subject: str,
                     rng: random.Random) -> Example:
    options = [correct, *wrong]
    rng.shuffle(options)
    letter = LETTERS[options.index(correct)]
    listed = "\n".join(f"{LETTERS[i]}. {opt}" for i, opt in enumerate(options))
    return Example(f"{question}\n\n{listed}\n\n{INSTRUCTION}", letter, kind, subject)


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def exclusions(texts: Iterable[str]) -> set[str]:
    """Every identifier (and each part of a dotted one) in ``texts``: what an evaluation set
    mentions, to be passed as :func:`build`'s ``exclude`` so no training question is about it.

    Example: ``["Which `itertools` function pairs items?", "pairwise"]`` ->
    ``{"Which", "itertools", "function", "pairs", "items", "pairwise"}`` (plain words match no
    stdlib name that matters; an over-broad exclusion only costs a few training questions).
    """
    found: set[str] = set()
    for text in texts:
        for match in _IDENTIFIER.finditer(text):
            dotted = match.group(0)
            found.add(dotted)
            found.update(dotted.split("."))
    return found


def decontaminate(examples: Sequence[Example], texts: Iterable[str]) -> list[Example]:
    """``examples`` minus those whose subject ``texts`` mention (by its full dotted name or its
    own name): no training question is about an API an evaluation item names."""
    words = exclusions(texts)
    kept = []
    for ex in examples:
        name = ex.subject.rsplit(".", 1)[-1]
        if ex.subject in words or name in words:
            continue
        kept.append(ex)
    return kept


def split(examples: Sequence[Example], held_out: float = 0.1, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """(train, validation), holding out whole *modules* (by a stable hash), so validation asks
    about names the training never saw.

    Example: ``held_out=0.1`` puts about one module in ten, with all its questions, in validation.
    """
    def module_of(ex: Example) -> str:
        return ex.subject.rsplit(".", 1)[0]

    def is_held(module: str) -> bool:
        digest = hashlib.blake2b(f"{seed}:{module}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < held_out

    train = [ex for ex in examples if not is_held(module_of(ex))]
    val = [ex for ex in examples if is_held(module_of(ex))]
    return train, val


def save(examples: Iterable[Example], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex.to_json(), ensure_ascii=False) + "\n")
    return path


def load(path: str | Path) -> list[Example]:
    """Examples from a JSONL file (one ``{"prompt", "answer"[, "kind", "subject"]}`` object per line)."""
    path = Path(path)
    if not path.is_file():
        raise FuserDataError(f"no data file at {path}", "build one with `kvwire fuser-data OUT_DIR`")
    examples = []
    number = 0
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as err:
                    raise FuserDataError(f"{path}:{number}: not JSON ({err.msg})") from None
                except RecursionError:
                    raise FuserDataError(f"{path}:{number}: JSON nested too deeply") from None
                examples.append(Example.from_json(data, f"{path}:{number}"))
    except UnicodeDecodeError as err:
        raise FuserDataError(f"{path}:{number + 1}: not UTF-8 text ({err.reason})",
                             "give a JSONL file of {\"prompt\", \"answer\"} objects") from None
    if not examples:
        raise FuserDataError(f"{path} holds no examples")
    return examples


def dataset(seed: int = 0, held_out: float = 0.1, evaluation: Iterable[str] | None = None
            ) -> tuple[list[Example], list[Example]]:
    """(train, validation) questions from the stdlib, decontaminated against ``evaluation``'s texts
    (default: every question, code snippet and keyed option of kvwire's bundled benchmark set)."""
    if evaluation is None:
        from ..evals import load as load_questions

        evaluation = [t for q in load_questions() for t in (q.question, q.code or "", q.options[q.answer])]
    return split(decontaminate(build(seed), evaluation), held_out, seed)


def load_dataset(path: str | Path, held_out: float = 0.1, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """(train, validation) from ``path``: a folder with ``train.jsonl`` and optionally ``val.jsonl``
    (as ``kvwire fuser-data`` writes), or one JSONL file, split by held-out modules when its
    examples name subjects, else its last ``held_out`` share."""
    path = Path(path)
    if path.is_dir():
        train = load(path / "train.jsonl")
        val = load(path / "val.jsonl") if (path / "val.jsonl").is_file() else []
        return train, val
    examples = load(path)
    if all(ex.subject for ex in examples):
        return split(examples, held_out, seed)
    cut = len(examples) - max(1, int(len(examples) * held_out))
    return examples[:cut], examples[cut:]


def corpus_fingerprint() -> str:
    """Which stdlib the questions came from: ``"python-3.11.7"`` style."""
    return f"python-{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
