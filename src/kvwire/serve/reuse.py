"""Automatic reuse: find what the store already holds for a prompt; publish what a request computed.

Three stages, each on the thread it belongs to:

- :meth:`Reuse.find` (I/O thread): look the prompt up in the prefix index
  (:mod:`.prefix_index`), fetch and verify the chain found, keep the longest prefix
  whose token ids equal the prompt's; with ``--splice`` also fetch the cached segments
  of earlier completions that appear as messages. Returns a :class:`Found`.
- :meth:`Reuse.prepare` (model thread): turn a :class:`Found` into a cache: the exact
  prefix as it is, and any segments spliced after it (:func:`kvwire.kv.splice.assemble`:
  re-rotation, recompute share R).
- :meth:`Reuse.publish` (I/O thread): when a request finishes, publish the K/V of its
  prompt plus completion as a chain link continuing what it reused, point the prefix
  index's blocks at it, and (``--splice``) publish the completion as a segment, and each
  of its own user messages long enough to pay (:func:`.prompt.message_spans`): a later
  request that reads the same message after another system prompt -- a pipeline's input,
  which every agent of a team reads after its own instructions -- splices it as it does a
  completion (found by its text, in the same index).

What is never served: a packet that does not decode (corrupt, truncated, unsigned
or signed with another key under ``KVWIRE_SIGNING_KEY``), was made by other weights
(foreign), sits under the wrong id, belongs to a broken chain, or whose token ids
differ from the prompt's. Each is refused, counted by reason (:data:`REBUILD_REASONS`)
and the tokens are recomputed. Only exactly computed K/V are published as chains: a
spliced request publishes its chain only up to its first spliced token, so a server
without ``--splice`` never reads an approximation.

The store may fail at any time (:class:`StoreGuard`): the server then serves without
reuse, says so in ``/health`` and in one log line, and tries the store again after
``store_retry_s``.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kv import chain, splice
from ..kv.receive import Reason, Refusal, fetch_verified
from .. import hf
from ..wire.options import CodecOptions
from ..errors import KvwireError, OverBudget, PacketError, StoreConfigError
from ..wire.packet import Packet, join
from ..wire.spec import ModelSpec
from ..store import Store, check_store_url, open_store
from ..store.local import LocalPackets
from ..store.scoped import scoped
from ..store.redis import redact
from ..store.retrying import Breaker, StoreDown, StoreState
from .config import ServeConfig
from .generator import Kv
from .metrics import Metrics
from .prefix_index import IndexEntryError, PrefixIndex
from .prompt import MessageSpan, Substitution

log = logging.getLogger(__name__)

REBUILD_REASONS = tuple(r.value for r in Reason if r is not Reason.EXPIRED)  # a server keeps no rounds


class StoreGuard(Breaker):
    """The server's store, opened lazily and put aside while it is unreachable: the server's side of
    :mod:`kvwire.store.retrying`'s policy (a :class:`~kvwire.store.retrying.Breaker`).

    :meth:`call` runs one store operation; a :class:`StoreError` marks the store
    degraded (one warning, not one per request) and raises :class:`StoreDown`; after
    ``retry_s`` the next call tries again (reopening it if it never opened) and, on
    success, logs that the store is back.
    """

    def __init__(self, url: str, retry_s: float, on_state: Callable[[StoreState], None] = lambda state: None,
                 local_bytes: int = 0) -> None:
        super().__init__(redact(url) if url.startswith("redis") else url, self._open, retry_s, on_state)
        self.url = url
        self.local_bytes = local_bytes  # > 0: keep packets in this process in front of a redis:// store

    def open(self) -> None:  # type: ignore[override]
        """Open the store now. A bad URL raises (:class:`UnknownStoreError`, or :class:`StoreError`
        for a local store that cannot be created), and so does a Redis server that refuses this
        configuration (:class:`StoreConfigError`: a wrong password, a TLS certificate that does not
        verify, a missing database); an unreachable one leaves the server degraded, never failing."""
        check_store_url(self.url)  # a malformed URL is an error, not an outage
        if not self.url.startswith("redis"):  # redis://, rediss://, redis+cluster://, rediss+cluster://
            self.store = self._open()  # local: any error is the configuration's
            return
        super().open(raising=StoreConfigError)  # retrying every few seconds would not fix it: say so at start

    def _open(self) -> Store:
        store = open_store(self.url)
        if self.local_bytes and self.url.startswith("redis"):
            return LocalPackets(store, self.local_bytes)
        return store


@dataclass(frozen=True)
class Completion:
    """An earlier completion found in a request's messages: where its text stands, and its segment."""

    substitution: Substitution
    packet: str  # id of the segment packet holding its K/V


