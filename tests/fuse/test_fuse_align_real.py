"""Token alignment on the pair kvwire fuses: SmolLM2-135M (receiver) and Qwen2.5-Coder-0.5B (sharer).

Only the two tokenizers are loaded (no weights), so this is fast, but it needs the second
model fetched: marked ``second_model`` (``make test-fuse``).
"""

from __future__ import annotations

import unicodedata

import pytest

from kvwire import hf, models
from kvwire.fuse import align

pytestmark = pytest.mark.second_model

TEXTS = {
    "cjk": "日本語のテキストと中文文本",
    "emoji": "ship it 🚀🚀 👨\u200d💻 done ✅",
    "combining marks": "cafe\u0301 na\u0308ive e\u0301e\u0301",  # Qwen's tokenizer NFC-normalizes these
    "whitespace runs": "a  b   c\n\n\n   d \t\t e      \n",
    "code indentation": "class A:\n\tdef f(self):\n\t\treturn 1\n        if x:\n                pass\n",
    "special tokens": "before <|im_end|> middle <|im_start|>user after <|endoftext|>",
    "empty": "",
}


@pytest.fixture(scope="module")
def pair():
    receiver = hf.load_tokenizer(models.resolve())
    sharer = hf.load_tokenizer(models.resolve("qwen2.5-coder-0.5b"))
    return receiver, sharer


@pytest.mark.parametrize("name", list(TEXTS))
def test_plain_texts(pair, name):
    receiver, sharer = pair
    text = TEXTS[name]
    alignment = align.align_texts(receiver, sharer, text)
    _, r_off = hf.encode_with_offsets(receiver, text)
    _, s_off = hf.encode_with_offsets(sharer, text)
    assert len(alignment) == len(r_off) and len(alignment.sharer_ids) == len(s_off)
    assert bool((alignment.index[1:] >= alignment.index[:-1]).all())
    uncovered = set(range(len(text))) - {c for a, b in s_off for c in range(a, b)}
    for i, (a, b) in enumerate(r_off):
        lo, hi = s_off[int(alignment.start[i])][0], s_off[int(alignment.end[i]) - 1][1]
        # its characters are inside the span -- except characters no sharer offset covers (a combining
        # mark NFC folded into the previous letter): those read the nearest sharer token before them
        assert lo <= a or a in uncovered, (name, i, text[a:b], text[lo:hi])
        assert b <= hi or set(range(max(a, hi), b)) <= uncovered, (name, i, text[a:b], text[lo:hi])


def test_special_tokens_in_content_are_special_for_both(pair):
    receiver, sharer = pair
    text = TEXTS["special tokens"]
    alignment = align.align_texts(receiver, sharer, text)
    r_end = receiver.convert_tokens_to_ids("<|im_end|>")
    s_end = sharer.convert_tokens_to_ids("<|im_end|>")
    i = alignment.receiver_ids.index(r_end)
    assert alignment.sharer_ids[int(alignment.index[i])] == s_end
    assert int(alignment.end[i] - alignment.start[i]) == 1


def test_cjk_byte_tokens_share_their_character(pair):
    receiver, sharer = pair
    alignment = align.align_texts(receiver, sharer, "日本語")
    _, r_off = hf.encode_with_offsets(receiver, "日本語")
    assert len(r_off) > 3  # SmolLM2 splits these characters into byte tokens
    by_char = {}
    for i, (a, _) in enumerate(r_off):
        by_char.setdefault(a, set()).add(int(alignment.index[i]))
    assert all(len(chosen) == 1 for chosen in by_char.values())  # all bytes of a character read one sharer token


def test_combining_marks_are_canonically_the_same_text(pair):
    receiver, sharer = pair
    text = TEXTS["combining marks"]
    decoded = hf.decode_exact(sharer, hf.encode_with_offsets(sharer, text)[0])
    assert decoded != text and decoded == unicodedata.normalize("NFC", text)  # Qwen reads the composed form
    assert len(align.align_texts(receiver, sharer, text)) > 0


def test_chat_templates_of_both_models(pair):
    receiver, sharer = pair
    messages = [{"role": "user", "content": "What does this print?\n\n```python\nfor i in range(3):\n"
                                            "        print(i * '😀')\n```"},
                {"role": "assistant", "content": "It prints three lines."},
                {"role": "user", "content": "Why?"}]
    alignment = align.align_chat(receiver, sharer, messages)
    r_ids, r_off = hf.encode_with_offsets(receiver, alignment.receiver_text)
    s_ids, s_off = hf.encode_with_offsets(sharer, alignment.sharer_text)
    assert alignment.receiver_text != alignment.sharer_text  # different default system prompts
    assert list(alignment.receiver_ids) == r_ids and list(alignment.sharer_ids) == s_ids
    for i, (a, b) in enumerate(r_off):
        piece = alignment.receiver_text[a:b]
        lo, hi = s_off[int(alignment.start[i])][0], s_off[int(alignment.end[i]) - 1][1]
        if alignment.content[i]:
            assert piece.strip("\n") in alignment.sharer_text[lo:hi]
        elif piece in ("<|im_start|>", "<|im_end|>"):  # both use ChatML markers: they meet
            assert alignment.sharer_text[lo:hi] == piece
    stats = alignment.stats()
    assert 0.3 < stats["content_share"] < 1 and stats["one_to_one"] > 0.5
