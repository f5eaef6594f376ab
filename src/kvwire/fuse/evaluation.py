"""What a fuser training run measures at every evaluation, and the best checkpoint it keeps.

On the validation modules' examples: the response loss of the trained module, of the
receiver alone and of the other-context control (the trained module fed another module's
sharer K/V), per token and per character; on the bundled multiple-choice questions: each
option's mean log-likelihood, for the same three paths. The evaluation with the lowest
held-out loss is saved as ``out/best`` and becomes the final checkpoint, with its gain
(:mod:`kvwire.fuse.gain`). :class:`Evaluation` is one part of :class:`kvwire.fuse.train.Trainer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from ..errors import FuserError
from . import checkpoint as ckpt
from . import gain
from .data import Record
from .train_config import EvalRecord


class Evaluation:
    """Held-out loss, the bundled questions, the control, the best checkpoint (a part of the trainer)."""

    @torch.no_grad()
    def evaluate(self) -> EvalRecord:
        """Held-out answer loss and letter accuracy, for the trained module and the receiver alone
        (and, with a sharer, its own accuracy and how often the trained module picks its letter)."""
        if not self.val:
            raise FuserError("no validation examples")
        self.module.eval()
        share = lambda xs: None if xs is None else sum(xs) / len(xs)  # noqa: E731
        loss, accuracy, picks, per_char = self._score("fused")
        if self._baseline is None:
            alone = self._score("alone")
            self._baseline = (alone[0], alone[1], alone[3])
        control = self._score("control") if self.config.method == "fuser" else None
        control_accuracy = None
        if self.val_options:  # the choice objective: held-out accuracy over the options, as the benchmark scores
            accuracy = share(self._choices_right("fused", self.val_options))
            if self._baseline[1] is None:
                self._baseline = (self._baseline[0], share(self._choices_right("alone", self.val_options)),
                                  self._baseline[2])
            if control is not None:
                control_accuracy = share(self._choices_right("control", self.val_options))
        mc = self._questions_right("fused") if self.questions else None
        if self.questions and self._mc_baseline is None:
            self._mc_baseline = self._questions_right("alone")
        mc_control = self._questions_right("control") if self.questions and control is not None else None
        sharer_picks = [self._sharer_pick(r) for r in self.val]
        agree = [p == q for p, q in zip(picks, sharer_picks) if p is not None and q is not None]
        right = [q == r.answer for q, r in zip(sharer_picks, self.val) if q is not None]
        counts = [sum(1 for p in picks if p == letter) for letter in range(4)] if any(
            p is not None for p in picks) else None
        record = EvalRecord(self.step, loss, accuracy, self._baseline[0], self._baseline[1], len(self.val),
                            sum(agree) / len(agree) if agree else None, sum(right) / len(right) if right else None,
                            counts, per_char, self._baseline[2], control[0] if control else None,
                            control[3] if control else None, share(mc), share(self._mc_baseline), share(mc_control),
                            None if mc is None else {"fused": mc, "alone": list(self._mc_baseline or []),
                                                     **({"control": mc_control} if mc_control else {})},
                            control_accuracy)
        self.evals.append(record)
        self._log({"step": self.step, "eval": asdict(record)})
        return record

    def _sharer_pick(self, record: Record) -> int | None:
        if self.store is None or record.choices is None:
            return None
        letters = self._sharer_kv(record).letters
        return None if letters is None else int(letters.argmax())

    def _eval_logits(self, records: Sequence[Record], path: str,
                     others: Sequence[Record | None] | None = None) -> list[torch.Tensor]:
        """Logits of ``path``: ``fused`` (the trained module), ``alone`` (the receiver alone; for LoRA
        its adapters disabled) or ``control`` (fused, reading ``others``' sharer K/V)."""
        if path == "alone" and self.config.method == "lora":
            with self.module.disable_adapter():
                return self._logits(records, fused=False)
        return self._logits(records, fused=path != "alone", others=others if path == "control" else None)

    def _score(self, path: str) -> tuple[float, float | None, list[int | None], float]:
        """(mean answer loss per token, letter accuracy, each record's picked letter, loss per character
        of the responses) over the validation records, on ``path`` (:meth:`_eval_logits`)."""
        total, count, chars, picks = 0.0, 0, 0, []
        size = self.config.batch
        for start in range(0, len(self.val), size):
            records = self.val[start: start + size]
            others = [self._other(self.val, i, -1) for i in range(start, start + len(records))] \
                if path == "control" else None
            for lg, record in zip(self._eval_logits(records, path, others), records):
                total += float(self._loss_sum(lg, record))
                count += record.answer_tokens
                chars += record.chars
                picks.append(int(lg[0][record.choices].argmax()) if record.choices is not None else None)
        right = [p == r.answer for p, r in zip(picks, self.val) if p is not None]
        return total / max(count, 1), (sum(right) / len(right) if right else None), picks, total / max(chars, 1)

    def _questions_right(self, path: str) -> list[bool]:
        """For each bundled question, whether ``path`` scores its right option highest (mean log-likelihood)."""
        return self._choices_right(path, [(records, question.answer) for question, records in self.questions])

    def _choices_right(self, path: str, items: Sequence[tuple[Sequence[Record], int]]) -> list[bool]:
        """For each ``(option records, right option)``, whether ``path`` scores the right one highest."""
        firsts = [records[0] for records, _ in items]
        right = []
        for i, (records, answer) in enumerate(items):
            others = [self._other(firsts, i, -2)] * len(records) if path == "control" else None
            scores = gain.option_scores(self._eval_logits(records, path, others), records)
            right.append(max(range(len(scores)), key=scores.__getitem__) == answer)
        return right

    def _evaluated(self, record: EvalRecord, on_eval: Callable[[EvalRecord], None] | None) -> None:
        """Keep ``out/best`` as the checkpoint with the lowest held-out loss so far."""
        if self.best is None or record.loss < self.best.loss:
            self.best = record
            ckpt.save(self.out / "best", self._config(record), self._weights())
        if on_eval:
            on_eval(record)
