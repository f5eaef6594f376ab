"""The sharer's side of fuser training, done once per example before any step: its K/V of each
prompt and its loss on each response, kept in a :class:`~kvwire.fuse.data.SharerStore`; and the gap
filter that keeps the examples where the sharer knows more than the receiver.

:class:`SharerPrecompute` is one part of :class:`kvwire.fuse.train.Trainer` (it reads the
trainer's records, models and store): the trainer's steps then cost only the receiver.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import hf
from ..errors import FuserDataError, FuserError
from .data import Record, letter_log_probs
from .fuser import KV

log = logging.getLogger(__name__)

PRECOMPUTE_TOKENS = 1536  # padded sharer tokens per precompute batch


class SharerPrecompute:
    """The sharer's K/V and response losses, and the gap filter (a part of the trainer)."""

    def prepare_sharer(self, on_item: Callable[[int, int], None] | None = None) -> int:
        """Compute the sharer's K/V of every example the run will still read (its remaining steps,
        calibration and validation) that is not yet stored; returns how many were computed."""
        if self.store is None:
            return 0
        c = self.config
        seen: set[str] = set()
        records = []
        remaining = range(self.position, c.steps * c.batch) if self.step < c.steps else range(0)
        # with the gap filter, every training example's sharer loss is needed before the first step
        reads = self.train if c.min_gap is not None and self.step == 0 else (self._record_at(p) for p in remaining)
        candidates = [*(self.train[: c.calibration_examples] if self.step == 0 else []), *reads, *self.val,
                      *(r for _, records in self.questions for r in records[:1])]
        for record in candidates:
            if record.key not in seen:
                seen.add(record.key)
                records.append(record)
        missing = [r for r in records if self.store.get(r) is None]
        if on_item:
            on_item(len(records) - len(missing), len(records))
        # shortest first, in batches of about PRECOMPUTE_TOKENS padded tokens: rows of like length waste
        # little on padding (knowledge questions are ~80 sharer tokens, code windows ~350)
        missing.sort(key=lambda r: r.sharer_ids.numel())
        done = 0
        while done < len(missing):
            longest = int(missing[min(done + 15, len(missing) - 1)].sharer_ids.numel())  # of the next 16
            size = max(1, min(16, PRECOMPUTE_TOKENS // longest))
            batch = missing[done: done + size]
            self._compute_sharer(batch)
            done += len(batch)
            if on_item:
                on_item(len(records) - len(missing) + done, len(records))
        return len(missing)

    def _compute_sharer(self, records: Sequence[Record]) -> None:
        """Run the sharer over the records' prompts as one left-padded batch and store each row."""
        assert self.store is not None and self.sharer is not None
        M = max(r.sharer_ids.numel() for r in records)
        ids = torch.zeros(len(records), M, dtype=torch.long)
        mask = torch.zeros(len(records), M, dtype=torch.long)
        for b, r in enumerate(records):
            ids[b, M - r.sharer_ids.numel():] = r.sharer_ids
            mask[b, M - r.sharer_ids.numel():] = 1
        keys, values, logits = hf.context_kv(self.sharer.model, ids, mask, with_logits=True)
        for b, r in enumerate(records):
            pad = M - r.sharer_ids.numel()
            letters = letter_log_probs(logits[b], self.sharer.tokenizer) if r.choices is not None else None
            kv = {s: (k[b:b + 1, :, pad:], v[b:b + 1, :, pad:]) for s, (k, v) in enumerate(zip(keys, values))}
            self.store.put(r, kv, letters, self._sharer_response_nats(r, kv, logits[b]))

    @torch.no_grad()
    def _sharer_response_nats(self, record: Record, kv: dict[int, KV], last: torch.Tensor) -> float | None:
        """The sharer's summed cross-entropy on the record's response, read after its prompt's cache."""
        response = record.sharer_response_ids
        if response is None or self.sharer is None:
            return None
        nats = torch.nn.functional.cross_entropy(last[None].float(), response[:1], reduction="sum")
        if response.numel() > 1:
            rest = hf.continuation_logits(self.sharer.model, [kv[s][0] for s in range(len(kv))],
                                          [kv[s][1] for s in range(len(kv))], response[None, :-1])[0]
            nats = nats + torch.nn.functional.cross_entropy(rest.float(), response[1:], reduction="sum")
        return float(nats)

    @torch.no_grad()
    def gaps(self, on_item: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """Per training example (by key): the receiver's loss on its response minus the sharer's, in nats
        per character -- large where only the sharer knows the answer. Each model's loss is measured
        once and kept (the sharer's in its K/V file, the receiver's in ``receiver-*.json`` beside them)."""
        assert self.store is not None
        path = self.store.root / f"receiver-{self.receiver.spec.fingerprint[:16]}.json"
        try:
            known = {k: float(v) for k, v in json.loads(path.read_text()).items()} if path.is_file() else {}
        except (ValueError, TypeError, AttributeError, OSError):
            log.warning("measuring the receiver's losses again: %s is unreadable", path)
            known = {}
        missing = [r for r in self.train if r.key not in known]
        size = 8
        for start in range(0, len(missing), size):
            records = missing[start: start + size]
            for lg, record in zip(self._logits(records, fused=False), records):
                known[record.key] = float(self._loss_sum(lg, record))
            if on_item:
                on_item(min(start + size, len(missing)), len(missing))
        if missing:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, path)
        out = {}
        for record in self.train:
            sharer = self.store.response_nats(record)  # one scalar, not the file's K/V
            if sharer is None:
                sharer = self._sharer_kv(record).response_nats
            if sharer is None:
                raise FuserError("the sharer's loss on a training response was not measured",
                                 "train a fuser with a sharer (the gap filter needs both models)")
            out[record.key] = (known[record.key] - sharer) / max(record.chars, 1)
        return out

    def filter_by_gap(self, gaps: dict[str, float]) -> dict[str, Any]:
        """Keep the training examples whose gap (:meth:`gaps`) is at least ``config.min_gap``; returns
        what was kept, for the run's record."""
        threshold = self.config.min_gap
        if threshold is None:
            return {}
        before = len(self.train)
        kept = [r for r in self.train if gaps[r.key] >= threshold]
        if len(kept) < 2 * self.config.batch:
            raise FuserDataError(f"only {len(kept)} of {before} training examples have a gap of at least "
                                 f"{threshold} nats per character", "lower --min-gap")
        keys = {r.key for r in kept}
        self.examples["train"] = [ex for ex, r in zip(self.examples["train"], self.train) if r.key in keys]
        self.train = kept
        self._order = (-1, torch.empty(0))
        values = sorted(gaps.values())
        info = {"min_gap": threshold, "kept": len(kept), "of": before,
                "gap_median_all": values[len(values) // 2],
                "gap_mean_kept": sum(gaps[r.key] for r in kept) / len(kept)}
        self.data_info["gap_filter"] = info
        return info
