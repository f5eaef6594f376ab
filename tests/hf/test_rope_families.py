"""RoPE conventions are measured on each model, never trusted from its config.

``hf.rope_tables`` runs a probe (a few tokens at positions 0.. and 61..) and keeps,
per layer, the convention -- half-split pairs (i, i + R/2) or interleaved pairs
(2i, 2i + 1) -- whose re-rotation reproduces the model's own keys; a model where
neither does is refused with an ``UnsupportedRopeError`` naming it and the error.

One model of each kind (half-split, partial rotary, per-layer-type bases, interleaved
from a rotary module, interleaved inside attention) is checked in detail, a few
refusals by name, and then every RoPE family transformers ships, built from
transformers' own registry by tests/support/rope_families.py (``python -m tests.support.rope_families``
prints the table: convention, probe error, or why refused or skipped).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tests.support import rope_families
from tests.support import tiny
from kvwire import KvwireError, ModelError, PacketError, UnsupportedRopeError, hf
from kvwire.wire import rope
from tests.wire.test_rope import keys_at, rel

# The convention each fast-subset family uses, as its transformers source reads.
CONVENTION = {"llama": "half", "qwen2": "half", "gpt_neox": "half", "gemma3_text": "half",
              "cohere": "interleaved", "glm": "interleaved", "gptj": "interleaved"}

# Families refused on purpose (slow sweep), with the reason's telling words. Everything else
# transformers 5.18 lists with RoPE must build and pass, or be in SKIPPED.
REFUSED = {
    # caches kvwire does not carry (linear attention, indexed / compressed KV)
    **{name: "cache layers" for name in (
        "axk2", "bamba", "deepseek_v32", "deepseek_v4", "falcon_h1", "glm_moe_dsa", "granitemoehybrid", "hy_v4",
        "minimax", "olmo_hybrid", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "qwen4_exp_text")},
    # multi-head latent attention: keys [nope | rope] with the rotary dims last, one head per token
    **{name: "cache keys" for name in (
        "axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "mimo_v2_flash", "youtu")},
    "falcon": "cache keys",  # multi_query: caches 1 KV head where its config says num_kv_heads=4
    "nanochat": "relative error",  # rotates the other way round: rotate_half = cat(x2, -x1)
    "gemma4_text": "per-layer attribute",  # head size differs per layer
    "gemma4_unified_text": "per-layer attribute",
    "recurrent_gemma": "no attention keys",  # recurrent blocks keep no K/V
    "longcat_flash": "probe",  # its tiny config does not run (MLA sizes this builder does not set)
}
# Families the generic tiny builder cannot make on CPU here; the reason is checked too.
SKIPPED = {
    **{name: "parameters once shrunk" for name in (  # multimodal wrappers; their decoders are the *_text families
        "blt", "emu3", "gemma3", "gemma4", "gemma4_unified", "got_ocr2", "llama4", "mllama", "phi4_multimodal",
        "qwen3_5", "qwen3_5_moe")},
    "gemma3n": "timm",  # vision tower needs timm, not a dependency
    "gemma3n_text": "does not build",  # needs per-layer sizes the generic builder does not set
    "dbrx": "rope_theta",  # attention config is a nested object
    "lfm2_moe": "does not build",
    "qwen4_exp": "does not build",
    "musicgen": "no tiny config", "musicgen_melody": "no tiny config",  # encoder-decoder audio models
    "zamba2": "no tiny config", "zaya": "no tiny config",  # layer pattern fixed to their real depth
}


def moved_error(model, p=100, q=300, n=6):
    """Worst relative error over layers of keys moved p -> q against keys computed at q."""
    ids = torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(5))
    tables = hf.rope_tables(model)
    at_p, at_q = keys_at(model, ids, p), keys_at(model, ids, q)
    src, dst = torch.arange(p, p + n), torch.arange(q, q + n)
    errors = []
    for layer, (kp, kq) in enumerate(zip(at_p, at_q)):
        kept = kp.shape[2]
        errors.append(rel(rope.rotate(kp, tables[layer], src[-kept:], dst[-kept:]), kq))
    return max(errors), tables


def build(name):
    model = rope_families.build(name)
    if isinstance(model, rope_families.Skipped):
        pytest.fail(f"{name} should build: {model.reason}")
    return model


@pytest.mark.parametrize("name", rope_families.FAST)
def test_each_kind_of_rope_is_measured_and_moves_exactly(name):
    model = build(name)
    error, tables = moved_error(model)
    assert error < 1e-4  # at other offsets than the probe's, every layer
    assert {t.convention for t in tables} == {CONVENTION[name]}
    assert all(t.checked and t.probe_error < 1e-5 for t in tables)
    # the bug this guards against: the other convention is far off (relative error near 1)
    other = "half" if CONVENTION[name] == "interleaved" else "interleaved"
    ids = torch.randint(3, 300, (1, 6), generator=torch.Generator().manual_seed(5))
    kp, kq = keys_at(model, ids, 100)[0], keys_at(model, ids, 300)[0]
    wrong = rope.rotate(kp, replace(tables[0], convention=other), torch.arange(100, 106), torch.arange(300, 306))
    assert rel(wrong, kq) > 0.3


def test_partial_rotary_and_per_layer_bases_are_read_from_the_model():
    assert hf.rope_tables(build("glm"))[0].rotary_dim == 8 < 16  # GLM rotates half its head
    assert hf.rope_tables(build("gptj"))[0].rotary_dim == 8  # GPT-J: RoPE inside attention, rotary_dim from config
    gemma = tiny.model("gemma3", 400, 2)  # sliding and full layers (the generic build's 2 layers are both sliding)
    kinds = hf.model_spec(gemma).layer_kinds
    tables = hf.rope_tables(gemma)
    assert not tables[kinds.index("sliding_attention")].same_rotation(tables[kinds.index("full_attention")])


def test_models_without_rope_are_refused_with_the_measured_error():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=320)).eval()
    with pytest.raises(UnsupportedRopeError, match=r"keys of gpt2 exactly.*relative error of half 1\.\d") as err:
        hf.rope_tables(gpt2)
    assert isinstance(err.value, PacketError) and "text mode" in err.value.hint


def test_a_rotation_kvwire_does_not_know_is_refused():
    """NanoChat turns pairs the other way round (rotate_half = cat(x2, -x1)): neither convention fits."""
    probe = hf.probe_rope(build("nanochat"))
    assert probe.tables == [] and min(min(e) for e in probe.errors.values()) > 0.5
    with pytest.raises(UnsupportedRopeError, match="keys of nanochat exactly.*relative error"):
        hf.rope_tables(build("nanochat"))


def test_under_compact_weights_a_refusal_is_still_the_rotations():
    """The probe multiplies compact weights exactly, so a refusal under int8 names the rotation (nanochat's turns
    the other way), says the format's rounding was not counted, and a right RoPE under int8 passes."""
    from kvwire.hf import weights

    with pytest.raises(UnsupportedRopeError, match="nanochat exactly.*int8 weights multiplied exactly in fp32"):
        hf.rope_tables(weights.convert(build("nanochat"), "int8"))
    probe = hf.probe_rope(weights.convert(build("llama"), "int8"))
    assert probe.tables and probe.weights == "int8" and probe.format_noise is not None


