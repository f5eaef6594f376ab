"""kvwire: pass KV-caches between the agents of a multi-agent LLM pipeline.

Data flows one way, and each stage is a subpackage::

    model -> hf.extract -> wire.Packet -> wire.codec.encode -> store.Store.put
          ... store.Store.get -> wire.codec.decode -> kv.chain.receive (join) | kv.splice
          -> hf.build_cache -> model

- :mod:`kvwire.wire` -- the packet and its wire format (spec, packet, quant, signing, codec, rope).
- :mod:`kvwire.store` -- bytes in, bytes out: memory, file, Redis, Redis Cluster.
- :mod:`kvwire.kv` -- K/V surgery: chains of packets joined, segments spliced.
- :mod:`kvwire.hf` -- the one place that touches transformers' internals.
- :mod:`kvwire.pipeline` -- pipelines of agents: spec, transcript, turn, linear and graph runs,
  worker processes, results, cost.
- :mod:`kvwire.fuse` -- cache-to-cache between different models.
- :mod:`kvwire.serve` -- an OpenAI-compatible server that reuses caches.
- :mod:`kvwire.evals` -- question sets.
- :mod:`kvwire.cli` -- the ``kvwire`` command.

The modules that need transformers (``kvwire.hf``, ``kvwire.pipeline``'s runners) are
imported on first use, so ``import kvwire`` is cheap. The old flat module names
(``kvwire.codec``, ``kvwire.chain``, ...) still import, with a DeprecationWarning naming
the new place (:mod:`kvwire._moved`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from . import _moved
from .errors import (ChainError, ChecksumError, CodecOptionsError, ContextTooLong, CorruptPacketError, EngineError,
                     KvwireError, ModelError, ModelMismatchError, NonFiniteError, OverBudget, PacketError,
                     PacketTooLargeError, PipelineConfigError, SignatureError, StoreAccessDenied, StoreConfigError,
                     StoreError, StoreUnavailable, TaskSetError, TranscriptError, UnknownStoreError,
                     UnsupportedRopeError, VersionConflict)
# each name below, and the module it comes from: imported on first use (``import kvwire`` and the command line's
# usage errors stay clear of torch, ~2.5 s on a 2-core CPU)
_LAZY: dict[str, str] = {
    "fetch_chain": "kv.chain", "publish": "kv.chain", "receive": "kv.chain",
    "AgentSpec": "pipeline.spec", "PipelineSpec": "pipeline.spec",
    "FileStore": "store", "MemoryStore": "store", "RedisStore": "store", "Store": "store", "open_store": "store",
    "CodecOptions": "wire.options", "Packet": "wire.packet", "join": "wire.packet", "ModelSpec": "wire.spec",
    "Pipeline": "pipeline.linear",
}

_moved.install()

from .version import __version__ as __version__  # noqa: E402  (re-exported: kvwire.__version__)

__all__ = [
    "AgentSpec", "ChainError", "ChecksumError", "CorruptPacketError", "FileStore", "KvwireError", "MemoryStore",
    "ContextTooLong", "ModelError", "ModelMismatchError", "ModelSpec", "Packet", "PacketError", "Pipeline",
    "PipelineConfigError",
    "PipelineSpec", "Store", "StoreError", "TranscriptError", "UnknownStoreError", "codec", "fetch_chain", "join",
    "open_store", "publish", "receive", "RedisStore", "VersionConflict", "OverBudget", "PacketTooLargeError",
    "SignatureError", "CodecOptionsError", "CodecOptions", "EngineError", "NonFiniteError", "UnsupportedRopeError",
    "StoreUnavailable", "StoreConfigError", "StoreAccessDenied", "TaskSetError",
]


def __getattr__(name: str) -> Any:
    if name == "codec":
        return import_module(".wire.codec", __name__)
    where = _LAZY.get(name)
    if where is not None:
        value = getattr(import_module(f".{where}", __name__), name)
        globals()[name] = value  # the next use is a plain attribute
        return value
    return _moved.attribute(name)  # an old module name (kvwire.chain, ...), or AttributeError


if TYPE_CHECKING:  # what type checkers and editors see: the same names, eagerly
    from .kv.chain import fetch_chain, publish, receive
    from .pipeline.linear import Pipeline
    from .pipeline.spec import AgentSpec, PipelineSpec
    from .store import FileStore, MemoryStore, RedisStore, Store, open_store
    from .wire import codec
    from .wire.options import CodecOptions
    from .wire.packet import Packet, join
    from .wire.spec import ModelSpec
