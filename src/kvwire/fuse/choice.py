"""The decision objective: train the fuser on which answer the receiver prefers, where the sharer knows it.

The response objective (:mod:`kvwire.fuse.dense`) trains the fused receiver to write the true
response token by token. Four data mixes trained that way lowered held-out loss exactly as much
as LoRA on the same data did, and never moved the bundled questions (BENCHMARKS section 9): the
fuser learned the responses' *format*, which the receiver can learn without the sharer. This
objective trains what the benchmark measures, and only where the sharer can teach it:

- **Data**: choice questions from the standard library (:mod:`kvwire.fuse.stdlib_qa`: which
  module defines a name, which name a docstring describes, what a name does, which parameter,
  which member), asked with the question alone (the options are not listed), as the benchmark
  asks. Split by module; the bundled questions' modules are in neither split.
- **Signal**: every option is scored by the receiver as the response to the fused question, its
  mean log-likelihood per token (exactly the benchmark's ``loglik_mean``); the loss is the
  cross-entropy of the softmax over the options towards the right one.
- **Only where the sharer knows** (``--choice-filter sharer-right``): each model's own pick is
  measured once per question (kept on disk), and the questions the sharer gets wrong are dropped,
  so every target is an answer the sharer's cache holds.
- **Controls**: a control row scores the options after *another* question's sharer K/V and is
  trained towards the receiver alone's distribution over the options (a KL), so a prior over
  option texts gains nothing.

Example::

    q = Example("Which module of the Python standard library defines the class `Counter`?",
                "collections", "module", "collections.Counter",
                ("heapq", "collections", "bisect", "statistics"))
    option_examples(q)[1]   # Example(q.prompt, "collections", ...): one response per option
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import FuserDataError
from . import dense, gain, stdlib_qa
from .stdlib_qa import LETTERS, Example

log = logging.getLogger(__name__)

FILTERS = ("none", "sharer-right")


def from_letters(example: Example) -> Example:
    """A :mod:`stdlib_qa` letter question (options listed, answer a letter) as a choice question:
    the question alone as the prompt, the right option as the answer, every option attached."""
    parts = example.prompt.split("\n\n")
    if len(parts) != 3 or example.answer not in LETTERS:
        raise FuserDataError(f"not a lettered multiple-choice example: {example.prompt[:60]!r}")
    options = tuple(line[3:] for line in parts[1].split("\n"))
    if any(not line.startswith(f"{LETTERS[i]}. ") for i, line in enumerate(parts[1].split("\n"))):
        raise FuserDataError(f"unexpected option lines in {example.prompt[:60]!r}")
    return Example(parts[0], options[LETTERS.index(example.answer)], example.kind, example.subject, options)


def dataset(seed: int = 0, held_out: float = 0.15) -> tuple[list[Example], list[Example]]:
    """(train, validation) choice questions, split by module as :func:`kvwire.fuse.dense.dataset`
    splits (the same validation modules), the bundled benchmark's modules in neither."""
    questions = [from_letters(ex) for ex in stdlib_qa.build(seed)]
    questions = [q for q in questions if len(set(q.options)) == len(q.options)]
    train, val = dense.split(questions, held_out, seed, dense.benchmark_modules())
    dense.check_disjoint(train, val)
    return train, val


def option_examples(example: Example) -> list[Example]:
    """One response example per option of a choice question."""
    if not example.options:
        raise FuserDataError("not a choice question (it lists no options)")
    return [Example(example.prompt, option, example.kind, example.subject) for option in example.options]


def answer_index(example: Example) -> int:
    return example.options.index(example.answer)


def check_questions(examples: Sequence[Example]) -> None:
    """Refuse examples that are not choice questions (no options), as the choice objective needs."""
    if not all(ex.options and ex.answer in ex.options for ex in examples):
        raise FuserDataError("the choice objective needs choice questions (examples with options)",
                             "train on --data choice, or drop --objective choice")


def option_log_probs(logits: Sequence[torch.Tensor], tails: Sequence[torch.Tensor]) -> torch.Tensor:
    """The options' log-probabilities ``[K]``: a softmax over their mean log-likelihood per token
    (``logits[i]`` over option i's tail; its end-of-turn token not counted), differentiable."""
    return torch.log_softmax(gain.option_means(logits, tails), dim=0)


def picks(score: Callable[[Example], int], questions: Sequence[Example], path: Path, model_id: str,
          on_item: Callable[[int, int], None] | None = None) -> dict[str, int]:
    """Each question's picked option by ``score`` (a model's own scoring), measured once and kept in
    ``path`` (JSON, keyed by model and question); returns ``{question key: option index}``."""
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(known, dict):
            raise ValueError("not an object")
    except (ValueError, OSError) as err:
        log.warning("measuring the picks again: %s is unreadable (%s)", path, err)
        known = {}
    out: dict[str, int] = {}
    todo = [q for q in questions if f"{model_id}:{key(q)}" not in known]
    for n, q in enumerate(todo):
        known[f"{model_id}:{key(q)}"] = int(score(q))
        if on_item:
            on_item(n + 1, len(todo))
        if (n + 1) % 50 == 0 or n + 1 == len(todo):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, path)
    for q in questions:
        value = known[f"{model_id}:{key(q)}"]
        if not isinstance(value, int) or not 0 <= value < len(q.options):
            raise FuserDataError(f"{path}: a stored pick is not an option index ({value!r})",
                                 "delete the file; the picks are measured again")
        out[key(q)] = value
    return out


def key(question: Example) -> str:
    return hashlib.blake2b(json.dumps([question.prompt, list(question.options)]).encode(),
                           digest_size=12).hexdigest()


def scorer(model: Any, tokenizer: Any) -> Callable[[Example], int]:
    """A model's own pick for a choice question: the benchmark's ``loglik_mean`` under its template."""
    from ..evals.questions import Question
    from ..hf import scoring

    def score(q: Example) -> int:
        question = Question("q", q.subject.rsplit(".", 1)[0] or "stdlib", q.prompt, q.options, answer_index(q))
        return scoring.score(model, tokenizer, question, "loglik_mean").predicted

    return score


def keep(questions: Sequence[Example], rule: str, sharer: dict[str, int]) -> list[Example]:
    """The training questions ``rule`` keeps: all, or those the sharer answers right."""
    if rule not in FILTERS:
        raise FuserDataError(f"unknown choice filter {rule!r}", f"use one of {', '.join(FILTERS)}")
    if rule == "none":
        return list(questions)
    return [q for q in questions if sharer[key(q)] == answer_index(q)]
