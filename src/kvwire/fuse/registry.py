"""Where trained projectors and fusers live, and which one serves a pair of models.

Checkpoints (the format is :mod:`kvwire.fuse.checkpoint`: a folder with ``config.json``
naming both models' specs and weight fingerprints) are kept under::

    $KVWIRE_HOME/fusers/<any name>/config.json          (or one level deeper)

``kvwire train-fuser`` and the ridge fit write there by default; ``kvwire check`` and
fuse mode look there. A checkpoint serves a pair only if both models' specs *and* weight
fingerprints match (:func:`find`); :func:`candidates` is the cheap first look that
ignores fingerprints (no weights loaded), to decide whether fingerprints are worth computing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .. import models
from ..wire.spec import ModelSpec

CONFIG_FILE = "config.json"


def fusers_dir() -> Path:
    """The folder holding trained projectors and fusers: ``$KVWIRE_HOME/fusers``."""
    return models.home() / "fusers"


def _configs(root: Path) -> Iterator[Path]:
    if not root.is_dir():
        return
    yield from sorted([*root.glob(f"*/{CONFIG_FILE}"), *root.glob(f"*/*/{CONFIG_FILE}")])


def find(root: Path, sharer: ModelSpec, receiver: ModelSpec, kinds: tuple[str, ...] = ("fuser", "ridge")) -> list[Path]:
    """Checkpoint folders under ``root`` made for exactly this sharer -> receiver pair (specs and
    fingerprints), learned fusers first."""
    if not any(True for _ in _configs(root)):
        return []
    from . import checkpoint

    found = []
    for kind in kinds:
        found += checkpoint.find(root, receiver, sharer, kind=kind)  # type: ignore[arg-type]
    return found


def candidates(root: Path, a: ModelSpec, b: ModelSpec) -> list[Path]:
    """Checkpoint folders for the pair in either direction, comparing specs without fingerprints
    (so that no weights need loading to know whether any is worth checking)."""
    if not any(True for _ in _configs(root)):
        return []
    from ..errors import CheckpointError
    from . import checkpoint

    def shape(spec: ModelSpec) -> dict:
        return {k: v for k, v in spec.to_json().items() if k != "fingerprint"}

    pair = {(repr(shape(a)), repr(shape(b))), (repr(shape(b)), repr(shape(a)))}
    found = []
    for config_path in _configs(root):
        try:
            config, _ = checkpoint.read_config(config_path.parent)
        except CheckpointError:
            continue
        if config.sharer is not None and (repr(shape(config.sharer.spec)), repr(shape(config.receiver.spec))) in pair:
            found.append(config_path.parent)
    return found
