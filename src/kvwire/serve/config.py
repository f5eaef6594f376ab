"""ServeConfig: everything ``kvwire serve`` is started with, in one dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .tenancy import check_keys


@dataclass(frozen=True)
class ServeConfig:
    """How a server runs. The CLI's options map one to one onto these fields."""

    model: str | None = None  # bundled default (None), a local HF model folder, or a .gguf file
    model_name: str | None = None  # the name clients send as "model"; default: the model folder's name
    store: str = "memory://"  # where caches are published and found (memory://, file:///DIR, redis://...)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    api_keys: tuple[str, ...] = ()  # more keys: each key is a tenant, whose requests never read another's caches
    reuse: bool = True  # False (--no-reuse): every request prefills its whole prompt; nothing is published
    splice: float | None = None  # --splice R: splice earlier completions and messages, recompute share R
    splice_when: str = "cheaper"  # "cheaper": only where splice.estimate says it beats prefilling them; "always"
    splice_guard: float = 0.0  # the fidelity guard's staleness bound (kvwire.kv.splice.Recompute.guard; 0: none)
    max_batch: int = 8  # sequences decoded together
    max_queue: int = 32  # requests waiting for a batch slot; one more is answered 429
    block_size: int = 16  # tokens per prefix-index block (finding a cached prefix costs O(log(blocks)) lookups)
    default_max_tokens: int = 512  # when a request gives no max_tokens (capped by the context left)
    threads: int | None = None  # torch threads of the model thread (None: leave torch's setting)
    weights: str = "fp32"  # the model's linear weights: fp32, bf16, int8 or int4 (kvwire.hf.weights)
    device: str = "cpu"  # where the model runs: cpu, cuda, cuda:N, mps (an accelerator takes fp32 weights)
    malloc_arenas: int = 2  # glibc malloc arenas for the process (0: glibc's default; see kvwire.allocator)
    malloc_trim_s: float = 30.0  # hand free heap pages back to the system this often (0: never)
    store_retry_s: float = 5.0  # after a store fault, serve without reuse this long before trying it again
    min_splice_tokens: int = 8  # shorter completions are not worth splicing
    local_packet_bytes: int = 512 * 2**20  # packets kept in this process in front of a redis:// store (0: none)
    shutdown_grace: float = 30.0  # on SIGTERM: new requests 503, running ones get this many seconds to finish
    # a longer prompt's first chunk (tokens), each riding in a decode step's pass; "auto": measured on the model at
    # start (kvwire.hf.auto_prefill_chunk: 192 on a 2-core CPU, more on a faster one; whole prefills on a GPU);
    # None: whole prefills
    prefill_chunk: int | str | None = "auto"
    reserve_slots: int = 0  # the engine's buffers: max_batch rows of this many slots, allocated at start (0: on demand)
    # a request body over this many bytes is refused (413) before it is read in full or parsed; None: 32 bytes a
    # token of the model's context window, at least 1 MiB (no prompt that fits the model comes near it)
    max_request_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.splice is not None and not 0.0 <= self.splice <= 1.0:
            raise ValueError(f"splice recompute share must be in [0, 1], got {self.splice}")
        if not (self.splice_guard >= 0.0 and math.isfinite(self.splice_guard)):
            raise ValueError(f"splice_guard must be a finite number >= 0, got {self.splice_guard!r}")
        if self.splice_when not in ("cheaper", "always"):
            raise ValueError(f"splice_when must be 'cheaper' or 'always', got {self.splice_when!r}")
        for name in ("max_batch", "block_size", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not 0 <= self.shutdown_grace <= 3600:
            raise ValueError(f"shutdown_grace must be 0..3600 seconds, got {self.shutdown_grace}")
        if not (self.prefill_chunk is None or self.prefill_chunk == "auto" or (
                isinstance(self.prefill_chunk, int) and not isinstance(self.prefill_chunk, bool)
                and self.prefill_chunk >= 1)):
            raise ValueError(f"prefill_chunk must be a token count >= 1, 'auto' or None (whole prefills), "
                             f"got {self.prefill_chunk!r}")
        if isinstance(self.reserve_slots, bool) or not isinstance(self.reserve_slots, int) or self.reserve_slots < 0:
            raise ValueError(f"reserve_slots must be a slot count >= 0 (0: allocate on demand), "
                             f"got {self.reserve_slots!r}")
        if self.max_request_bytes is not None and (isinstance(self.max_request_bytes, bool)
                                                   or not isinstance(self.max_request_bytes, int)
                                                   or self.max_request_bytes < 1024):
            raise ValueError(f"max_request_bytes must be a byte count >= 1024 (or None: from the model's context "
                             f"window), got {self.max_request_bytes!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.malloc_trim_s <= 86400:
            raise ValueError(f"malloc_trim_s must be 0..86400 seconds (0: never), got {self.malloc_trim_s}")
        if not 0 <= self.malloc_arenas <= 1024:
            raise ValueError(f"malloc_arenas must be 0..1024 (0: the C library's default), got {self.malloc_arenas}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to serve without one)")
        check_keys(self.keys, "api key")

    @property
    def keys(self) -> tuple[str, ...]:
        """Every API key the server accepts (each one a tenant); empty: no key needed."""
        return ((self.api_key,) if self.api_key is not None else ()) + tuple(self.api_keys)
