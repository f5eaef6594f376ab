"""Checkpoints of anything trained to fuse one model's cache into another's: a folder, no pickle.

One format for the learned fuser, the ridge projector and the LoRA-tuned receiver
(the baseline reported next to the fuser)::

    CHECKPOINT/
      config.json          what the tensors are, for which pair of models (below)
      weights.safetensors  the module's tensors, named as in its state_dict
      state.safetensors    optional, training checkpoints only: what an exact resume
                           needs (optimizer moments, random generator states)

    config.json = {
      "format": "kvwire.fuse-checkpoint", "format_version": 1,
      "kind": "fuser" | "ridge" | "lora",
      "receiver": {"name": "smollm2-135m-instruct", "spec": {<ModelSpec JSON, fingerprint included>}},
      "sharer":   {"name": "qwen2.5-coder-0.5b",    "spec": {...}} | null   (null: no sharer, e.g. lora),
      "alignment": "<token alignment method>" | null,
      "layer_map": [null, ..., 0, 1, ...],  per receiver layer: the sharer layer it reads, or null
      "module":   {...},   hyperparameters that rebuild the module (its kind's business)
      "training": {...},   how it was made (steps, data, seed, final losses): informational
      "state":    {...} | null,  JSON part of a resumable training state (step, data position)
      "files":    {"weights.safetensors": {"bytes": N, "blake3": "<hex>"}, ...},
      "config_blake3": "<hex>"   blake3 of this JSON without this field (sorted keys, compact)
    }

Reading treats a checkpoint as untrusted, in this order: ``config.json`` at most
1 MiB; JSON; format and version; every field's type; the file list (weights
required, nothing unknown); each file's size against the config and a bound; its
blake3 against the config; only then the safetensors parse (header and dtypes
checked by ``safetensors``; only float and integer dtypes accepted). The pair check
(:func:`check_pair`) compares both models' specs and weight fingerprints with the
models about to use it and refuses another pair, naming which model differs. The
module that loads the tensors checks their names and shapes against its config.

Writes go to a temporary folder beside the target, renamed into place, so a reader
never sees half a checkpoint. A write replaces only an earlier checkpoint (a folder of
these files), never another folder or file, and refuses tensors holding NaN or inf.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import blake3
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import CheckpointError, CorruptPacketError, reason
from ..wire.spec import ModelSpec

FORMAT = "kvwire.fuse-checkpoint"
FORMAT_VERSION = 1
Kind = Literal["fuser", "ridge", "lora"]
KINDS: tuple[str, ...] = ("fuser", "ridge", "lora")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
STATE_FILE = "state.safetensors"
CONFIG_DIGEST = "config_blake3"  # written since 2026-12-02; checked where present (older checkpoints lack it)
MAX_CONFIG_BYTES = 1 << 20
MAX_FILE_BYTES = 8 << 30
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)
_RETRAIN = "train one for this pair with `kvwire train-fuser --sharer A --receiver B`"


@dataclass(frozen=True)
class ModelRef:
    """A model a checkpoint was made for: a readable name and its full cache spec (with fingerprint)."""

    name: str
    spec: ModelSpec

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "spec": self.spec.to_json()}

    @classmethod
    def from_json(cls, data: Any, what: str) -> ModelRef:
        if not isinstance(data, dict) or set(data) != {"name", "spec"} or not isinstance(data["name"], str):
            raise CheckpointError(f"checkpoint config: {what} must be {{'name': str, 'spec': {{...}}}}")
        try:
            return cls(data["name"], ModelSpec.from_json(data["spec"]))
        except CorruptPacketError as err:
            raise CheckpointError(f"checkpoint config: {what} spec: {err.message}") from None


@dataclass(frozen=True)
class CheckpointConfig:
    """What a checkpoint holds and for which models (see the module docstring for the JSON)."""

    kind: Kind
    receiver: ModelRef
    sharer: ModelRef | None
    alignment: str | None
    layer_map: tuple[int | None, ...]  # per receiver layer: the sharer layer it reads, or None
    module: Mapping[str, Any] = field(default_factory=dict)
    training: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "kind": self.kind,
            "receiver": self.receiver.to_json(), "sharer": self.sharer.to_json() if self.sharer else None,
            "alignment": self.alignment, "layer_map": list(self.layer_map),
            "module": dict(self.module), "training": dict(self.training),
        }

    @classmethod
    def from_json(cls, data: Any) -> CheckpointConfig:
        if not isinstance(data, dict):
            raise CheckpointError("checkpoint config is not a JSON object")
        if data.get("format") != FORMAT:
            raise CheckpointError(f"not a kvwire fuse checkpoint (format {data.get('format')!r})")
        if data.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint format version {data.get('format_version')!r} is not supported "
                                  f"(this kvwire reads {FORMAT_VERSION})", "retrain it with this version")
        kind = data.get("kind")
        if kind not in KINDS:
            raise CheckpointError(f"checkpoint kind {kind!r} is not one of {', '.join(KINDS)}")
        types = {"alignment": (str, type(None)), "layer_map": list, "module": dict, "training": dict}
        for name, typ in types.items():
            if not isinstance(data.get(name), typ):
                raise CheckpointError(f"checkpoint config field {name!r} is missing or has the wrong type")
        layer_map = data["layer_map"]
        if not all(s is None or (isinstance(s, int) and not isinstance(s, bool) and s >= 0) for s in layer_map):
            raise CheckpointError("checkpoint layer_map must list a sharer layer (int >= 0) or null per layer")
        receiver = ModelRef.from_json(data.get("receiver"), "receiver")
        sharer = None if data.get("sharer") is None else ModelRef.from_json(data["sharer"], "sharer")
        if len(layer_map) not in (0, receiver.spec.num_layers):
            raise CheckpointError(f"checkpoint layer_map has {len(layer_map)} entries for a receiver of "
                                  f"{receiver.spec.num_layers} layers")
        if sharer is not None and any(s is not None and s >= sharer.spec.num_layers for s in layer_map):
            raise CheckpointError(f"checkpoint layer_map names a sharer layer beyond its {sharer.spec.num_layers}")
        return cls(kind, receiver, sharer, data["alignment"], tuple(layer_map), data["module"], data["training"])

    def describe(self) -> str:
        """One line: ``fuser for sharer qwen2.5-coder-0.5b (a1b2c3d4e5f6) -> receiver smollm2 (...)``."""
        sharer = f"sharer {self.sharer.name} ({self.sharer.spec.fingerprint[:12]}) -> " if self.sharer else ""
        return f"{self.kind} for {sharer}receiver {self.receiver.name} ({self.receiver.spec.fingerprint[:12]})"


@dataclass
class Checkpoint:
    """A loaded checkpoint: its config, its tensors and, for training checkpoints, the resume state."""

    path: Path
    config: CheckpointConfig
    weights: dict[str, torch.Tensor]
    state: dict[str, Any] | None = None  # JSON part of the training state
    state_tensors: dict[str, torch.Tensor] | None = None


# -- writing -----------------------------------------------------------------------------------------


def save(path: str | os.PathLike[str], config: CheckpointConfig, weights: Mapping[str, torch.Tensor], *,
         state: Mapping[str, Any] | None = None, state_tensors: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write a checkpoint folder at ``path`` atomically (replacing one that is there)."""
    path = Path(path)
    files = {WEIGHTS_FILE: _tensor_bytes(weights)}
    if state_tensors is not None:
        files[STATE_FILE] = _tensor_bytes(state_tensors)
    document = config.to_json()
    document["state"] = dict(state) if state is not None else None
    document["files"] = {name: {"bytes": len(data), "blake3": blake3.blake3(data).hexdigest()}
                         for name, data in files.items()}
    document[CONFIG_DIGEST] = _config_digest(document)
    text = json.dumps(document, indent=1, sort_keys=False, allow_nan=False).encode()
    if len(text) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"checkpoint config would be {len(text):,} bytes, over {MAX_CONFIG_BYTES:,}",
                              "keep bulky training records out of the config")
    _check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, data in files.items():
            _write(tmp / name, data)
        _write(tmp / CONFIG_FILE, text)
        old = path.with_name(f".{path.name}.{os.getpid()}.old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def check_writable(path: str | os.PathLike[str]) -> Path:
    """Before minutes of fitting or training: ``path`` may receive a checkpoint (free, an empty folder or
    an earlier checkpoint) and its parent folder can be made and written."""
    path = Path(path)
    _check_replaceable(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(f"cannot write a checkpoint at {path}: {reason(err)}",
                              "choose a folder you can write") from None
    return path


def _check_replaceable(path: Path) -> None:
    """``path`` is free, or an earlier checkpoint (its files and nothing else): never a user's folder or file."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a checkpoint folder: not replacing it",
                              "write the checkpoint to a new path")
    entries = {entry.name for entry in path.iterdir()}
    if not entries:  # an empty folder made for it
        return
    if CONFIG_FILE not in entries or not entries <= {CONFIG_FILE, WEIGHTS_FILE, STATE_FILE}:
        raise CheckpointError(f"{path} exists and is not a kvwire checkpoint (it holds "
                              f"{', '.join(sorted(entries)[:5])}{', ...' if len(entries) > 5 else ''}): "
                              "not replacing it", "write the checkpoint to a new or empty path")


def _config_digest(document: Mapping[str, Any]) -> str:
    """blake3 of the config's JSON without this digest: a changed layer map or weight is caught too."""
    body = {k: v for k, v in document.items() if k != CONFIG_DIGEST}
    return blake3.blake3(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


def _tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {tensor.dtype}, not storable in a checkpoint")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"tensor {name!r} holds NaN or infinite values: nothing was saved",
                                  "the fit or the training diverged; lower the learning rate or check the data")
    return st_save({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()})


def _write(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# -- reading -----------------------------------------------------------------------------------------


def read_config(path: str | os.PathLike[str]) -> tuple[CheckpointConfig, dict[str, Any]]:
    """The config of the checkpoint at ``path`` and its raw JSON, without reading any tensors."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        inside = [path / name for name in ("fuser", "lora") if (path / name / CONFIG_FILE).is_file()]
        raise CheckpointError(f"no fuse checkpoint at {path} ({CONFIG_FILE} missing)",
                              f"the checkpoint train-fuser wrote there is {inside[0]}" if inside else
                              "pass the checkpoint folder: OUT/fuser of kvwire train-fuser, or fit-ridge's --out")
    size = config_path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{config_path} is {size:,} bytes, over the {MAX_CONFIG_BYTES:,}-byte limit")
    try:
        document = json.loads(config_path.read_bytes(), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {str(err)[:200]}") from None
    config = CheckpointConfig.from_json(document)
    digest = document.get(CONFIG_DIGEST)
    if digest is not None and digest != _config_digest(document):
        raise CheckpointError(f"{config_path} does not match its recorded digest: the config was changed or "
                              "damaged after it was written", "retrain, or restore the checkpoint from a copy")
    return config, document


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a checkpoint may hold")


def load(path: str | os.PathLike[str], *, kind: Kind | None = None, receiver: ModelSpec | None = None,
         sharer: ModelSpec | None = None, with_state: bool = False) -> Checkpoint:
    """Read and verify a checkpoint; with ``receiver`` / ``sharer`` specs, refuse another pair.

    ``with_state`` also reads the training state (resume); otherwise it is not touched.
    """
    path = Path(path)
    config, document = read_config(path)
    if kind is not None and config.kind != kind:
        raise CheckpointError(f"{path} holds a {config.kind} checkpoint, not a {kind}")
    if receiver is not None:
        check_pair(config, receiver, sharer)
    files = document.get("files")
    if not isinstance(files, dict) or WEIGHTS_FILE not in files or not set(files) <= {WEIGHTS_FILE, STATE_FILE}:
        raise CheckpointError(f"{path}: the config's file list must name {WEIGHTS_FILE} (and optionally "
                              f"{STATE_FILE}), got {sorted(files) if isinstance(files, dict) else files!r}")
    weights = _read_tensors(path, WEIGHTS_FILE, files[WEIGHTS_FILE])
    state = state_tensors = None
    if with_state:
        if STATE_FILE not in files or not isinstance(document.get("state"), dict):
            raise CheckpointError(f"{path} holds no training state", "resume from a checkpoint written during "
                                  "training (OUT/checkpoints/step-*), not from a final one")
        state = document["state"]
        state_tensors = _read_tensors(path, STATE_FILE, files[STATE_FILE])
    return Checkpoint(path, config, weights, state, state_tensors)


def _read_tensors(folder: Path, name: str, entry: Any) -> dict[str, torch.Tensor]:
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) \
            or not isinstance(entry.get("blake3"), str):
        raise CheckpointError(f"{folder}: the config's entry for {name} needs 'bytes' and 'blake3'")
    file = folder / name
    if not file.is_file():
        raise CheckpointError(f"{folder}: {name} is missing", "copy the whole checkpoint folder")
    size = file.stat().st_size
    if size != entry["bytes"] or size > MAX_FILE_BYTES:
        raise CheckpointError(f"{file} is {size:,} bytes, the config says {entry['bytes']:,} (truncated or replaced)",
                              "copy the checkpoint again, or retrain it")
    data = file.read_bytes()
    if blake3.blake3(data).hexdigest() != entry["blake3"]:
        raise CheckpointError(f"{file} does not match the checksum in its config (corrupt or altered)",
                              "copy the checkpoint again, or retrain it")
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError) as err:
        raise CheckpointError(f"{file} is not a valid safetensors file: {err}") from None
    for tensor_name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise CheckpointError(f"{file}: tensor {tensor_name!r} has unsupported dtype {tensor.dtype}")
    return tensors


# -- which pair --------------------------------------------------------------------------------------


def check_pair(config: CheckpointConfig, receiver: ModelSpec, sharer: ModelSpec | None = None) -> None:
    """Refuse a checkpoint made for other models than ``receiver`` (and ``sharer``).

    Compares the whole cache spec, weight fingerprint included; the error names the model
    that differs, what the checkpoint expects, and what came.
    """
    _check_one("receiver", config.receiver, receiver, config)
    if config.sharer is None:
        if sharer is not None:
            raise CheckpointError(f"{config.describe()} uses no sharer, but one was given")
        return
    if sharer is None:
        raise CheckpointError(f"{config.describe()} needs its sharer's cache; none was given")
    _check_one("sharer", config.sharer, sharer, config)


def _check_one(role: str, expected: ModelRef, got: ModelSpec, config: CheckpointConfig) -> None:
    diffs = expected.spec.differences(got)
    if not diffs:
        return
    if all(d.startswith("fingerprint:") for d in diffs):
        detail = (f"same architecture, other weights: fingerprint {got.fingerprint[:12]} != "
                  f"{expected.spec.fingerprint[:12]} (a fine-tune or another checkpoint of the model)")
    else:
        detail = "; ".join(d for d in diffs if not d.startswith("fingerprint:"))
    raise CheckpointError(f"this checkpoint is a {config.describe()}; the {role} given is another model "
                          f"({detail})", _RETRAIN)


def find(root: str | os.PathLike[str], receiver: ModelSpec, sharer: ModelSpec | None,
         kind: Kind = "fuser") -> list[Path]:
    """Checkpoint folders under ``root`` (searched two levels deep) made for exactly this pair."""
    root = Path(root)
    found = []
    for config_path in sorted([*root.glob(f"*/{CONFIG_FILE}"), *root.glob(f"*/*/{CONFIG_FILE}")]):
        try:
            config, _ = read_config(config_path.parent)
            if config.kind == kind:
                check_pair(config, receiver, sharer)
                found.append(config_path.parent)
        except CheckpointError:
            continue
    return found