def test_the_probe_runs_once_per_model():
    model = build("llama")
    first = hf.probe_rope(model)
    assert hf.probe_rope(model) is first  # recalled by weight fingerprint + config
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # new weights: probed again
    assert hf.probe_rope(model) is not first


def test_unchecked_tables_are_refused_where_packets_move():
    model = build("cohere")
    spec = hf.model_spec(model)
    ids = torch.randint(3, 300, (1, 5), generator=torch.Generator().manual_seed(1))
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    packet = hf.extract(cache, spec, ids)
    unchecked = [replace(t, probe_error=None) for t in hf.rope_tables(model, spec)]
    with pytest.raises(PacketError, match="never checked"):
        rope.move(packet, unchecked, 7)
    moved = rope.move(packet, hf.rope_tables(model, spec), 7)
    want = keys_at(model, ids, 7)
    assert max(rel(moved.keys[i], want[i]) for i in range(spec.num_layers)) < 1e-4


def test_every_rope_family_transformers_ships():
    """~120 families, a few KB of weights and two 4-token forwards each: about 15 s."""
    names = rope_families.families()
    assert len(names) > 100 and set(REFUSED) | set(SKIPPED) <= set(names)
    passed, wrong = [], []
    for name in names:
        model = rope_families.build(name)
        if isinstance(model, rope_families.Skipped):
            if not (name in SKIPPED and SKIPPED[name] in model.reason):
                wrong.append((name, model.reason))
            continue
        try:
            error, tables = moved_error(model)
        except (UnsupportedRopeError, ModelError) as err:
            if not (name in REFUSED and REFUSED[name] in str(err)):
                wrong.append((name, str(err)))
            continue
        except KvwireError as err:  # no other refusal is expected
            pytest.fail(f"{name}: {err}")
        if name in REFUSED or name in SKIPPED or not error < 1e-4:
            wrong.append((name, f"passed, error {error:.1e}"))
        passed.append(name)
    assert wrong == []
    assert {"cohere", "glm", "gptj", "codegen", "ernie4_5", "helium", "llama4_text"} <= set(passed)


# transformers' own forward fails on the generic tiny config of these (text mode too): not a kvwire finding
FORWARD_FAILS = {"longcat_flash": "must match the size of tensor"}


# The families the sweep's assertions name run in its default half; the other half is `make test-slow`'s.
NAMED = {"llama", "mistral", "phi3", "qwen3", "olmo2", "gpt_oss", "hrm_text", "jetmoe", "doge"}


def sweep_half(part: str) -> list[str]:
    """Every other family in transformers' registry order (and the named ones) for ``part="sample"``; the rest."""
    names = rope_families.families()
    return [name for i, name in enumerate(names) if (i % 2 == 0 or name in NAMED) == (part == "sample")]


