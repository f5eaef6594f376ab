"""Building a chat transcript turn by turn gives the ids of a full template rendering."""

from __future__ import annotations

import pytest

from kvwire import TranscriptError
from kvwire.transcript import ChatTranscript


def test_incremental_ids_equal_the_full_rendering(tiny_tokenizer):
    t = ChatTranscript(tiny_tokenizer)
    t.add("system", "You are the reviewer.")
    t.add("user", "List the bugs.")
    t.open_assistant_turn()
    reply = tiny_tokenizer("The code has a bug.", add_special_tokens=False)["input_ids"]
    t.add_generated(reply + [tiny_tokenizer.eos_token_id], frozenset([tiny_tokenizer.eos_token_id]))
    t.add("user", "Fix it.")
    t.open_assistant_turn()
    assert t.verify().matches
    assert t.ids == tiny_tokenizer(t.tokenizer.apply_chat_template(t.messages, tokenize=False,
                                                                    add_generation_prompt=True),
                                   add_special_tokens=False)["input_ids"]
    assert t.messages[2] == {"role": "assistant", "content": "The code has a bug."}


def test_generated_ids_are_kept_even_when_they_do_not_retokenize(tiny_tokenizer):
    t = ChatTranscript(tiny_tokenizer)
    t.add("user", "Summarize.")
    t.open_assistant_turn()
    # "T", "h", "e" as single-character tokens: decoding and re-encoding merges them
    odd = [tiny_tokenizer.convert_tokens_to_ids(c) for c in "The"]
    assert tiny_tokenizer("The", add_special_tokens=False)["input_ids"] != odd
    added = t.add_generated(odd, frozenset([tiny_tokenizer.eos_token_id]))
    assert added[:3] == odd  # the model's own tokens, not a re-tokenization
    check = t.verify()
    assert not check.matches and check.retokenized_turns == [1] and check.first_difference is not None


def test_the_real_template_is_append_only(real_model):
    model, tokenizer, spec = real_model
    t = ChatTranscript(tokenizer)
    t.add("system", "You review code.")
    t.add("user", "def f(x): return 1/x\nWhat is wrong?")
    t.open_assistant_turn()
    assert t.verify().matches
    from_strings = ChatTranscript.from_messages(tokenizer, t.messages)
    from_strings.open_assistant_turn()
    assert from_strings.ids == t.ids


def test_a_rewriting_template_is_refused(tiny_tokenizer):
    tok = tiny_tokenizer.__class__.from_pretrained  # noqa: F841 - only to show we copy the tokenizer below
    import copy

    rewriting = copy.deepcopy(tiny_tokenizer)
    # numbers each message by the total count: adding a message rewrites earlier text
    rewriting.chat_template = "{% for m in messages %}[{{ messages|length }}] {{ m['content'] }}\n{% endfor %}"
    t = ChatTranscript(rewriting)
    t.add("user", "one")
    with pytest.raises(TranscriptError, match="not append-only"):
        t.add("user", "two")


def test_turn_order_is_enforced(tiny_tokenizer):
    t = ChatTranscript(tiny_tokenizer)
    t.add("user", "hi")
    with pytest.raises(TranscriptError, match="no assistant turn is open"):
        t.add_generated([5], frozenset())
    t.open_assistant_turn()
    with pytest.raises(TranscriptError, match="pending"):
        t.add("user", "again")
