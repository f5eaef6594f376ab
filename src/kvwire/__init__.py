"""kvwire: pass KV-caches between the agents of a multi-agent LLM pipeline.

Data flows one way::

    model -> hf.extract -> Packet -> codec.encode -> Store.put
          ... Store.get -> codec.decode -> chain.receive (join) -> hf.build_cache -> model

The modules that need transformers (``kvwire.hf``, ``kvwire.pipeline``) are
imported on first use, so ``import kvwire`` is cheap.
"""

from __future__ import annotations

from typing import Any

from . import codec
from .chain import fetch_chain, publish, receive
from .errors import (ChainError, ChecksumError, CodecOptionsError, CorruptPacketError, EngineError, KvwireError,
                     ContextTooLong, ModelError, ModelMismatchError, NonFiniteError, OverBudget, PacketError, PacketTooLargeError,
                     PipelineConfigError, SignatureError, StoreAccessDenied, StoreConfigError, StoreError,
                     StoreUnavailable, TranscriptError, UnknownStoreError, UnsupportedRopeError, VersionConflict)
from .codec_options import CodecOptions
from .packet import Packet, join
from .pipefile import AgentSpec, PipelineSpec
from .spec import ModelSpec
from .store import FileStore, MemoryStore, RedisStore, Store, open_store

__version__ = "0.1.0"

__all__ = [
    "AgentSpec", "ChainError", "ChecksumError", "CorruptPacketError", "FileStore", "KvwireError", "MemoryStore",
    "ContextTooLong", "ModelError", "ModelMismatchError", "ModelSpec", "Packet", "PacketError", "Pipeline", "PipelineConfigError",
    "PipelineSpec", "Store", "StoreError", "TranscriptError", "UnknownStoreError", "codec", "fetch_chain", "join",
    "open_store", "publish", "receive", "RedisStore", "VersionConflict", "OverBudget", "PacketTooLargeError",
    "SignatureError", "CodecOptionsError", "CodecOptions", "EngineError", "NonFiniteError", "UnsupportedRopeError",
    "StoreUnavailable", "StoreConfigError", "StoreAccessDenied",
]


def __getattr__(name: str) -> Any:
    if name == "Pipeline":
        from .pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'kvwire' has no attribute {name!r}")
