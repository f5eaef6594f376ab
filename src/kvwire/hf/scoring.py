"""Scoring multiple-choice questions with a causal LM, optionally from a given cache (transformers side).

Each question (:class:`kvwire.evals.Question`) becomes one user message under the model's
own chat template, followed by the assistant's generation prompt. Then, by ``method``:

- ``"letter"``: the message lists the options as ``A. ...`` lines and asks for the letter;
  an option's score is log P(the assistant's first token is its letter), the letter
  written with or without a leading space (both token variants summed). One forward pass.
- ``"loglik"``: the message is the question alone; an option's score is the summed
  log-probability of its text as the assistant's answer, teacher forced. One forward over
  the prompt, then one per option from a copy of the prompt's cache.
- ``"loglik_mean"``: ``"loglik"`` divided by the option's token count (no bias toward short
  options).
- ``"listed"``: the message lists the options as ``- ...`` lines and asks for the correct one;
  an option's score is the mean per-token log-probability of its text as the answer. Small
  models that cannot map options to letters still show what they know this way: on the
  bundled set it separates Qwen2.5-Coder-0.5B from SmolLM2-135M best (see README).

The prediction is the highest score. **From a cache**: ``score(..., cache=c)`` takes a
``DynamicCache`` that already covers the first ``n`` tokens of the prompt (``n`` smaller
than the prompt: at least one token must be computed, as in :func:`kvwire.hf.generate`);
only the rest is computed. That is how fuse mode scores with a fused cache: build the
prompt with :func:`build_prompt`, make a cache over its first tokens, pass both. The
cache is grown in place; pass a clone to keep it.

``ItemScore.seconds`` is the wall time of the forward passes for that item (the part of
the prompt not covered by the cache, plus the options).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

from ..errors import PacketError, QuestionSetError
from ..evals.questions import Layout, Question
from .cache import cache_length, clone_cache, new_cache
from .linears import fast_linears
from .loading import model_device
from .tokens import render_chat

log = logging.getLogger(__name__)

Method = Literal["letter", "loglik", "loglik_mean", "listed"]
METHODS: tuple[str, ...] = ("letter", "loglik", "loglik_mean", "listed")
#: how each method shows the options in the question (kvwire.evals.Question.layout)
LAYOUTS: dict[str, Layout] = {"letter": "letters", "loglik": "none", "loglik_mean": "none", "listed": "list"}


@dataclass(frozen=True)
class Prompt:
    """What a model is asked for one question: the prompt ids and what each option is scored by."""

    ids: tuple[int, ...]  # chat template + generation prompt
    method: str
    option_ids: tuple[tuple[int, ...], ...] = ()  # loglik: each option's continuation
    letter_ids: tuple[tuple[int, ...], ...] = ()  # letter: each option's letter tokens (variants)


@dataclass
class ItemScore:
    """One question scored: per-option scores (higher = more likely), the prediction, the cost."""

    id: str
    scores: list[float]
    predicted: int
    answer: int
    seconds: float
    prompt_tokens: int
    cached_tokens: int = 0
    topic: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def correct(self) -> bool:
        return self.predicted == self.answer

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "topic": self.topic, "scores": self.scores, "predicted": self.predicted,
                "answer": self.answer, "correct": self.correct, "seconds": self.seconds,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, **self.extra}


def build_prompt(tokenizer: Any, question: Question, method: Method = "letter", *,
                 system: str | None = None) -> Prompt:
    """The prompt ids for ``question`` under ``tokenizer``'s chat template (see the module docstring)."""
    if method not in METHODS:
        raise QuestionSetError(f"unknown scoring method {method!r}", f"use one of {', '.join(METHODS)}")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question.layout(LAYOUTS[method])})
    text = render_chat(tokenizer, messages)  # special-token strings in a question read as plain text
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))  # the template writes any BOS itself
    if method == "letter":
        letters = []
        for letter in question.letters:
            variants = {tuple(tokenizer.encode(v, add_special_tokens=False)) for v in (letter, f" {letter}")}
            singles = tuple(sorted(v[0] for v in variants if len(v) == 1))
            if not singles:
                raise QuestionSetError(f"the tokenizer has no single token for the letter {letter!r}",
                                       "score this model with method='loglik'")
            letters.append(singles)
        if len({t for group in letters for t in group}) != sum(len(g) for g in letters):
            raise QuestionSetError("two option letters share a token under this tokenizer", "use method='loglik'")
        return Prompt(ids, method, letter_ids=tuple(letters))
    options = tuple(tuple(tokenizer.encode(option, add_special_tokens=False)) for option in question.options)
    return Prompt(ids, method, option_ids=options)


@torch.inference_mode()
def score(model: Any, tokenizer: Any, question: Question, method: Method = "letter", *,
          cache: DynamicCache | None = None, prompt: Prompt | None = None) -> ItemScore:
    """Score every option of ``question`` (see the module docstring); ``cache`` covers a prompt prefix."""
    prompt = prompt or build_prompt(tokenizer, question, method)
    if prompt.method != method:
        raise QuestionSetError(f"the prompt was built for method {prompt.method!r}, not {method!r}")
    cached = cache_length(cache)
    if cached >= len(prompt.ids):
        raise PacketError(f"the cache covers {cached} tokens but the prompt has {len(prompt.ids)}",
                          "leave at least one prompt token uncached")
    cache = cache if cache is not None else new_cache(model)
    start = time.perf_counter()
    device = model_device(model)
    rest = torch.tensor([prompt.ids[cached:]], dtype=torch.long, device=device)
    with fast_linears(model, rest.numel(), 1):
        out = model(input_ids=rest, past_key_values=cache, use_cache=True, logits_to_keep=1)
    last = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # [V]: the first answer token
    if method == "letter":
        scores = [float(torch.logsumexp(last[list(group)], dim=0)) for group in prompt.letter_ids]
    else:
        scores = []
        for ids in prompt.option_ids:
            logprob = float(last[ids[0]])
            if len(ids) > 1:
                branch = clone_cache(cache, model)
                with fast_linears(model, len(ids) - 1, len(ids) - 1):
                    step = model(input_ids=torch.tensor([ids[:-1]], dtype=torch.long, device=device),
                                 past_key_values=branch, use_cache=True).logits[0].float()  # [n-1, V]: predicts ids[1:]
                next_ids = torch.tensor(ids[1:], device=device)[:, None]
                logprob += float(torch.log_softmax(step, dim=-1).gather(1, next_ids).sum())
            scores.append(logprob / len(ids) if method in ("loglik_mean", "listed") else logprob)
    seconds = time.perf_counter() - start
    predicted = max(range(len(scores)), key=lambda i: scores[i])
    return ItemScore(question.id, scores, predicted, question.answer, seconds, len(prompt.ids), cached,
                     question.topic)


def score_all(model: Any, tokenizer: Any, questions: Sequence[Question], method: Method = "letter", *,
              on_item: Callable[[int, ItemScore], None] | None = None) -> list[ItemScore]:
    """Score every question from scratch (no cache); ``on_item(index, result)`` after each (progress)."""
    results = []
    for index, question in enumerate(questions):
        results.append(score(model, tokenizer, question, method))
        if on_item is not None:
            on_item(index, results[-1])
    return results
