"""Token alignment between two tokenizers, by the characters each token covers.

The sharer and the receiver read the same messages, each through its own chat template
and tokenizer, so their token sequences differ in length and boundaries. An
:class:`Alignment` maps every receiver token ``i`` to the sharer tokens covering the same
characters (their span ``start[i]:end[i]``) and to one chosen sharer token ``index[i]``,
as C2C's aligner pairs each receiver token with one sharer token. Character spans come
from the fast tokenizers' offsets (:func:`kvwire.hf.encode_with_offsets`).

Example (SmolLM2 receiver, Qwen2.5 sharer, text ``"日本語"``)::

    receiver tokens  'æĹ' (日)  '¥' (日)  'æľ¬' (本)  'è' 'ª' 'ŀ' (語: three byte tokens)
    sharer tokens    'æĹ¥æľ¬' (日本)            'èªŀ' (語)
    span             [0:1]  [0:1]  [0:1]      [1:2] [1:2] [1:2]
    index            0      0      0          1     1     1

**Chat templates** (:func:`align_chat`). Each side renders the messages with its own
template; the two texts share only the message *contents*. They are located exactly
(each content is rendered once with a sentinel in its place, so repeated or empty
contents are unambiguous, and a template that alters contents is refused), and the
texts are cut into sections: template, content 1, template, content 2, ..., template.

- A receiver token inside a content (or overlapping one: a newline of the template
  merged with the content's indentation) maps by characters to the sharer's rendering
  of the same content.
- A receiver template token (role markers, a default system prompt, the generation
  prompt) maps into the sharer's template section of the same number: by characters
  where the two sections' texts agree at their start or end (``<|im_start|>user\n``:
  both models use ChatML markers), otherwise by relative position -- the j-th of the n
  remaining receiver tokens reads the sharer token at ``(j + 0.5) / n`` of the sharer
  section's remaining tokens (each model's default system prompt). ``content[i]`` is
  False for template tokens, so a projector may skip them.

Which sharer token is chosen (:data:`Select`): ``"last"`` (default) -- the last one
covering the receiver token, whose K/V have read all of its characters; or ``"first"``
(C2C's default).

Texts must survive their tokenizers: each side's ids must decode back to a text
canonically equal (Unicode NFC) to the one rendered, so that both models read the same
characters. Qwen2.5's tokenizer NFC-normalizes (``e`` + combining acute reads as ``é``,
which is fine); one that drops or replaces characters is refused with
:class:`~kvwire.errors.AlignmentError`, as is a tokenizer without offsets.
"""

from __future__ import annotations

import bisect
import unicodedata
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .. import hf
from ..errors import AlignmentError

Select = Literal["last", "first"]
Scope = Literal["text", "chat"]  # one text both models read, or each model's own chat rendering
METHOD = "char-offsets-v1"  # recorded in checkpoints: projectors are fitted on one alignment method
_SENTINEL = "\u2063kvwire-content-{}\u2063"  # invisible separators: never in real text, never trimmed


