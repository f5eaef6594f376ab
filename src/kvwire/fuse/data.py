"""Training examples -> receiver token ids, the token alignment, and the sharer's K/V on disk.

An :class:`~kvwire.fuse.stdlib_qa.Example` (a user message and the reply to learn) is
asked as a chat; each model reads it through its own chat template and tokenizer (as
in fuse mode), and :mod:`kvwire.fuse.align` maps every receiver token to the sharer
token that covers its last character (:func:`chat_aligner`). The receiver's tokens::

    <|im_start|>system ... <|im_end|> <|im_start|>user ... <|im_end|> <|im_start|>assistant \n  B <|im_end|>
    |------------------------------ context: fused ---------------------------------------| |last| |- answer -|

The prompt's tokens except the last are the *context*, whose cache is fused; the
last prompt token and the answer are the *tail*, which the receiver reads after the
fused cache; the loss covers the answer and its end-of-turn token. (The same split
as generating from a cache: the last prompt token stays uncached.)

**Sharer K/V store**: the sharer's cache of each prompt over its own tokens (what
fuse mode ships as a packet: every layer, keys rotated at positions ``0..M-1``) and,
for multiple choice, its log-probabilities of answering each letter; one safetensors
file per prompt, named by the sharer's weights and a hash of its ids, so it does not
depend on the receiver or the alignment. Stored as fp16 (about 12 KB per token for
Qwen2.5-0.5B; fp32 when a value would not fit), so training reads it instead of
running the sharer again. A file that is missing, unreadable or of the wrong shape
is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import FuserDataError
from ..hf.tokens import render_chat
from . import align
from .fuser import KV
from .stdlib_qa import LETTERS, Example

log = logging.getLogger(__name__)

MAX_CONTEXT = 1024  # receiver tokens; longer prompts are refused


@dataclass(frozen=True)
class Record:
    """One example, tokenized for both models. Receiver positions are ``0..N-1`` then ``N..N+n-1``."""

    key: str  # hash of the sharer's ids: names the example's sharer K/V file
    context_ids: torch.Tensor  # [N] receiver ids of the fused context
    tail_ids: torch.Tensor  # [n] the last prompt token, the answer, the end-of-turn token
    loss_mask: torch.Tensor  # [n - 1] bool: which next-token predictions of the tail are trained
    sharer_ids: torch.Tensor  # [M] the sharer's ids of the whole prompt
    index: torch.Tensor  # [N] receiver context token -> sharer token
    choices: torch.Tensor | None  # [4] receiver ids of "A".."D" when the answer is one of them
    answer: int  # index into choices (-1 if not multiple choice)
    chars: int = 0  # characters of the response (losses per character compare across tokenizers)
    module: str = ""  # the module the example is about (control rows read another module's sharer K/V)
    # the sharer's ids of the response and its end of turn, when its loss on the response is measured
    sharer_response_ids: torch.Tensor | None = None

    @property
    def answer_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def ids(self) -> torch.Tensor:
        """All receiver ids: context then tail ``[N + n]``."""
        return torch.cat([self.context_ids, self.tail_ids])


Aligner = Callable[[list[dict[str, str]]], tuple[list[int], list[int], torch.Tensor]]
"""``messages -> (receiver ids, sharer ids, index)``: both models' prompt ids (chat template and
generation prompt included) and, per receiver token, the sharer token it reads."""


def messages(example: Example, system: str | None = None) -> list[dict[str, str]]:
    """The chat the example's prompt is asked in (``system`` None: each model's default)."""
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": example.prompt}]


def encode(example: Example, receiver_tok: Any, end_id: int, aligner: Aligner | None,
           system: str | None = None, sharer_response: tuple[Any, int] | None = None) -> Record:
    """Tokenize ``example`` for both models and align them (``aligner`` None: receiver only).

    ``sharer_response``: ``(sharer tokenizer, its end-of-turn id)`` to tokenize the response for
    the sharer too, so that its loss on the response can be measured (:attr:`Record.sharer_response_ids`).
    """
    chat = messages(example, system)
    if aligner is not None:
        prompt_ids, sharer_ids, index_all = aligner(chat)
        index = [int(i) for i in index_all[:-1]]
    else:
        text = render_chat(receiver_tok, chat)  # as the aligner renders it: special-token strings defused
        prompt_ids, sharer_ids = list(receiver_tok(text, add_special_tokens=False)["input_ids"]), []
        index = [0] * (len(prompt_ids) - 1)
    if len(prompt_ids) < 2:
        raise FuserDataError("a rendered prompt has fewer than two tokens")
    if len(prompt_ids) - 1 > MAX_CONTEXT:
        raise FuserDataError(f"a prompt of {len(prompt_ids)} tokens is over the {MAX_CONTEXT}-token limit",
                             "shorten the example")
    answer_ids = list(receiver_tok(example.answer, add_special_tokens=False)["input_ids"]) + [end_id]
    tail = [prompt_ids[-1], *answer_ids]
    context = list(prompt_ids[:-1])
    choices, answer = None, -1
    if example.answer.strip() in LETTERS:
        letter_ids = [receiver_tok(c, add_special_tokens=False)["input_ids"] for c in LETTERS]
        if all(len(ids) == 1 for ids in letter_ids):
            choices = torch.tensor([ids[0] for ids in letter_ids])
            answer = LETTERS.index(example.answer.strip())
    response = None
    if sharer_response is not None and aligner is not None:
        sharer_tok, sharer_end = sharer_response
        response = torch.tensor([*sharer_tok(example.answer, add_special_tokens=False)["input_ids"], sharer_end])
    # the key names the sharer's prompt, and its response where the file also keeps its loss on it
    keyed = ["sharer-prompt-v2", list(sharer_ids)] + ([response.tolist()] if response is not None else [])
    digest = hashlib.blake2b(json.dumps(keyed).encode(), digest_size=16).hexdigest()
    mask = torch.ones(len(tail) - 1, dtype=torch.bool)  # every prediction from the last prompt token on
    module = example.subject.rsplit(".", 1)[0] if "." in example.subject else example.subject
    return Record(digest, torch.tensor(context), torch.tensor(tail), mask,
                  torch.tensor(list(sharer_ids), dtype=torch.long), torch.tensor(index, dtype=torch.long), choices,
                  answer, len(example.answer), module, response)


def chat_aligner(receiver_tok: Any, sharer_tok: Any) -> tuple[Aligner, str]:
    """The aligner fuse mode uses (:func:`kvwire.fuse.align.align_chat`: each model reads the chat
    through its own template; tokens matched by characters, the last covering sharer token chosen)
    and its method name, recorded in checkpoints."""
    def aligned(chat: list[dict[str, str]]) -> tuple[list[int], list[int], torch.Tensor]:
        a = align.align_chat(receiver_tok, sharer_tok, chat, select="last")
        return list(a.receiver_ids), list(a.sharer_ids), a.index

    return aligned, align.method_name("chat", "last")


def end_of_turn_id(tokenizer: Any, eos_ids: frozenset[int]) -> int:
    """The token that ends an assistant turn: the tokenizer's eos if the model stops on it."""
    if tokenizer.eos_token_id in eos_ids or not eos_ids:
        if tokenizer.eos_token_id is None:
            raise FuserDataError("the receiver's tokenizer has no end-of-sequence token")
        return int(tokenizer.eos_token_id)
    return min(eos_ids)


