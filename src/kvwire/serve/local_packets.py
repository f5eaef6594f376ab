"""Moved to :mod:`kvwire.store.local` (nothing in it is the server's own); this name stays importable."""

from __future__ import annotations

from ..store.local import PACKETS, LocalPackets

__all__ = ["PACKETS", "LocalPackets"]
