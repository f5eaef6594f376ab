"""LoRA fine-tuning on token sequences, a thin layer over ``peft`` (transformers side).

What flows in: a causal LM, a :class:`LoraSettings` (rank, alpha, which linear layers),
a :class:`TrainSettings` (steps, learning rate, batch, seed) and :class:`Example` s --
token ids ``[N]`` with a loss mask ``[N]`` (1 = this token is a target, predicted from
the ones before it; prompts are 0, answers 1). What flows out: the trained adapter
(:func:`train` returns the ``peft`` model and a :class:`TrainResult` with the losses),
a plain merged model (:func:`merge`: ``merge_and_unload``, no peft left in it), and an
adapter file (:func:`save_adapter` / :func:`load_adapter`).

Example::

    peft_model, result = lora.train(model, examples, LoraSettings(rank=8), TrainSettings(steps=200))
    lora.save_adapter(peft_model, "variant.safetensors")     # ~1 MB for rank 8 on the default model
    variant = lora.merge(peft_model)                        # a plain model with W + (alpha / r) B A

``train`` wraps ``model`` in place (peft injects its layers into the given module):
pass ``copy.deepcopy(model)`` to keep the base. Runs are deterministic: the adapter's
initialisation, the order of examples and dropout all come from ``TrainSettings.seed``.

**Adapter file** (safetensors; read with ``safetensors``' own loader, never pickle)::

    tensors        peft's adapter state dict (``...lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r]), fp32
    __metadata__   {"kvwire": JSON {"format": "kvwire.lora", "format_version": 1, "rank": int,
                    "alpha": float, "dropout": float, "target_modules": [str], "base_fingerprint": str}}

Loading checks the format, the settings, that the base model is the one the adapter was
trained on (weights fingerprint) and that the tensor names and shapes are exactly the
ones the settings imply; anything else raises :class:`~kvwire.errors.TrainingError`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from ..wire.atomic import atomic_write
from ..errors import TrainingError
from .loading import model_spec
from .training import tensors_misfit

log = logging.getLogger(__name__)

FORMAT = "kvwire.lora"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class LoraSettings:
    """Which layers get a low-rank update ``W + (alpha / rank) B A``, and how big it is."""

    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # names of nn.Linear modules
    dropout: float = 0.0  # on the LoRA branch's input, during training only

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank > 0):
            raise TrainingError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise TrainingError(f"LoRA alpha must be positive, got {self.alpha!r}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise TrainingError(f"LoRA target_modules must name modules, got {self.target_modules!r}",
                                "e.g. ('q_proj', 'v_proj')")
        if not 0.0 <= self.dropout < 1.0:
            raise TrainingError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")

    def peft_config(self) -> LoraConfig:
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(self.target_modules),
                          lora_dropout=self.dropout, bias="none", task_type="CAUSAL_LM")


@dataclass(frozen=True)
class TrainSettings:
    """The optimisation: AdamW over the adapter only, linear warm-up then cosine decay."""

    steps: int
    lr: float = 2e-4
    batch_size: int = 4  # sequences per step (right-padded to the longest)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # None: no clipping
    seed: int = 0  # adapter init, example order, dropout

    def __post_init__(self) -> None:
        if not (isinstance(self.steps, int) and self.steps > 0):
            raise TrainingError(f"steps must be a positive integer, got {self.steps!r}")
        if not (isinstance(self.batch_size, int) and self.batch_size > 0):
            raise TrainingError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if not self.lr > 0:
            raise TrainingError(f"lr must be positive, got {self.lr!r}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise TrainingError(f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate for step ``step`` (0-based). Example (lr=1, steps=10, warmup=2): 0.5, 1.0, then cosine."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        return self.lr * 0.5 * (1 + math.cos(math.pi * (step - self.warmup_steps) / span))


@dataclass(frozen=True)
class Example:
    """One training sequence: ``input_ids`` [N] and ``loss_mask`` [N] (1 = target token).

    Token ``i`` with ``loss_mask[i] == 1`` is predicted from tokens ``0..i-1``; the first
    token can never be a target. ``Example.lm(ids)`` makes every token after the first one.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor

    @classmethod
    def lm(cls, input_ids: Sequence[int] | torch.Tensor) -> Example:
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        mask = torch.ones_like(ids, dtype=torch.uint8)
        mask[:1] = 0
        return cls(ids, mask).check()

    @classmethod
    def prompt_answer(cls, prompt: Sequence[int], answer: Sequence[int]) -> Example:
        """Targets are the answer's tokens only (the loss on the answer, as instruction tuning)."""
        ids = torch.tensor([*prompt, *answer], dtype=torch.long)
        mask = torch.cat([torch.zeros(len(prompt), dtype=torch.uint8), torch.ones(len(answer), dtype=torch.uint8)])
        return cls(ids, mask).check()

    def check(self, vocab_size: int | None = None) -> Example:
        ids, mask = self.input_ids, self.loss_mask
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 1 and ids.dtype == torch.long and ids.numel() >= 2):
            raise TrainingError(f"input_ids must be an int64 tensor [N] with N >= 2, got {_describe(ids)}")
        if not (isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(ids.shape)):
            raise TrainingError(f"loss_mask must be [N]=[{ids.numel()}] like input_ids, got {_describe(mask)}")
        if bool(((mask != 0) & (mask != 1)).any()):
            raise TrainingError("loss_mask values must be 0 or 1")
        if int(mask[0]) != 0:
            raise TrainingError("the first token cannot be a target (nothing precedes it)", "set loss_mask[0] = 0")
        if not bool(mask.any()):
            raise TrainingError("an example has no target tokens (loss_mask is all zeros)")
        if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise TrainingError(f"token ids must lie in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
        return self


@dataclass
class TrainResult:
    """Per-step mean loss over the step's target tokens, and what the run cost."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    target_tokens: int = 0  # tokens the loss was taken on
    tokens: int = 0  # tokens forwarded (targets and context)
    trainable_parameters: int = 0


def wrap(model: Any, lora: LoraSettings, seed: int = 0) -> PeftModel:
    """``model`` with LoRA layers injected (in place; B starts at zero, so outputs are unchanged).

    Records the base weights' fingerprint on the result (``kvwire_base_fingerprint``) so a
    saved adapter names the model it belongs to.
    """
    fingerprint = model_spec(model).fingerprint
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = sorted(set(lora.target_modules) - names)
    if missing:
        raise TrainingError(f"{type(model).__name__} has no linear modules named {missing}",
                            f"choose target_modules among {sorted(names)}")
    torch.manual_seed(seed)  # peft initialises A with kaiming-uniform from the global generator
    peft_model = get_peft_model(model, lora.peft_config())
    peft_model.kvwire_base_fingerprint = fingerprint
    peft_model.kvwire_lora = lora
    return peft_model


def train(model: Any, examples: Sequence[Example], lora: LoraSettings, settings: TrainSettings, *,
          peft_model: PeftModel | None = None,
          on_step: Callable[[int, float, TrainResult], None] | None = None) -> tuple[PeftModel, TrainResult]:
    """Train a LoRA adapter on ``examples`` for ``settings.steps`` steps; return it (peft) and the run.

    Only the adapter's parameters are trained; the base stays frozen. Each step takes the
    next ``batch_size`` examples of a seeded shuffle (reshuffled every epoch), right-pads
    them, and minimises the mean cross-entropy over their target tokens. ``peft_model``
    continues training an adapter already wrapped with :func:`wrap` (or loaded).
    ``on_step(step, loss, result)`` is called after every step (progress bars, logging).
    """
    if not examples:
        raise TrainingError("no training examples")
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    for example in examples:
        example.check(vocab)
    net = peft_model if peft_model is not None else wrap(model, lora, settings.seed)
    params = [p for p in net.parameters() if p.requires_grad]
    result = TrainResult(trainable_parameters=sum(p.numel() for p in params))
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    order = torch.Generator().manual_seed(settings.seed)
    pad = int(model.config.pad_token_id if getattr(model.config, "pad_token_id", None) is not None else 0)
    queue: list[int] = []
    net.train()
    torch.manual_seed(settings.seed)  # dropout
    start = time.perf_counter()
    try:
        for step in range(settings.steps):
            batch = []
            while len(batch) < settings.batch_size:
                if not queue:
                    queue = torch.randperm(len(examples), generator=order).tolist()
                batch.append(examples[queue.pop(0)])
            ids, attention, targets = _collate(batch, pad)
            for group in optimizer.param_groups:
                group["lr"] = settings.lr_at(step)
            logits = net(input_ids=ids, attention_mask=attention).logits  # [B, N, V]
            loss = masked_loss(logits, ids, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if settings.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
            optimizer.step()
            result.losses.append(float(loss.detach()))
            result.target_tokens += int(targets.sum())
            result.tokens += int(attention.sum())
            result.seconds = time.perf_counter() - start
            if on_step is not None:
                on_step(step, result.losses[-1], result)
    finally:
        net.eval()
    log.info("LoRA: %d steps in %.1f s, loss %.3f -> %.3f", settings.steps, result.seconds, result.losses[0],
             result.losses[-1])
    return net, result


def masked_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over target tokens.

    ``logits`` [B, N, V] at every position, ``input_ids`` and ``loss_mask`` [B, N]: position
    ``i``'s logits predict token ``i + 1``, counted where ``loss_mask[:, i + 1] == 1``.
    """
    B, N, V = logits.shape
    predicted = logits[:, :-1].reshape(-1, V).float()  # [B * (N-1), V]
    wanted = input_ids[:, 1:].reshape(-1)  # [B * (N-1)]
    weight = loss_mask[:, 1:].reshape(-1).float()
    losses = torch.nn.functional.cross_entropy(predicted, wanted, reduction="none")
    return (losses * weight).sum() / weight.sum().clamp(min=1.0)


def merge(peft_model: PeftModel) -> Any:
    """The plain transformers model with the adapter folded into its weights (``merge_and_unload``).

    Consumes ``peft_model``: the returned model is its base module with merged weights.
    """
    merged = peft_model.merge_and_unload()
    merged.eval()
    for param in merged.parameters():
        param.requires_grad_(False)
    return merged


def save_adapter(peft_model: PeftModel, path: str | os.PathLike[str]) -> Path:
    """Write the adapter as one safetensors file (see the module docstring), atomically."""
    lora: LoraSettings | None = getattr(peft_model, "kvwire_lora", None)
    if lora is None:
        raise TrainingError("this model was not wrapped by kvwire.hf.lora", "make it with lora.wrap or lora.train")
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous()
               for name, t in get_peft_model_state_dict(peft_model).items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "rank": lora.rank, "alpha": float(lora.alpha),
            "dropout": float(lora.dropout), "target_modules": list(lora.target_modules),
            "base_fingerprint": peft_model.kvwire_base_fingerprint}
    return atomic_write(Path(path), [save(tensors, metadata={"kvwire": json.dumps(meta, sort_keys=True)})])