@pytest.mark.parametrize("part", ["sample", pytest.param("rest", marks=pytest.mark.slow)])
def test_cache_passing_is_exact_or_refused_up_front_on_every_family(monkeypatch, part):
    """Every causal-LM family transformers ships, as a tiny random model: a three-agent pipeline in prefix
    mode, the same agents with private system prompts in splice mode at R = 1, and a graph whose two reviewers
    decode as one batch over the intake's shared cache (a merge spliced at R = 1), each equal to recomputation
    token for token (logits within 1e-3) -- or refused before any turn with a KvwireError naming what kvwire
    does not model (recurrent or linear-attention layers, multi-latent attention, heads the config does not
    count, sliding windows in splice mode). A model the batched engine cannot run decodes one agent at a time
    instead (JetMoE attends with keys it repeats after caching; Doge's attention takes no boolean mask).
    Never a crash, never a silent difference. The default suite sweeps half the families (``part``), the
    slow marker the other half."""
    from kvwire import AgentSpec, Pipeline, PipelineSpec
    from kvwire.kv.splice import Recompute
    from kvwire.pipeline.graph import GraphRunner

    tokenizer = tiny.tokenizer()
    monkeypatch.setitem(rope_families.SHRINK, "vocab_size", len(tokenizer))
    monkeypatch.setitem(rope_families.SHRINK, "eos_token_id", tokenizer.eos_token_id)
    monkeypatch.setitem(rope_families.SHRINK, "max_position_embeddings", 1024)
    code = "def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)"
    linear = PipelineSpec(name="sweep", system="You are the reviewer.", input_label="Code", max_new_tokens=6,
                          input_text=code, agents=(AgentSpec("analyst", "List the bugs."),
                                                   AgentSpec("fixer", "Suggest a fix."),
                                                   AgentSpec("critic", "Point out what is wrong.")))
    board = PipelineSpec(name="board", system="You are on a review board.", input_label="Code", max_new_tokens=5,
                         input_text=code, agents=(AgentSpec("intake", "Say what the code does."),
                                                  AgentSpec("bugs", "List the bugs.", after=("intake",)),
                                                  AgentSpec("style", "Review the style.", after=("intake",)),
                                                  AgentSpec("chair", "Merge.", after=("bugs", "style"))))
    order = list(board.graph.order)

    def differences(model, agents, tokens):
        for index, agent in enumerate(agents):
            reference = hf.generate(model, agent.context_ids, max_new_tokens=tokens(index), use_cache=False)
            difference = float((reference.first_logits - agent.first_logits).abs().max())
            if reference.tokens != agent.output_ids or difference > 1e-3:
                yield f"{agent.agent}: not exact (logits {difference:.1e} apart)"

    private = PipelineSpec(name="private", system="Be brief.", input_label="Code", max_new_tokens=6, input_text=code,
                           agents=tuple(AgentSpec(a.name, a.instruction, system=f"You are the {a.name}.")
                                        for a in linear.agents))
    runs = {"prefix": (lambda model: Pipeline(model, tokenizer, linear).run("prefix"), linear.new_tokens),
            "graph": (lambda model: GraphRunner(model, tokenizer, board, recompute=Recompute(1.0),
                                                merge="splice").run("graph"), lambda i: board.new_tokens(order[i])),
            "splice": (lambda model: Pipeline(model, tokenizer, private, recompute=Recompute(1.0),
                                              splice_when="always").run("splice"), private.new_tokens)}
    exact: dict[str, list[str]] = {mode: [] for mode in runs}
    batched, refused, wrong = [], [], []
    for name in sweep_half(part):
        model = rope_families.build(name)
        if isinstance(model, rope_families.Skipped):
            continue
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        for mode, (run, tokens) in runs.items():
            try:
                result = run(model)
            except KvwireError as err:
                refused.append((name, mode, str(err)))
                continue
            except Exception as err:  # noqa: BLE001 - a crash is the finding
                if not (name in FORWARD_FAILS and FORWARD_FAILS[name] in str(err)):
                    wrong.append((name, mode, f"crash: {type(err).__name__}: {err}"))
                continue
            wrong += [(name, mode, finding) for finding in differences(model, result.agents, tokens)]
            exact[mode].append(name)
            if mode == "graph" and result.batches == [1, 2, 1]:
                batched.append(name)
    assert wrong == []
    # each half of the 121 families in transformers 5.18: 35-40 run prefix exactly, 28 splice, 24 batch a graph
    assert len(exact["prefix"]) > 30 and len(exact["splice"]) > 25 and len(batched) > 20
    if part == "sample":
        assert {"llama", "mistral", "phi3", "qwen3", "olmo2", "gpt_oss", "hrm_text"} <= set(exact["prefix"])
        assert "hrm_text" in batched and not {"jetmoe", "doge"} & set(batched)
    rope_refused = {name for name, mode, why in refused if mode == "graph" and "re-rotate" in why}
    assert set(exact["prefix"]) - set(exact["graph"]) <= rope_refused  # a merge splices: RoPE must re-rotate
    assert all(any(words in why for words in ("text mode", "kvwire supports", "re-rotate", "sliding-window"))
               for _, _, why in refused), refused
