"""One verified receive: fetch a chain or a segment from a store, check it, and return it or say why not.

Every reader of packets -- an agent receiving its upstream chain, a merging agent fetching its
branches, the server looking up a prompt's prefix or an earlier completion -- goes through
:func:`fetch_verified`. It returns either a :class:`Received` (the links, root first) or a
:class:`Refusal`: a :class:`Reason` and a message. A refusal is not an error: the reader
recomputes those tokens (a *rebuild*), records the refusal and goes on. What is refused:

==================  ==============================================================  ==================
reason              what came                                                        pipeline label
==================  ==============================================================  ==================
``foreign``         a packet made by other weights (the model was updated or swapped)  stale-fingerprint
``corrupt``         a packet that does not decode (damaged, truncated, unsigned, ...)  broken-chain
``broken-chain``    a link or segment missing (evicted), or stored under a wrong id    broken-chain
``mismatch``        token ids that are not the reader's context                        broken-chain
``expired``         a chain older than the reader's :class:`Freshness` allows          expired
``store-unreachable``  the store did not answer (:class:`~kvwire.errors.StoreUnavailable`)  store-unreachable
==================  ==============================================================  ==================

The pipeline's results have recorded the coarser labels of the last column since 0.1
(``AgentResult.events``, ``PipelineResult.rebuilds``); :attr:`Refusal.pipeline_event` keeps
writing them, while the server records :attr:`Refusal.event` (the reason itself).

A store that is configured wrongly (:class:`~kvwire.errors.StoreConfigError`) is never a
refusal: rebuilding on every turn would only hide it. Example::

    got = fetch_verified(store, head, spec, ids=context_ids)
    if isinstance(got, Refusal):
        log.warning("rebuilding: %s", got)          # e.g. "foreign: packet 3f2a... was made by other weights"
    else:
        cache = hf.build_cache(got.context, model, spec)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from ..errors import ChainError, KvwireError, ModelMismatchError, PacketError, StoreConfigError, StoreError, \
    StoreUnavailable
from ..store import Store
from ..wire import codec
from ..wire.options import CodecOptions
from ..wire.packet import Packet, join
from ..wire.spec import ModelSpec
from .chain import fetch_chain, packet_key


class Reason(str, Enum):
    """Why a cache from the store is not used (the value is what the server records)."""

    FOREIGN = "foreign"
    CORRUPT = "corrupt"
    BROKEN_CHAIN = "broken-chain"
    MISMATCH = "mismatch"
    EXPIRED = "expired"
    STORE_UNREACHABLE = "store-unreachable"

    @property
    def pipeline_label(self) -> str:
        """The label pipeline results have recorded since 0.1 (see the module docstring)."""
        return _PIPELINE_LABELS.get(self, self.value)


_PIPELINE_LABELS = {Reason.FOREIGN: "stale-fingerprint", Reason.CORRUPT: "broken-chain",
                    Reason.MISMATCH: "broken-chain"}


@dataclass(frozen=True)
class Refusal:
    """A cache that must not be used: ``reason``, a human ``message``, and the error behind it (if any)."""

    reason: Reason
    message: str
    error: KvwireError | None = field(default=None, compare=False, repr=False)

    @property
    def event(self) -> str:
        """``"reason: message"``, as the server records it."""
        return f"{self.reason.value}: {self.message}"

    @property
    def pipeline_event(self) -> str:
        """``"label: message"``, as pipeline results record it (:attr:`Reason.pipeline_label`)."""
        return f"{self.reason.pipeline_label}: {self.message}"

    def __str__(self) -> str:
        return self.event

    @classmethod
    def of(cls, error: KvwireError) -> Refusal:
        """The refusal an error from fetching or checking packets stands for."""
        if isinstance(error, ModelMismatchError):
            reason = Reason.FOREIGN
        elif isinstance(error, PacketError):
            reason = Reason.CORRUPT
        elif isinstance(error, StoreUnavailable):
            reason = Reason.STORE_UNREACHABLE
        else:  # ChainError, or a damaged value the store itself refused
            reason = Reason.BROKEN_CHAIN
        return cls(reason, str(error), error)


@dataclass(frozen=True)
class Freshness:
    """How old a received cache may be before it is rebuilt instead of used."""

    max_rounds: int | None = None  # rounds between the chain's first packet and now
    max_age_s: float | None = None  # seconds since the chain's first packet was made

    def check(self, first: Packet, round: int) -> Refusal | None:
        """``None`` if a chain whose root is ``first`` may be used in ``round``; else why not."""
        if self.max_rounds is not None and round - first.round > self.max_rounds:
            return Refusal(Reason.EXPIRED, f"chain started in round {first.round}, now round {round} "
                                           f"(max {self.max_rounds} rounds)")
        age = time.time() - first.created_at
        if self.max_age_s is not None and age > self.max_age_s:
            return Refusal(Reason.EXPIRED, f"chain is {age:.0f} s old (max {self.max_age_s:g} s)")
        return None


@dataclass(eq=False)
class Received:
    """What a verified receive got: ``links`` root first (a segment: one packet)."""

    links: list[Packet]
    _context: Packet | None = field(default=None, repr=False)

    @property
    def head(self) -> Packet:
        """The last link: the packet a continuation names as its parent."""
        return self.links[-1]

    @property
    def first(self) -> Packet:
        """The root: its age is the chain's."""
        return self.links[0]

    @property
    def context(self) -> Packet:
        """One packet covering every token of the links (joined once, on first use)."""
        if self._context is None:
            self._context = self.links[0] if len(self.links) == 1 else join(self.links)
        return self._context


