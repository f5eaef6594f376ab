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

import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3
import torch

from .. import hf
from ..wire import rope as rope_math
from ..errors import CheckpointError, FuserError
from ..wire.spec import ModelSpec
from . import checkpoint as ckpt
from . import run_folder
from .data import Aligner, Record, SharerEntry, SharerStore, encode, end_of_turn_id, letter_log_probs
from .fuser import KV, Fuser, FuserConfig
from .stdlib_qa import Example
from .train_config import EvalRecord, StepRecord, TrainConfig, TrainResult
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


class Trainer:
    """Trains a fuser (or the LoRA baseline) for ``config.steps`` steps; see the module docstring."""

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
            [[[e.prompt, e.answer] for e in train], [[e.prompt, e.answer] for e in val[: config.eval_examples]]]
        ).encode()).hexdigest()
        hf.freeze(receiver.model)
        if sharer is not None:
            hf.freeze(sharer.model)
        end_id = end_of_turn_id(receiver.tokenizer, hf.eos_token_ids(receiver.model))
        use = aligner if sharer is not None else None
        self.train = [encode(ex, receiver.tokenizer, end_id, use, config.system) for ex in train]
        self.val = [encode(ex, receiver.tokenizer, end_id, use, config.system) for ex in val[: config.eval_examples]]
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
        self._baseline: tuple[float, float | None] | None = None

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

    def prepare_sharer(self, on_item: Callable[[int, int], None] | None = None) -> int:
        """Compute the sharer's K/V of every example the run will still read (its remaining steps,
        calibration and validation) that is not yet stored; returns how many were computed."""
        if self.store is None:
            return 0
        c = self.config
        seen: set[str] = set()
        records = []
        remaining = range(self.position, c.steps * c.batch) if self.step < c.steps else range(0)
        candidates = [*(self.train[: c.calibration_examples] if self.step == 0 else []),
                      *(self._record_at(p) for p in remaining), *self.val]
        for record in candidates:
            if record.key not in seen:
                seen.add(record.key)
                records.append(record)
        missing = [r for r in records if self.store.get(r) is None]
        if on_item:
            on_item(len(records) - len(missing), len(records))
        for start in range(0, len(missing), c.batch):  # the sharer reads a step's worth at once
            self._compute_sharer(missing[start: start + c.batch])
            if on_item:
                on_item(len(records) - len(missing) + min(start + c.batch, len(missing)), len(records))
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
            self.store.put(r, {s: (k[b:b + 1, :, pad:], v[b:b + 1, :, pad:]) for s, (k, v) in
                               enumerate(zip(keys, values))}, letters)

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
            keys, values, logits = hf.context_kv(self.sharer.model, record.sharer_ids, with_logits=True)
            letters = letter_log_probs(logits[0], self.sharer.tokenizer) if record.choices is not None else None
            self.store.put(record, {s: (k, v) for s, (k, v) in enumerate(zip(keys, values))}, letters)
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

    def _logits(self, records: Sequence[Record], fused: bool = True) -> list[torch.Tensor]:
        """Per record the logits ``[n, V]`` over its tail, the records run as one right-padded batch;
        ``fused=False``: the receiver alone (the baseline)."""
        B = len(records)
        N = max(r.context_ids.numel() for r in records)
        n = max(r.tail_ids.numel() for r in records)
        if self.config.method == "lora" and fused:  # the whole prompt, with autograd through the adapters
            L = max(r.ids.numel() for r in records)
            ids, mask = _right_padded([r.ids for r in records], L)
            logits = hf.sequence_logits(self.module, ids, attention_mask=mask)  # [B, L, V]
            return [logits[b, r.context_ids.numel(): r.ids.numel()] for b, r in enumerate(records)]
        context, context_mask = _right_padded([r.context_ids for r in records], N)
        tail, tail_mask = _right_padded([r.tail_ids for r in records], n)
        own_k, own_v = hf.context_kv(self.receiver.model, context, context_mask)  # [B, H, N, D] per layer
        if fused:
            sharer = self._sharer_batch(records, N)
            keys, values = self.module(own_k, own_v, sharer, torch.arange(N).expand(B, -1), self.rope, self.noise)
        else:
            keys, values = own_k, own_v
        lengths = torch.tensor([r.context_ids.numel() for r in records])
        positions = lengths[:, None] + torch.arange(n)[None]  # each row continues its own context
        logits = hf.continuation_logits(self.receiver.model, keys, values, tail,
                                        torch.cat([context_mask, tail_mask], dim=1), positions)  # [B, n, V]
        return [logits[b, : r.tail_ids.numel()] for b, r in enumerate(records)]

    def _sharer_batch(self, records: Sequence[Record], N: int) -> dict[int, KV]:
        """The records' aligned, position-free sharer K/V, zero-padded to ``N`` tokens: ``{s: [B, H_s, N, D_s]}``."""
        inputs = [self._sharer_input(r) for r in records]
        pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, N - x.shape[-2]))  # noqa: E731  [1, H, N, D]
        return {s: (torch.cat([pad(i[s][0]) for i in inputs]), torch.cat([pad(i[s][1]) for i in inputs]))
                for s in inputs[0]}

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

    # -- the loop --------------------------------------------------------------------------------

    def _record_at(self, position: int) -> Record:
        """The example read at ``position`` of the data order: a seeded shuffle per epoch."""
        epoch, offset = divmod(position, len(self.train))
        if self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.train), generator=generator))
        return self.train[int(self._order[1][offset])]

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
        records = self._next_records()
        answer_tokens = sum(r.answer_tokens for r in records)
        self.optimizer.zero_grad(set_to_none=True)
        logits = self._logits(records)
        loss = sum(self._loss_sum(lg, r) for lg, r in zip(logits, records)) / answer_tokens
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

    @torch.no_grad()
    def evaluate(self) -> EvalRecord:
        """Held-out answer loss and letter accuracy, for the trained module and the receiver alone
        (and, with a sharer, its own accuracy and how often the trained module picks its letter)."""
        if not self.val:
            raise FuserError("no validation examples")
        self.module.eval()
        loss, accuracy, picks = self._score(fused=True)
        if self._baseline is None:
            self._baseline = self._score(fused=False)[:2]
        sharer_picks = [self._sharer_pick(r) for r in self.val]
        agree = [p == q for p, q in zip(picks, sharer_picks) if p is not None and q is not None]
        right = [q == r.answer for q, r in zip(sharer_picks, self.val) if q is not None]
        counts = [sum(1 for p in picks if p == letter) for letter in range(4)] if any(
            p is not None for p in picks) else None
        record = EvalRecord(self.step, loss, accuracy, self._baseline[0], self._baseline[1], len(self.val),
                            sum(agree) / len(agree) if agree else None, sum(right) / len(right) if right else None,
                            counts)
        self.evals.append(record)
        self._log({"step": self.step, "eval": asdict(record)})
        return record

    def _sharer_pick(self, record: Record) -> int | None:
        if self.store is None or record.choices is None:
            return None
        letters = self._sharer_kv(record).letters
        return None if letters is None else int(letters.argmax())

    def _score(self, fused: bool) -> tuple[float, float | None, list[int | None]]:
        """(mean answer loss, letter accuracy, each record's picked letter) over the validation records."""
        total, count, picks = 0.0, 0, []
        size = self.config.batch
        for start in range(0, len(self.val), size):
            records = self.val[start: start + size]
            if fused or self.config.method != "lora":
                logits = self._logits(records, fused=fused)
            else:  # the LoRA baseline's baseline: the receiver with its adapters disabled
                with self.module.disable_adapter():
                    logits = self._logits(records, fused=False)
            for lg, record in zip(logits, records):
                total += float(self._loss_sum(lg, record))
                count += record.answer_tokens
                picks.append(int(lg[0][record.choices].argmax()) if record.choices is not None else None)
        right = [p == r.answer for p, r in zip(picks, self.val) if p is not None]
        return total / max(count, 1), (sum(right) / len(right) if right else None), picks

    def run(self, on_step: Callable[[StepRecord], None] | None = None,
            on_eval: Callable[[EvalRecord], None] | None = None, stop_after: int | None = None) -> TrainResult:
        """Train up to ``config.steps`` (from the resumed step, if any); evaluate, checkpoint, plot.

        ``stop_after``: leave after that step with a resumable checkpoint and no final one, as
        an interrupted run would (the schedules still span ``config.steps``).
        """
        c = self.config
        if self.step == 0:
            run_folder.check_fresh_out(self.out, self.config.method)
        self.out.mkdir(parents=True, exist_ok=True)
        if self.step == 0:
            self._truncate_log(0)
            if isinstance(self.module, Fuser):
                self.calibrate()
            if self.val:
                rec = self.evaluate()
                if on_eval:
                    on_eval(rec)
        while self.step < c.steps:
            rec = self.train_step()
            if on_step:
                on_step(rec)
            if self.val and (self.step % c.eval_every == 0 or self.step == c.steps):
                ev = self.evaluate()
                if on_eval:
                    on_eval(ev)
            if self.step % c.checkpoint_every == 0 or self.step == c.steps or self.step == stop_after:
                self.save_checkpoint()
                self.plot()
            if self.step == stop_after:
                return TrainResult(self.out, self.out / "checkpoints" / f"step-{self.step:06d}", self.history,
                                   self.evals, *self.size())
        final = self.save_final()
        self.plot()
        return TrainResult(self.out, final, self.history, self.evals, *self.size())

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

    def _config(self) -> ckpt.CheckpointConfig:
        c = self.config
        module = self.module.config.to_json() if isinstance(self.module, Fuser) else \
            {"rank": c.lora_rank, "alpha": c.lora_alpha}
        training = {"config": c.to_json(), "data": self.data_info, "steps_done": self.step,
                    "examples_seen": self.position,
                    "last_eval": asdict(self.evals[-1]) if self.evals else None}
        return ckpt.CheckpointConfig(
            kind="fuser" if c.method == "fuser" else "lora", receiver=self.receiver.ref(),
            sharer=self.sharer.ref() if self.sharer is not None and c.method == "fuser" else None,
            alignment=self.alignment_name if c.method == "fuser" else None, layer_map=self.layer_map,
            module=module, training=training)

    def save_final(self) -> Path:
        name = "fuser" if self.config.method == "fuser" else "lora"
        return ckpt.save(self.out / name, self._config(), self._weights())

    def save_checkpoint(self) -> Path:
        tensors: dict[str, torch.Tensor] = {"noise_generator": self.noise.get_state()}
        state = self.optimizer.state_dict()
        steps = {}
        for index, moments in state["state"].items():
            for name, value in moments.items():
                if name == "step":
                    steps[str(index)] = float(value)
                else:
                    tensors[f"optimizer.{index}.{name}"] = value
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
        resume = {"step": self.step, "position": self.position, "optimizer_groups": groups,
                  "optimizer_steps": steps, "baseline": list(self._baseline) if self._baseline else None,
                  "config": self.config.to_json(), "data": self.data_fingerprint}
        path = ckpt.save(self.out / "checkpoints" / f"step-{self.step:06d}", self._config(), self._weights(),
                         state=resume, state_tensors=tensors)
        old = sorted((self.out / "checkpoints").glob("step-*"))[: -self.config.keep_checkpoints]
        for folder in old:
            shutil.rmtree(folder, ignore_errors=True)
        return path

    def resume(self, path: str | Path | None = None) -> int:
        """Continue from ``path`` or the newest checkpoint under ``out/checkpoints``; returns its step."""
        if path is None:
            found = sorted((self.out / "checkpoints").glob("step-*"))
            if not found:
                raise CheckpointError(f"no checkpoint to resume under {self.out / 'checkpoints'}",
                                      "start without --resume")
            path = found[-1]
        loaded = ckpt.load(path, kind="fuser" if self.config.method == "fuser" else "lora",
                           receiver=self.receiver.spec,
                           sharer=self.sharer.spec if self.config.method == "fuser" and self.sharer else None,
                           with_state=True)
        state, tensors = loaded.state or {}, loaded.state_tensors or {}
        saved = state.get("config", {})
        mine = self.config.to_json()
        differ = sorted(k for k in mine if k not in ("steps", "checkpoint_every", "eval_every", "keep_checkpoints")
                        and saved.get(k) != mine[k])
        if differ:
            raise CheckpointError(f"{path} was trained with other settings: {', '.join(differ)}",
                                  "resume with the same options, or start a new --out")
        if state.get("data") not in (None, self.data_fingerprint):  # None: a checkpoint from before it was kept
            raise CheckpointError(f"{path} was trained on other examples than this run's (training or held-out)",
                                  "resume with the same --data, --examples and --eval-examples, or start a new --out")
        if saved.get("steps") != mine["steps"]:
            log.warning("resuming with --steps %s (the run started with %s): the learning-rate schedule changes",
                        mine["steps"], saved.get("steps"))
        self._load_weights(loaded.weights)
        try:
            moments: dict[int, dict[str, Any]] = {}
            for name, value in tensors.items():
                if name.startswith("optimizer."):
                    _, index, key = name.split(".", 2)
                    moments.setdefault(int(index), {})[key] = value
            for index, step in state["optimizer_steps"].items():
                moments.setdefault(int(index), {})["step"] = torch.tensor(float(step))
            groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in state["optimizer_groups"]]
            self.optimizer.load_state_dict({"state": moments, "param_groups": groups})
            self.noise.set_state(tensors["noise_generator"])
            self.step, self.position = int(state["step"]), int(state["position"])
        except (KeyError, ValueError, TypeError, RuntimeError) as err:
            raise CheckpointError(f"{path}: the training state is incomplete or does not fit this run ({err})",
                                  "start a new --out") from None
        self._baseline = tuple(state["baseline"])[:2] if state.get("baseline") else None  # type: ignore[assignment]
        self._truncate_log(self.step)
        return self.step

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if isinstance(self.module, Fuser):
            load_fuser_weights(self.module, weights)
        else:
            hf.set_lora_state(self.module, weights)

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
