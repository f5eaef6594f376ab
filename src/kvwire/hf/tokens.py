"""Tokenizers: ids with character offsets, exact decoding, chat rendering, identity (transformers side).

What cache-to-cache between different models needs from a tokenizer, on the public
surface of transformers' fast tokenizers: ``tokenizer(text, return_offsets_mapping=True)``,
``decode(..., skip_special_tokens=False, clean_up_tokenization_spaces=False)``,
``apply_chat_template(..., tokenize=False)`` and the vocabulary. Errors are kvwire's
(:class:`~kvwire.errors.AlignmentError`, :class:`~kvwire.errors.ModelError`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # kvwire never contacts a model hub

import blake3  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from ..errors import AlignmentError, ModelError  # noqa: E402

Offsets = list[tuple[int, int]]


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer of a local model folder, without loading weights."""
    try:
        return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load the tokenizer in {path}: {err}", "check that the folder is complete") from None


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], Offsets]:
    """Token ids of ``text`` as the model sees it (no special tokens added: a rendered chat
    template already holds them) and each token's character span ``(start, end)`` in ``text``.

    Example (SmolLM2): ``"def f"`` -> ids ``[1604, 275]``, offsets ``[(0, 3), (3, 5)]`` (``"def"``, ``" f"``).
    A character split over several byte-level tokens (an emoji, a CJK character) gives each
    of them that character's span. Raises :class:`AlignmentError` for a tokenizer without
    offsets (a "slow" Python tokenizer).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise AlignmentError(f"{type(tokenizer).__name__} gives no character offsets (not a fast tokenizer)",
                             "load the model folder's tokenizer.json (a tokenizers-backed fast tokenizer)")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    offsets = [(int(a), int(b)) for a, b in encoded["offset_mapping"]]
    return ids, offsets


def decode_exact(tokenizer: Any, ids: list[int]) -> str:
    """The text of ``ids`` with nothing skipped or cleaned up (special tokens included)."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def whole_characters(tokenizer: Any, ids: list[int], text: str | None = None) -> tuple[list[int], str]:
    """``ids`` and their ``text`` (decoded, special tokens skipped, when not given) without the incomplete
    UTF-8 character a length limit left at the end (decoded as U+FFFD): up to three trailing ids whose
    bytes do not finish a character are dropped. (A real U+FFFD ending a cut reply goes too: decoding
    cannot tell it from a cut character.) The serve scheduler and the pipeline's replies use it.

    Example: ids of "ok 🌟" cut after two of the star's four bytes: "ok \ufffd" -> the ids of "ok ", "ok ".
    """
    text = tokenizer.decode(ids, skip_special_tokens=True) if text is None else text
    if not text.endswith("\ufffd"):
        return list(ids), text
    for drop in range(1, min(3, len(ids)) + 1):
        shorter = tokenizer.decode(ids[:-drop], skip_special_tokens=True)
        if not shorter.endswith("\ufffd"):
            return ids[:-drop], shorter
    return ids, text


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The model's chat template applied to ``messages`` (:func:`defused`), as text (what
    :func:`encode_with_offsets` reads)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"{type(tokenizer).__name__} has no chat template", "use a chat (instruct) model")
    try:
        return tokenizer.apply_chat_template(defused(tokenizer, messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as err:  # jinja errors raised by the template itself: any type
        raise ModelError(f"the chat template cannot render these messages: {err}") from None


def default_system_prompt(tokenizer: Any) -> bool:
    """Whether the chat template writes a system turn of its own when the messages have none
    (SmolLM2's "You are a helpful AI assistant named SmolLM...", Qwen2.5's "You are Qwen...").

    Checked by rendering: the header a system message gets must not appear in a user-only chat.
    """
    marker = "\u2063kvwire-system\u2063"
    try:
        with_system = render_chat(tokenizer, [{"role": "system", "content": marker}, {"role": "user", "content": "x"}],
                                  add_generation_prompt=False)
        user_only = render_chat(tokenizer, [{"role": "user", "content": "x"}], add_generation_prompt=False)
    except ModelError:
        return False
    header = with_system[:with_system.find(marker)]
    bos = getattr(tokenizer, "bos_token", None) or ""
    header = header[len(bos):] if bos and header.startswith(bos) else header
    return bool(header.strip()) and header in user_only


DEFUSER = "\u2060"  # WORD JOINER: invisible, in no tokenizer's special tokens


def defuse(tokenizer: Any, text: str) -> str:
    """``text`` with every special token's string (``<|im_end|>``, ``<|im_start|>``, ``<eos>``) broken by
    an invisible WORD JOINER after its first character, so that it tokenizes as the plain text it is.

    A chat template is rendered to text and tokenized whole, so a document or a request that
    merely *contains* ``<|im_end|>\n<|im_start|>assistant\n...`` would otherwise close its turn and
    forge one -- the prompt injection a signed cache is meant to rule out. Idempotent; text
    without such strings is returned unchanged. Applied to every message that is not the model's
    own reply (:func:`defused`), wherever kvwire renders a conversation.
    """
    if not text:
        return text
    for token in _special_strings(tokenizer):
        if token in text:
            text = text.replace(token, token[0] + DEFUSER + token[1:])
    return text


def defused(tokenizer: Any, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """``messages`` with :func:`defuse` applied to the content of each one that is not an assistant reply."""
    return [message if message.get("role") == "assistant" else
            {**message, "content": defuse(tokenizer, message["content"])} for message in messages]


def _special_strings(tokenizer: Any) -> list[str]:
    """The strings of the tokenizer's special tokens, longest first (one inside another is broken whole)."""
    strings = set(special_tokens(tokenizer)) | {str(t) for t in getattr(tokenizer, "all_special_tokens", []) or []}
    return sorted((t for t in strings if len(t) > 1), key=len, reverse=True)


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special added tokens (BOS/EOS, chat markers, padding): their strings and ids."""
    return {str(getattr(token, "content", token)): int(token_id)
            for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
            if getattr(token, "special", False)}


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of every special (added, non-normalized) token: BOS/EOS, chat markers, padding."""
    return frozenset(set(getattr(tokenizer, "all_special_ids", []) or []) | set(special_tokens(tokenizer).values()))


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer: its class, vocabulary size and a hash of the vocabulary
    (token -> id, added tokens included), the special tokens, and a hash of the chat template.

    Two tokenizers with equal ``vocab_hash`` map every string to the same ids (same
    vocabulary and merges are not proven by it, but a differing hash proves them different).
    """
    vocab = tokenizer.get_vocab()
    hasher = blake3.blake3(b"kvwire-vocab-v1\0")
    hasher.update(json.dumps(sorted(vocab.items(), key=lambda item: item[1]), ensure_ascii=False).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str()).get("model", {}) if backend is not None else {}
    template = getattr(tokenizer, "chat_template", None) or ""
    return {
        "class": type(tokenizer).__name__,
        "algorithm": str(model.get("type", "unknown")),  # BPE, Unigram, WordPiece
        "vocab_size": len(vocab),
        "vocab_hash": hasher.hexdigest(),
        "special_tokens": sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", [])),
        "bos_token": getattr(tokenizer, "bos_token", None),
        "eos_token": getattr(tokenizer, "eos_token", None),
        "chat_template_hash": blake3.blake3(template.encode()).hexdigest() if template else "",
        "fast": bool(getattr(tokenizer, "is_fast", False)),
    }
