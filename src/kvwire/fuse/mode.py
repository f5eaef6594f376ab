"""Fuse mode: a sharer agent reads the context on one model; a receiver on another generates from the fused cache.

Data flow (the sharer's cache travels through the store like any packet)::

    sharer    messages -> its ids -> hf.prefill (no generation) -> hf.extract -> packet
              -> chain.publish (codec -> store)
    receiver  store -> codec -> packet (chain.receive: checked against the projector's sharer spec)
              -> align (each receiver token <- a sharer token over the same characters)
              -> sharer keys RoPE-stripped, gathered per mapped sharer layer
              -> its own cache of the context (hf.prefill) -> projector: fused K/V -> receiver packet
              -> hf.build_cache -> hf.generate (or scoring)

The fused cache covers the receiver's context except its last token (generation
starts there, as from any prefix cache). Which text the sharer reads follows the
alignment the projector was made with (:func:`kvwire.fuse.align.parse_method`):
``chat`` -- each model its own chat rendering of the messages (its own default system
prompt and markers); ``text`` -- both read the receiver's rendering.

:meth:`FuseRunner.compare` runs four paths on the same messages, each timed end to end
(the sharer's work included where the path uses the sharer):

- ``receiver``: the receiver alone reads the messages;
- ``sharer``: the sharer alone (its own chat template);
- ``text``: text-to-text -- the sharer writes a reply (``hint_tokens``), appended to the
  last user message for the receiver, which reads it all and answers;
- ``fuse``: the sharer prefills, the receiver generates from the fused cache.

A sharer and receiver with different specs and no projector are refused
(:class:`~kvwire.errors.NoFuserError`), as is a projector made for another pair
(:class:`~kvwire.errors.CheckpointError`) or a sharer packet that covers other tokens than
the aligned context (:class:`~kvwire.errors.AlignmentError`).
"""

from __future__ import annotations

import difflib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..kv import chain
from .. import hf
from ..wire import rope as rope_math
from ..wire.options import CodecOptions
from ..errors import AlignmentError, FuserError, NoFuserError
from ..wire.packet import Packet
from ..store import Store, open_store
from . import align, checkpoint
from .projector import Projector

log = logging.getLogger(__name__)

PathName = Literal["receiver", "sharer", "text", "fuse"]
PATHS: tuple[PathName, ...] = ("receiver", "sharer", "text", "fuse")
HINT_INTRO = "Another assistant's answer, for reference:"


@dataclass(frozen=True)
class FuseOptions:
    """Generation settings shared by every path."""

    max_new_tokens: int = 48
    hint_tokens: int = 64  # text-to-text: tokens the sharer writes for the receiver
    hint_intro: str = HINT_INTRO

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "hint_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FuserError(f"{name} must be a whole number >= 1, got {value!r}")


@dataclass
class Fused:
    """A fused cache ready for the receiver, and what making it cost (seconds)."""

    cache: Any  # hf DynamicCache covering ids[:-1]
    ids: list[int]  # the receiver's whole context (its last token is not cached)
    alignment: align.Alignment
    sharer_s: float  # the sharer's prefill
    publish_s: float  # extract + encode + store put
    receive_s: float  # store get + decode + verify
    own_s: float  # the receiver's own prefill of the context
    fuse_s: float  # align + strip + project + build the cache
    packet_bytes: int

    @property
    def total_s(self) -> float:
        return self.sharer_s + self.publish_s + self.receive_s + self.own_s + self.fuse_s


@dataclass
class PathResult:
    """One path's answer and its end-to-end time (seconds)."""

    path: str
    output_text: str
    output_ids: list[int]
    context_tokens: int
    total_s: float
    sharer_s: float = 0.0  # sharer's work: prefill (fuse) or prefill + writing the hint (text)
    transfer_s: float = 0.0  # fuse: publish + receive
    fuse_s: float = 0.0  # fuse: align + project + build, plus the receiver's own prefill of the context
    prefill_s: float = 0.0  # the answering model's prefill of what it had not cached
    decode_s: float = 0.0
    hint: str = ""  # text path: what the sharer wrote
    packet_bytes: int = 0
    first_logits: torch.Tensor | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "output": self.output_text, "context_tokens": self.context_tokens,
                "new_tokens": len(self.output_ids), "total_s": self.total_s, "sharer_s": self.sharer_s,
                "transfer_s": self.transfer_s, "fuse_s": self.fuse_s, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "hint": self.hint, "packet_bytes": self.packet_bytes}