@dataclass(frozen=True)
class Alignment:
    """Receiver token ``i`` reads sharer token ``index[i]``; ``start[i]:end[i]`` are all the
    sharer tokens covering its characters (``start <= index < end``). Tensors are int64
    ``[N_r]`` (``content`` bool ``[N_r]``); ids are the exact ids each model reads."""

    receiver_ids: tuple[int, ...]
    sharer_ids: tuple[int, ...]
    index: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    content: torch.Tensor  # True: the token holds message content; False: chat template only
    select: Select = "last"
    scope: Scope = "text"
    receiver_text: str = ""
    sharer_text: str = ""

    @property
    def method(self) -> str:
        """Names how the alignment was made, e.g. ``"char-offsets-v1/text/last"`` (checkpoints record it)."""
        return method_name(self.scope, self.select)

    def __len__(self) -> int:
        return len(self.receiver_ids)

    def gather(self, kv: torch.Tensor) -> torch.Tensor:
        """Sharer K or V ``[B, H, N_s, D]`` -> ``[B, H, N_r, D]``: each receiver token gets its chosen
        sharer token's."""
        self._check_sharer(kv)
        return kv.index_select(2, self.index.to(kv.device))

    def span_mean(self, kv: torch.Tensor) -> torch.Tensor:
        """Sharer K or V ``[B, H, N_s, D]`` -> ``[B, H, N_r, D]``: the mean over each receiver token's covering span."""
        self._check_sharer(kv)
        B, H, _, D = kv.shape
        zero = kv.new_zeros(B, H, 1, D)
        sums = torch.cat([zero, kv.cumsum(dim=2)], dim=2)  # [B, H, N_s + 1, D]: sums[j] = kv[:j].sum()
        start, end = self.start.to(kv.device), self.end.to(kv.device)
        total = sums.index_select(2, end) - sums.index_select(2, start)  # [B, H, N_r, D]
        return total / (end - start).to(kv.dtype)[None, None, :, None]

    def stats(self) -> dict[str, float | int]:
        """How the tokenizations relate: token counts, the share of receiver tokens covered by
        exactly one sharer token, the mean span, the share of content tokens."""
        n = len(self.receiver_ids)
        spans = (self.end - self.start).to(torch.float64)
        return {
            "receiver_tokens": n,
            "sharer_tokens": len(self.sharer_ids),
            "one_to_one": float((spans == 1).double().mean()) if n else 0.0,
            "mean_span": float(spans.mean()) if n else 0.0,
            "content_share": float(self.content.double().mean()) if n else 0.0,
        }

    def _check_sharer(self, kv: torch.Tensor) -> None:
        if kv.dim() != 4 or kv.shape[2] != len(self.sharer_ids):
            raise AlignmentError(f"sharer K/V must be [B, H, N_s={len(self.sharer_ids)}, D], got {list(kv.shape)}",
                                 "align the exact ids the sharer's cache covers")


def align_texts(receiver_tokenizer: Any, sharer_tokenizer: Any, text: str, select: Select = "last") -> Alignment:
    """Align two tokenizations of one plain ``text`` (no chat template): every token is content.

    Example: ``align_texts(smollm_tok, qwen_tok, "def f(x):")`` -> receiver ``def| f|(|x|):``,
    sharer ``def| f|(x|):``; index ``[0, 1, 2, 2, 3]``.
    """
    r_ids, r_offsets = _encode_checked(receiver_tokenizer, text, "receiver")
    s_ids, s_offsets = _encode_checked(sharer_tokenizer, text, "sharer")
    spans = [_nonempty(span, len(text)) for span in r_offsets]
    start, end = _cover(spans, s_offsets, len(s_ids))
    return _build(r_ids, s_ids, start, end, [True] * len(r_ids), select, "text", text, text)


def align_chat(receiver_tokenizer: Any, sharer_tokenizer: Any, messages: list[dict[str, str]],
               add_generation_prompt: bool = True, select: Select = "last") -> Alignment:
    """Align the two models' renderings of ``messages`` through their own chat templates
    (section by section, see the module docstring).

    Example (one user message ``"Hi there"``): the receiver's (SmolLM2) default system prompt
    and role markers map, by relative position, onto the sharer's (Qwen2.5) own default
    system prompt and markers; ``Hi`` and `` there`` map to the sharer's ``Hi`` and `` there``.
    """
    r_text, r_contents = _render_with_contents(receiver_tokenizer, messages, add_generation_prompt, "receiver")
    s_text, s_contents = _render_with_contents(sharer_tokenizer, messages, add_generation_prompt, "sharer")
    r_ids, r_offsets = _encode_checked(receiver_tokenizer, r_text, "receiver")
    s_ids, s_offsets = _encode_checked(sharer_tokenizer, s_text, "sharer")

    starts: list[int] = [0] * len(r_ids)
    ends: list[int] = [0] * len(r_ids)
    content = [False] * len(r_ids)
    template_tokens: dict[int, list[int]] = {}  # section k -> receiver token indices in it, in order
    r_content_ends = [e for _, e in r_contents]
    for i, span in enumerate(r_offsets):
        a, b = _nonempty(span, len(r_text))
        k = _overlapping(r_contents, a, b)
        if k is not None:  # (part of) a message content: map its characters
            (rs, re_), (ss, _) = r_contents[k], s_contents[k]
            lo, hi = max(a, rs), min(b, re_)
            (starts[i],), (ends[i],) = _cover([(lo - rs + ss, hi - rs + ss)], s_offsets, len(s_ids))
            content[i] = True
        else:  # template: section k is the text before content k (k == len: after the last one)
            template_tokens.setdefault(bisect.bisect_right(r_content_ends, a), []).append(i)
    r_sections, s_sections = _sections(r_contents, len(r_text)), _sections(s_contents, len(s_text))
    for k, tokens in template_tokens.items():
        (rl, rh), (sl, sh) = r_sections[k], s_sections[k]
        prefix, suffix = _common_ends(r_text[rl:rh], s_text[sl:sh])
        middle = []
        for i in tokens:
            a, b = _nonempty(r_offsets[i], len(r_text))
            if b <= rl + prefix:  # identical template text at the section's start: same characters
                (starts[i],), (ends[i],) = _cover([(a - rl + sl, b - rl + sl)], s_offsets, len(s_ids))
            elif a >= rh - suffix:  # identical at its end (role markers before the next content)
                (starts[i],), (ends[i],) = _cover([(a - rh + sh, b - rh + sh)], s_offsets, len(s_ids))
            else:
                middle.append(i)
        t0, t1 = _token_range(s_offsets, sl + prefix, sh - suffix)
        for j, i in enumerate(middle):  # the rest (e.g. each model's default system prompt): by relative position
            if t1 > t0:
                pick = t0 + int((j + 0.5) * (t1 - t0) / len(middle))
            else:  # the sharer's template has nothing here: the nearest token before it
                pick = max(0, min(t0, len(s_ids)) - 1)
            starts[i], ends[i] = pick, pick + 1
    return _build(r_ids, s_ids, starts, ends, content, select, "chat", r_text, s_text)


