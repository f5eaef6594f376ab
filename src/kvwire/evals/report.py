"""What ``kvwire eval`` reports, computed from its result lines alone (no model, no transformers).

A run's results file (:mod:`kvwire.pipeline.evaluation` writes it) is JSON lines: one header, then one line per
finished (task, mode). :func:`summarize` reads those records and gives, per mode, on the tasks
that mode and text mode both finished (paired):

- ``pass@1`` with its 95 % Wilson interval (greedy decoding: one sample a task);
- beside text: tasks ``gained`` (pass here, fail in text) and ``lost``, and the exact McNemar
  ``p`` (two-sided binomial test on the discordant pairs; 1.0 when there are none);
- ``consistency``: the share of tasks whose final reply is identical to text mode's; for a
  judge (a reply that names ``Candidate: N``), ``judge_consistency``: the share choosing the same;
- ``reuse``: over agents 2..N (the first receives nothing), the context tokens served from
  received caches and not recomputed, over those agents' context tokens;
- ``speedup`` (text's end-to-end seconds over this mode's, summed over tasks) and
  ``ttft_speedup`` (the same for the summed TTFT of agents 2..N);
- ``ttft_bound``: the TTFT ratio the tokens alone allow -- text's context tokens of agents 2..N
  over the ones this mode computed (its context less what it served from received caches).
  A prefill's cost follows its tokens on a CPU, so this is what a splice free of overhead would
  reach: it says how much of a missed TTFT target is the agents' own tokens and the recompute
  share (which no speed-up of the splice itself removes) and how much the splice's own work;
- ``kl``: the mean teacher-forced next-token KL of agents 2..N against text, where measured.
- ``guarded``: the tasks on which the fidelity guard recomputed a splice (``--recompute-guard``); the time it cost
  is in the mode's TTFT and end to end.

Example: text passes tasks {1, 2}, splice {1, 3} of three -> gained 1, lost 1, p = 1.0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from .stats import wilson

_CANDIDATE = re.compile(r"candidate\s*(?:#|no\.?|number)?\s*:?\s*\**\s*([0-9]+|[A-C]\b)", re.I)


def mcnemar_p(gained: int, lost: int) -> float:
    """Exact two-sided McNemar p over ``gained + lost`` discordant pairs. Example: (0, 5) -> 0.0625; (3, 3) -> 1."""
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def chosen_candidate(reply: str) -> str | None:
    """The candidate a judge's reply names first (``Candidate: 2``, ``candidate #2``, ``Candidate B``), or None."""
    match = _CANDIDATE.search(reply)
    return match.group(1).upper() if match else None


@dataclass(frozen=True)
class ModeSummary:
    mode: str
    tasks: int  # tasks this mode finished
    passed: int
    pass_at_1: float
    ci95: tuple[float, float]
    paired: int  # tasks both this mode and text finished
    gained: int | None = None  # None for text itself
    lost: int | None = None
    mcnemar_p: float | None = None
    consistency: float | None = None
    judge_consistency: float | None = None
    reuse: float = 0.0
    speedup: float | None = None
    ttft_speedup: float | None = None
    ttft_bound: float | None = None
    kl: float | None = None
    seconds: float = 0.0  # this mode's end-to-end seconds, summed over its tasks
    guarded: int = 0  # tasks where the fidelity guard recomputed a splice (kvwire.kv.splice.Recompute.guard)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Iterable[dict[str, Any]]) -> list[ModeSummary]:
    """One :class:`ModeSummary` per mode, text first, in the order modes first appear."""
    by_mode: dict[str, dict[str, dict[str, Any]]] = {}
    for record in records:
        by_mode.setdefault(record["mode"], {})[record["task"]] = record
    text = by_mode.get("text", {})
    order = (["text"] if "text" in by_mode else []) + [m for m in by_mode if m != "text"]
    return [_summary(mode, by_mode[mode], text) for mode in order]


def _summary(mode: str, mine: dict[str, dict[str, Any]], text: dict[str, dict[str, Any]]) -> ModeSummary:
    passed = sum(bool(r["passed"]) for r in mine.values())
    low, high = wilson(passed, len(mine)) if mine else (0.0, 0.0)
    later_context = sum(r["context_later"] for r in mine.values())
    reuse = sum(r["reused_later"] for r in mine.values()) / later_context if later_context else 0.0
    kls = [r["kl"] for r in mine.values() if r.get("kl") is not None]
    guarded = sum(any(a.get("guarded_tokens") for a in r.get("agents", [])) for r in mine.values())
    base = ModeSummary(mode, len(mine), passed, passed / len(mine) if mine else 0.0, (low, high), 0, reuse=reuse,
                       kl=sum(kls) / len(kls) if kls else None, seconds=sum(r["total_s"] for r in mine.values()),
                       guarded=guarded)
    if mode == "text":
        return replace(base, paired=len(mine))
    both = [t for t in mine if t in text]
    if not both:
        return base
    gained = sum(bool(mine[t]["passed"]) and not text[t]["passed"] for t in both)
    lost = sum(bool(text[t]["passed"]) and not mine[t]["passed"] for t in both)
    same = sum(mine[t]["final"] == text[t]["final"] for t in both)
    choices = [(chosen_candidate(mine[t]["final"]), chosen_candidate(text[t]["final"])) for t in both]
    choices = [(a, b) for a, b in choices if b is not None]
    their_s, our_s = sum(text[t]["total_s"] for t in both), sum(mine[t]["total_s"] for t in both)
    their_ttft, our_ttft = sum(text[t]["ttft_later_s"] for t in both), sum(mine[t]["ttft_later_s"] for t in both)
    their_tokens = sum(text[t]["context_later"] for t in both)
    our_tokens = sum(mine[t]["context_later"] - mine[t]["reused_later"] for t in both)
    return ModeSummary(
        mode, len(mine), passed, base.pass_at_1, (low, high), len(both), gained, lost, mcnemar_p(gained, lost),
        same / len(both), sum(a == b for a, b in choices) / len(choices) if choices else None, reuse,
        their_s / our_s if our_s else None, their_ttft / our_ttft if our_ttft else None,
        their_tokens / our_tokens if our_tokens else None, base.kl, base.seconds, guarded)