Kind = Literal["chain", "segment"]


def fetch_verified(store: Store, packet_id: str, spec: ModelSpec, *, kind: Kind = "chain",
                   ids: list[int] | None = None, freshness: Freshness | None = None, round: int = 0,
                   options: CodecOptions | None = None, store_faults: Literal["refuse", "raise"] = "refuse",
                   ) -> Received | Refusal:
    """Fetch the chain ending at ``packet_id`` (``kind="chain"``) or the one packet ``packet_id``
    (``"segment"``) from ``store``, and verify it: every packet decodes under ``options`` and sits
    under its own id, was made by the model ``spec`` describes, its token ids start ``ids`` (if
    given) and a chain is as fresh as ``freshness`` asks in ``round``.

    ``store_faults="raise"`` lets :class:`~kvwire.errors.StoreError` through, for a caller whose
    own store policy handles faults; otherwise a fault is a refusal (``store-unreachable``, or
    ``broken-chain`` for a damaged value). :class:`~kvwire.errors.StoreConfigError` always raises.
    """
    try:
        links = (fetch_chain(store, packet_id, options=options) if kind == "chain"
                 else [_fetch_one(store, packet_id, options)])
        for link in links:
            what = f"packet {link.id[:12]} from {link.producer or 'an agent'}" if kind == "chain" else \
                f"segment {packet_id[:12]}"
            spec.check_same_model(link.spec, what=what)
    except StoreConfigError:
        raise
    except StoreError as err:
        if store_faults == "raise":
            raise
        return Refusal.of(err)
    except (ChainError, PacketError) as err:
        return Refusal.of(err)
    received = Received(links)
    if ids is not None:
        refusal = _check_ids(received, packet_id, kind, ids)
        if refusal is not None:
            return refusal
    if freshness is not None:
        return freshness.check(received.first, round) or received
    return received


def _fetch_one(store: Store, packet_id: str, options: CodecOptions | None) -> Packet:
    data = store.get(packet_key(packet_id))
    if data is None:
        raise ChainError(f"segment {packet_id[:12]} is not in {store.url} (evicted?)",
                         "the sender must publish its segment before the handoff")
    packet = codec.decode(data, options=options)
    if packet.id != packet_id:
        raise ChainError(f"{store.url} holds a packet under id {packet_id[:12]} whose content hashes to "
                         f"{packet.id[:12]}")
    return packet


def _check_ids(received: Received, packet_id: str, kind: Kind, ids: list[int]) -> Refusal | None:
    """A refusal unless the received tokens are the first tokens of ``ids``."""
    context = received.context
    if context.batch_size == 1 and context.token_ids[0].tolist() == ids[: context.length]:
        return None
    if kind == "chain":
        return Refusal(Reason.MISMATCH, f"chain {packet_id[:12]} does not cover this context's first "
                                        f"{context.length} tokens")
    return Refusal(Reason.MISMATCH, f"segment {packet_id[:12]} holds other tokens than its completion")