@dataclass(frozen=True)
class SharerEntry:
    """What the store keeps of the sharer for one example."""

    kv: dict[int, KV]  # sharer layer -> (k, v) [1, H, M, D] over its M prompt tokens, fp32, keys rotated
    letters: torch.Tensor | None  # [4] the sharer's log-probabilities of answering "A".."D" (multiple choice)
    response_nats: float | None = None  # the sharer's summed cross-entropy on the response (when measured)


class SharerStore:
    """The sharer's aligned K/V (and, for multiple choice, its answer) per example, one safetensors
    file each (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], sharer_fingerprint: str, num_layers: int) -> None:
        self.root = Path(root) / sharer_fingerprint[:16]
        self.num_layers = num_layers

    def path(self, record: Record) -> Path:
        return self.root / record.key[:2] / f"{record.key}.safetensors"

    def get(self, record: Record) -> SharerEntry | None:
        """The stored entry, or None if absent or unusable (then it is recomputed)."""
        path = self.path(record)
        if not path.is_file():
            return None
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError, ValueError) as err:
            log.warning("recomputing the sharer cache %s: %s", path.name, err)
            return None
        keys, values, letters = tensors.get("keys"), tensors.get("values"), tensors.get("letters")
        nats = tensors.get("response_nats")
        M = int(record.sharer_ids.numel())
        if keys is None or values is None or keys.dim() != 5 or keys.shape != values.shape \
                or keys.shape[0] != self.num_layers or keys.shape[1] != 1 or keys.shape[3] != M \
                or (record.choices is not None and (letters is None or letters.shape != (len(LETTERS),))) \
                or (record.sharer_response_ids is not None and (nats is None or nats.shape != (1,)
                                                                or not bool(torch.isfinite(nats).all()))):
            log.warning("recomputing the sharer cache %s: unexpected contents", path.name)
            return None
        # copies: the loaded tensors may map the file, which a later put or a damaged disk could change
        keys, values = keys.to(torch.float32, copy=True), values.to(torch.float32, copy=True)
        return SharerEntry({s: (keys[s], values[s]) for s in range(self.num_layers)},
                           letters.to(torch.float32, copy=True) if letters is not None else None,
                           float(nats[0]) if nats is not None else None)

    def response_nats(self, record: Record) -> float | None:
        """The sharer's stored loss on the record's response, read alone (not the file's K/V);
        None where absent or unusable (then :meth:`get` recomputes the entry)."""
        try:
            with safe_open(self.path(record), framework="pt") as f:
                nats = f.get_tensor("response_nats") if "response_nats" in f.keys() else None
        except (SafetensorError, OSError, ValueError):
            return None
        if nats is None or nats.shape != (1,) or not bool(torch.isfinite(nats).all()):
            return None
        return float(nats[0])

    def put(self, record: Record, kv: dict[int, KV], letters: torch.Tensor | None = None,
            response_nats: float | None = None) -> Path:
        keys = torch.stack([kv[s][0] for s in range(self.num_layers)])  # [L, 1, H, M, D]
        values = torch.stack([kv[s][1] for s in range(self.num_layers)])
        fits = max(float(keys.abs().max()), float(values.abs().max())) < 6e4
        dtype = torch.float16 if fits else torch.float32
        tensors = {"keys": keys.to(dtype).contiguous(), "values": values.to(dtype).contiguous()}
        if letters is not None:
            tensors["letters"] = letters.to(torch.float32).contiguous()
        if response_nats is not None:
            tensors["response_nats"] = torch.tensor([float(response_nats)], dtype=torch.float32)
        path = self.path(record)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(tensors, tmp)
        os.replace(tmp, path)
        return path


def letter_log_probs(logits: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """``[4]``: log P(the answer starts with "A".."D"), each letter's variants with and without a
    leading space summed (as the benchmark scores letters)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for letter in LETTERS:
        ids = {tuple(tokenizer.encode(v, add_special_tokens=False)) for v in (letter, f" {letter}")}
        singles = sorted(t[0] for t in ids if len(t) == 1)
        if not singles:
            raise FuserDataError(f"the sharer's tokenizer has no single token for {letter!r}")
        out.append(torch.logsumexp(log_probs[singles], dim=0))
    return torch.stack(out)
