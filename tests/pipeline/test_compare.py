"""One agent of a comparison, judged the same way for the linear pipeline and the graph runner
(no model: a recomputation is what test_graph and test_pipeline_tiny exercise)."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvwire.pipeline.compare import compare_agent
from kvwire.pipeline.fidelity import measure
from kvwire.pipeline.results import AgentResult


def turn(mode: str, output: list[int], context: tuple[int, ...] = (1, 2, 3), logits: float = 0.0,
         **fields) -> AgentResult:
    times = dict.fromkeys(("ttft_s", "prefill_s", "decode_s", "receive_s", "compute_s", "publish_s", "tokenize_s",
                           "total_s"), 0.0)
    fields = {"retokenized_turns": [], **fields}
    return AgentResult(agent="b", mode=mode, context_tokens=len(context), cached_tokens=0, new_tokens=len(output),
                       output_text="", output_ids=output, packet_bytes=0, transcript_matches_template=True,
                       context_ids=list(context), first_logits=torch.full((4,), logits), **times, **fields)


TEXT = turn("text", [5, 6, 7, 8])


def test_an_exact_mode_on_the_same_ids_is_judged_by_the_text_run_in_either_runner():
    for mode in ("prefix", "graph"):
        same = compare_agent(TEXT, turn(mode, [5, 6, 7, 8], logits=0.25), None)
        assert (same.exact, same.max_logit_diff, same.note) == (True, 0.25, "identical")
        other = compare_agent(TEXT, turn(mode, [5, 6, 0, 0]), None)
        assert other.exact is False and other.note == "DIFFERENT output from the same context ids"


def test_modes_without_an_exactness_claim_report_agreement_only():
    for mode, fields in (("splice", {}), ("auto", {}), ("graph", {"exact_fidelity": measure([5], [5])})):
        other = replace(turn(mode, [5, 6, 0, 0], **fields), fidelity=measure(TEXT.output_ids, [5, 6, 0, 0]))
        judged = compare_agent(TEXT, other, None)
        assert (judged.exact, judged.max_logit_diff, judged.note) == (None, None, "agreement 50%"), mode


def test_an_agent_extending_a_spliced_merge_is_approximate_with_its_logit_difference():
    judged = compare_agent(TEXT, turn("graph", [5, 6, 7, 8], logits=1.0, approximate_via="chair"), None)
    assert (judged.exact, judged.max_logit_diff) == (None, 1.0)
    assert judged.note == ("approximate: its cache extends chair's spliced cache; output identical to text mode, "
                           "first-token logits within 1")
    apart = compare_agent(TEXT, turn("graph", [0], context=(1, 2), approximate_via="chair"), None)
    assert apart.max_logit_diff is None and apart.note.endswith("not measured with text mode")


def test_a_cache_received_as_lossy_packets_is_approximate_not_exact():
    """KVWIRE_ENCODING=int4: the greedy output may well be identical, but the logits are not a recomputation's."""
    judged = compare_agent(TEXT, turn("prefix", [5, 6, 7, 8], logits=0.75, lossy_encoding="int4"), None)
    assert (judged.exact, judged.max_logit_diff, judged.identical) == (None, 0.75, True)
    assert judged.note.startswith("approximate: its cache came as int4 packets (lossy); output identical")


def test_lossy_encodings_make_a_prefix_run_approximate_and_lossless_ones_keep_it_exact(tiny_tokenizer):
    from kvwire import CodecOptions, Pipeline, hf
    from tests.pipeline.test_pipeline_tiny import SPEC
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    spec = hf.model_spec(model)
    for encoding, lossy in (("int4", True), ("int8", True), ("bf16", True), ("fp32", False), (None, False)):
        comparison = Pipeline(model, tiny_tokenizer, SPEC, model_spec=spec,
                              codec_options=CodecOptions(encoding=encoding)).compare()
        receivers = comparison.agents[1:]
        if lossy:
            assert comparison.approximate == ["fixer", "critic"], encoding
            assert all(a.exact is None and f"{encoding} packets (lossy)" in a.note for a in receivers), encoding
            assert comparison.to_json()["approximate"] == ["fixer", "critic"]
        else:
            assert comparison.approximate == [] and all(a.exact for a in comparison.agents), encoding


def test_a_context_that_differs_and_is_not_recomputed_is_not_called_exact():
    other = turn("prefix", [5, 6, 7, 8], context=(1, 2, 4), retokenized_turns=[2])
    judged = compare_agent(TEXT, other, None)
    assert judged.exact is False and not judged.same_context
    assert judged.note == ("context differs from text mode: re-tokenizing generated message(s) 2 gives other ids; "
                           "output identical (not checked against a recomputation)")


def test_a_difference_under_reduced_precision_says_so(tiny_tokenizer):
    """A model in bfloat16 (or with compact weights) is not batch-invariant: prefix mode may then differ from
    text mode, and the verdict (still not exact) says why instead of leaving a bare DIFFERENT."""
    from types import SimpleNamespace

    from kvwire.hf import weights
    from kvwire.pipeline.compare import reduced_precision
    from tests.support import tiny

    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    assert reduced_precision(model) is None
    assert compare_agent(TEXT, turn("prefix", [5, 6, 0, 0]), SimpleNamespace(model=model)).note == \
        "DIFFERENT output from the same context ids"
    assert reduced_precision(weights.convert(tiny.model("llama", 300, 2), "int8")) == \
        "the model's linear layers compute with int8 weights"
    model = model.to(torch.bfloat16)
    assert reduced_precision(model) == "the model computes in bfloat16"
    judged = compare_agent(TEXT, turn("prefix", [5, 6, 0, 0]), SimpleNamespace(model=model))
    assert judged.exact is False and "bfloat16, which is not batch-invariant" in judged.note
    upstream = compare_agent(TEXT, turn("prefix", [5, 6, 7, 8], context=(1, 2, 4)), None)
    assert upstream.note.startswith("context differs from text mode: an upstream agent's reply differs;")
