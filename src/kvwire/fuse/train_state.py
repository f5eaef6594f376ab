"""Saving and resuming a fuser training run: the final checkpoint (the best weights, with their
gain), resumable checkpoints (weights, optimizer moments, generator state, data position) and
an exact resume. :class:`TrainState` is one part of :class:`kvwire.fuse.train.Trainer`.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .. import hf
from ..errors import CheckpointError
from . import checkpoint as ckpt
from .fuser import Fuser
from .train_config import EvalRecord
from .trained import load_fuser_weights

log = logging.getLogger(__name__)


class TrainState:
    """Final and resumable checkpoints (a part of the trainer)."""

    def save_final(self) -> Path:
        """The trained checkpoint: the weights best on held-out loss (``out/best``) with their gain, or
        the last weights when there was no validation."""
        name = "fuser" if self.config.method == "fuser" else "lora"
        if self.best is None or not (self.out / "best").is_dir():
            return ckpt.save(self.out / name, self._config(), self._weights())
        best = ckpt.load(self.out / "best", kind="fuser" if self.config.method == "fuser" else "lora",
                         receiver=self.receiver.spec,
                         sharer=self.sharer.spec if self.config.method == "fuser" and self.sharer else None)
        return ckpt.save(self.out / name, self._config(self.best), best.weights)

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
                  "mc_baseline": self._mc_baseline, "best": asdict(self.best) if self.best else None,
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
        baseline = list(state["baseline"]) + [None] * 3 if state.get("baseline") else None
        self._baseline = tuple(baseline[:3]) if baseline else None  # type: ignore[assignment]
        self._mc_baseline = state.get("mc_baseline")
        self.best = EvalRecord(**state["best"]) if state.get("best") else None
        self._truncate_log(self.step)
        return self.step

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if isinstance(self.module, Fuser):
            load_fuser_weights(self.module, weights)
        else:
            hf.set_lora_state(self.module, weights)
