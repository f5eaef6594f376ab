"""The HTTP layer: FastAPI routes over a :class:`~kvwire.serve.service.Service`, and nothing else.

Routes::

    POST /v1/chat/completions   OpenAI chat completions, streamed (server-sent events) or not
    GET  /v1/models             the one model served (and /v1/models/{id})
    GET  /health                model, store ok / degraded / off, queue depth (no API key needed); 503 while
                                draining for a shutdown (HEAD too)
    GET  /metrics               Prometheus text format (no API key needed)

Every error leaves through :func:`error_response`, the one place where errors become
HTTP statuses and OpenAI error objects (``{"error": {"message", "type", "param",
"code"}}``): :data:`STATUS` maps the :class:`~kvwire.errors.ServeError` tree, a
request body that is not valid JSON or has a field of the wrong type is a 400, and
anything unexpected a 500 (logged with its traceback, never shown to the client).
Model calls never run on the event loop: tokenizing and store queries run on the app's
own worker threads (``kvwire-http``, joined when the app stops, so a stopped server
leaves no thread behind) and generation on the service's model thread, which delivers
events back to the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import (AuthenticationFailed, ContextLengthExceeded, InvalidRequest, KvwireError, QueueFull,
                      RequestTooLarge, ServeError, ServerUnavailable, UnknownModel)
from .scheduler import Done, Event, Failed, Job, Text
from .schemas import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Choice, ChunkChoice, Delta,
                      ErrorDetail, ErrorResponse, Health, KvwireUsage, ModelCard, ModelList, PromptTokensDetails,
                      ResponseMessage, Usage)
from .service import Service
from .tenancy import authenticate

log = logging.getLogger(__name__)
T = TypeVar("T")

# error class -> (HTTP status, OpenAI error type, code); the first match wins, so subclasses come first
STATUS: tuple[tuple[type[KvwireError], int, str, str | None], ...] = (
    (ContextLengthExceeded, 400, "invalid_request_error", "context_length_exceeded"),
    (RequestTooLarge, 413, "invalid_request_error", "request_too_large"),
    (InvalidRequest, 400, "invalid_request_error", None),
    (AuthenticationFailed, 401, "invalid_request_error", "invalid_api_key"),
    (UnknownModel, 404, "invalid_request_error", "model_not_found"),
    (QueueFull, 429, "rate_limit_error", "queue_full"),
    (ServerUnavailable, 503, "server_error", "unavailable"),
)


def error_response(error: BaseException, service: Service | None = None) -> JSONResponse:
    """The one mapping from an error to an HTTP response with an OpenAI error object."""
    status, kind, code, param, headers = 500, "server_error", None, None, {}
    message = "the server failed to answer this request; see its log"
    for cls, cls_status, cls_kind, cls_code in STATUS:
        if isinstance(error, cls):
            status, kind, code, message = cls_status, cls_kind, cls_code, str(error)
            param = getattr(error, "param", None)
            break
    else:
        if isinstance(error, StarletteHTTPException):
            status, kind, message = error.status_code, "invalid_request_error", str(error.detail)
            code = {404: "not_found", 405: "method_not_allowed"}.get(status)
            headers.update(error.headers or {})  # a 405's Allow: the methods the route takes
        else:
            log.error("request failed", exc_info=error)
    if isinstance(error, (QueueFull, ServerUnavailable)) and error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    if service is not None:
        service.metrics.requests.labels(status=str(status)).inc()
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or a \uDC00-\uDFFF escape not preceded by a high half
_LONE_SURROGATE = re.compile(rb"(?<!\\)\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<![0-9a-fA-F]{2})(?<!\\u[dD][89abAB])\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def parse_request(body: bytes) -> ChatCompletionRequest:
    """A request from its JSON body; :class:`InvalidRequest` naming the first bad field."""
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            lone = _LONE_SURROGATE.search(body)
            if lone is not None:  # valid JSON syntax, but not a character: say so, not "end of hex escape"
                raise InvalidRequest(f"the request body's {lone.group().decode()} escape at byte {lone.start():,} is "
                                     "half of a UTF-16 surrogate pair, not a character",
                                     "send text as valid Unicode: the character itself, or both halves of its pair"
                                     ) from None
            raise InvalidRequest(f"the request body is not valid JSON: {first['msg']}",
                                 "send a JSON object as the body") from None
        if first["type"] == "model_type" and not first["loc"]:  # the body itself, not a field in it
            raise InvalidRequest("the request body must be a JSON object", "send a JSON object as the body") from None
        # a union reports one error per member, each under its member's tag ("str", "list[TextPart]"):
        # the field is the part of the location they share. Only the first bad field's errors are grouped
        # (messages.1.content), not every error under "messages" (a bad role two messages later)
        field = first["loc"][:-1] if len(first["loc"]) > 1 else first["loc"]
        group = [e for e in err.errors(include_url=False) if e["loc"][:len(field)] == field]
        loc = first["loc"]
        for other in group[1:]:
            loc = tuple(a for a, b in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(loc, other["loc"])))
        where = ".".join(str(part) for part in loc)
        messages = [e["msg"].removeprefix("Value error, ") for e in group[:3]]  # a validator's own words
        detail = messages[0] if len(group) == 1 else "; ".join(dict.fromkeys(messages))
        raise InvalidRequest(f"{where}: {detail}", param=where or None) from None


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (:class:`RequestTooLarge`) as soon as it is known to pass ``limit`` bytes:
    from its Content-Length before reading, or while reading a chunked one -- a 30 MB prompt is never
    read in full, parsed or tokenized, so it cannot stall the other requests."""
    hint = "send a shorter prompt (no prompt that fits the model's context comes near this), or start the server " \
           "with a larger --max-request-bytes"
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"the request body is {int(declared):,} bytes, over this server's limit of "
                              f"{limit:,}", hint)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"the request body passed this server's limit of {limit:,} bytes", hint)
        parts.append(chunk)
    return b"".join(parts)


