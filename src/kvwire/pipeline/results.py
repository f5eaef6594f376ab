"""What runs produce: per-agent results, whole runs, and side-by-side comparisons."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .cost import Decision
from .fidelity import Fidelity
from ..store.metered import Traffic


@dataclass
class AgentResult:
    """One agent's turn. Times in seconds; ``transfer_s = receive_s + publish_s``."""

    agent: str
    mode: str
    context_tokens: int  # tokens the reply was generated from
    cached_tokens: int  # of those, served from upstream packets (kept as received)
    new_tokens: int
    output_text: str
    output_ids: list[int]
    ttft_s: float  # agent start -> first token (receive, tokenize, inject/splice, prefill)
    prefill_s: float  # the forward pass over the uncached tail of the context
    decode_s: float
    receive_s: float  # handoff + packets: store get, decode, verify, join, place, build cache
    compute_s: float  # model work before the prefill: splice's own prefix, selection, recompute
    publish_s: float  # extract, encode, store put, handoff
    tokenize_s: float  # building the transcript ids (incl. the template check)
    total_s: float
    packet_bytes: int  # K/V bytes this agent published (0 in text mode)
    transcript_matches_template: bool
    retokenized_turns: list[int]
    recomputed_tokens: int = 0  # splice: segment tokens recomputed (gaps not counted)
    staleness: list[float | None] = field(default_factory=list)  # splice: per spliced segment (kvwire.kv.splice)
    guarded_tokens: int = 0  # splice: spliced tokens the fidelity guard recomputed (of recomputed_tokens)
    round: int = 0
    events: list[str] = field(default_factory=list)  # rebuilds and why ("stale-fingerprint: ...")
    cache_fingerprint: str | None = None  # weights that made the cache used (None: no cache used)
    fingerprint: str = ""  # this agent's weights
    device_copy_bytes: int = 0  # K/V bytes moved between the model's device and the CPU (explicit, counted)
    decision: str = ""  # mode auto: what this hop sent and why
    select_s: float = 0.0  # splice: of compute_s, choosing which spliced tokens to recompute
    prediction: Decision | None = None  # mode auto: the predicted costs behind ``decision``
    started_at: float = 0.0  # wall clock (time.time()) at the turn's start: lays turns of processes on one axis
    traffic: Traffic = field(default_factory=Traffic)  # this turn's packet puts and gets: seconds and bytes
    fidelity: Fidelity | None = None  # vs the reference run's agent, when compared
    exact_fidelity: Fidelity | None = None  # splice: vs a no-cache recomputation of its own context ids
    approximate_via: str | None = None  # graph: the merging agent whose spliced (approximate) cache this one extends
    lossy_encoding: str | None = None  # the received cache came as packets of this lossy encoding (int8, int4, ...)
    finish_reason: str = "stop"  # "length": the reply was cut at its max_new_tokens (OpenAI's words)
    context_ids: list[int] = field(repr=False, default_factory=list)
    first_logits: torch.Tensor | None = field(repr=False, default=None)
    step_logits: torch.Tensor | None = field(repr=False, default=None)  # [n, V], kept for references

    @property
    def transfer_s(self) -> float:
        return self.receive_s + self.publish_s

    def to_json(self) -> dict[str, Any]:
        return {
            "agent": self.agent, "mode": self.mode, "context_tokens": self.context_tokens,
            "cached_tokens": self.cached_tokens, "recomputed_tokens": self.recomputed_tokens,
            "new_tokens": self.new_tokens, "ttft_s": self.ttft_s, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s, "transfer_s": self.transfer_s, "compute_s": self.compute_s,
            "select_s": self.select_s, "staleness": self.staleness, "guarded_tokens": self.guarded_tokens,
            "tokenize_s": self.tokenize_s, "total_s": self.total_s, "packet_bytes": self.packet_bytes,
            "transcript_matches_template": self.transcript_matches_template, "round": self.round,
            "events": self.events, "device_copy_bytes": self.device_copy_bytes, "decision": self.decision,
            "prediction": self.prediction.to_json() if self.prediction else None,
            "started_at": self.started_at, "receive_s": self.receive_s, "publish_s": self.publish_s,
            "packet_put_s": self.traffic.put_s, "packet_get_s": self.traffic.get_s,
            "packet_put_bytes": self.traffic.put_bytes, "packet_get_bytes": self.traffic.get_bytes,
            "fidelity": self.fidelity.to_json() if self.fidelity else None,
            "exact_fidelity": self.exact_fidelity.to_json() if self.exact_fidelity else None,
            "approximate_via": self.approximate_via, "lossy_encoding": self.lossy_encoding,
            "finish_reason": self.finish_reason,
            "output": self.output_text,
        }


