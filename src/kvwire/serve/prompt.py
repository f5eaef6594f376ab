"""Chat messages -> the token ids the model reads.

:func:`prompt_ids` is what every request gets by default: the chat template rendered
with the generation prompt, tokenized once. It depends only on the messages, so a
request served with reuse reads exactly the ids the same request reads with
``--no-reuse``.

:func:`pieces` is for splicing: it tokenizes the template's own text and each
message's content separately, so that a message whose content is an earlier
completion, or contains one, can take that completion's *generated* ids (the ids
its cached K/V belong to) and so that every such span in the ids is known. Used only when a
request has something to splice; it is refused (``None``) for templates that change
the content they render (a ``trim``, say), where spans could not be trusted.

:func:`message_spans` is for publishing (``--splice``): where each of a request's own user messages
stands in the ids it was computed from, so that its K/V can be published as a segment and spliced
into a later request that reads the same message after another system prompt (a pipeline's input,
which every agent of a team reads after its own instructions: KVCOMM's shared input).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from ..hf.tokens import defused

_SENTINEL = "\u2063kvwire-content-{}\u2063"  # never produced by a model, never trimmed by a template


def as_dicts(messages: Sequence[Any], tokenizer: Any) -> list[dict[str, str]]:
    """Schema messages -> template messages; ``developer`` is OpenAI's newer name for ``system``. Special-token
    strings in any message but an assistant reply are read as plain text (:func:`kvwire.hf.tokens.defuse`):
    a request quoting ``<|im_end|>`` cannot forge a turn."""
    return defused(tokenizer, [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                               for m in messages])


def render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja raises its own errors from inside the template
        raise InvalidRequest(f"the model's chat template cannot render these messages: {err}",
                             param="messages") from None


def encode(tokenizer: Any, text: str) -> list[int]:
    # the template writes any BOS itself; add_special_tokens would add a second one
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The ids of the rendered conversation plus the generation prompt."""
    return encode(tokenizer, render(tokenizer, messages))


@dataclass(frozen=True)
class Substitution:
    """Characters ``start:stop`` of message ``message``'s content are read as ``ids`` (an earlier
    completion, as it was generated)."""

    message: int
    start: int
    stop: int
    ids: tuple[int, ...]


@dataclass
class Pieces:
    """Ids built piece by piece; ``spans[k]`` is substitution k's ``(start, stop)`` in ``ids``."""

    ids: list[int]
    spans: list[tuple[int, int]]


def pieces(tokenizer: Any, messages: list[dict[str, str]], substitutions: Sequence[Substitution]) -> Pieces | None:
    """Tokenize template text and contents separately, with each substitution's ids in place of its text.

    Example (ChatML, one substitution covering a whole user message): ``<|im_start|>user\n`` +
    the completion's ids + ``<|im_end|>\n<|im_start|>assistant\n``, its span known exactly.
    Substitutions must be in order and not overlap. ``None`` when the template does not render
    each content verbatim between text of its own.
    """
    marked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    text = render(tokenizer, marked)
    by_message: dict[int, list[Substitution]] = {}
    for sub in substitutions:
        by_message.setdefault(sub.message, []).append(sub)
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    rest = text
    rebuilt = []
    for index, message in enumerate(messages):
        head, sep, rest = rest.partition(_SENTINEL.format(index))
        if not sep:
            return None
        ids += encode(tokenizer, head) if head else []
        content, done = message["content"], 0
        for sub in by_message.get(index, []):
            if sub.start < done:
                raise ValueError("substitutions overlap or are out of order")
            ids += encode(tokenizer, content[done:sub.start]) if sub.start > done else []
            spans.append((len(ids), len(ids) + len(sub.ids)))
            ids += sub.ids
            done = sub.stop
        ids += encode(tokenizer, content[done:]) if done < len(content) else []
        rebuilt += [head, content]
    ids += encode(tokenizer, rest) if rest else []
    if "".join(rebuilt) + rest != render(tokenizer, messages):
        return None
    return Pieces(ids, spans)


@dataclass(frozen=True)
class MessageSpan:
    """A user message's whole ``text``, read as ``ids`` at ``start`` of a request's ids."""

    start: int
    ids: tuple[int, ...]
    text: str


def message_spans(tokenizer: Any, messages: list[dict[str, str]], substitutions: Sequence[Substitution],
                  ids: Sequence[int], *, min_tokens: int, min_chars: int) -> list[MessageSpan]:
    """The user messages of ``messages`` that hold no substitution (earlier completions the request was given
    as cached K/V), are at least ``min_tokens`` tokens and ``min_chars`` characters long, with where each
    stands in ``ids`` (the ids the request was computed from, built with ``substitutions``). Each message's
    content tokenized alone must be exactly its span of ``ids``: where the template or the tokenizer joins a
    message with its surroundings the ids are not checked piece by piece, and nothing is returned."""
    taken = {sub.message for sub in substitutions}
    wanted = [index for index, message in enumerate(messages)
              if message["role"] == "user" and index not in taken and len(message["content"]) >= min_chars]
    if not wanted:
        return []
    contents = {index: messages[index]["content"] for index in wanted}
    whole = [Substitution(index, 0, len(text), tuple(encode(tokenizer, text))) for index, text in contents.items()]
    ordered = sorted([*substitutions, *whole], key=lambda sub: (sub.message, sub.start))
    built = pieces(tokenizer, messages, ordered)
    if built is None or built.ids != list(ids):
        return []
    spans = dict(zip(ordered, built.spans))
    return [MessageSpan(spans[sub][0], sub.ids, messages[sub.message]["content"]) for sub in whole
            if len(sub.ids) >= min_tokens]
