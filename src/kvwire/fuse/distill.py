"""Sharer-written responses (distillation): the sharer's own greedy answer to a knowledge question
becomes the response the receiver is trained on.

Ground-truth responses (:mod:`kvwire.fuse.dense`) include what neither model knows: a fuser
can lower that loss only by adapting the receiver, which LoRA does as well. The sharer's own
answer is, by construction, in the sharer's cache of the question: a fused receiver can learn
to say it only by reading that cache. That is the signal a fuser exists for (issue 21, kind c).

:func:`distill` answers each knowledge example's question with the sharer, greedily, in
batches (:func:`kvwire.hf.greedy.greedy_batch`), and keeps every answer in a JSONL cache beside the
data (keyed by the sharer's fingerprint, the question and the token limit), so an interrupted
run loses at most one batch and a second run costs nothing. Code continuations keep their
ground truth: a window's next lines are the sharer's to read already. Validation examples are
never distilled: held-out loss is always measured against the truth.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import FuserDataError
from .dense import KNOWLEDGE_KINDS
from .stdlib_qa import Example

log = logging.getLogger(__name__)

MAX_NEW_TOKENS = 32
BATCH = 64  # decode reads all the weights each step: a wide batch costs little more than a narrow one


def cache_key(fingerprint: str, prompt: str, max_new_tokens: int) -> str:
    """What a cached answer is valid for: these sharer weights, this question, this token limit."""
    return hashlib.blake2b(f"{fingerprint}\0{max_new_tokens}\0{prompt}".encode(), digest_size=16).hexdigest()


def load_cache(path: Path) -> dict[str, str]:
    """The answers kept at ``path`` (``{}`` if none). A torn last line (a run killed mid-write) is
    dropped with a warning; a bad line anywhere else is refused."""
    if not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    answers: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("key"), str) \
                    or not isinstance(row.get("answer"), str):
                raise ValueError("expected {\"key\": str, \"answer\": str}")
        except ValueError as err:
            if number == len(lines):
                log.warning("%s: dropping a torn last line (%s)", path, err)
                break
            raise FuserDataError(f"{path}:{number}: not a distilled answer ({err})",
                                 "delete the file; the sharer's answers are computed again") from None
        answers[row["key"]] = row["answer"]
    return answers


def distill(examples: Sequence[Example], party: Any, cache: Path, max_new_tokens: int = MAX_NEW_TOKENS,
            batch: int = BATCH, on_item: Callable[[int, int], None] | None = None) -> tuple[list[Example], dict]:
    """``examples`` with each knowledge example's answer replaced by the sharer's greedy answer
    (``party``: a :class:`kvwire.fuse.train.Party`). An empty answer drops its example. Returns the
    examples and what was done, for the data folder's record."""
    from ..hf.greedy import greedy_batch

    fingerprint = party.spec.fingerprint
    known = load_cache(cache)
    todo = [ex for ex in examples if ex.kind in KNOWLEDGE_KINDS]
    missing = list({cache_key(fingerprint, ex.prompt, max_new_tokens): ex for ex in todo
                    if cache_key(fingerprint, ex.prompt, max_new_tokens) not in known}.items())
    cache.parent.mkdir(parents=True, exist_ok=True)
    done = len(todo) - len(missing)
    if on_item:
        on_item(done, len(todo))
    with cache.open("a", encoding="utf-8") as f:
        for start in range(0, len(missing), batch):
            chunk = missing[start: start + batch]
            rows = greedy_batch(party.model, [_prompt_ids(party.tokenizer, ex.prompt) for _, ex in chunk],
                                max_new_tokens)
            for (key, _), tokens in zip(chunk, rows):
                known[key] = whole_sentences(party.tokenizer.decode(tokens, skip_special_tokens=True).strip(),
                                             cut=len(tokens) >= max_new_tokens)
                f.write(json.dumps({"key": key, "answer": known[key]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            if on_item:
                on_item(done + min(start + batch, len(missing)), len(todo))
    out, replaced, dropped = [], 0, 0
    for ex in examples:
        if ex.kind not in KNOWLEDGE_KINDS:
            out.append(ex)
            continue
        answer = known[cache_key(fingerprint, ex.prompt, max_new_tokens)]
        if not answer:
            dropped += 1
            continue
        replaced += int(answer != ex.answer)
        out.append(replace(ex, answer=answer))
    info = {"sharer": party.name, "sharer_fingerprint": fingerprint, "max_new_tokens": max_new_tokens,
            "distilled": len(todo) - dropped, "dropped_empty": dropped, "differs_from_truth": replaced,
            "kept_truth": len(out) - (len(todo) - dropped)}
    return out, info


def whole_sentences(answer: str, cut: bool) -> str:
    """An answer the token limit ``cut`` ends at its last whole sentence, where it has one: the
    receiver is trained to end its turn there, not after half a word."""
    if not cut:
        return answer
    end = max(answer.rfind(". "), answer.rfind(".\n"), answer.rfind("`."))
    return answer[: end + 1 + (answer[end] == "`")].strip() if end > 0 else answer


def _prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    from .. import hf

    text = hf.render_chat(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)