@dataclass
class PipelineResult:
    pipeline: str
    mode: str
    store: str
    session: str
    agents: list[AgentResult]
    total_s: float  # wall time of the whole run (fidelity measurement excluded)
    settings: str = ""  # e.g. splice's "R=0.15"
    rebuilds: dict[str, int] = field(default_factory=dict)  # event kind -> count ("stale-fingerprint": 2)
    peak_store_bytes: int = 0  # most bytes the store held after any turn
    peak_rss_bytes: int = 0  # the process's peak resident memory so far
    batches: list[int] = field(default_factory=list)  # graph runs: agents decoded together, batch by batch

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "mode": self.mode, "settings": self.settings, "store": self.store,
                "total_s": self.total_s, "rebuilds": self.rebuilds, "peak_store_bytes": self.peak_store_bytes,
                "peak_rss_bytes": self.peak_rss_bytes, "batches": self.batches,
                "agents": [a.to_json() for a in self.agents]}


@dataclass
class AgentComparison:
    agent: str
    identical: bool  # same output ids in both modes
    same_context: bool  # both modes generated from the same ids
    exact: bool | None  # prefix: output equals a recomputation from its own ids; None for splice
    max_logit_diff: float | None  # first-token logits vs the recomputation (prefix)
    fidelity: Fidelity | None  # vs text mode
    note: str


@dataclass
class Comparison:
    """``text`` and another mode's runs of one pipeline, side by side.

    - ``speedup``       text total / candidate total
    - ``ttft_speedup``  mean TTFT of agents 2..N, text / candidate
    - ``ideal_s``       text total minus the re-prefill the candidate avoids (per agent 2..N:
                        text prefill - candidate prefill - candidate model work before it),
                        i.e. the candidate with free packets, codec, store and inject
    - ``efficiency``    speedup / ideal speedup = ideal_s / candidate total
    - ``agreement``     mean greedy token agreement with text mode over agents 2..N
    """

    text: PipelineResult
    other: PipelineResult
    agents: list[AgentComparison]

    @property
    def prefix(self) -> PipelineResult:  # the issue-2 name for the candidate
        return self.other

    @property
    def speedup(self) -> float:
        return self.text.total_s / self.other.total_s

    @property
    def ttft_speedup(self) -> float:
        text = [a.ttft_s for a in self.text.agents[1:]]
        other = [a.ttft_s for a in self.other.agents[1:]]
        return sum(text) / sum(other) if other else 1.0

    @property
    def avoided_s(self) -> float:
        return sum(t.prefill_s - o.prefill_s - o.compute_s for t, o in zip(self.text.agents[1:], self.other.agents[1:]))

    @property
    def ideal_s(self) -> float:
        return self.text.total_s - self.avoided_s

    @property
    def ideal_speedup(self) -> float:
        return self.text.total_s / self.ideal_s

    @property
    def efficiency(self) -> float:
        return self.ideal_s / self.other.total_s

    @property
    def identical(self) -> bool:
        return all(a.identical for a in self.agents)

    @property
    def exact(self) -> bool:
        return all(a.exact is not False for a in self.agents)

    @property
    def approximate(self) -> list[str]:
        """Agents whose turn makes no exactness claim: a lossy packet encoding, a spliced merge upstream, an
        approximate mode. :attr:`exact` covers the others only."""
        return [a.agent for a in self.agents if a.exact is None]

    @property
    def agreement(self) -> float:
        scores = [a.fidelity.agreement for a in self.agents[1:] if a.fidelity is not None]
        return sum(scores) / len(scores) if scores else 1.0

    @property
    def exact_agreement(self) -> float | None:
        """Mean agreement of agents 2..N with a recomputation of their own context ids (splice)."""
        scores = [a.exact_fidelity.agreement for a in self.other.agents[1:] if a.exact_fidelity is not None]
        return sum(scores) / len(scores) if scores else None

    @property
    def kl(self) -> float | None:
        scores = [a.fidelity.kl for a in self.agents[1:] if a.fidelity is not None and a.fidelity.kl is not None]
        return sum(scores) / len(scores) if scores else None

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline": self.text.pipeline, "mode": self.other.mode, "settings": self.other.settings,
            "store": self.other.store, "speedup": self.speedup, "ttft_speedup": self.ttft_speedup,
            "ideal_speedup": self.ideal_speedup, "efficiency": self.efficiency,
            "identical": self.identical, "exact": self.exact, "approximate": self.approximate,
            "agreement": self.agreement, "kl": self.kl,
            "exact_agreement": self.exact_agreement,
            "text_s": self.text.total_s, "other_s": self.other.total_s,
            "agents": [{"agent": a.agent, "identical": a.identical, "exact": a.exact,
                        "max_logit_diff": a.max_logit_diff, "note": a.note,
                        "fidelity": a.fidelity.to_json() if a.fidelity else None} for a in self.agents],
            "runs": [self.text.to_json(), self.other.to_json()],
        }
