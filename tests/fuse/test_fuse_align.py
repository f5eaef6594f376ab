"""Token alignment (kvwire.fuse.align): each receiver token -> the sharer tokens over the same characters.

These run in the default suite on two real, very different byte-level BPE tokenizers:
SmolLM2's (49k tokens) as the receiver and the tiny test tokenizer (~400 tokens, so most
words split into many pieces) as the sharer. The pair the project fuses, SmolLM2 and
Qwen2.5-Coder, is tested in ``test_fuse_align_real.py`` (``make test-fuse``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models as tok_models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, PythonBackend

from tests.support import tiny
from kvwire import hf, models
from kvwire.errors import AlignmentError
from kvwire.fuse import align

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm():
    return hf.load_tokenizer(models.resolve())


@pytest.fixture(scope="module")
def small():
    return tiny.tokenizer()


def covered_text(alignment: align.Alignment, tokenizer, text: str, i: int) -> tuple[str, str]:
    """(receiver token i's characters, the characters of its sharer span), by offsets."""
    _, r_off = hf.encode_with_offsets(tokenizer[0], text)
    _, s_off = hf.encode_with_offsets(tokenizer[1], text)
    a, b = r_off[i]
    lo, hi = s_off[int(alignment.start[i])][0], s_off[int(alignment.end[i]) - 1][1]
    return text[a:b], text[lo:hi]


def check_invariants(alignment: align.Alignment, receiver, sharer, text: str) -> None:
    """Every receiver token's characters lie inside the characters of its covering sharer span,
    the chosen token is in the span, and the chosen tokens never go backwards."""
    n = len(alignment)
    assert len(alignment.index) == len(alignment.start) == len(alignment.end) == len(alignment.content) == n
    assert bool(((alignment.start <= alignment.index) & (alignment.index < alignment.end)).all())
    assert bool((alignment.index[1:] >= alignment.index[:-1]).all())
    _, r_off = hf.encode_with_offsets(receiver, text)
    _, s_off = hf.encode_with_offsets(sharer, text)
    for i, (a, b) in enumerate(r_off):
        lo, hi = s_off[int(alignment.start[i])][0], s_off[int(alignment.end[i]) - 1][1]
        assert lo <= a and b <= hi, (i, text[a:b], text[lo:hi])


def test_plain_text_maps_each_token_to_the_sharer_tokens_over_its_characters(smollm, small):
    text = "def export(rows, totals={}):\n    return sum(r[2] for r in rows)"
    alignment = align.align_texts(smollm, small, text)
    assert list(alignment.receiver_ids) == hf.encode_with_offsets(smollm, text)[0]
    assert list(alignment.sharer_ids) == hf.encode_with_offsets(small, text)[0]
    check_invariants(alignment, smollm, small, text)
    # the small vocabulary splits words: several sharer tokens cover one receiver token
    assert alignment.stats()["mean_span"] > 1 and bool(alignment.content.all())
    last, first = alignment, align.align_texts(smollm, small, text, select="first")
    assert torch.equal(last.index, last.end - 1) and torch.equal(first.index, first.start)
    assert last.method == "char-offsets-v1/text/last" and align.parse_method(first.method) == ("text", "first")
    with pytest.raises(AlignmentError, match="unknown token alignment method"):
        align.parse_method("char-last")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(list("ab xy_(){}:=\t\n") + ["    ", "\u00e9", "e\u0301", "日本", "語", "😀",
                                                             "\U0001F468\u200D\U0001F4BB"]), max_size=30)
       .map("".join))
def test_any_text_aligns_with_characters_inside_the_covering_span(smollm, small, text):
    alignment = align.align_texts(smollm, small, text)
    check_invariants(alignment, smollm, small, text)


def test_empty_text_aligns_to_nothing(smollm, small):
    alignment = align.align_texts(smollm, small, "")
    assert len(alignment) == 0 and alignment.sharer_ids == ()
    assert alignment.stats()["receiver_tokens"] == 0


