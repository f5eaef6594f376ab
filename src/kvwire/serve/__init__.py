"""``kvwire serve``: an OpenAI-compatible chat server whose requests reuse each other's caches.

What flows in and out::

    HTTP request (OpenAI chat completion JSON)
      -> app.py        parse (schemas.py: typed, strict), authorize; errors -> OpenAI error objects, in one place
      -> service.py    messages -> token ids (prompt.py), limits, sampling -> Params
      -> scheduler.py  queue (bounded: 429), then on the I/O thread:
         reuse.py        find the longest published prefix (prefix_index.py: content-addressed block hashes)
                         and, with --splice, earlier completions and user messages among the messages;
                         fetch + verify packets
                         (kvwire.store.local: those already seen, from this process, in front of redis://)
         on the model thread:
         reuse.py        prepare the cache (exact prefix; splice.assemble for completions)
         generator.py    prefill the rest, join the batch; decode steps shared by every running request
         finish -> I/O thread: reuse.py publishes prompt + completion K/V as a chain link (chain.publish),
                   indexes its blocks (and, with --splice, the completion as a segment)
      <- text deltas (server-sent events) or one response, with usage.prompt_tokens_details.cached_tokens
    metrics.py: Prometheus counters (vLLM's prefix_cache_queries / prefix_cache_hits names and kvwire's own)

The store is the only thing servers share: several processes on one ``redis://``
store (or one ``file:///dev/shm/...`` store) reuse each other's caches, and a
``file://`` store on disk survives a restart. Nothing in this package imports
transformers; the model is reached through :mod:`kvwire.hf`.
"""

from typing import Any

from .config import ServeConfig

__all__ = ["Background", "ServeConfig", "Service", "serve"]


def __getattr__(name: str) -> Any:
    # imported on first use: the command line checks its arguments before paying for torch and FastAPI
    if name in ("Background", "serve"):
        from . import runner

        return getattr(runner, name)
    if name == "Service":
        from .service import Service

        return Service
    raise AttributeError(f"module 'kvwire.serve' has no attribute {name!r}")
