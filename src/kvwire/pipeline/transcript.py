"""A chat transcript built turn by turn, with token ids that match the chat template.

Agents that pass caches must agree, token for token, on the context the cache
covers. :class:`ChatTranscript` appends messages one at a time and tokenizes only
the text each one adds to the rendered chat template, so a receiver can extend an
upstream cache instead of re-tokenizing the whole conversation:

- a user/system turn adds ``render(messages + [turn]) - render(messages)``;
- the generation prompt adds ``render(messages, add_generation_prompt=True) - render(messages)``;
- an assistant turn adds the *generated token ids themselves* (what the model
  actually attended over) plus the template's closing text after the content.

:meth:`ChatTranscript.verify` checks the ids against a from-scratch rendering
of all messages. They can differ only where decoding a generated turn and
tokenizing the text again gives different ids; ``verify`` reports those turns
-- also a reply that re-tokenizes alone but merges with the template text around
it (``"\\n\\n"`` opening a reply after a prompt that ends in ``"\\n"``) -- and raises
:class:`TranscriptError` for any other difference (a template that is not
append-only, or a tokenizer that merges across the boundaries of the other turns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import TranscriptError
from ..hf.tokens import defuse, defused, whole_characters

_SENTINEL = "\u2063kvwire-sentinel\u2063"  # never produced by a model, never trimmed by a template


@dataclass
class Verification:
    """Result of :meth:`ChatTranscript.verify`."""

    matches: bool  # ids == tokenize(render(messages))
    retokenized_turns: list[int]  # message indices whose generated ids do not survive decode+encode
    first_difference: int | None  # first token index where ids and the rendering differ


class ChatTranscript:
    """Messages plus the exact token ids a model sees for them."""

    def __init__(self, tokenizer: Any, messages: list[dict[str, str]] | None = None,
                 ids: list[int] | None = None, generated: dict[int, list[int]] | None = None,
                 open_turn: bool = False) -> None:
        self.tokenizer = tokenizer
        # as add() keeps them: special-token strings read as plain text (messages from a handoff were written raw)
        self.messages: list[dict[str, str]] = defused(tokenizer, list(messages or []))
        self.ids: list[int] = list(ids or [])
        # message index -> the token ids the model generated for that assistant turn
        self.generated: dict[int, list[int]] = dict(generated or {})
        self.open_turn = open_turn  # generation prompt appended, assistant reply pending

    @classmethod
    def from_messages(cls, tokenizer: Any, messages: list[dict[str, str]]) -> ChatTranscript:
        """Tokenize a whole conversation from its strings (what text-passing frameworks do)."""
        transcript = cls(tokenizer)
        transcript.messages = defused(tokenizer, [dict(m) for m in messages])  # as add() keeps them
        transcript.ids = transcript._encode(transcript._render(transcript.messages))
        return transcript

    @classmethod
    def replay(cls, tokenizer: Any, system: str, messages: list[dict[str, str]],
               generated: dict[int, list[int]]) -> tuple[ChatTranscript, list[int]]:
        """Rebuild a conversation turn by turn under ``system`` (empty: none), using the
        generated ids of assistant turns where known. Returns the transcript and, per
        message, the index of its first token in ``ids``."""
        transcript = cls(tokenizer)
        if system:
            transcript.add("system", system)
        offsets = []
        for index, message in enumerate(messages):
            offsets.append(len(transcript.ids))
            if message["role"] == "assistant":
                transcript.open_assistant_turn()
                ids = generated.get(index)
                if ids is None:
                    ids = transcript._encode(message["content"])
                transcript.add_generated(list(ids), frozenset())
            else:
                transcript.add(message["role"], message["content"])
        return transcript, offsets

    # -- appending ---------------------------------------------------------------------------------

    def add(self, role: str, content: str) -> list[int]:
        """Append a system or user turn; return the ids it added. Special-token strings in ``content``
        are read as plain text (:func:`kvwire.hf.tokens.defuse`: a document quoting ``<|im_end|>``
        cannot close its turn), and the turn is kept so."""
        if self.open_turn:
            raise TranscriptError("an assistant reply is pending; add it before the next turn")
        content = defuse(self.tokenizer, content)
        before = self._render(self.messages)
        after = self._render([*self.messages, {"role": role, "content": content}])
        added = self._encode(self._suffix(before, after, f"adding a {role} turn"))
        self.messages.append({"role": role, "content": content})
        self.ids += added
        return added

    def open_assistant_turn(self) -> list[int]:
        """Append the generation prompt (e.g. ``<|im_start|>assistant\\n``); return its ids."""
        if self.open_turn:
            raise TranscriptError("the assistant turn is already open")
        before = self._render(self.messages)
        after = self._render(self.messages, add_generation_prompt=True)
        added = self._encode(self._suffix(before, after, "adding the generation prompt"))
        self.ids += added
        self.open_turn = True
        return added

    def add_generated(self, tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
        """Close the open assistant turn with the model's tokens; return the ids added.

        A final eos token is dropped: the template's own closing text (often the same
        token) follows the content. A reply cut by its token limit inside a character keeps its
        ids (the cache holds them) but its text ends at the last whole character, not U+FFFD.
        """
        if not self.open_turn:
            raise TranscriptError("no assistant turn is open; call open_assistant_turn first")
        content_ids = tokens[:-1] if tokens and tokens[-1] in eos_ids else list(tokens)
        content = self.tokenizer.decode(content_ids, skip_special_tokens=False)
        if content.endswith("\ufffd") and content_ids == list(tokens):  # cut, not ended: no half character
            content = self.tokenizer.decode(whole_characters(self.tokenizer, content_ids)[0],
                                            skip_special_tokens=False)
        prompt = self._render(self.messages, add_generation_prompt=True)
        probe = self._render([*self.messages, {"role": "assistant", "content": _SENTINEL}])
        head, sep, closing = probe.partition(_SENTINEL)
        if not sep or head != prompt:
            raise TranscriptError(
                "the chat template does not render an assistant turn as generation prompt + content + closing text",
                "kvwire needs an append-only chat template",
            )
        added = content_ids + self._encode(closing)
        self.generated[len(self.messages)] = list(content_ids)
        self.messages.append({"role": "assistant", "content": content})
        self.ids += added
        self.open_turn = False
        return added

    # -- checking ----------------------------------------------------------------------------------

    def verify(self) -> Verification:
        """Compare the incrementally built ids with a from-scratch rendering of all messages."""
        full = self._encode(self._render(self.messages, add_generation_prompt=self.open_turn))
        if full == self.ids:
            return Verification(True, [], None)
        retokenized = [index for index, ids in self.generated.items()
                       if self._encode(self.messages[index]["content"]) != ids]
        first = next((i for i, (a, b) in enumerate(zip(self.ids, full)) if a != b), min(len(self.ids), len(full)))
        at = self._message_at(first) if not retokenized else None
        if at in self.generated:
            # the reply re-tokenizes alone but merges with the template text around it (a reply that opens
            # with "\n\n" after a prompt ending in "\n" is one token "\n\n\n" when rendered whole)
            retokenized = [at]
        if not retokenized:
            raise TranscriptError(
                f"incrementally built ids differ from the chat template rendering at token {first} "
                "although every generated turn re-tokenizes identically",
                "the chat template is not append-only or the tokenizer merges across turns",
            )
        return Verification(False, retokenized, first)

    # -- helpers -----------------------------------------------------------------------------------

    def _message_at(self, position: int) -> int:
        """The index of the message whose rendering holds token ``position`` of the whole rendering
        (``len(messages)``: the generation prompt after them)."""
        for index in range(len(self.messages)):
            if len(self._encode(self._render(self.messages[: index + 1]))) > position:
                return index
        return len(self.messages)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        if not messages:
            return ""
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as err:  # jinja errors from the template itself
            raise TranscriptError(f"the chat template cannot render this conversation: {err}") from None

    def _encode(self, text: str) -> list[int]:
        # The template writes any BOS itself; add_special_tokens would add a second one.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _suffix(before: str, after: str, what: str) -> str:
        if not after.startswith(before):
            raise TranscriptError(f"the chat template is not append-only: {what} rewrites earlier text",
                                  "kvwire needs a chat template whose rendering only grows")
        return after[len(before):]
