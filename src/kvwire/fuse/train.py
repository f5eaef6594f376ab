"""Training the learned fuser (both models frozen), and the LoRA-tuned receiver to compare it with.

In: a receiver and a sharer (model, tokenizer, spec), training and validation
:class:`~kvwire.fuse.stdlib_qa.Example` s, a :class:`TrainConfig`. Out, in ``out/``::

    fuser/ or lora/       the trained checkpoint (:mod:`kvwire.fuse.checkpoint`), no training state
    checkpoints/step-N/   resumable checkpoints (weights, optimizer moments, generator state, data position)
    log.jsonl             one line per step ({"step", "loss", "lr", "temperature", "tokens", "seconds"})
                          and per evaluation ({"step", "eval": {...}})
    loss.png              the training curve

**One fuser step** (nanoGPT's loop: config at the top, eval every N steps, checkpoint
and resume, the loss printed and plotted). For each of ``batch`` examples: the
receiver computes its own cache of the context (no autograd); the sharer's aligned
K/V come from the store (computed once per example, :class:`~kvwire.fuse.data.SharerStore`);
the fuser fuses them (gates sampled, temperature annealed); the receiver reads the
tail (last prompt token, answer, end of turn) after the fused cache and the loss is
the cross-entropy of the answer tokens, back-propagated through the frozen receiver
into the fuser. The step's loss is the mean over all answer tokens of the batch.

**The LoRA baseline** (``method="lora"``): the receiver alone, with LoRA adapters
(:mod:`kvwire.hf.lora`), trained on the same examples in the same order for the
same steps, with the same loss (the answer tokens after the whole prompt). A gain of
the fuser over it is a gain of fusion, not of fine-tuning on the data.

**Validation** every ``eval_every`` steps on a fixed held-out subset: the mean answer
loss and, for multiple-choice answers, the accuracy of the receiver's first answer
token among the option letters -- for the model being trained (hard gates), and once
for the receiver alone.

**Resume** restores the weights, the optimizer's moments, the gate-noise generator
and the position in the data (the example order is a seeded shuffle per epoch), so a
resumed run produces the same losses as one that never stopped (tested).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3
import torch

from .. import hf
from ..wire import rope as rope_math
from ..errors import FuserError
from ..wire.spec import ModelSpec
from . import checkpoint as ckpt
from . import choice, gain, run_folder
from .data import Aligner, Record, SharerEntry, SharerStore, encode, end_of_turn_id
from .fuser import KV, Fuser, FuserConfig
from .stdlib_qa import Example
from .stdlib_qa import save as save_examples
from .train_config import EvalRecord, StepRecord, TrainConfig, TrainResult
from .evaluation import Evaluation
from .precompute import SharerPrecompute
from .train_state import TrainState
from .trained import load_fuser, load_fuser_weights, load_lora

log = logging.getLogger(__name__)



@dataclass
class Party:
    """One model taking part: the loaded model, its tokenizer, its spec and a readable name."""

    model: Any
    tokenizer: Any
    spec: ModelSpec
    name: str

    def ref(self) -> ckpt.ModelRef:
        return ckpt.ModelRef(self.name, self.spec)


class Trainer(SharerPrecompute, Evaluation, TrainState):
    """Trains a fuser (or the LoRA baseline) for ``config.steps`` steps; see the module docstring.

    Its parts: :class:`~kvwire.fuse.precompute.SharerPrecompute` (the sharer's K/V and losses, the gap
    filter), :class:`~kvwire.fuse.evaluation.Evaluation` (held-out loss, questions, controls, the best
    checkpoint) and :class:`~kvwire.fuse.train_state.TrainState` (final and resumable checkpoints)."""

    def __init__(self, config: TrainConfig, receiver: Party, sharer: Party | None, train: Sequence[Example],
                 val: Sequence[Example], out: str | Path, *, aligner: Aligner | None = None,
                 alignment: str | None = None, store: str | Path | None = None,
                 data_info: dict[str, Any] | None = None) -> None:
        if (config.method == "fuser" or config.targets == "sharer") and (sharer is None or aligner is None
                                                                          or store is None):
            raise FuserError("training a fuser, or towards the sharer's answers, needs a sharer, a token aligner "
                             "and a sharer K/V store")
        if not train:
            raise FuserError("no training examples")
        self.config, self.receiver, self.sharer = config, receiver, sharer
        self.out = Path(out)
        self.alignment = alignment
        self.data_info = dict(data_info or {})
        self.data_fingerprint = blake3.blake3(json.dumps(  # what a resumed run must be trained on too
            [[[e.prompt, e.answer, *([list(e.options)] if e.options else [])] for e in examples]
             for examples in (train, val[: config.eval_examples])]
        ).encode()).hexdigest()
        hf.freeze(receiver.model)
        if sharer is not None:
            hf.freeze(sharer.model)
        end_id = end_of_turn_id(receiver.tokenizer, hf.eos_token_ids(receiver.model))
        use = aligner if sharer is not None else None
        response = None  # the sharer's loss on each training response is measured (the gap filter)
        if sharer is not None and config.method == "fuser":
            response = (sharer.tokenizer, end_of_turn_id(sharer.tokenizer, hf.eos_token_ids(sharer.model)))
        self.train = [encode(ex, receiver.tokenizer, end_id, use, config.system, response) for ex in train]
        self.examples = {"train": list(train), "val": list(val[: config.eval_examples])}  # as data/*.jsonl
        self.val = [encode(ex, receiver.tokenizer, end_id, use, config.system) for ex in val[: config.eval_examples]]
        # the choice objective: each example's options, one record each (all read the same sharer K/V)
        self.options: list[tuple[list[Record], int]] = []
        self.val_options: list[tuple[list[Record], int]] = []
        if config.objective == "choice":
            choice.check_questions([*train, *val])
            encoded = lambda ex: ([encode(o, receiver.tokenizer, end_id, use, config.system)  # noqa: E731
                                   for o in choice.option_examples(ex)], choice.answer_index(ex))
            self.options = [encoded(ex) for ex in train]
            self.val_options = [encoded(ex) for ex in val[: config.eval_examples]]
        self.questions = [(q, [encode(ex, receiver.tokenizer, end_id, use, config.system) for ex in q.examples])
                          for q in gain.question_examples(config.eval_questions)]
        self.store = SharerStore(store, sharer.spec.fingerprint, sharer.spec.num_layers) \
            if sharer is not None and store is not None else None
        self.rope = hf.rope_tables(receiver.model, receiver.spec)[0] if config.method == "fuser" else None
        self.sharer_rope = hf.rope_tables(sharer.model, sharer.spec) if config.method == "fuser" and sharer else None
        self.noise = torch.Generator().manual_seed(config.seed + 1)
        self.module, self.layer_map = self._build()
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        self.step = 0
        self.position = 0  # examples consumed
        self._order: tuple[int, torch.Tensor] = (-1, torch.empty(0))  # (epoch, its permutation)
        self.history: list[StepRecord] = []
        self.evals: list[EvalRecord] = []
        self._baseline: tuple[float, float | None, float | None] | None = None  # loss, accuracy, loss per char
        self._mc_baseline: list[bool] | None = None
        self.best: EvalRecord | None = None  # the evaluation with the lowest held-out loss so far

    # -- building --------------------------------------------------------------------------------

    def _build(self) -> tuple[torch.nn.Module, tuple[int | None, ...]]:
        c, r = self.config, self.receiver.spec
        if c.method == "lora":
            from ..hf import lora

            model = lora.wrap(self.receiver.model, lora.LoraSettings(rank=c.lora_rank, alpha=c.lora_alpha),
                              seed=c.seed)
            return model, ()
        assert self.sharer is not None
        s = self.sharer.spec
        layer_map = _layer_map(c.layer_map, s.num_layers, r.num_layers)
        if c.fuse_last:
            mapped = [t for t, m in enumerate(layer_map) if m is not None][-c.fuse_last:]
            layer_map = tuple(m if t in mapped else None for t, m in enumerate(layer_map))
        fuser = Fuser(FuserConfig(r.num_kv_heads, r.head_dim, s.num_kv_heads, s.head_dim, layer_map,
                                  hidden=c.hidden, blocks=c.blocks, seed=c.seed))
        return fuser, layer_map

    def calibrate(self) -> None:
        """Set the fuser's input statistics from the first training examples (fresh runs only)."""
        assert isinstance(self.module, Fuser)
        samples = []
        for record in self.train[: self.config.calibration_examples]:
            own_k, own_v = hf.context_kv(self.receiver.model, record.context_ids)
            samples.append((own_k, own_v, self._sharer_input(record), self._positions(record)))
        self.module.calibrate(samples, self.rope)

    # -- per example -----------------------------------------------------------------------------

    def _positions(self, record: Record) -> torch.Tensor:
        return torch.arange(record.context_ids.numel())

    def _sharer_kv(self, record: Record) -> SharerEntry:
        """The sharer's cache of the prompt (and its letter distribution), as stored: always read back
        from the store, so a run computes with the same rounded values whether or not it computed
        them itself."""
        assert self.store is not None and self.sharer is not None
        entry = self.store.get(record)
        if entry is None:
            self._compute_sharer([record])
            entry = self.store.get(record)
            if entry is None:
                raise FuserError(f"cannot read back the sharer cache just written to {self.store.path(record)}")
        return entry

    def _sharer_input(self, record: Record) -> dict[int, KV]:
        assert isinstance(self.module, Fuser) and self.sharer_rope is not None
        kv = self._sharer_kv(record).kv
        index = self._index(record)
        out = {}
        for s in self.module.config.sharer_layers:
            k, v = kv[s]  # [1, H, M, D], keys rotated at the sharer's positions 0..M-1
            out[s] = (rope_math.strip(k[:, :, index], self.sharer_rope[s], index), v[:, :, index])
        return out

    def _index(self, record: Record) -> torch.Tensor:
        """For each fused receiver token, the sharer token it reads; with ``final_token="sharer-last"``
        the last one reads the sharer's last prompt token (where its answer is decided)."""
        if self.config.final_token == "aligned":
            return record.index
        index = record.index.clone()
        index[-1] = record.sharer_ids.numel() - 1
        return index

    def _soft_targets(self, record: Record) -> torch.Tensor | None:
        """The sharer's distribution over the letters, when the first answer token is trained towards it."""
        if self.config.targets != "sharer" or record.choices is None:
            return None
        letters = self._sharer_kv(record).letters
        if letters is None:
            return None
        if self.config.sharer_temperature <= 0:
            return torch.nn.functional.one_hot(letters.argmax(), len(letters)).to(letters.dtype)
        return torch.softmax(letters / self.config.sharer_temperature, dim=0)

    def _logits(self, records: Sequence[Record], fused: bool = True,
                others: Sequence[Record | None] | None = None) -> list[torch.Tensor]:
        """Per record the logits ``[n, V]`` over its tail, the records run as one right-padded batch;
        ``fused=False``: the receiver alone (the baseline); ``others[b]``: row ``b`` reads that
        record's sharer K/V instead of its own (the other-context control)."""
        return self._forward(records, fused, others)[0]

    def _forward(self, records: Sequence[Record], fused: bool = True, others: Sequence[Record | None] | None = None,
                 with_alone: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """:meth:`_logits`, and with ``with_alone`` also the receiver's own logits (no autograd) from the
        same context cache."""
        B = len(records)
        N = max(r.context_ids.numel() for r in records)
        n = max(r.tail_ids.numel() for r in records)
        if self.config.method == "lora" and fused:  # the whole prompt, with autograd through the adapters
            L = max(r.ids.numel() for r in records)
            ids, mask = _right_padded([r.ids for r in records], L)
            logits = hf.sequence_logits(self.module, ids, attention_mask=mask)  # [B, L, V]
            return [logits[b, r.context_ids.numel(): r.ids.numel()] for b, r in enumerate(records)], None
        context, context_mask = _right_padded([r.context_ids for r in records], N)
        tail, tail_mask = _right_padded([r.tail_ids for r in records], n)
        own_k, own_v = hf.context_kv(self.receiver.model, context, context_mask)  # [B, H, N, D] per layer
        if fused:
            sharer = self._sharer_batch(records, N, others)
            keys, values = self.module(own_k, own_v, sharer, torch.arange(N).expand(B, -1), self.rope, self.noise)
        else:
            keys, values = own_k, own_v
        lengths = torch.tensor([r.context_ids.numel() for r in records])
        positions = lengths[:, None] + torch.arange(n)[None]  # each row continues its own context
        mask = torch.cat([context_mask, tail_mask], dim=1)
        logits = hf.continuation_logits(self.receiver.model, keys, values, tail, mask, positions)  # [B, n, V]
        alone = None
        if with_alone:
            with torch.no_grad():
                own = hf.continuation_logits(self.receiver.model, own_k, own_v, tail, mask, positions)
            alone = [own[b, : r.tail_ids.numel()] for b, r in enumerate(records)]
        return [logits[b, : r.tail_ids.numel()] for b, r in enumerate(records)], alone

    def _sharer_batch(self, records: Sequence[Record], N: int,
                      others: Sequence[Record | None] | None = None) -> dict[int, KV]:
        """The records' aligned, position-free sharer K/V, zero-padded to ``N`` tokens: ``{s: [B, H_s, N, D_s]}``;
        a row with an ``others`` record reads that record's sharer K/V, spread over its own tokens."""
        others = others or [None] * len(records)
        inputs = [self._sharer_input(r) if o is None else self._control_input(r, o) for r, o in zip(records, others)]
        pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, N - x.shape[-2]))  # noqa: E731  [1, H, N, D]
        return {s: (torch.cat([pad(i[s][0]) for i in inputs]), torch.cat([pad(i[s][1]) for i in inputs]))
                for s in inputs[0]}

    def _control_input(self, record: Record, other: Record) -> dict[int, KV]:
        """``other``'s aligned sharer K/V, read by ``record``'s context tokens (:func:`gain.control_index`)."""
        index = gain.control_index(record.context_ids.numel(), other.context_ids.numel())
        return {s: (k[:, :, index], v[:, :, index]) for s, (k, v) in self._sharer_input(other).items()}

    def _other(self, records: Sequence[Record], i: int, salt: int = 0) -> Record:
        """A record about another module than ``records[i]``'s, chosen by a stable hash (the control's text);
        where every record is about the same module (or names none), another record."""
        start = int.from_bytes(blake3.blake3(f"{self.config.seed}:{salt}:{i}".encode()).digest()[:8], "big")
        candidates = [records[(start + k) % len(records)] for k in range(len(records))]
        others = [r for r in candidates if r.module != records[i].module] or \
            [r for r in candidates if r is not records[i]] or [records[i]]
        return others[0]

    def _is_control(self, position: int) -> bool:
        """Whether the example read at ``position`` is a control row (about ``control_share`` of them)."""
        if self.config.method != "fuser" or self.config.control_share <= 0:
            return False
        digest = blake3.blake3(f"control:{self.config.seed}:{position}".encode()).digest()[:8]
        return int.from_bytes(digest, "big") / 2**64 < self.config.control_share

    def _loss_sum(self, logits: torch.Tensor, record: Record) -> torch.Tensor:
        """Summed cross-entropy of the tail's answer tokens; with ``targets="sharer"`` the first one
        is taken against the sharer's distribution over the option letters."""
        targets = record.tail_ids[1:][record.loss_mask]
        predicted = logits[:-1][record.loss_mask]
        soft = self._soft_targets(record)
        if soft is None:
            return torch.nn.functional.cross_entropy(predicted, targets, reduction="sum")
        first = -(soft * torch.log_softmax(predicted[0], dim=-1)[record.choices]).sum()
        return first + torch.nn.functional.cross_entropy(predicted[1:], targets[1:], reduction="sum")

    def _choice_loss(self, indices: Sequence[int], others: Sequence[Record | None]) -> torch.Tensor:
        """The choice objective (:mod:`kvwire.fuse.choice`) for the training examples at ``indices``: the
        cross-entropy of the softmax over each question's options towards the right one; a control row
        (its ``others`` record's sharer K/V read instead) is trained towards the receiver alone's softmax."""
        groups = [self.options[i] for i in indices]
        flat = [r for records, _ in groups for r in records]
        flat_others = [o for (records, _), o in zip(groups, others) for _ in records]
        logits, alone = self._forward(flat, others=flat_others, with_alone=any(o is not None for o in others))
        total, start = torch.zeros(()), 0
        for (records, answer), other in zip(groups, others):
            tails = [r.tail_ids for r in records]
            fused = choice.option_log_probs(logits[start: start + len(records)], tails)
            if other is None:
                total = total - fused[answer]
            else:
                target = choice.option_log_probs(alone[start: start + len(records)], tails)  # type: ignore[index]
                total = total + self.config.control_weight * (target.exp() * (target - fused)).sum()
            start += len(records)
        return total / len(groups)

    # -- the loop --------------------------------------------------------------------------------

    def _record_at(self, position: int) -> Record:
        """The example read at ``position`` of the data order: a seeded shuffle per epoch."""
        epoch, offset = divmod(position, len(self.train))
        if self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.train), generator=generator))
        return self.train[int(self._order[1][offset])]

    def _order_index(self, position: int) -> int:
        """The index into ``self.train`` of the example read at ``position``."""
        self._record_at(position)
        return int(self._order[1][position % len(self.train)])

    def _next_records(self) -> list[Record]:
        records = [self._record_at(self.position + i) for i in range(self.config.batch)]
        self.position += self.config.batch
        return records

    def train_step(self) -> StepRecord:
        c = self.config
        start = time.perf_counter()
        self.module.train()
        if isinstance(self.module, Fuser):
            self.module.temperature = c.temperature_at(self.step)
            self.module.gate_noise = c.gate_noise
        lr = c.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        first = self.position
        records = self._next_records()
        others = [self._other(self.train, self._order_index(first + b), first + b) if self._is_control(first + b)
                  else None for b in range(len(records))]
        self.optimizer.zero_grad(set_to_none=True)
        if c.objective == "choice":
            loss = self._choice_loss([self._order_index(first + b) for b in range(len(records))], others)
        else:
            answer_tokens = sum(r.answer_tokens for r in records)
            logits, alone = self._forward(records, others=others, with_alone=any(o is not None for o in others))
            loss = sum(self._loss_sum(lg, r) if o is None else
                       c.control_weight * gain.kl_sum(lg[:-1][r.loss_mask], alone[b][:-1][r.loss_mask])  # type: ignore[index]
                       for b, (lg, r, o) in enumerate(zip(logits, records, others))) / answer_tokens
        total = float(loss.detach())
        if not math.isfinite(total):
            kept = sorted((self.out / "checkpoints").glob("step-*"))
            raise FuserError(f"training diverged at step {self.step + 1}: the loss is {total}; nothing of this "
                             "step was saved" + (f" (the last checkpoint, {kept[-1].name}, is kept)" if kept else ""),
                             "lower --lr (or check the data); --resume continues from the last checkpoint")
        loss.backward()
        tokens = sum(r.context_ids.numel() + r.tail_ids.numel() for r in records)
        torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], c.grad_clip)
        self.optimizer.step()
        self.step += 1
        record = StepRecord(self.step, total, lr, c.temperature_at(self.step - 1), tokens,
                            time.perf_counter() - start)
        self.history.append(record)
        self._log({**asdict(record)})
        return record

    def run(self, on_step: Callable[[StepRecord], None] | None = None,
            on_eval: Callable[[EvalRecord], None] | None = None, stop_after: int | None = None,
            deadline: float | None = None) -> TrainResult:
        """Train up to ``config.steps`` (from the resumed step, if any); evaluate, checkpoint, plot.

        ``stop_after``: leave after that step with a resumable checkpoint and no final one, as
        an interrupted run would (the schedules still span ``config.steps``). ``deadline`` (a
        :func:`time.monotonic` time): a fresh run sets its step count from its first steps' pace
        so that it ends, evaluations included, by then (:meth:`fit_steps`).
        """
        if self.step == 0:
            run_folder.check_fresh_out(self.out, self.config.method)
        self.out.mkdir(parents=True, exist_ok=True)
        eval_s = 0.0
        if self.step == 0:
            self._truncate_log(0)
            for split, examples in self.examples.items():  # what was trained on: a baseline reads the same
                save_examples(examples, self.out / "data" / f"{split}.jsonl")
            if isinstance(self.module, Fuser):
                self.calibrate()
            if self.val:
                start = time.monotonic()
                self._evaluated(self.evaluate(), on_eval)
                eval_s = time.monotonic() - start
        check_repeats(self.config, len(self.train))
        if deadline is not None and time.monotonic() + eval_s >= deadline:
            raise FuserError("the time budget leaves no room for training: it is spent before the first step "
                             "(the sharer's K/V and the first evaluation took it)",
                             "give more --hours (or precompute the sharer's K/V first, with the same command)")
        while self.step < self.config.steps:
            rec = self.train_step()
            if on_step:
                on_step(rec)
            if deadline is not None and self.step == FIT_AFTER:
                self.fit_steps(deadline, eval_s)
            if deadline is not None and time.monotonic() + eval_s + rec.seconds > deadline:
                log.warning("the time budget is spent at step %d (planned %d): stopping here", self.step,
                            self.config.steps)  # the machine got slower than the first steps' pace
                self.config = dataclasses.replace(self.config, steps=self.step)
            c = self.config
            if self.val and (self.step % c.eval_every == 0 or self.step == c.steps):
                self._evaluated(self.evaluate(), on_eval)
            if self.step % c.checkpoint_every == 0 or self.step == c.steps or self.step == stop_after:
                self.save_checkpoint()
                self.plot()
            if self.step == stop_after:
                return TrainResult(self.out, self.out / "checkpoints" / f"step-{self.step:06d}", self.history,
                                   self.evals, *self.size())
        final = self.save_final()
        self.plot()
        return TrainResult(self.out, final, self.history, self.evals, *self.size())

    def fit_steps(self, deadline: float, eval_s: float) -> int:
        """Set ``config.steps`` so that training, its evaluations and the final save end by ``deadline``,
        at the pace of the steps so far (``eval_s``: one evaluation's seconds); returns the new count."""
        done = self.history[-FIT_AFTER:]
        step_s = sum(r.seconds for r in done) / max(len(done), 1)
        per_step = step_s + eval_s / self.config.eval_every
        left = deadline - time.monotonic() - eval_s
        more = int(left // per_step) if per_step > 0 else 0
        if more < 1:
            raise FuserError(f"the time budget leaves no room for training: a step takes {step_s:.1f} s and an "
                             f"evaluation {eval_s:.0f} s", "give more --hours, or fewer --eval-examples / "
                             "--eval-questions")
        self.config = dataclasses.replace(self.config, steps=self.step + more)
        check_repeats(self.config, len(self.train))
        log.info("time budget: %d steps in all (%.1f s a step, %.0f s an evaluation)", self.config.steps, step_s,
                 eval_s)
        return self.config.steps

    # -- sizes, checkpoints, resume --------------------------------------------------------------

    def size(self) -> tuple[int, int]:
        """(trainable parameters, bytes saved) of what is trained."""
        if isinstance(self.module, Fuser):
            return self.module.parameter_count(), self.module.nbytes()
        weights = self._weights()
        return sum(t.numel() for t in weights.values()), sum(t.numel() * t.element_size() for t in weights.values())

    def _weights(self) -> dict[str, torch.Tensor]:
        if isinstance(self.module, Fuser):
            return dict(self.module.state_dict())
        return hf.lora_state(self.module)

    @property
    def alignment_name(self) -> str | None:
        """The token alignment a checkpoint records: the aligner's method, and the final-token rule."""
        if self.alignment is None or self.config.final_token == "aligned":
            return self.alignment
        return f"{self.alignment}+{self.config.final_token}"

    def _config(self, evaluation: EvalRecord | None = None) -> ckpt.CheckpointConfig:
        """The checkpoint config; with ``evaluation``, the weights are those it measured: their gain."""
        c = self.config
        module = self.module.config.to_json() if isinstance(self.module, Fuser) else \
            {"rank": c.lora_rank, "alpha": c.lora_alpha}
        training = {"config": c.to_json(), "data": self.data_info, "steps_done": self.step,
                    "examples_seen": self.position,
                    "last_eval": _brief_eval(self.evals[-1]) if self.evals else None,
                    "gain": gain.figures(evaluation) if evaluation is not None else None}
        return ckpt.CheckpointConfig(
            kind="fuser" if c.method == "fuser" else "lora", receiver=self.receiver.ref(),
            sharer=self.sharer.ref() if self.sharer is not None and c.method == "fuser" else None,
            alignment=self.alignment_name if c.method == "fuser" else None, layer_map=self.layer_map,
            module=module, training=training)

    # -- log and plot ----------------------------------------------------------------------------

    def _log(self, entry: dict[str, Any]) -> None:
        run_folder.append(self.out, entry)

    def _truncate_log(self, step: int) -> None:
        """Keep the log's lines up to ``step`` (a resumed run rewrites what came after)."""
        self.history, self.evals = run_folder.truncate(self.out, step)

    def plot(self) -> Path | None:
        if not self.history:
            return None
        from ..plots import training_curve

        title = f"{self.config.method}: {self.receiver.name}" + \
            (f" <- {self.sharer.name}" if self.sharer and self.config.method == "fuser" else "")
        return training_curve([asdict(r) for r in self.history], [asdict(e) for e in self.evals],
                              self.out / "loss.png", title)


FIT_AFTER = 3  # steps timed before a time budget sets the step count
MAX_REPEATS = 30  # times each training example may be read; more is memorising, not learning


def check_repeats(config: TrainConfig, examples: int) -> None:
    """Refuse a step count that would read each training example more than :data:`MAX_REPEATS` times."""
    reads = config.steps * config.batch
    if examples and reads > MAX_REPEATS * examples:
        raise FuserError(f"{config.steps} steps of {config.batch} read each of the {examples} training examples "
                         f"{reads / examples:.0f} times (at most {MAX_REPEATS})",
                         "use fewer --steps or --hours, or more data")


def _brief_eval(record: EvalRecord) -> dict[str, Any]:
    """An evaluation for a checkpoint's config, without the per-question outcomes."""
    return {k: v for k, v in asdict(record).items() if k != "mc_outcomes"}


def _right_padded(rows: Sequence[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids right-padded to ``length``: ids ``[B, length]`` (padding: id 0) and mask (1 = token)."""
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : row.numel()] = row
        mask[b, : row.numel()] = 1
    return ids, mask


def _layer_map(kind: str, sharer_layers: int, receiver_layers: int) -> tuple[int | None, ...]:
    shift = sharer_layers - receiver_layers
    if kind == "terminal":
        return tuple(t + shift if t + shift >= 0 else None for t in range(receiver_layers))
    if kind == "proportional":
        if receiver_layers == 1:
            return (sharer_layers - 1,)
        return tuple(round(t * (sharer_layers - 1) / (receiver_layers - 1)) for t in range(receiver_layers))
    raise FuserError(f"unknown layer map {kind!r}", "use 'terminal' or 'proportional'")


__all__ = ["EvalRecord", "Party", "StepRecord", "TrainConfig", "TrainResult", "Trainer", "load_fuser",
           "load_fuser_weights", "load_lora"]
