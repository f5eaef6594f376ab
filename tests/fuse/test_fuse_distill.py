"""Sharer-written responses (``kvwire fuser-data --distill``): the sharer's own greedy answer to
each knowledge question replaces the truth as the training response; code continuations keep
theirs; answers are cached, so a second run (or an interrupted one) does not ask again.

On a tiny random model the answers are gibberish, but they are exactly the model's greedy
continuation of the rendered chat prompt, which is what is checked.
"""

from __future__ import annotations

import json

import pytest
from tests.support import tiny
from kvwire import hf
from kvwire.errors import FuserDataError
from kvwire.fuse import distill
from kvwire.fuse.stdlib_qa import Example
from kvwire.fuse.train import Party
from kvwire.hf.greedy import greedy_batch

EXAMPLES = [
    Example("What does the function `heapq.heappush` do?", "Push item onto heap.", "doc", "heapq.heappush"),
    Example("Which module of the Python standard library defines `Counter`?", "`collections`.", "module",
            "collections.Counter"),
    Example("Here are 2 lines of `textwrap`:\n\nimport re\n\nWrite the line that follows.", "_ws = ' '",
            "continuation", "textwrap.@1"),
    Example("What is the signature of `math.gcd`?", "`math.gcd(*integers)`", "signature", "math.gcd"),
]


@pytest.fixture(scope="module")
def sharer():
    tok = tiny.tokenizer()
    model = tiny.model("qwen2", len(tok), tok.eos_token_id, seed=3)
    return Party(model, tok, hf.model_spec(model), "tiny-qwen2")


def one_by_one(party, prompt: str, limit: int) -> list[int]:
    """The unbatched greedy continuation, the reference the batch is checked against."""
    ids = distill._prompt_ids(party.tokenizer, prompt)
    tokens = hf.generate(party.model, ids, max_new_tokens=limit).tokens
    eos = hf.eos_token_ids(party.model)
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


def test_a_left_padded_batch_answers_as_each_prompt_alone(sharer):
    prompts = [ex.prompt for ex in EXAMPLES]  # different lengths: the shorter rows are padded
    rows = greedy_batch(sharer.model, [distill._prompt_ids(sharer.tokenizer, p) for p in prompts], 6)
    assert rows == [one_by_one(sharer, p, 6) for p in prompts]


def test_knowledge_answers_are_the_sharers_and_continuations_keep_the_truth(sharer, tmp_path):
    out, info = distill.distill(EXAMPLES, sharer, tmp_path / "cache.jsonl", max_new_tokens=5)
    by_kind = {ex.kind: ex for ex in out}
    assert by_kind["continuation"] == EXAMPLES[2]
    for ex in EXAMPLES[:2] + EXAMPLES[3:]:
        if ex.kind in by_kind:  # an empty answer drops its example
            expected = sharer.tokenizer.decode(one_by_one(sharer, ex.prompt, 5), skip_special_tokens=True).strip()
            assert by_kind[ex.kind].answer == distill.whole_sentences(expected, cut=True) or \
                by_kind[ex.kind].answer == expected
    assert info["distilled"] + info["dropped_empty"] == 3 and info["kept_truth"] == 1
    assert info["sharer_fingerprint"] == sharer.spec.fingerprint


def test_answers_are_cached_and_not_asked_again(sharer, tmp_path, monkeypatch):
    cache = tmp_path / "cache.jsonl"
    first, _ = distill.distill(EXAMPLES, sharer, cache, max_new_tokens=4)
    calls = []
    generate = sharer.model.generate

    def counting(**kwargs):  # the same sharer, counting its calls
        calls.append(kwargs)
        return generate(**kwargs)

    monkeypatch.setattr(sharer.model, "generate", counting)
    again, _ = distill.distill(EXAMPLES, sharer, cache, max_new_tokens=4)
    assert again == first and calls == []
    distill.distill(EXAMPLES[:1], sharer, cache, max_new_tokens=3)
    assert len(calls) == 1  # another token limit is another answer


def test_a_torn_last_line_is_dropped_and_a_corrupt_one_refused(tmp_path):
    cache = tmp_path / "cache.jsonl"
    cache.write_text(json.dumps({"key": "a", "answer": "x"}) + "\n" + '{"key": "b", "ans')
    assert distill.load_cache(cache) == {"a": "x"}
    cache.write_text('{"key": "b", "ans\n' + json.dumps({"key": "a", "answer": "x"}) + "\n")
    with pytest.raises(FuserDataError, match="cache.jsonl:1: not a distilled answer"):
        distill.load_cache(cache)


@pytest.mark.parametrize("answer, cut, expected", [
    ("The function pushes. It then sorts the", True, "The function pushes."),
    ("Use `heapq.heappush`. Then", True, "Use `heapq.heappush`."),
    ("no sentence ends here", True, "no sentence ends here"),
    ("Done. Finished early", False, "Done. Finished early"),
])
def test_an_answer_cut_by_the_token_limit_ends_at_its_last_sentence(answer, cut, expected):
    assert distill.whole_sentences(answer, cut) == expected
