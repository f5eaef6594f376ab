"""The compact formats keep a model's token embeddings as 8-bit block codes where the table is exactly such codes (a
model converted from a GGUF: the default model's Q8_0 table, the coder model's Q6_K one): a lookup gives the
table's own fp32 bits in 0.31x the memory. Any other table stays fp32."""

from __future__ import annotations

import pytest
import torch

from kvwire import hf
from kvwire.hf import weights
from kvwire.hf.embeddings import BLOCK, CodedEmbedding, block_codes, code_embeddings
from tests.support import tiny


def q8_0_table(rows: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """What a Q8_0 GGUF's embeddings are once dequantized to fp32: per block of 32, an fp16 scale times codes in
    [-127, 127], the largest of them +-127 (llama.cpp's quantize_row_q8_0)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, hidden // 32, 32), generator=g)
    codes[..., 0] = torch.where(torch.rand(rows, hidden // 32, generator=g) < 0.5, -127, 127)
    scales = (torch.rand(rows, hidden // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    return (codes.float() * scales).reshape(rows, hidden)


def q6_k_table(rows: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """A Q6_K GGUF's embeddings dequantized to fp32 (Qwen2.5-Coder-0.5B's ``Q4_K_M``): per block of 16, codes in
    [-32, 31] times ``d * sc``, an fp16 scale a superblock of 256 times a signed int8 one, so some blocks' zeros
    are -0.0; the largest code of a block is anything up to 32."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32, 32, (rows, hidden // 16, 16), generator=g)
    codes = codes * torch.randint(1, 33, (rows, hidden // 16, 1), generator=g) // 33  # the largest code varies
    d = (torch.rand(rows, hidden // 256 if hidden >= 256 else 1, 1, 1, generator=g) * 1e-3).half().float()
    sc = torch.randint(-127, 128, (rows, max(1, hidden // 256), 16 if hidden >= 256 else hidden // 16, 1),
                       generator=g).float()
    return (codes.float().reshape(rows, -1, sc.shape[2], 16) * (d * sc)).reshape(rows, hidden)


def with_table(model: torch.nn.Module, table: torch.Tensor) -> torch.nn.Module:
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(table)
    return model


@pytest.mark.parametrize("made_as", [q8_0_table, q6_k_table])
def test_a_gguf_table_is_kept_as_codes_and_looked_up_to_the_same_bits(made_as):
    table = made_as(5000, 64)  # more rows than one checking block
    codes, scales = block_codes(table)
    assert codes.dtype == torch.int8 and scales.shape == (5000, 64 // BLOCK)
    coded = CodedEmbedding(codes, scales)
    ids = torch.tensor([[0, 4999, 17, 17], [4096, 4095, 1, 2]])
    got = coded(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 4, 64)
    assert torch.equal(got.view(torch.int32), table[ids].view(torch.int32))  # bit for bit
    assert torch.equal(coded.dequantized(), table)


@pytest.mark.parametrize("damage", ["one ulp", "a value off the codes", "both zeros in a block", "nan", "not fp32",
                                    "a row not whole blocks"])
def test_a_table_that_is_not_exactly_codes_stays_as_it_is(damage):
    table = q8_0_table(300, 64)
    if damage == "one ulp":
        table[7, 3] = torch.nextafter(table[7, 3], torch.tensor(float("inf")))
    elif damage == "a value off the codes":
        table[299, 63] = table[299, 63] + table[299, 32:].abs().max() / 254  # half a code step
    elif damage == "both zeros in a block":  # s * 0 has one sign for any one scale s
        table[2, 0], table[2, 1] = -0.0, 0.0
    elif damage == "nan":
        table[0, 5] = float("nan")
    elif damage == "not fp32":
        table = table.double()
    elif damage == "a row not whole blocks":
        table = table[:, :40]
    assert block_codes(table) is None


def test_random_fp32_embeddings_stay_fp32(tiny_tokenizer):
    model = weights.convert(tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id), "int8")
    assert type(model.get_input_embeddings()) is torch.nn.Embedding


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_converting_codes_a_q8_0_table_and_the_model_computes_the_same_bits(fmt, tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    table = q8_0_table(vocab, 64, seed=1)
    plain = tiny.model("llama", vocab, tiny_tokenizer.eos_token_id)
    coded = weights.convert(with_table(tiny.model("llama", vocab, tiny_tokenizer.eos_token_id), table), fmt)
    reference = weights.convert(with_table(plain, table), fmt)
    reference.set_input_embeddings(torch.nn.Embedding.from_pretrained(table.clone(), freeze=True))  # fp32, as before
    assert type(coded.get_input_embeddings()) is CodedEmbedding
    ids = torch.arange(3, 40).unsqueeze(0) % vocab
    with torch.no_grad():
        assert torch.equal(coded(ids).logits, reference(ids).logits)
    out = hf.generate(coded, ids[0].tolist(), max_new_tokens=6, eos_ids=frozenset())
    want = hf.generate(reference, ids[0].tolist(), max_new_tokens=6, eos_ids=frozenset())
    assert out.tokens == want.tokens
    assert hf.model_spec(coded).torch_dtype == torch.float32  # the spec's dtype is the model's, not the codes'


def test_embeddings_shared_with_the_output_layer_stay_as_they_are(tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    model = with_table(tiny.model("llama", vocab, tiny_tokenizer.eos_token_id), q8_0_table(vocab, 64))
    model.lm_head.weight = model.get_input_embeddings().weight  # tied: the output layer multiplies by the table
    assert not code_embeddings(model)
    assert code_embeddings(with_table(tiny.model("llama", vocab, tiny_tokenizer.eos_token_id), q8_0_table(vocab, 64)))


@pytest.mark.parametrize("made_as", [q8_0_table, q6_k_table])
def test_a_compact_load_reads_a_gguf_made_table_into_codes(made_as, tmp_path, tiny_tokenizer):
    """The loader reads the table a block of rows at a time straight into codes: the fp32 table is never whole."""
    folder = tmp_path / "llama"
    vocab = len(tiny_tokenizer)
    with_table(tiny.model("llama", vocab, tiny_tokenizer.eos_token_id), made_as(vocab, 64, seed=2)).save_pretrained(
        folder)
    tiny_tokenizer.save_pretrained(folder)
    model, _ = hf.load_model(folder, weights="int8")
    assert type(model.get_input_embeddings()) is CodedEmbedding
    fp32, _ = hf.load_model(folder)
    assert type(fp32.get_input_embeddings()) is torch.nn.Embedding  # fp32 is loaded as transformers loads it
    assert torch.equal(model.get_input_embeddings().dequantized(), fp32.get_input_embeddings().weight)


@pytest.mark.real_model
def test_the_default_models_embeddings_are_coded_in_int8_to_the_same_bits(real_model):
    """The bundled SmolLM2's table (Q8_0 in its GGUF) is kept as codes in int8, and gives the fp32 load's bits."""
    from kvwire import models

    fp32, _, _ = real_model
    model, _ = hf.load_model(models.resolve(), weights="int8")
    coded = model.get_input_embeddings()
    assert type(coded) is CodedEmbedding
    assert torch.equal(coded.dequantized().view(torch.int32), fp32.get_input_embeddings().weight.view(torch.int32))
    assert coded.codes.nbytes + coded.scales.nbytes < 0.32 * fp32.get_input_embeddings().weight.nbytes


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_a_model_with_coded_embeddings_decodes_in_the_batched_engine(fmt, tiny_tokenizer):
    """A coded model's first parameters are int8 codes; its caches and buffers still take the dtype it computes in
    (``hf.model_dtype``). Before, the engine sized them from the codes and refused the model ("model dtype int8 is
    not supported"), and the server fell back to one request at a time, said only in a log line: four sessions made
    no more tokens a second than one."""
    from kvwire.serve.generator import Batched, decoder_for

    vocab = len(tiny_tokenizer)
    model = weights.convert(with_table(tiny.model("llama", vocab, tiny_tokenizer.eos_token_id),
                                       q8_0_table(vocab, 64, seed=3)), fmt)
    assert next(model.parameters()).dtype == torch.int8  # the codes come first
    assert hf.model_dtype(model) == torch.float32  # the compact formats compute in fp32
    requests = [hf.Request([(5 * i + 3) % vocab for i in range(n)], max_new_tokens=6, eos_ids=frozenset())
                for n in (9, 14, 20)]  # rows at different positions, as a server's sessions are
    engine = hf.Engine(model, max_batch=4)
    results = engine.run(requests)
    assert engine.last_run_batch == 3 and engine.rows_cache.dtype == hf.model_dtype(model)
    if fmt == "int8":  # W8A32: a row's numbers are the same alone or batched, so greedy tokens are too
        for request, result in zip(requests, results):
            alone = hf.generate(model, list(request.input_ids), max_new_tokens=6, eos_ids=frozenset())
            assert result.tokens == alone.tokens
    else:
        assert all(len(result.tokens) == 6 for result in results)
    assert isinstance(decoder_for(model, 4), Batched)