@dataclass
class FuseComparison:
    paths: dict[str, PathResult]
    projector: str  # the checkpoint's one-line description

    def speedup(self, fast: str = "fuse", slow: str = "text") -> float | None:
        if fast in self.paths and slow in self.paths and self.paths[fast].total_s > 0:
            return self.paths[slow].total_s / self.paths[fast].total_s
        return None

    def to_json(self) -> dict[str, Any]:
        return {"projector": self.projector, "paths": {k: v.to_json() for k, v in self.paths.items()},
                "speedup_fuse_vs_text": self.speedup()}


def no_fuser(sharer: str, receiver: str) -> NoFuserError:
    """The refusal when two different models have no projector or fuser between them, saying how to get one."""
    return NoFuserError(f"the sharer ({sharer}) and the receiver ({receiver}) run different models and no projector "
                        "or fuser was given",
                        f"fit one (kvwire fit-ridge --sharer {sharer} --receiver {receiver}) or train one "
                        f"(kvwire train-fuser ...); kvwire check {sharer} {receiver} lists what is trained")


class FuseRunner:
    """A sharer and a receiver (each a :class:`~kvwire.fuse.train.Party`) and the projector between them."""

    def __init__(self, receiver: Any, sharer: Any, projector: Projector | None,
                 config: checkpoint.CheckpointConfig | None, *, store: Store | str = "memory://",
                 options: FuseOptions | None = None, codec_options: CodecOptions | None = None) -> None:
        if projector is None or config is None:
            if receiver.spec.differences(sharer.spec):
                raise no_fuser(sharer.name, receiver.name)
            raise NoFuserError("the sharer and the receiver run the same model: no fuser is needed",
                               "pass caches directly (prefix or splice mode)")
        checkpoint.check_pair(config, receiver.spec, sharer.spec)
        if config.alignment is None:
            raise FuserError(f"the checkpoint ({config.describe()}) records no token alignment")
        self.scope, self.select = align.parse_method(config.alignment)
        self.receiver, self.sharer = receiver, sharer
        self.projector, self.config = projector, config
        self.store = open_store(store) if isinstance(store, str) else store
        self.options = options or FuseOptions()
        self.codec_options = codec_options or CodecOptions()
        self.sharer_layers = sorted({s for s in config.layer_map if s is not None})
        # a learned fuser may be trained on rotated sharer keys (rope_free=False); every other projector
        # reads them position-free
        self.strip_sharer = bool(getattr(getattr(projector, "config", None), "rope_free", True))
        self.receiver_rope = _one_table(hf.rope_tables(receiver.model, receiver.spec), receiver.name)
        self.sharer_rope = hf.rope_tables(sharer.model, sharer.spec)

    # -- the two agents ------------------------------------------------------------------------

    def alignment(self, messages: list[dict[str, str]]) -> align.Alignment:
        """How the receiver's tokens of ``messages`` map to the sharer's (the projector's method)."""
        if self.scope == "chat":
            return align.align_chat(self.receiver.tokenizer, self.sharer.tokenizer, messages, select=self.select)
        text = hf.render_chat(self.receiver.tokenizer, messages)
        return align.align_texts(self.receiver.tokenizer, self.sharer.tokenizer, text, select=self.select)

    def share(self, messages: list[dict[str, str]], session: str = "") -> tuple[str, float, float, int]:
        """The sharer agent: read the context (no generation) and publish its cache.
        Returns ``(packet id, prefill seconds, publish seconds, packet bytes)``."""
        if self.scope == "chat":
            text = hf.render_chat(self.sharer.tokenizer, messages)
        else:
            text = hf.render_chat(self.receiver.tokenizer, messages)
        ids = hf.encode_with_offsets(self.sharer.tokenizer, text)[0]
        hf.check_fits(self.sharer.model, len(ids), f"the sharer's reading of the context ({len(ids):,} tokens)")
        start = time.perf_counter()
        cache = hf.prefill(self.sharer.model, ids)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        packet = hf.extract(cache, self.sharer.spec, torch.tensor([ids]), producer=self.sharer.name, session=session)
        packet_id = chain.publish(self.store, packet, options=self.codec_options)
        return packet_id, prefill_s, time.perf_counter() - start, packet.nbytes

    def fused_cache(self, messages: list[dict[str, str]], packet_id: str) -> Fused:
        """The receiver agent's side: fetch the sharer's packet, fuse it into its own cache of
        ``messages`` (everything but the last token)."""
        start = time.perf_counter()
        received = chain.receive(self.store, packet_id, self.config.sharer.spec,  # type: ignore[union-attr]
                                 options=self.codec_options).context
        receive_s = time.perf_counter() - start
        start = time.perf_counter()
        alignment = self.alignment(messages)
        fuse_s = time.perf_counter() - start
        if received.token_ids[0].tolist() != list(alignment.sharer_ids):
            raise AlignmentError(f"the sharer's packet covers {received.length} tokens that are not its reading of "
                                 f"this context ({len(alignment.sharer_ids)} tokens)",
                                 "the sharer and the receiver must read the same messages")
        ids = list(alignment.receiver_ids)
        if len(ids) < 2:
            raise FuserError("the receiver's context has fewer than two tokens: nothing to fuse")
        start = time.perf_counter()
        own = hf.prefill(self.receiver.model, ids[:-1])
        own_s = time.perf_counter() - start
        start = time.perf_counter()
        cache = self._fuse(own, ids, alignment, received)
        fuse_s += time.perf_counter() - start
        return Fused(cache, ids, alignment, 0.0, 0.0, receive_s, own_s, fuse_s, received.nbytes)

    def fuse_other(self, messages: list[dict[str, str]], other: list[dict[str, str]]) -> Fused:
        """The other-context control: the receiver's cache of ``messages`` fused with the sharer's cache
        of ``other`` messages, spread over this context's tokens as training's control rows read it
        (:func:`kvwire.fuse.gain.control_index`). A gain that survives it is not reading the sharer."""
        from .gain import control_index

        packet_id, sharer_s, publish_s, _ = self.share(other)
        received = chain.receive(self.store, packet_id, self.config.sharer.spec,  # type: ignore[union-attr]
                                 options=self.codec_options).context
        theirs, alignment = self.alignment(other), self.alignment(messages)
        ids = list(alignment.receiver_ids)
        n, m = len(ids) - 1, len(theirs.receiver_ids) - 1
        own = hf.prefill(self.receiver.model, ids[:-1])
        cache = self._fuse(own, ids, alignment, received, theirs.index[:m][control_index(n, m)])
        return Fused(cache, ids, alignment, sharer_s, publish_s, 0.0, 0.0, 0.0, received.nbytes)

    def _fuse(self, own: Any, ids: list[int], alignment: align.Alignment, sharer_packet: Packet,
              index: torch.Tensor | None = None) -> Any:
        """``index``: the sharer token each receiver context token reads (default: the alignment's)."""
        n = len(ids) - 1
        own_packet = hf.extract(own, self.receiver.spec, torch.tensor([ids[:-1]]))
        positions = sharer_packet.positions()[0]  # [M]
        index = alignment.index[:n] if index is None else index
        with torch.inference_mode():
            shared = {}
            for s in self.sharer_layers:
                k = sharer_packet.keys[s]  # [1, H_s, M, D_s], rotated at the sharer's positions
                if self.strip_sharer:
                    k = rope_math.strip(k, self.sharer_rope[s], positions)
                shared[s] = (k.index_select(2, index), sharer_packet.values[s].index_select(2, index))
            keys, values = self.projector(list(own_packet.keys), list(own_packet.values), shared, torch.arange(n),
                                          self.receiver_rope)
        fused = Packet(spec=self.receiver.spec, keys=tuple(k.contiguous() for k in keys),
                       values=tuple(v.contiguous() for v in values), token_ids=torch.tensor([ids[:-1]]),
                       mask=torch.ones(1, n, dtype=torch.uint8), producer=f"fuse:{sharer_packet.producer}",
                       session=sharer_packet.session).validate()
        return hf.build_cache(fused, self.receiver.model, self.receiver.spec)

    def fuse(self, messages: list[dict[str, str]], session: str | None = None) -> Fused:
        """Both agents, one after the other: share, then fuse (what the ``fuse`` path times)."""
        session = session or uuid.uuid4().hex[:12]
        mine = _chat_ids(self.receiver.tokenizer, messages)  # refused before either model prefills anything
        hf.check_fits(self.receiver.model, len(mine) + self.options.max_new_tokens,
                   f"the receiver's context ({len(mine):,} tokens) plus {self.options.max_new_tokens} new tokens")
        packet_id, sharer_s, publish_s, _ = self.share(messages, session)
        fused = self.fused_cache(messages, packet_id)
        fused.sharer_s, fused.publish_s = sharer_s, publish_s
        return fused

    # -- the four paths ------------------------------------------------------------------------

    def run(self, path: PathName, messages: list[dict[str, str]]) -> PathResult:
        """One path end to end (see the module docstring)."""
        o = self.options
        start = time.perf_counter()
        if path == "receiver":
            ids = _chat_ids(self.receiver.tokenizer, messages)
            gen = hf.generate(self.receiver.model, ids, max_new_tokens=o.max_new_tokens)
            return self._result(path, self.receiver, gen, len(ids), start)
        if path == "sharer":
            ids = _chat_ids(self.sharer.tokenizer, messages)
            gen = hf.generate(self.sharer.model, ids, max_new_tokens=o.max_new_tokens)
            return self._result(path, self.sharer, gen, len(ids), start)
        if path == "text":
            hint_ids = _chat_ids(self.sharer.tokenizer, messages)
            hint = hf.generate(self.sharer.model, hint_ids, max_new_tokens=o.hint_tokens)
            hint_text = self.sharer.tokenizer.decode(hint.tokens, skip_special_tokens=True).strip()
            sharer_s = time.perf_counter() - start
            ids = _chat_ids(self.receiver.tokenizer, with_hint(messages, hint_text, o.hint_intro))
            gen = hf.generate(self.receiver.model, ids, max_new_tokens=o.max_new_tokens)
            result = self._result(path, self.receiver, gen, len(ids), start)
            result.sharer_s, result.hint = sharer_s, hint_text
            return result
        if path == "fuse":
            fused = self.fuse(messages)
            gen = hf.generate(self.receiver.model, fused.ids, cache=fused.cache, max_new_tokens=o.max_new_tokens)
            result = self._result(path, self.receiver, gen, len(fused.ids), start)
            result.sharer_s, result.transfer_s = fused.sharer_s, fused.publish_s + fused.receive_s
            result.fuse_s, result.packet_bytes = fused.own_s + fused.fuse_s, fused.packet_bytes
            return result
        raise FuserError(f"unknown path {path!r}", f"use one of {', '.join(PATHS)}")

    def compare(self, messages: list[dict[str, str]], paths: Sequence[PathName] = PATHS) -> FuseComparison:
        """Every path in ``paths`` on the same messages, in one run."""
        return FuseComparison({path: self.run(path, messages) for path in paths}, self.config.describe())

    @staticmethod
    def _result(path: str, party: Any, gen: Any, context: int, start: float) -> PathResult:
        text = party.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        return PathResult(path, text, list(gen.tokens), context, time.perf_counter() - start,
                          prefill_s=gen.prefill_s, decode_s=gen.decode_s, first_logits=gen.first_logits)


def with_hint(messages: list[dict[str, str]], hint: str, intro: str = HINT_INTRO) -> list[dict[str, str]]:
    """``messages`` with the sharer's text appended to the last user message (the text-to-text path)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        raise FuserError("text-to-text needs a user message to append the sharer's answer to")
    out = [dict(m) for m in messages]
    out[last]["content"] = f"{out[last]['content']}\n\n{intro}\n{hint}"
    return out


def repeat_overlap(reference: str, output: str) -> float:
    """How much of ``reference`` an answer repeats, in order: difflib's matching characters / len(reference).

    Example: ``repeat_overlap("def f(x): return x", "def f(x): return x")`` -> 1.0;
    an answer that drops half the characters scores about 0.5.
    """
    if not reference:
        return 1.0
    matcher = difflib.SequenceMatcher(None, reference, output, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()) / len(reference)


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return hf.encode_with_offsets(tokenizer, hf.render_chat(tokenizer, messages))[0]


def _one_table(tables: list[Any], name: str) -> Any:
    first = tables[0]
    if not all(t.same_rotation(first) for t in tables):
        raise FuserError(f"{name} rotates its layers differently (per-layer RoPE); fuse mode supports receivers "
                         "with one RoPE table")
    return first