def test_gather_and_span_mean_read_the_sharer_kv(smollm, small):
    alignment = align.align_texts(smollm, small, "Summarize the incident report in three sentences.")
    B, H, D = 2, 3, 4
    kv = torch.randn(B, H, len(alignment.sharer_ids), D)
    gathered = alignment.gather(kv)
    mean = alignment.span_mean(kv)
    assert gathered.shape == mean.shape == (B, H, len(alignment), D)
    for i in range(len(alignment)):
        s, e = int(alignment.start[i]), int(alignment.end[i])
        assert torch.equal(gathered[:, :, i], kv[:, :, int(alignment.index[i])])
        assert torch.allclose(mean[:, :, i], kv[:, :, s:e].mean(dim=2), atol=1e-5)
    with pytest.raises(AlignmentError, match=r"N_s=\d+"):
        alignment.gather(kv[:, :, :-1])


def test_chat_sections_align_contents_by_characters_and_templates_by_position(smollm, small):
    messages = [{"role": "system", "content": "You are the reviewer."},
                {"role": "user", "content": "def f(x):\n\treturn x"},
                {"role": "assistant", "content": ""},  # empty contents are located exactly too
                {"role": "user", "content": "def f(x):\n\treturn x"}]  # a repeated content
    alignment = align.align_chat(smollm, small, messages)
    assert alignment.method == "char-offsets-v1/chat/last"
    r_text, s_text = alignment.receiver_text, alignment.sharer_text
    assert r_text == hf.render_chat(smollm, messages) and s_text == hf.render_chat(small, messages)
    assert list(alignment.receiver_ids) == hf.encode_with_offsets(smollm, r_text)[0]
    assert list(alignment.sharer_ids) == hf.encode_with_offsets(small, s_text)[0]
    _, r_off = hf.encode_with_offsets(smollm, r_text)
    _, s_off = hf.encode_with_offsets(small, s_text)
    for i, (a, b) in enumerate(r_off):
        lo, hi = s_off[int(alignment.start[i])][0], s_off[int(alignment.end[i]) - 1][1]
        if alignment.content[i]:  # content characters reappear in the covering sharer text
            assert r_text[a:b].strip() in s_text[lo:hi], (r_text[a:b], s_text[lo:hi])
        elif r_text[a:b] == "<|im_start|>":  # identical ChatML markers map onto each other
            assert s_text[lo:hi] == "<|im_start|>"
    assert bool((alignment.index[1:] >= alignment.index[:-1]).all())
    content_chars = sum(len(m["content"]) for m in messages)
    assert 0 < int(alignment.content.sum()) <= content_chars


# -- what cannot be aligned ---------------------------------------------------------------------------


class CharTokenizer(PythonBackend):
    """A real (slow, pure-Python) transformers tokenizer: one token per ASCII character, no offsets."""

    def __init__(self, **kwargs):
        self.vocab = {chr(c): c - 32 for c in range(32, 127)}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    def _tokenize(self, text, **kwargs):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.vocab.get(token, 0)

    def _convert_id_to_token(self, index):
        return chr(index + 32)


def lossy_tokenizer(normalizer=None) -> PreTrainedTokenizerFast:
    """A fast word-level tokenizer that knows a few words: everything else becomes [UNK]."""
    vocab = {"[UNK]": 0, "def": 1, "f": 2, "return": 3, "x": 4}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    if normalizer is not None:
        tok.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_a_tokenizer_without_offsets_is_refused(small):
    with pytest.raises(AlignmentError, match="no character offsets") as info:
        align.align_texts(CharTokenizer(), small, "def f")
    assert "fast tokenizer" in info.value.hint


def test_a_tokenizer_that_loses_characters_is_refused(smollm):
    with pytest.raises(AlignmentError, match="sharer tokenizer .* does not reproduce the text") as info:
        align.align_texts(smollm, lossy_tokenizer(), "def g")
    assert "different texts" in info.value.hint
    with pytest.raises(AlignmentError, match="receiver tokenizer .* reads back as"):
        align.align_texts(lossy_tokenizer(normalizers.Lowercase()), smollm, "def F")


def test_a_template_that_changes_contents_is_refused(smollm):
    trimming = tiny.tokenizer()
    trimming.chat_template = tiny.CHAT_TEMPLATE.replace("message['content']", "message['content'] | trim")
    with pytest.raises(AlignmentError, match="changes message contents"):
        align.align_chat(smollm, trimming, [{"role": "user", "content": "  indented"}])
    assert len(align.align_chat(smollm, trimming, [{"role": "user", "content": "plain"}])) > 0
