"""``kvwire check A B``: two models side by side, and what it takes to pass caches between them.

"Compare the two configs before anything else" is the first troubleshooting step of
cache passing. :func:`compare` lines up both models' cache-relevant facts (layers,
heads, KV heads, head_dim, hidden size, RoPE, vocabulary and tokenizer, sliding
windows, dtype, weight fingerprint) and gives one of three verdicts
(:data:`Verdict`):

- ``identical``: same spec and same weights -- caches pass as they are (prefix, splice);
- ``variant``: same architecture and tokenizer, other weights (a fine-tune, an update) --
  caches do not pass as they are, partial-layer transfer applies (reuse the layers
  that barely changed, recompute the rest);
- ``different``: anything else -- a projector or learned fuser is needed (``fuse``
  mode); the verdict says whether one is trained for this pair and where
  (:mod:`kvwire.fuse.registry`).

Configs and tokenizers are read without loading weights; weights are loaded only when
the verdict needs their fingerprints (same architecture and tokenizer: identical or
variant? a fuser on disk: made for these exact weights?), or when asked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import hf, models
from ..errors import CheckpointError, ModelError
from ..wire.spec import ModelSpec

log = logging.getLogger(__name__)

Verdict = Literal["identical", "variant", "different"]

# rows that decide whether the architectures match (a tokenizer's rows are compared separately)
_ARCHITECTURE_ROWS = ("architecture", "layers", "attention heads", "KV heads", "head_dim", "hidden size",
                      "RoPE type", "RoPE base", "layer kinds", "sliding window", "vocabulary (config)")
_TOKENIZER_ROWS = ("tokenizer vocabulary", "vocabulary hash")


@dataclass
class ModelFacts:
    """One model as ``check`` sees it. ``spec.fingerprint`` is ``""`` until weights are loaded."""

    name: str  # as given on the command line
    path: Path
    spec: ModelSpec
    config: dict[str, Any]  # hf.describe.config_facts without the spec
    tokenizer: dict[str, Any]  # hf.tokenizer_info
    parameters: int | None = None  # with weights only
    layout: str | None = None  # with weights only: why its cache cannot be passed (hf.check_model_layout), if so

    @property
    def fingerprint(self) -> str:
        return self.spec.fingerprint

    def rows(self) -> dict[str, str]:
        """The facts as the table shows them, by row name."""
        s, c, t = self.spec, self.config, self.tokenizer
        kinds = sorted(set(s.layer_kinds))
        return {
            "architecture": s.architecture,
            "layers": str(s.num_layers),
            "attention heads": str(c["num_attention_heads"]),
            "KV heads": str(s.num_kv_heads),
            "head_dim": str(s.head_dim),
            "hidden size": str(c["hidden_size"]),
            "RoPE type": c["rope_type"],
            "RoPE base": _number(c["rope_theta"]),
            "layer kinds": (f"all {kinds[0].split('_')[0]}" if len(kinds) == 1 else
                            ", ".join(f"{s.layer_kinds.count(k)} {k.split('_')[0]}" for k in kinds)),
            "sliding window": str(s.sliding_window or "none"),
            "vocabulary (config)": f"{s.vocab_size:,}",
            "tokenizer": f"{t['class']} ({t['algorithm']})",
            "tokenizer vocabulary": f"{t['vocab_size']:,}",
            "vocabulary hash": t["vocab_hash"][:12],
            "chat template hash": t["chat_template_hash"][:12] or "none",
            "bos / eos": f"{t['bos_token']} / {t['eos_token']}",
            "cache dtype": s.dtype,
            "KV bytes per token": f"{s.kv_bytes(1):,}",
            "parameters": f"{self.parameters:,}" if self.parameters is not None else "(weights not loaded)",
            "fingerprint": self.fingerprint[:12] if self.fingerprint else "(weights not loaded)",
        }

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "spec": self.spec.to_json(), "config": self.config,
                "tokenizer": self.tokenizer, "parameters": self.parameters, "layout": self.layout}


@dataclass
class Row:
    name: str
    a: str
    b: str
    same: bool


@dataclass
class Comparison:
    """The side-by-side table, the verdict and why, and the fusers found for the pair."""

    a: ModelFacts
    b: ModelFacts
    rows: list[Row]
    verdict: Verdict
    reason: str
    advice: str
    fusers: dict[str, list[str]] = field(default_factory=dict)  # "A->B" / "B->A" -> checkpoint folders
    gains: dict[str, str] = field(default_factory=dict)  # checkpoint folder -> its validated gain, in words

    @property
    def differences(self) -> list[str]:
        return [row.name for row in self.rows if not row.same]

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a.to_json(), "b": self.b.to_json(), "verdict": self.verdict, "reason": self.reason,
                "advice": self.advice, "differences": self.differences, "fusers": self.fusers, "gains": self.gains,
                "rows": [{"name": r.name, "a": r.a, "b": r.b, "same": r.same} for r in self.rows]}


def inspect(model: str, with_weights: bool = False) -> ModelFacts:
    """The facts of ``model`` (a registered name, a folder or a .gguf file); weights only if asked."""
    path = models.resolve(model)
    facts = hf.config_facts(path)
    spec = facts.pop("spec")
    tokenizer = hf.tokenizer_info(hf.load_tokenizer(path))
    result = ModelFacts(model, path, spec, facts, tokenizer)
    if with_weights:
        load_weights(result)
    return result


def load_weights(facts: ModelFacts) -> None:
    """Load the model once to fill in its fingerprint and parameter count."""
    log.info("loading %s to fingerprint its weights", facts.path)
    loaded, _ = hf.load_model(facts.path)
    facts.spec = hf.model_spec(loaded)
    facts.parameters = sum(p.numel() for p in loaded.parameters())
    try:
        hf.check_model_layout(loaded, facts.spec)
    except ModelError as error:
        facts.layout = error.message
    del loaded


def compare(a: str, b: str, weights: bool | None = None, fusers_root: Path | None = None) -> Comparison:
    """Compare models ``a`` (the sharer) and ``b`` (the receiver). ``weights``: True loads both
    models, False never does, None (default) loads them only when the verdict needs it."""
    from . import registry

    facts_a, facts_b = inspect(a, bool(weights)), inspect(b, bool(weights))
    same_architecture = _same(facts_a, facts_b, _ARCHITECTURE_ROWS)
    same_tokenizer = _same(facts_a, facts_b, _TOKENIZER_ROWS)
    root = fusers_root if fusers_root is not None else registry.fusers_dir()
    candidates = registry.candidates(root, facts_a.spec, facts_b.spec)
    needs_weights = (same_architecture and same_tokenizer) or bool(candidates)
    if weights is None and needs_weights:
        load_weights(facts_a)
        if facts_b.path.resolve() == facts_a.path.resolve():  # one folder: the same weights, load once
            facts_b.spec, facts_b.parameters = facts_a.spec, facts_a.parameters
        else:
            load_weights(facts_b)
    fingerprints = bool(facts_a.fingerprint and facts_b.fingerprint)
    rows = [Row(name, value, facts_b.rows()[name], value == facts_b.rows()[name])
            for name, value in facts_a.rows().items()
            if fingerprints or name not in ("parameters", "fingerprint")]
    fusers: dict[str, list[str]] = {}
    if not (same_architecture and same_tokenizer):
        verdict: Verdict = "different"
        what = [name for name in _ARCHITECTURE_ROWS + _TOKENIZER_ROWS if not _same(facts_a, facts_b, (name,))]
        reason = f"different models: {', '.join(what)} differ"
        if same_tokenizer:
            reason += " (same tokenizer: token alignment is the identity)"
        if fingerprints:
            fusers = {"A->B": [str(p) for p in registry.find(root, facts_a.spec, facts_b.spec)],
                      "B->A": [str(p) for p in registry.find(root, facts_b.spec, facts_a.spec)]}
        elif not candidates:  # nothing on disk for these architectures: no weights needed to say so
            fusers = {"A->B": [], "B->A": []}
        advice = _fuser_advice(a, b, fusers, root)
    elif not fingerprints:
        verdict, reason = "variant", "same architecture and tokenizer; weights not compared (--no-weights)"
        advice = "run without --no-weights to tell identical weights from a fine-tuned variant"
    elif facts_a.fingerprint == facts_b.fingerprint:
        verdict, reason = "identical", "same architecture, tokenizer and weights"
        advice = "pass caches directly: prefix mode (shared transcript) or splice mode (private prompts)"
    else:
        verdict, reason = "variant", "same architecture and tokenizer, other weights (a fine-tuned variant)"
        advice = ("caches do not pass as they are; partial-layer transfer applies: reuse the sender's first "
                  "layers and recompute the rest (or re-prefill from the token ids)")
    layout = facts_a.layout or facts_b.layout
    if layout is not None and verdict != "different":  # the same model, but not a cache kvwire can pass
        advice = f"caches cannot be passed: {layout}; run the agents in text mode"
    return Comparison(facts_a, facts_b, rows, verdict, reason, advice, fusers,
                      {p: gain_line(Path(p)) for paths in fusers.values() for p in paths})


def gain_line(path: Path) -> str:
    """What a checkpoint's recorded gain says: ``"helps: ..."`` or ``"refused (no better than alone): ..."``."""
    from . import checkpoint, gain

    try:
        config, _ = checkpoint.read_config(path)
    except CheckpointError as error:
        return f"unreadable: {error}"
    recorded = dict(config.training or {}).get("gain")
    verdict = "helps" if gain.is_positive(recorded) else "refused without --allow-worse"
    return f"{verdict}: {gain.describe(recorded)}"


def _fuser_advice(a: str, b: str, fusers: dict[str, list[str]], root: Path) -> str:
    if not fusers:
        return (f"a projector or fuser is needed (fuse mode); checkpoints for these architectures are in {root}: "
                "run without --no-weights to see whether one was made for these exact weights")
    if fusers.get("A->B"):
        return f"fuse mode: {a} shares, {b} receives, with the fuser at {fusers['A->B'][0]}"
    if fusers.get("B->A"):
        return (f"a fuser is trained only for the other direction ({b} shares, {a} receives): {fusers['B->A'][0]}; "
                f"for {a} -> {b} train one: kvwire train-fuser --sharer {a} --receiver {b}")
    return (f"a projector or fuser is needed and none is trained for this pair in {root}: "
            f"kvwire train-fuser --sharer {a} --receiver {b} (or fit the ridge baseline)")


def _same(a: ModelFacts, b: ModelFacts, names: tuple[str, ...]) -> bool:
    rows_a, rows_b = a.rows(), b.rows()
    return all(rows_a[name] == rows_b[name] for name in names)


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:g}" if value < 1e4 else f"{value:.0e}".replace("e+0", "e")