def read_adapter(path: str | os.PathLike[str]) -> tuple[LoraSettings, str, dict[str, torch.Tensor]]:
    """An adapter file's settings, base fingerprint and tensors, checked (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise TrainingError(f"no adapter file at {path}", "train one first (see README: partial-layer transfer)")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("kvwire")
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise TrainingError(f"{path} is not a safetensors file: {err}") from None
    try:
        meta = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TrainingError(f"{path} is not a kvwire LoRA adapter (no {FORMAT!r} metadata)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise TrainingError(f"{path}: adapter format version {meta.get('format_version')!r} is not supported "
                            f"(this kvwire reads {FORMAT_VERSION})")
    try:
        lora = LoraSettings(rank=meta["rank"], alpha=meta["alpha"], dropout=meta["dropout"],
                            target_modules=tuple(meta["target_modules"]))
        fingerprint = meta["base_fingerprint"]
    except (KeyError, TypeError) as err:
        raise TrainingError(f"{path}: adapter metadata is incomplete or malformed ({err})") from None
    if not isinstance(fingerprint, str):
        raise TrainingError(f"{path}: adapter metadata field base_fingerprint must be a string")
    return lora, fingerprint, tensors


def load_adapter(model: Any, path: str | os.PathLike[str]) -> PeftModel:
    """Wrap ``model`` (in place) with the adapter saved at ``path``; refuse another base model."""
    lora, fingerprint, tensors = read_adapter(path)
    base = model_spec(model).fingerprint
    if fingerprint != base:
        raise TrainingError(f"the adapter at {path} was trained on other weights (base fingerprint "
                            f"{fingerprint[:12]} != {base[:12]})", "load it onto the model it was trained on")
    peft_model = wrap(model, lora)
    misfit = tensors_misfit(get_peft_model_state_dict(peft_model), tensors)
    if misfit:
        raise TrainingError(f"the adapter at {path} does not fit: {misfit}")
    set_peft_model_state_dict(peft_model, tensors)
    peft_model.eval()
    return peft_model


def _collate(batch: Sequence[Example], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest: ids [B, N], attention [B, N] (1 = token), loss mask [B, N]."""
    n = max(int(e.input_ids.numel()) for e in batch)
    ids = torch.full((len(batch), n), pad, dtype=torch.long)
    attention = torch.zeros(len(batch), n, dtype=torch.long)
    targets = torch.zeros(len(batch), n, dtype=torch.uint8)
    for row, example in enumerate(batch):
        length = int(example.input_ids.numel())
        ids[row, :length] = example.input_ids
        attention[row, :length] = 1
        targets[row, :length] = example.loss_mask
    return ids, attention, targets


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
    return type(t).__name__
