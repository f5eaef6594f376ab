"""What a training run of :mod:`kvwire.fuse.train` depends on (:class:`TrainConfig`) and what
it records: a line per step (:class:`StepRecord`), per evaluation (:class:`EvalRecord`), and
the run's result (:class:`TrainResult`). Plain data; no model is touched here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import FuserError

Method = Literal["fuser", "lora"]
Objective = Literal["response", "choice"]
Targets = Literal["answer", "sharer"]
FinalToken = Literal["aligned", "sharer-last"]
LayerMapKind = Literal["terminal", "proportional"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on. Steps count optimizer updates of ``batch`` examples."""

    method: Method = "fuser"
    # what a step trains: every response token (response), or which option of a choice question the
    # receiver prefers, scored as the benchmark scores it (choice; kvwire.fuse.choice)
    objective: Objective = "response"
    steps: int = 600
    batch: int = 4  # examples per optimizer step (gradients accumulated one example at a time)
    lr: float = 1e-3
    min_lr: float = 1e-4  # cosine decay ends here
    warmup: int = 20  # steps of linear warm-up
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0  # weights, data order, gate noise
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    eval_every: int = 100
    eval_examples: int = 64
    system: str | None = None  # None: each model's default system prompt
    # what the first answer token is trained towards on multiple-choice examples: the example's
    # answer, or what the sharer would answer (which the receiver can only learn to read from the
    # fused cache): its letter distribution at temperature sharer_temperature, 0 = its top letter.
    # Qwen2.5-0.5B's letter distributions are nearly flat (mean entropy 1.378 of at most 1.386 nats)
    # though its top letter is right about twice as often as chance: sharpen, or take the top letter.
    targets: Targets = "answer"
    sharer_temperature: float = 0.0
    # fuser
    hidden: int = 256
    blocks: int = 1
    layer_map: LayerMapKind = "terminal"
    fuse_last: int = 0  # fuse only the receiver's last K mapped layers (0: all mapped layers)
    temperature: tuple[float, float] = (1.0, 0.01)  # gate temperature, annealed geometrically over the run
    gate_noise: bool = True  # Gumbel-sigmoid gates in training (C2C); False: the annealed sigmoid alone
    # which sharer token the last fused receiver token reads: the one its characters align to, or
    # the sharer's last prompt token (the end of its generation prompt, where its answer is formed;
    # still prompt only). Recorded in the checkpoint's alignment ("...+sharer-last") for fuse mode.
    final_token: FinalToken = "aligned"
    calibration_examples: int = 16
    # the share of training rows fed *another* module's sharer K/V and trained towards the receiver
    # alone (a KL): a fuser gains nothing on those rows, so whatever it learns must come from reading
    # the sharer cache of the context in front of it, not from adapting the receiver to the data
    control_share: float = 0.25
    control_weight: float = 1.0  # weight of a control row's KL against a real row's cross-entropy
    # keep only training examples where the sharer's loss on the response is at least this many nats
    # per character below the receiver's (measured once per example); None: keep every example
    min_gap: float | None = None
    eval_questions: int = 0  # bundled multiple-choice questions scored at each evaluation (the CLI: 150)
    # lora
    lora_rank: int = 8
    lora_alpha: float = 16.0

    def __post_init__(self) -> None:
        if self.method not in ("fuser", "lora"):
            raise FuserError(f"unknown training method {self.method!r}", "use 'fuser' or 'lora'")
        if self.objective not in ("response", "choice"):
            raise FuserError(f"unknown objective {self.objective!r}", "use 'response' or 'choice'")
        if self.objective == "choice" and (self.min_gap is not None or self.targets != "answer"):
            raise FuserError("the choice objective trains towards the right option; it takes no --min-gap or "
                             "--targets sharer", "filter its questions with --choice-filter instead")
        if self.targets not in ("answer", "sharer"):
            raise FuserError(f"unknown targets {self.targets!r}", "use 'answer' or 'sharer'")
        if self.final_token not in ("aligned", "sharer-last"):
            raise FuserError(f"unknown final_token {self.final_token!r}", "use 'aligned' or 'sharer-last'")
        for name in ("steps", "batch", "checkpoint_every", "eval_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise FuserError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, value in self.__dict__.items():  # a NaN or infinite setting trains a broken module
            if isinstance(value, float) and not math.isfinite(value):
                raise FuserError(f"{name} must be a finite number, got {value}")
        if not 0.0 <= self.control_share < 1.0:
            raise FuserError(f"control_share must be in [0, 1), got {self.control_share}")
        if self.eval_questions < 0 or self.eval_examples < 0:
            raise FuserError("eval_questions and eval_examples must be >= 0")
        if not self.lr > 0 or self.min_lr < 0:
            raise FuserError(f"learning rates must be positive (lr={self.lr}, min_lr={self.min_lr})")

    def lr_at(self, step: int) -> float:
        """Linear warm-up to ``lr``, then cosine to ``min_lr`` at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))

    def temperature_at(self, step: int) -> float:
        start, end = self.temperature
        return start * (end / start) ** min(step / max(1, self.steps - 1), 1.0)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["temperature"] = list(self.temperature)
        return data


@dataclass
class StepRecord:
    """What one step did (also a line of ``log.jsonl``)."""

    step: int  # 1-based: the number of optimizer updates done
    loss: float  # mean cross-entropy over the step's answer tokens
    lr: float
    temperature: float
    tokens: int  # receiver tokens read (contexts and tails)
    seconds: float


@dataclass
class EvalRecord:
    step: int
    loss: float
    accuracy: float | None
    baseline_loss: float
    baseline_accuracy: float | None
    examples: int
    agreement: float | None = None  # share of questions where it picks the letter the sharer would
    sharer_accuracy: float | None = None  # the sharer's own accuracy on these questions
    picks: list[int] | None = None  # how often it picked each letter (a collapse onto one shows here)
    # per character of the responses (compares across tokenizers), and the other-context control:
    # the same module fed another module's sharer K/V
    loss_per_char: float | None = None
    baseline_loss_per_char: float | None = None
    control_loss: float | None = None
    control_loss_per_char: float | None = None
    # the bundled multiple-choice questions, each option scored by its mean log-likelihood
    mc_accuracy: float | None = None
    mc_baseline_accuracy: float | None = None
    mc_control_accuracy: float | None = None
    mc_outcomes: dict[str, list[bool]] | None = None  # "fused" / "alone" / "control": right or wrong per item
    control_accuracy: float | None = None  # choice objective: the control's held-out accuracy


@dataclass
class TrainResult:
    out: Path
    checkpoint: Path
    steps: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    parameters: int = 0
    nbytes: int = 0