@dataclass
class Found:
    """What the store holds for one prompt, fetched and verified, not yet a cache."""

    context: Packet | None = None  # K/V of ids[:prefix] (rotated at 0..prefix-1)
    prefix: int = 0  # tokens of the prompt served exactly from the store
    indexed: int = 0  # tokens of the prompt whose blocks the prefix index already has
    parent: Packet | None = None  # the last whole chain link inside the prefix: a publish continues it
    segments: list[splice.Segment] = field(default_factory=list)  # earlier completions, after the prefix
    events: list[str] = field(default_factory=list)  # refusals, "reason: detail"
    lookup_s: float = 0.0
    store: StoreState = "ok"


@dataclass
class Prepared:
    """A request's starting point (model thread) and where its tokens came from: ``context`` (an exact
    prefix, shared by requests that found the same chain) or ``cache`` (a spliced context), or neither."""

    context: Packet | None  # exact K/V of ids[:prefix]
    cache: Any | None  # DynamicCache of a spliced context
    prefix: int  # exact prefix from the store
    spliced: int  # segment tokens kept as received
    recomputed: int  # segment and gap tokens recomputed while splicing
    exact_until: int | None = None  # only slots [0, exact_until) are exact (publishable as a chain); None: all
    splice_s: float = 0.0
    splice: str = ""  # segments were found: spliced, or prefilled because that was estimated cheaper (and why)
    staleness: tuple[float | None, ...] = ()  # per spliced segment (kvwire.kv.splice.Spliced.staleness)
    guarded: int = 0  # spliced tokens the fidelity guard (--splice-guard) recomputed


