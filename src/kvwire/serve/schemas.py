"""The wire format of ``kvwire serve``: OpenAI's chat completions API as typed pydantic models.

Requests are validated strictly (a string where a number belongs is refused, not
coerced; NaN and infinities too); fields OpenAI defines that kvwire does not implement
are refused when they ask for something (``n > 1``, ``tools``, ``logprobs``,
``response_format`` other than text, ``logit_bias``, presence and frequency penalties,
``tool_choice``) and ignored when left at their defaults; so are the sampling and output options
vLLM and OpenAI's newer models add (:data:`REFUSED_UNLESS`: ``top_k``, ``min_p``,
``repetition_penalty``, ``modalities``, ``audio``, ``prediction``, guided decoding, ...);
fields nobody defines are ignored, as OpenAI's clients and agent frameworks send a few of their own.
Roles (:func:`check_roles`): system or developer messages first, then user and assistant turns, ending with a user turn.

Responses carry OpenAI's own ``usage.prompt_tokens_details.cached_tokens`` and a
``kvwire`` object saying where the prompt's K/V came from (:class:`KvwireUsage`).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import InvalidRequest
from .tenancy import MAX_SALT_CHARS

Role = Literal["system", "developer", "user", "assistant"]
FinishReason = Literal["stop", "length"]


class TextPart(BaseModel):
    """One part of a message's content; kvwire serves text models, so only text parts."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Role
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """An image, audio or file part is refused by what it is, not as a malformed text part."""
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"part {index} is {'an' if kind[:1] in 'aeiou' else 'a'} {kind!r} part: "
                                     "kvwire serves text models; send the content as text (or text parts)")
        return content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