def create_app(service: Service) -> FastAPI:
    """The ASGI app for ``service`` (started and closed with the app's lifespan)."""

    workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvwire-http")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.close()
            workers.shutdown(wait=True, cancel_futures=True)

    async def off_loop(call: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(workers, call, *args)

    app = FastAPI(title="kvwire", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error, service)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return error_response(error, service)

    _add_status_routes(app, service, off_loop)
    _add_model_routes(app, service)
    _add_chat_route(app, service, off_loop)
    return app


OffLoop = Callable[..., Awaitable[Any]]  # runs a blocking call on the app's worker threads


def authorize(service: Service, request: Request) -> str | None:
    """The tenant the request's API key names (``None`` when the server needs no key);
    :class:`AuthenticationFailed` unless it carries one of the server's keys."""
    return authenticate(service.config.keys, request.headers.get("authorization", ""))


def _add_status_routes(app: FastAPI, service: Service, off_loop: OffLoop) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"], response_model=None)
    async def health() -> JSONResponse:
        state = Health(**await off_loop(service.health))
        return JSONResponse(state.model_dump(), status_code=503 if state.status == "draining" else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        await off_loop(service.refresh_store_bytes)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_model_routes(app: FastAPI, service: Service) -> None:
    @app.get("/v1/models", response_model=None)
    async def list_models(request: Request) -> ModelList | JSONResponse:
        try:
            authorize(service, request)
        except ServeError as error:
            return error_response(error, service)
        created = int(service.started_at)
        return ModelList(data=[ModelCard(id=service.name, created=created)])

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def retrieve_model(request: Request, model_id: str) -> ModelCard | JSONResponse:
        try:
            authorize(service, request)
            service.check_model(model_id)
        except ServeError as error:
            return error_response(error, service)
        return ModelCard(id=service.name, created=int(service.started_at))


def _add_chat_route(app: FastAPI, service: Service, off_loop: OffLoop) -> None:
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Any:
        try:
            tenant = authorize(service, request)
            try:
                raw = await read_body(request, service.max_request_bytes)
            except ClientDisconnect:  # gone while sending its body: nobody to answer, nothing to log
                service.metrics.requests.labels(status="499").inc()
                return Response(status_code=499)
            body = parse_request(raw)
            params = await off_loop(service.params, body, tenant)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[Event] = asyncio.Queue()
            job = service.submit(params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        except ServeError as error:
            return error_response(error, service)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            service.metrics.requests.labels(status="200").inc()
            return StreamingResponse(_stream(service, job, events, body.model, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _answer(service, job, events, request, body)


async def _answer(service: Service, job: Job, events: asyncio.Queue[Event], request: Request,
                  body: ChatCompletionRequest) -> Response:
    """The whole completion as one JSON response, once the job is done (499 if the client left first)."""
    done = await _collect(service, job, events, request)
    if done is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    if isinstance(done, Failed):
        return error_response(done.error, service)
    service.metrics.requests.labels(status="200").inc()
    return JSONResponse(ChatCompletion(
        id=job.id, model=body.model, choices=[Choice(message=ResponseMessage(content=done.content),
                                                     finish_reason=done.finish_reason)],
        usage=_usage(done), kvwire=_kvwire(done), system_fingerprint=_fingerprint(service)).model_dump())


def _usage(done: Done) -> Usage:
    return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                 total_tokens=done.prompt_tokens + done.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=done.served.cached_tokens))


def _kvwire(done: Done) -> KvwireUsage:
    s = done.served
    return KvwireUsage(cached_tokens=s.cached_tokens, prefix_tokens=s.prefix_tokens, spliced_tokens=s.spliced_tokens,
                       recomputed_tokens=s.recomputed_tokens, prefilled_tokens=s.prefilled_tokens,
                       rebuilds=list(s.rebuilds), store=s.store, splice=s.splice, staleness=list(s.staleness),
                       guarded_tokens=s.guarded_tokens)


def _fingerprint(service: Service) -> str:
    return f"kvwire-{service.spec.fingerprint[:12]}"


async def _collect(service: Service, job: Job, events: asyncio.Queue[Event], request: Request) -> Done | Failed | None:
    """Wait for the job's end; ``None`` if the client disconnects first (the job is cancelled at once)."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            getter = asyncio.ensure_future(events.get())
            finished, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in finished:
                getter.cancel()
                service.cancel(job)
                return None
            event = getter.result()
            if isinstance(event, (Done, Failed)):
                return event
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(service: Service, job: Job, events: asyncio.Queue[Event], model: str,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format; a client gone mid-stream cancels the job at once."""
    created = int(time.time())
    fingerprint = _fingerprint(service)

    def chunk(delta: Delta, finish: str | None = None, **extra: Any) -> str:
        body = ChatCompletionChunk(id=job.id, created=created, model=model, system_fingerprint=fingerprint,
                                   choices=[ChunkChoice(delta=delta, finish_reason=finish)], **extra)
        return f"data: {body.model_dump_json(exclude_none=True)}\n\n"

    finished = False
    try:
        yield chunk(Delta(role="assistant", content=""))
        while True:
            event = await events.get()
            if isinstance(event, Text):
                yield chunk(Delta(content=event.text))
            elif isinstance(event, Failed):
                finished = True
                response = error_response(event.error)  # the status line went out as 200 with the first chunk
                service.metrics.stream_errors.labels(status=str(response.status_code)).inc()
                yield f"data: {json.dumps(json.loads(bytes(response.body)))}\n\n"
                break
            else:
                finished = True
                yield chunk(Delta(), event.finish_reason, kvwire=_kvwire(event))
                if include_usage:
                    body = ChatCompletionChunk(id=job.id, created=created, model=model, choices=[],
                                               usage=_usage(event), system_fingerprint=fingerprint)
                    yield f"data: {body.model_dump_json(exclude_none=True)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            service.cancel(job)