# -- pieces ------------------------------------------------------------------------------------------


def method_name(scope: Scope, select: Select) -> str:
    """``"char-offsets-v1/{scope}/{select}"``: what a checkpoint records as its ``alignment``."""
    return f"{METHOD}/{scope}/{select}"


def parse_method(method: str) -> tuple[Scope, Select]:
    """``(scope, select)`` of a method name from :func:`method_name`; refuses others.

    Example: ``"char-offsets-v1/text/last"`` -> ``("text", "last")``.
    """
    base, _, rule = method.partition("+")
    if rule:  # a fuser trained with --final-token sharer-last: fuse mode aligns the last token by characters
        raise AlignmentError(f"the checkpoint was trained with the final-token rule {rule!r}, which fuse mode "
                             "does not apply", "use a fuser trained with --final-token aligned (the default)")
    parts = base.split("/")
    if len(parts) != 3 or parts[0] != METHOD or parts[1] not in ("text", "chat") or parts[2] not in ("last", "first"):
        raise AlignmentError(f"unknown token alignment method {method!r}",
                             f"kvwire aligns with {METHOD}/text|chat/last|first")
    return parts[1], parts[2]  # type: ignore[return-value]


def _build(r_ids: list[int], s_ids: list[int], start: list[int], end: list[int], content: list[bool],
           select: Select, scope: Scope, r_text: str, s_text: str) -> Alignment:
    if select not in ("last", "first"):
        raise ValueError(f"select must be 'last' or 'first', got {select!r}")
    start_t = torch.tensor(start, dtype=torch.int64)
    end_t = torch.tensor(end, dtype=torch.int64)
    index = (end_t - 1) if select == "last" else start_t.clone()
    return Alignment(tuple(r_ids), tuple(s_ids), index, start_t, end_t, torch.tensor(content, dtype=torch.bool),
                     select, scope, r_text, s_text)


