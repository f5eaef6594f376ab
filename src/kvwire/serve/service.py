"""The engine the HTTP layer talks to: a model, its scheduler and its store. No HTTP in here.

:class:`Service` turns a validated :class:`~kvwire.serve.schemas.ChatCompletionRequest`
into :class:`~kvwire.serve.scheduler.Params` (token ids, limits, sampling; refusing
prompts that do not fit the model's context), hands them to the
:class:`~kvwire.serve.scheduler.Scheduler`, and reports its health.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .. import hf, models
from ..errors import ContextLengthExceeded, ModelError, UnknownModel
from ..hf.weights import format_of
from .config import ServeConfig
from .generator import Decoder, decoder_for
from .metrics import Metrics
from .prefix_index import COMPLETION_KEY_CHARS
from .prompt import as_dicts, message_spans, pieces, prompt_ids
from .reuse import Reuse
from .scheduler import Event, Job, Params, Scheduler
from .schemas import ChatCompletionRequest
from .tenancy import namespace

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 2048  # for configs that do not say


def served_name(model: str | None) -> str:
    """The name clients send as ``model``: the default's name, or the folder's (or .gguf file's) name."""
    if model is None or str(model) in (models.DEFAULT_MODEL, "default"):
        return models.DEFAULT_MODEL
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


class Service:
    """One model served with reuse through one store. :meth:`start` starts its threads."""

    def __init__(self, config: ServeConfig, model: Any, tokenizer: Any, *, decoder: Decoder | None = None) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.name = config.model_name or served_name(config.model)
        self.started_at = time.time()
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.spec = hf.model_spec(model)
        if config.reuse:  # a cache kvwire cannot pass: refused at start, not on the first reused request
            try:
                hf.check_model_layout(model, self.spec)
            except ModelError as error:
                raise ModelError(error.message, "serve it with --no-reuse (every request prefilled)") from None
        self.context = hf.context_window(model) or DEFAULT_CONTEXT
        self.max_request_bytes = config.max_request_bytes or max(2**20, 32 * self.context)
        self.metrics = Metrics()
        self.reuse = Reuse(config, model, tokenizer, self.spec, self.metrics)
        self._encode_lock = threading.Lock()  # fast tokenizers may not be encoded from two threads at once
        self.scheduler = Scheduler(config, tokenizer, hf.eos_token_ids(model),
                                   decoder or decoder_for(model, config.max_batch, config.prefill_chunk,
                                                          config.reserve_slots),
                                   self.reuse, self.metrics, self._lookup)

    @classmethod
    def load(cls, config: ServeConfig) -> Service:
        """Load the configured model (converted once if it is a .gguf) and build the service."""
        from ..hf.weights import check_format

        check_format(config.weights)  # before a model is fetched or converted
        hf.check_device(config.device, config.weights)
        model, tokenizer = hf.load_model(models.resolve(config.model), weights=config.weights, device=config.device)
        return cls(config, model, tokenizer)

    def start(self) -> Service:
        self.scheduler.start()
        chunks = ""
        if getattr(self.scheduler.decoder, "engine", None) is not None:  # else one request at a time: no chunks
            chunk = self.prefill_chunk
            chunks = "; long prompts prefilled " + ("whole" if chunk is None else f"{chunk} tokens a chunk first") \
                + (" (auto)" if self.config.prefill_chunk == "auto" else "")
        log.info("serving %s (fingerprint %s) with store %s (%s)%s%s", self.name, self.spec.fingerprint[:12],
                 self.reuse.guard.shown_url, self.reuse.state,
                 "" if self.config.splice is None else f", splicing with recompute share {self.config.splice:g}",
                 chunks)
        return self

    def close(self) -> None:
        self.scheduler.close()
        self.reuse.close()

    # -- requests ----------------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise UnknownModel(f"the model {name!r} does not exist on this server",
                               f"this server serves {self.name!r} (GET /v1/models)", param="model")

    def params(self, request: ChatCompletionRequest, tenant: str | None = None) -> Params:
        """Token ids, limits and sampling for ``request`` (checked: model, options, roles, lengths), and the
        namespace of ``tenant`` (the API key's) and the request's ``cache_salt`` its caches live in."""
        self.check_model(request.model)
        request.check_supported()
        messages = as_dicts(request.messages, self.tokenizer)
        with self._encode_lock:
            ids = prompt_ids(self.tokenizer, messages)
        room = self.context - len(ids)
        limit = request.token_limit
        if room < 1:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.context} tokens; the messages are {len(ids)} tokens",
                "shorten the messages", param="messages")
        if limit is not None and limit > room:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.context} tokens; you requested "
                f"{len(ids) + limit} tokens ({len(ids)} in the messages, {limit} in the completion)",
                "ask for fewer tokens or shorten the messages",
                param="max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens")
        temperature = 1.0 if request.temperature is None else request.temperature
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        sampling = hf.Sampling(temperature, 1.0 if request.top_p is None else request.top_p, seed)
        return Params(messages, ids, limit if limit is not None else min(self.config.default_max_tokens, room),
                      sampling, tuple(request.stops), request.ignore_eos, namespace(tenant, request.cache_salt))

    def submit(self, params: Params, sink: Any) -> Job:
        return self.scheduler.submit(params, sink)

    def cancel(self, job: Job) -> None:
        self.scheduler.cancel(job)

    def _lookup(self, job: Job) -> None:
        """I/O thread: the ids the request is decoded from, and what the store holds for them."""
        params = job.params
        completions = self.reuse.completions(params.messages, params.namespace)
        built = None
        if completions:
            with self._encode_lock:
                built = pieces(self.tokenizer, params.messages, [c.substitution for c in completions])
            if built is not None and len(built.ids) + params.max_tokens > self.context:
                built = None  # the generated ids are longer than the text's: splicing would not fit
        if built is None:
            job.prompt_ids = list(params.ids)
            job.found = self.reuse.find(job.prompt_ids, namespace=params.namespace)
        else:
            job.prompt_ids = built.ids
            job.found = self.reuse.find(built.ids, [(span[0], c) for span, c in zip(built.spans, completions)],
                                        namespace=params.namespace)
        if self.config.reuse and self.config.splice is not None:  # its own user messages, for later requests
            with self._encode_lock:
                job.inputs = message_spans(self.tokenizer, params.messages,
                                           [c.substitution for c in completions] if built is not None else [],
                                           job.prompt_ids, min_tokens=self.config.min_splice_tokens,
                                           min_chars=COMPLETION_KEY_CHARS)

    # -- state -------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """What ``GET /health`` says; a degraded store is tried again here (a Redis server back up, say)."""
        if self.config.reuse:
            self.reuse.guard.probe()
        state = self.reuse.state
        status = "draining" if self.scheduler.draining else "degraded" if state == "degraded" else "ok"
        return {"status": status, "model": self.name,
                "fingerprint": self.spec.fingerprint, "store": self.reuse.guard.shown_url, "store_status": state,
                "store_error": self.reuse.guard.error, "reuse": self.config.reuse, "splice": self.config.splice,
                "running": self.scheduler.running, "waiting": self.scheduler.waiting,
                "max_batch": self.config.max_batch, "max_queue": self.config.max_queue,
                "device": str(hf.model_device(self.model)), "weights": format_of(self.model),
                "prefill_chunk": self.prefill_chunk, "decoding": self.decoding}

    @property
    def decoding(self) -> str:
        """``batched``, or ``one request at a time: <why>`` where the batched engine refused the model."""
        if getattr(self.scheduler.decoder, "engine", None) is not None:
            return "batched"
        return f"one request at a time: {getattr(self.scheduler.decoder, 'why', '') or 'a decoder of its own'}"

    @property
    def prefill_chunk(self) -> int | None:
        """The first chunk a long prompt is prefilled in (``--prefill-chunk``, ``auto`` resolved at start); None:
        whole prefills (or no batched engine: one request at a time)."""
        engine = getattr(self.scheduler.decoder, "engine", None)
        return None if engine is None else engine.prefill_chunk

    def refresh_store_bytes(self) -> None:
        """Read the store's size for /metrics (a directory scan for file:// stores: done per scrape)."""
        if self.config.reuse:
            used = self.reuse.guard.used_bytes()
            if used is not None:
                store = self.reuse.guard.store
                self.metrics.store_bytes(used, getattr(store, "evictions", None) if store is not None else None)


__all__ = ["Service", "Event", "served_name"]