class Reuse:
    """Finding and publishing caches for one model in one store (see the module docstring)."""

    def __init__(self, config: ServeConfig, model: Any, tokenizer: Any, spec: ModelSpec, metrics: Metrics,
                 codec_options: CodecOptions | None = None) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        self.metrics = metrics
        self.options = codec_options if codec_options is not None else CodecOptions.from_env()
        self.index = PrefixIndex(spec.fingerprint, config.block_size)  # the store's root: no tenant, no salt
        self.guard = StoreGuard(config.store, config.store_retry_s, metrics.store_state, config.local_packet_bytes)
        self.recompute = splice.Recompute(config.splice or 0.0, guard=config.splice_guard)
        self.partial_links = not spec.has_sliding_window  # a full-attention cache cuts anywhere
        self.device = hf.model_device(model)  # contexts found move there once; published K/V come back to the CPU
        self._tables: list[Any] | None = None
        self._no_tables: KvwireError | None = None  # why this model's keys cannot be re-rotated (said once)
        self.pass_cost: Any = None  # what a forward pass costs here, in tokens: prices splice-or-prefill
        if config.reuse and config.splice is not None:
            self._measure_tables()  # the RoPE probe takes seconds: at start, not in the first spliced request's TTFT
            if config.splice_when == "cheaper" and self._tables is not None:
                self.pass_cost = hf.measure_pass_cost(model)  # ~1 s, at start: the prior fits one model only
                log.info("--splice-when cheaper: %s", self.pass_cost.describe())
        # contexts held by requests in flight, by (last chain link, length): requests that find the same
        # context get the same packet object, which the batched decoder reads once for all of them
        self._live: weakref.WeakValueDictionary[tuple[str, str, int], Packet] = weakref.WeakValueDictionary()
        if config.reuse:
            self.guard.open()
        else:
            metrics.store_state("off")

    @property
    def state(self) -> StoreState:
        return "off" if not self.config.reuse else self.guard.state

    def scope(self, namespace: str) -> tuple[PrefixIndex, Callable[[Store], Store]]:
        """The prefix index and the store view of ``namespace`` (:mod:`kvwire.serve.tenancy`): a tenant's
        block hashes are seeded with it and every key it reads or writes lies under it."""
        if not namespace:
            return self.index, lambda store: store
        return (PrefixIndex(self.spec.fingerprint, self.config.block_size, namespace),
                lambda store: scoped(store, namespace))

    # -- find (I/O thread) -------------------------------------------------------------------------

    def completions(self, messages: list[dict[str, str]], namespace: str = "") -> list[Completion]:
        """Earlier completions standing in the messages, at the start of a message or of a line in it
        (only those published in ``namespace``)."""
        found: list[Completion] = []
        if not self.config.reuse or self.config.splice is None:
            return found
        keys, view = self.scope(namespace)
        for index, message in enumerate(messages):
            content = message["content"]
            done = 0
            for start in [0] + [i + 1 for i, c in enumerate(content) if c == "\n"]:
                key = keys.completion_key(content[start:])
                if start < done or key is None:
                    continue
                try:
                    value = self.guard.call("looking up completions", lambda store, key=key: view(store).get(key))
                except StoreDown:
                    return []
                if value is None:
                    continue
                try:
                    entries = keys.parse_completions(value)
                except IndexEntryError as err:
                    self._refused([], Refusal(Reason.CORRUPT, f"{key}: {err}"))
                    continue
                for entry in reversed(entries):  # the most recent first
                    if len(entry["ids"]) < self.config.min_splice_tokens or not keys.matches(entry, content, start):
                        continue
                    stop = start + entry["chars"]
                    if self.tokenizer.decode(entry["ids"], skip_special_tokens=True) != content[start:stop]:
                        self._refused([], Refusal(Reason.MISMATCH, f"{key}: its ids do not decode to its text"))
                        continue
                    found.append(Completion(Substitution(index, start, stop, tuple(entry["ids"])), entry["packet"]))
                    done = stop
                    break
        return found

    def find(self, ids: list[int], segments: list[tuple[int, Completion]] | None = None, *,
             namespace: str = "") -> Found:
        """The longest exact prefix of ``ids`` in ``namespace`` of the store (never all of them: one token
        is left to prefill), then the cached ``segments`` ((offset in ids, completion)) that lie after it."""
        found = Found(store=self.state)
        if not self.config.reuse:
            return found
        start = time.perf_counter()
        try:
            self._find_prefix(ids, found, namespace)
            if segments:
                self._find_segments(segments, found, namespace)
        except StoreDown:
            refusal = Refusal(Reason.STORE_UNREACHABLE, str(self.guard.error))
            found.events.append(refusal.event)
            self.metrics.rebuild(refusal.reason.value)
            found.context, found.prefix, found.parent, found.segments = None, 0, None, []
        found.store = self.state
        found.lookup_s = time.perf_counter() - start
        self.metrics.prefix_query(len(ids), found.prefix)
        return found

    def _find_prefix(self, ids: list[int], found: Found, namespace: str) -> None:
        limit = len(ids) - 1
        index, view = self.scope(namespace)
        try:
            hit = self.guard.call("looking up the prefix index", lambda store: index.find(view(store), ids, limit))
        except IndexEntryError as err:
            return self._refused(found.events, Refusal(Reason.CORRUPT, str(err)))
        if hit is None:
            return None
        blocks, head = hit
        got = self.guard.call("fetching a chain", lambda store: fetch_verified(
            view(store), head, self.spec, options=self.options, store_faults="raise"))
        if isinstance(got, Refusal):
            return self._refused(found.events, got)
        links = got.links
        # the longest common prefix of the chain's tokens and the prompt (never trusting the index)
        chain_ids = torch.cat([link.token_ids[0] for link in links]).tolist()
        common = 0
        for a, b in zip(chain_ids[:limit], ids[:limit]):
            if a != b:
                break
            common += 1
        if common < blocks:
            return self._refused(found.events, Refusal(Reason.MISMATCH, f"chain {head[:12]} named by the prefix index "
                                                                        f"holds other tokens than its key's block (at "
                                                                        f"{common})"))
        whole = [link for link in links if link.end <= common]
        used = whole if not self.partial_links else links[:len(whole) + (common > (whole[-1].end if whole else 0))]
        if not used:
            return None
        prefix = min(common, sum(link.length for link in used))
        live = (namespace, used[-1].id, prefix)
        shared = self._live.get(live)  # another request of this namespace reading this very context right now
        if shared is None:
            context = join(used)
            shared = (_cut(context, prefix) if prefix < context.length else context).to(self.device)
            self._live[live] = shared
        found.context = shared
        found.prefix, found.indexed = prefix, blocks
        found.parent = whole[-1] if whole else None
        return None

    def _find_segments(self, segments: list[tuple[int, Completion]], found: Found, namespace: str) -> None:
        _, view = self.scope(namespace)
        for offset, completion in segments:
            packet_id, ids = completion.packet, list(completion.substitution.ids)
            if offset < found.prefix:
                continue  # the exact prefix already covers it
            got = self.guard.call("fetching a segment", lambda store: fetch_verified(
                view(store), packet_id, self.spec, kind="segment", ids=ids, options=self.options, store_faults="raise"))
            if isinstance(got, Refusal):
                self._refused(found.events, got)
                continue
            packet = got.head
            if packet.length:
                found.segments.append(splice.Segment(offset, packet.to(self.device)))

    def _refused(self, events: list[str], refusal: Refusal) -> None:
        events.append(refusal.event)
        self.metrics.rebuild(refusal.reason.value)
        log.warning("refused a cache from the store (%s), recomputing: %s", refusal.reason.value, refusal.message)

    # -- prepare (model thread) --------------------------------------------------------------------

    def prepare(self, found: Found, ids: list[int]) -> Prepared:
        """The starting point for ``ids``: the exact prefix, then any segments spliced in after it."""
        if not found.segments:
            return Prepared(found.context, None, found.prefix, 0, 0)
        spans = [(s.offset, s.offset + s.packet.length) for s in found.segments]
        cost = splice.estimate(len(ids), found.prefix, spans, self.recompute, self.spec.num_layers,
                               self.pass_cost)
        estimated = cost.describe()
        if self.config.splice_when == "cheaper" and not cost.splice_pays:  # exact, and sooner
            return Prepared(found.context, None, found.prefix, 0, 0,
                            splice=f"prefilled {cost.between} tokens after the exact prefix ({estimated})")
        cache = hf.build_cache(found.context, self.model, self.spec) if found.context is not None else None
        start = time.perf_counter()
        try:
            spliced = splice.assemble(self.model, self.spec, self._rope_tables(), ids, found.segments,
                                      recompute=self.recompute, placement="end", prefix=cache)
        except KvwireError as err:  # refused segments: serve the exact prefix alone
            self._refused(found.events, Refusal(Reason.MISMATCH, f"splicing: {err}"))
            return Prepared(found.context, None, found.prefix, 0, 0)
        everything = spliced.recomputed == sum(s.packet.length for s in found.segments)  # R = 1: a full prefill
        exact_until = None if everything else found.segments[0].offset
        return Prepared(None, spliced.cache, found.prefix, spliced.spliced, spliced.recomputed + spliced.gaps,
                        exact_until, time.perf_counter() - start,
                        f"spliced {len(found.segments)} segment(s) ({estimated})", tuple(spliced.staleness),
                        spliced.guarded)

    def _measure_tables(self) -> None:
        """Measure the model's RoPE tables once; a model kvwire cannot re-rotate is said once in the log."""
        if self._tables is None and self._no_tables is None:
            try:
                self._tables = hf.rope_tables(self.model, self.spec)
            except KvwireError as err:
                self._no_tables = err
                log.warning("--splice: %s; prompts are served without splicing", err)

    def _rope_tables(self) -> list[Any]:
        """The model's RoPE tables (measured at start with ``--splice``); a model kvwire cannot re-rotate is
        refused with the same error every time, without measuring again."""
        self._measure_tables()
        if self._no_tables is not None:
            raise self._no_tables
        return self._tables  # type: ignore[return-value]

    # -- publish (I/O thread) ----------------------------------------------------------------------

    def publish(self, kv: Kv, prompt: list[int], tokens: list[int], found: Found, prepared: Prepared,
                completion: tuple[list[int], str] | None = None, *, namespace: str = "",
                inputs: list[MessageSpan] | None = None) -> None:
        """Publish ``kv`` (the K/V of ``prompt + tokens`` but the last token) as a chain link
        continuing ``found.parent`` and index its blocks; with ``--splice`` also ``completion``
        (its ids and the text the client got for them, or None when they differ) and ``inputs``
        (the request's own user messages and where they stand in ``prompt``) as segments.
        A store fault or a packet over the store's budget skips the rest (logged, counted)."""
        if not self.config.reuse:
            return
        n = kv.length
        ids = prompt + tokens
        exact = n if prepared.exact_until is None else min(n, prepared.exact_until)
        provenance = {"producer": "kvwire-serve"}
        index, view = self.scope(namespace)
        try:
            parent = found.parent
            if exact > (parent.end if parent is not None else 0):
                packet = kv.extract(self.spec, parent=parent, **provenance)
                if exact < n:
                    packet = _cut(packet, exact - packet.start)
                packet = packet.to("cpu")  # a store holds CPU memory (a model on an accelerator: one copy)
                head = self.guard.call("publishing a chain link",
                                       lambda store: chain.publish(view(store), packet, options=self.options))
                self.metrics.published(packet.nbytes)
                self.guard.call("indexing prefix blocks",
                                lambda store: index.publish(view(store), ids, head, covered=exact, known=found.indexed))
            if self.config.splice is not None:
                if completion is not None and n > len(prompt):
                    self._publish_segment(kv, len(prompt), *completion, provenance, index, view)
                for message in inputs or ():
                    if message.start + len(message.ids) <= min(n, len(prompt)):
                        self._publish_segment(kv, message.start, list(message.ids), message.text, provenance, index,
                                              view, length=len(message.ids))
        except StoreDown:
            pass
        except OverBudget as err:
            log.warning("a finished request's cache is not published: %s", err)

    def _publish_segment(self, kv: Kv, start: int, ids: list[int], text: str, provenance: dict[str, Any],
                         index: PrefixIndex, view: Callable[[Store], Store], length: int | None = None) -> None:
        """Publish the K/V from ``start`` (``length`` tokens, else to the end) as the segment of ``text`` read as
        ``ids``, and index it by its text: a completion, or a request's own message."""
        if len(ids) < self.config.min_splice_tokens or index.completion_key(text) is None:
            return
        segment = kv.extract(self.spec, start=start, **provenance)
        segment = (segment if length is None else _cut(segment, length)).to("cpu")  # its K/V, and nothing after
        segment_id = self.guard.call("publishing a completion segment",
                                     lambda store: chain.publish(view(store), segment, options=self.options))
        self.metrics.published(segment.nbytes)
        self.guard.call("indexing a completion", lambda store: index.add_completion(view(store), text, segment_id, ids))

    def close(self) -> None:
        self.guard.close()


def _cut(packet: Packet, length: int) -> Packet:
    """The first ``length`` tokens of a full-attention packet (views, no copy)."""
    if length >= packet.length:
        return packet
    if packet.spec.has_sliding_window:
        raise PacketError("a sliding-window packet keeps only its last tokens; it cannot be cut to a prefix")
    return Packet(spec=packet.spec, keys=tuple(k[:, :, :length] for k in packet.keys),
                  values=tuple(v[:, :, :length] for v in packet.values), token_ids=packet.token_ids[:, :length],
                  mask=packet.mask[:, :length], start=packet.start, attention=packet.attention,
                  rotary=packet.rotary, parent=packet.parent, parent_checksum=packet.parent_checksum,
                  producer=packet.producer, session=packet.session, round=packet.round, version=packet.version,
                  created_at=packet.created_at).validate()
