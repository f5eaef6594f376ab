"""``kvwire serve``: the CLI side of the OpenAI-compatible server.

The library does the work (:mod:`kvwire.serve`); this module parses the options into a
:class:`~kvwire.serve.ServeConfig`. :mod:`kvwire.cli` adds the command to the ``kvwire``
group (errors become one ``error: ...`` line there).
"""

from __future__ import annotations

import click

from .types import GUARD_HELP, FiniteFloat, PrefillChunk, device_option, weights_option
from ..models import MODEL_HELP


@click.command("serve")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--model-name", default=None,
              help="the name clients send as \"model\" (default: the model's folder name)")
@click.option("--store", "store_url", default="memory://?budget=1GiB", show_default=True,
              help="where caches are published and found: memory://, file:///DIR (file:///dev/shm/NAME shares "
                   "one host), redis://HOST:PORT/DB (several processes or hosts); add ?budget=SIZE")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", "api_keys", envvar="KVWIRE_API_KEY", multiple=True,
              help="require Authorization: Bearer KEY on /v1/* (or set KVWIRE_API_KEY); give it several times "
                   "for several tenants: each key's requests never read another key's caches")
@click.option("--api-keys-file", type=click.Path(path_type=str), default=None,
              help="API keys, one per line (# comments): each key a tenant, as with --api-key")
@click.option("--no-reuse", is_flag=True, help="prefill every prompt in full and publish nothing (the baseline)")
@click.option("--splice", "splice_r", type=FiniteFloat(0.0, 1.0), default=None,
              help="splice earlier completions (and user messages) found in messages, recomputing share R of "
                   "their tokens (approximate; off by default: the server is exact)")
@click.option("--splice-when", type=click.Choice(["cheaper", "always"]), default=None,
              help="with --splice: splice only where that is estimated cheaper than prefilling the completions "
                   "(short ones are prefilled, exactly), or always  [default: cheaper]")
@click.option("--splice-guard", type=FiniteFloat(0.0, None), default=None,
              help="with --splice: " + GUARD_HELP.replace("splice and a graph's spliced merges: ", ""))
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True,
              help="sequences decoded together")
@click.option("--max-queue", type=click.IntRange(0), default=32, show_default=True,
              help="requests waiting for a batch slot; beyond that 429 with Retry-After")
@click.option("--max-tokens", "default_max_tokens", type=click.IntRange(1), default=512, show_default=True,
              help="completion tokens when a request does not say")
@click.option("--block-size", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="tokens per prefix-index block")
@click.option("--shutdown-grace", type=FiniteFloat(0.0, 3600.0), default=30.0, show_default=True,
              help="on SIGTERM: answer new requests 503 with Retry-After and give running ones this many seconds "
                   "to finish, then end the rest with an error and exit 0")
@click.option("--prefill-chunk", type=PrefillChunk(), default="auto", show_default=True,
              help="prefill a longer prompt in chunks, each carried in the running requests' decode step (they keep "
                   "streaming while it joins): N tokens first, fewer as its context grows, so that every chunk costs "
                   "the same; auto: measured on the model at start on a CPU (192 on 2 cores), whole prefills on an "
                   "accelerator (where a chunk costs a whole pass); none: whole prefills")
@click.option("--reserve-slots", type=click.IntRange(0), default=0, show_default=True,
              help="allocate the batched engine's buffers at start, --max-batch rows of this many slots (tokens), "
                   "and keep them: a long prompt then joins without pausing the running requests while its room is "
                   "allocated (0: grow them on demand and drop them when idle)")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="torch threads for the model (default: torch's own setting)")
@click.option("--malloc-arenas", type=click.IntRange(0, 1024), default=2, show_default=True,
              help="glibc malloc arenas for the process, which keep RSS flat under load (0: glibc's default; "
                   "MALLOC_ARENA_MAX in the environment wins)")
@click.option("--malloc-trim", "malloc_trim_s", type=click.FloatRange(0, 86400), default=30.0, show_default=True,
              help="seconds between returns of free heap pages to the system (glibc's malloc_trim; 0: never)")
@click.option("--max-request-bytes", type=click.IntRange(1024), default=None,
              help="refuse a request body over this many bytes (413) before reading it in full [default: 32 bytes a "
                   "token of the model's context window, at least 1 MiB]")
@weights_option
@device_option
def serve_cmd(model: str | None, model_name: str | None, store_url: str, host: str, port: int,
              api_keys: tuple[str, ...], api_keys_file: str | None, no_reuse: bool, splice_r: float | None,
              splice_when: str | None, splice_guard: float | None, max_batch: int,
              max_queue: int, default_max_tokens: int, block_size: int, shutdown_grace: float,
              prefill_chunk: int | str | None, reserve_slots: int, threads: int | None, malloc_arenas: int,
              malloc_trim_s: float, max_request_bytes: int | None, weights: str, device: str) -> None:
    """Serve the model over OpenAI's chat completions API; requests reuse each other's caches through the store."""
    from ..serve import ServeConfig, serve

    if no_reuse and splice_r is not None:
        raise click.UsageError("--splice reuses caches: it cannot go with --no-reuse")
    if splice_when is not None and splice_r is None:
        raise click.UsageError("--splice-when says when to splice: it needs --splice R")
    if splice_guard is not None and splice_r is None:
        raise click.UsageError("--splice-guard guards a splice: it needs --splice R")
    if any(key == "" for key in api_keys):
        raise click.BadParameter("must not be empty", param_hint="--api-key")
    from ..serve.tenancy import load_keys

    keys = tuple(api_keys) + (load_keys(api_keys_file) if api_keys_file is not None else ())
    from ..wire.options import CodecOptions

    CodecOptions.from_env()  # a bad KVWIRE_ENCODING or KVWIRE_SIGNING_KEY: said before the model loads
    try:
        config = ServeConfig(model=model, model_name=model_name, store=store_url, host=host, port=port,
                             api_keys=keys, reuse=not no_reuse, splice=splice_r,
                             splice_when=splice_when or "cheaper", splice_guard=splice_guard or 0.0,
                             max_batch=max_batch,
                             max_queue=max_queue, block_size=block_size, default_max_tokens=default_max_tokens,
                             shutdown_grace=shutdown_grace, prefill_chunk=prefill_chunk,
                             reserve_slots=reserve_slots, threads=threads,
                             malloc_arenas=malloc_arenas, malloc_trim_s=malloc_trim_s,
                             max_request_bytes=max_request_bytes, weights=weights, device=device)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    serve(config)