# Fields other servers define that kvwire does not implement: (the values that ask for nothing, what to do).
# A request giving another value is refused naming the field -- never served as if it had not asked.
REFUSED_UNLESS: dict[str, tuple[tuple[Any, ...], str]] = {
    "top_k": ((None, 0, -1), "kvwire samples with temperature and top_p only; leave top_k out"),
    "min_p": ((None, 0, 0.0), "kvwire samples with temperature and top_p only; leave min_p out"),
    "typical_p": ((None, 1, 1.0), "kvwire samples with temperature and top_p only; leave typical_p out"),
    "repetition_penalty": ((None, 1, 1.0), "only 1 is supported: leave repetition_penalty out"),
    "length_penalty": ((None, 1, 1.0), "no beam search: leave length_penalty out"),
    "min_tokens": ((None, 0), "leave min_tokens out; ignore_eos decodes exactly max_tokens"),
    "best_of": ((None, 1), "kvwire serve returns one choice: leave best_of out"),
    "use_beam_search": ((None, False), "kvwire serve decodes greedily or by sampling: no beam search"),
    "stop_token_ids": ((None, []), "give stop strings in stop instead"),
    "bad_words": ((None, []), "leave bad_words out"),
    "allowed_token_ids": ((None, []), "leave allowed_token_ids out"),
    "prompt_logprobs": ((None, 0), "no logprobs: leave prompt_logprobs out"),
    "echo": ((None, False), "leave echo out: the response carries the completion only"),
    "continue_final_message": ((None, False), "end the messages with a user message"),
    "add_generation_prompt": ((None, True), "leave add_generation_prompt out"),
    "guided_json": ((None,), "kvwire serve does not constrain output; ask for JSON in the prompt"),
    "guided_regex": ((None,), "kvwire serve does not constrain output"),
    "guided_choice": ((None,), "kvwire serve does not constrain output"),
    "guided_grammar": ((None,), "kvwire serve does not constrain output"),
    "structured_outputs": ((None,), "kvwire serve does not constrain output"),
    "modalities": ((None, ["text"]), "kvwire serves text models: leave modalities out or send [\"text\"]"),
    "audio": ((None,), "kvwire serves text models: no audio output"),
    "prediction": ((None,), "no predicted outputs: leave prediction out"),
    "web_search_options": ((None,), "kvwire serve has no web search"),
    "reasoning_effort": ((None,), "the served model is not a reasoning model: leave reasoning_effort out"),
}


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``. ``temperature`` 0 is greedy; ``ignore_eos`` (vLLM's) decodes
    exactly ``max_tokens`` tokens, for benchmarks."""

    model_config = ConfigDict(extra="allow", strict=True)  # extra fields: checked by name (REFUSED_UNLESS)
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None  # what a 64-bit generator takes
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # vLLM's: caches are shared only between requests with the same salt (and API key); none is its own namespace
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_SALT_CHARS)] | None = None
    # accepted only at values that ask for nothing kvwire does not do
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stop

    def check_supported(self) -> None:
        """Refuse options kvwire does not implement (:class:`InvalidRequest` naming the field)."""
        if self.n not in (None, 1):
            raise InvalidRequest(f"n={self.n} is not supported", "kvwire serve returns one choice: n=1", param="n")
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED_UNLESS and not _neutral(value, REFUSED_UNLESS[name][0]):
                raise InvalidRequest(f"{name}={json.dumps(value)[:80]} is not supported", REFUSED_UNLESS[name][1],
                                     param=name)
        if self.logprobs:
            raise InvalidRequest("logprobs are not supported", param="logprobs")
        if self.top_logprobs:
            raise InvalidRequest("top_logprobs are not supported", param="top_logprobs")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} are not supported", "describe the tools in the prompt instead",
                                     param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                raise InvalidRequest(f"{name}={getattr(self, name)!r} is not supported (no tools)",
                                     "leave it out, or send 'none'", param=name)
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise InvalidRequest(f"response_format {self.response_format.get('type')!r} is not supported: "
                                 "kvwire serve does not constrain output to JSON",
                                 "ask for JSON in the prompt and parse the text", param="response_format")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "set stream, or leave "
                                 "stream_options out", param="stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} is not supported (only 0)", param=name)
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequest("max_tokens and max_completion_tokens differ", "give one of them",
                                 param="max_completion_tokens")
        check_roles(self.messages)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``neutral`` (by type too: ``True`` is not ``1``, ``"0"`` is not ``0``)."""
    return any(type(value) is type(n) and value == n for n in neutral) or \
        (value is not None and isinstance(value, (int, float)) and not isinstance(value, bool)
         and any(isinstance(n, (int, float)) and not isinstance(n, bool) and value == n for n in neutral))


def check_roles(messages: list[ChatMessage]) -> None:
    """System/developer messages come first; an assistant turn answers a user turn; the last is a user turn.

    Example: [system, user, assistant, user] is fine; [user, system], [assistant, user],
    [system, user, assistant] are refused (:class:`InvalidRequest`, ``param="messages"``).
    """
    seen_turn = False
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if message.role in ("system", "developer"):
            if seen_turn:
                raise InvalidRequest(f"{where} is a {message.role} message after the conversation started",
                                     "put system and developer messages first", param="messages")
        elif message.role == "assistant" and not seen_turn:
            raise InvalidRequest(f"{where} is an assistant message before any user message",
                                 "start the conversation with a user message", param="messages")
        else:
            seen_turn = True
    if messages[-1].role != "user":
        role = messages[-1].role
        raise InvalidRequest(f"the last message is {'an' if role[0] in 'aeiou' else 'a'} {role} message",
                             "end with the user message the completion answers", param="messages")


# -- responses ----------------------------------------------------------------------------------------


class KvwireUsage(BaseModel):
    """Where the prompt's K/V came from. ``cached_tokens`` = ``prefix_tokens`` + ``spliced_tokens``."""

    cached_tokens: int = 0  # served from cache: a published prefix plus spliced segments kept as received
    prefix_tokens: int = 0  # an exact prefix found in the store
    spliced_tokens: int = 0  # tokens of earlier completions or messages spliced in (re-rotated), kept as received
    recomputed_tokens: int = 0  # spliced tokens recomputed (--splice R) and gap tokens between segments
    prefilled_tokens: int = 0  # prompt tokens computed for this request
    rebuilds: list[str] = []  # caches found but refused (corrupt, foreign, broken chain, store fault)
    store: Literal["ok", "degraded", "off"] = "ok"
    splice: str = ""  # --splice: earlier completions found in the messages were spliced, or prefilled (cheaper)
    # per spliced segment, the mean relative change of its recomputed share's K/V from what it brought (how far
    # this context moved it; None where nothing of it was recomputed), and the tokens --splice-guard recomputed
    staleness: list[float | None] = []
    guarded_tokens: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    kvwire: KvwireUsage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    kvwire: KvwireUsage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvwire"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class Health(BaseModel):
    # degraded: the store is unreachable, requests are served without reuse; draining: shutting down (GET /health
    # answers 503 then, so a load balancer stops sending requests)
    status: Literal["ok", "degraded", "draining"]
    model: str
    fingerprint: str
    store: str  # the store URL (password redacted)
    store_status: Literal["ok", "degraded", "off"]  # off: --no-reuse
    store_error: str | None = None
    reuse: bool
    splice: float | None
    running: int  # sequences in the batch
    waiting: int  # requests admitted, waiting for a batch slot
    max_batch: int
    max_queue: int
    device: str  # where the model runs (--device)
    weights: str  # its linear weights' format (--weights)
    prefill_chunk: int | None  # a long prompt's first chunk, --prefill-chunk auto resolved; None: whole prefills
    # "batched" (continuous batching, up to max_batch rows a step), or "one request at a time: <why>" for a model the
    # batched engine refuses: then max_batch sessions share the CPU, they do not batch
    decoding: str
