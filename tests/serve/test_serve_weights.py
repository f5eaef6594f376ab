"""``kvwire serve --weights int8|bf16|int4``: the server in a compact weight format stays exact in that format."""

from __future__ import annotations

import pytest

from kvwire import hf
from kvwire.serve import ServeConfig, Service
from tests.serve.test_serve import DOCUMENT, SYSTEM, TURNS, converse
from tests.support.serve_utils import client, get_json, in_process


@pytest.mark.parametrize("weights", ["int8", "bf16", "int4"])
def test_reuse_and_batching_are_exact_under_compact_weights(tiny_folder, weights):
    """At temperature 0, answers with reuse equal answers without, and each equals the same model
    decoding the prompt alone in the same format; the served model's spec names its format."""
    model, tokenizer = hf.load_model(tiny_folder, weights=weights)

    def service(**config):
        return in_process(Service(ServeConfig(model=str(tiny_folder), weights=weights, block_size=4, **config),
                                  model, tokenizer))

    with service() as reusing, service(reuse=False) as plain:
        api, baseline = client(reusing.url), client(plain.url)
        name = api.models.list().data[0].id
        with_reuse = converse(api, name, max_tokens=12)
        without = converse(baseline, name, max_tokens=12)
        assert [a.choices[0].message.content for a in with_reuse] == \
            [b.choices[0].message.content for b in without]
        assert with_reuse[-1].usage.prompt_tokens_details.cached_tokens > 0
        assert get_json(f"{reusing.root}/health")["status"] == "ok"
        assert get_json(f"{reusing.root}/health")["decoding"] == "batched"
    ids = hf.encode_with_offsets(tokenizer, hf.render_chat(tokenizer, [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{DOCUMENT}\n\n{TURNS[0]}"}]))[0]
    alone = hf.generate(model, ids, max_new_tokens=12)
    text = tokenizer.decode(alone.tokens, skip_special_tokens=True)  # the tiny model writes bytes: a last
    assert text.strip().rstrip("\ufffd") == without[0].choices[0].message.content.strip().rstrip("\ufffd")
    assert len(alone.tokens) == without[0].usage.completion_tokens  # incomplete character is held back
    assert hf.model_spec(model).weights == weights


def test_health_says_when_requests_are_served_one_at_a_time(tiny_tokenizer):
    """A model the batched engine refuses (here gemma3's sliding-window layers) is served one request at a time:
    ``GET /health`` says so and why, not only a log line at start. (A coded int8 model once fell back this way
    unnoticed, and K sessions made no more tokens a second than one.)"""
    from tests.support import tiny

    model = tiny.model("gemma3", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    service = Service(ServeConfig(model="gemma3", reuse=False), model, tiny_tokenizer)
    decoding = service.health()["decoding"]
    assert decoding.startswith("one request at a time: ") and "sliding-window" in decoding