def _encode_checked(tokenizer: Any, text: str, who: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and offsets of ``text``; refuse a tokenizer that does not read the text as written."""
    ids, offsets = hf.encode_with_offsets(tokenizer, text)
    decoded = hf.decode_exact(tokenizer, ids)
    if decoded != text and unicodedata.normalize("NFC", decoded) != unicodedata.normalize("NFC", text):
        a, b = unicodedata.normalize("NFC", text), unicodedata.normalize("NFC", decoded)
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise AlignmentError(
            f"the {who} tokenizer ({type(tokenizer).__name__}) does not reproduce the text: at character {at} "
            f"{a[max(0, at - 12):at + 12]!r} reads back as {b[max(0, at - 12):at + 12]!r}",
            "the two models would read different texts: remove the characters it cannot represent, "
            "or use a tokenizer that encodes every character (byte-level BPE)")
    if len(offsets) != len(ids) or any(not 0 <= a <= b <= len(text) for a, b in offsets):
        raise AlignmentError(f"the {who} tokenizer's offsets do not describe the text", "use a fast tokenizer")
    return ids, offsets


def _render_with_contents(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool,
                          who: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat text and each message content's character span in it.

    Rendering once with sentinels in place of the contents locates every content exactly
    (even repeated or empty ones); substituting them back must give the real rendering.
    """
    for message in messages:
        if not isinstance(message.get("content"), str):
            raise AlignmentError(f"message {message!r} has no text content", "align messages with string contents")
        if any(_SENTINEL.format(k) in message["content"] for k in range(len(messages))):
            raise AlignmentError("a message contains kvwire's content sentinel")
    text = hf.render_chat(tokenizer, messages, add_generation_prompt)
    probe = hf.render_chat(tokenizer, [{**m, "content": _SENTINEL.format(k)} for k, m in enumerate(messages)],
                                  add_generation_prompt)
    spans, rebuilt, cursor = [], [], 0
    for k, message in enumerate(messages):
        at = probe.find(_SENTINEL.format(k), cursor)
        if at < 0:
            raise AlignmentError(f"the {who}'s chat template does not show message {k} ({message['role']}) as written",
                                 "align messages whose contents the template renders verbatim")
        rebuilt.append(probe[cursor:at])
        begin = sum(len(part) for part in rebuilt)
        rebuilt.append(message["content"])
        spans.append((begin, begin + len(message["content"])))
        cursor = at + len(_SENTINEL.format(k))
    rebuilt.append(probe[cursor:])
    if "".join(rebuilt) != text:
        raise AlignmentError(f"the {who}'s chat template changes message contents (e.g. strips them)",
                             "pass contents that the template keeps as they are (no leading/trailing whitespace)")
    return text, spans


def _sections(contents: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """Character ranges of the template sections around ``contents``: before the first, between, after the last."""
    edges = [0] + [x for span in contents for x in span] + [length]
    return [(edges[2 * k], edges[2 * k + 1]) for k in range(len(contents) + 1)]


def _common_ends(a: str, b: str) -> tuple[int, int]:
    """Lengths of the common prefix and the common suffix of ``a`` and ``b`` (not overlapping)."""
    prefix = 0
    while prefix < min(len(a), len(b)) and a[prefix] == b[prefix]:
        prefix += 1
    suffix = 0
    while suffix < min(len(a), len(b)) - prefix and a[-1 - suffix] == b[-1 - suffix]:
        suffix += 1
    return prefix, suffix


def _overlapping(contents: list[tuple[int, int]], a: int, b: int) -> int | None:
    for k, (s, e) in enumerate(contents):
        if s < b and e > a:
            return k
    return None


def _nonempty(span: tuple[int, int], length: int) -> tuple[int, int]:
    """A token with an empty span (a trimmed offset) counts as covering the character at its position."""
    a, b = span
    if b > a or length == 0:
        return a, b
    return (a, a + 1) if a < length else (length - 1, length)


def _token_range(offsets: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """Indices ``[t0, t1)`` of the tokens overlapping characters ``[lo, hi)``."""
    ends = [e for _, e in offsets]
    starts = [s for s, _ in offsets]
    return bisect.bisect_right(ends, lo), bisect.bisect_left(starts, hi)


def _cover(spans: list[tuple[int, int]], offsets: list[tuple[int, int]], n: int) -> tuple[list[int], list[int]]:
    """For each character span, the sharer tokens ``[start, end)`` overlapping it. A span no
    sharer token overlaps (whitespace its offsets leave out) takes the nearest token before it."""
    ends = [e for _, e in offsets]
    starts = [s for s, _ in offsets]
    out_start, out_end = [], []
    for a, b in spans:
        t0, t1 = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
        if t1 <= t0:
            if n == 0:
                raise AlignmentError("the sharer's text has no tokens to align to")
            t0 = max(0, min(t0, n) - 1)
            t1 = t0 + 1
        out_start.append(t0)
        out_end.append(t1)
    return out_start, out_end
