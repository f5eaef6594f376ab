"""Quantization math: keys per channel, values per token, error within half a step."""

from __future__ import annotations

import pytest
import torch

from kvwire.wire import quant


def kv(B=1, H=2, T=40, D=8, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    if outliers:  # real keys have a few large channels, the reason keys are quantized per channel
        x[..., 1] = x[..., 1] * 20 + 30
    return x


def key_steps(q, group, tokens):
    """The quantization step of every key element, [B, H, T, D]."""
    size = group or max(tokens, 1)
    return q.scale.repeat_interleave(size, dim=2)[:, :, :tokens, :]


def test_the_docstring_examples():
    keys = torch.tensor([[0.0, 5.0], [1.0, 5.0], [3.0, 5.0]]).view(1, 1, 3, 2)
    q = quant.quantize_keys(keys, 8)
    assert q.codes.view(3, 2).T.tolist() == [[0, 85, 255], [0, 0, 0]]
    assert q.minimum.flatten().tolist() == [0.0, 5.0] and q.scale.flatten().tolist()[1] == 1.0
    values = torch.tensor([-1.0, 0.0, 1.0, 2.0]).view(1, 1, 1, 4)
    assert quant.quantize_values(values, 8).codes.flatten().tolist() == [0, 85, 170, 255]
    assert quant.group_count(300, 128) == 3 and quant.group_count(300, None) == 1 and quant.group_count(0, 64) == 0
    assert quant.packed_dim(64, 8) == 64 and quant.packed_dim(64, 4) == 32


@pytest.mark.parametrize("bits, group", [(8, None), (4, None), (4, 16), (8, 7), (4, 64)])
def test_keys_are_within_half_a_step_per_channel(bits, group):
    x = kv(B=2, T=50)
    q = quant.quantize_keys(x, bits, group)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (2, 2, 50, quant.packed_dim(8, bits))
    assert q.scale.shape == quant.key_stats_shape(2, 2, 50, 8, group) and q.scale.dtype == torch.float32
    y = quant.dequantize_keys(q, bits, group, 50)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert bool(((x - y).abs() <= key_steps(q, group, 50) / 2 * (1 + 1e-5) + 1e-6).all())
    # per channel: the outlier channel gets its own (large) step; the others stay fine
    steps = q.scale[0, 0, 0]
    assert steps[1] > 5 * steps[0]


@pytest.mark.parametrize("bits", [8, 4])
def test_values_are_within_half_a_step_per_token(bits):
    x = kv(T=33, outliers=False)
    q = quant.quantize_values(x, bits)
    assert q.scale.shape == quant.value_stats_shape(1, 2, 33)
    y = quant.dequantize_values(q, bits)
    assert bool(((x - y).abs() <= q.scale / 2 * (1 + 1e-5) + 1e-6).all())


def test_int8_error_is_small_relative_to_the_range():
    x = kv(T=512, D=64)
    y = quant.dequantize_keys(quant.quantize_keys(x, 8), 8, None, 512)
    span = x.amax(dim=2) - x.amin(dim=2)  # per channel
    assert float(((x - y).abs().amax(dim=2) / span).max()) <= 0.5 / 255 + 1e-6


@pytest.mark.parametrize("tokens", [0, 1, 2, 3, 30])
def test_short_packets_get_their_own_statistics(tokens):
    """A delta packet of a chain is quantized from its own tokens: 0 and 1 token work
    (1 token is exact: max == min), and short links get tighter ranges than the whole."""
    whole = kv(T=200)
    link = whole[:, :, 200 - tokens :, :]
    for bits, group in ((8, None), (4, quant.INT4_KEY_GROUP)):
        q = quant.quantize_keys(link, bits, group)
        assert q.scale.shape[2] == quant.group_count(tokens, group)
        y = quant.dequantize_keys(q, bits, group, tokens)
        assert y.shape == link.shape and bool(torch.isfinite(y).all())
        if tokens == 1:
            assert torch.equal(y, link)
        if tokens >= 2:  # (one token stores scale 1.0 as a placeholder: every code is 0)
            assert bool((q.scale <= quant.quantize_keys(whole, bits, None).scale + 1e-7).all())
        v = quant.quantize_values(link, bits)
        assert quant.dequantize_values(v, bits).shape == link.shape


def test_constant_channels_and_tokens_are_exact():
    x = torch.full((1, 1, 5, 4), 2.5)
    for bits in (8, 4):
        assert torch.equal(quant.dequantize_keys(quant.quantize_keys(x, bits), bits, None, 5), x)
        assert torch.equal(quant.dequantize_values(quant.quantize_values(x, bits), bits), x)


def test_four_bit_codes_pack_two_per_byte():
    codes = torch.arange(16, dtype=torch.uint8).view(1, 1, 2, 8)
    packed = quant._pack(codes, 4)
    assert packed.shape == (1, 1, 2, 4) and packed[0, 0, 0, 0] == 0 | (1 << 4)
    assert torch.equal(quant._unpack(packed, 4), codes)
    with pytest.raises(ValueError, match="odd"):
        quant._pack(torch.zeros(1, 1, 1, 3, dtype=torch.uint8), 4)


def test_non_finite_input_is_refused():
    x = kv()
    x[0, 0, 3, 2] = float("inf")
    with pytest.raises(ValueError, match="inf or nan"):
        quant.quantize_keys(x, 8)
    x[0, 0, 3, 2] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        quant.quantize_values(x, 8)
    with pytest.raises(ValueError, match="overflows"):
        quant.quantize_keys(torch.tensor([-3e38, 3e38]).view(1, 1, 2, 1), 8)


def test_conversion_math_is_fp32_for_half_inputs():
    x = kv(T=64).to(torch.bfloat16)
    q = quant.quantize_keys(x, 8)
    assert q.scale.dtype == torch.float32
    _, values = quant.decode_layer("int8", 0, quant.encode_layer("int8", 0, x, x), torch.bfloat16, 64)
    assert values.dtype == torch.bfloat16


def test_layer_layouts():
    shape = (1, 3, 10, 64)
    assert quant.layer_layout("fp16", 2, shape) == {"keys.2": (torch.float16, shape),
                                                    "values.2": (torch.float16, shape)}
    layout = quant.layer_layout("int8", 0, shape)
    assert layout["keys.0"] == (torch.uint8, shape)
    assert layout["keys.0.scale"] == layout["keys.0.min"] == (torch.float32, (1, 3, 1, 64))
    assert layout["values.0.scale"] == (torch.float32, (1, 3, 10, 1))
    int4 = quant.layer_layout("int4", 0, (1, 3, 130, 64))
    assert int4["keys.0"] == (torch.uint8, (1, 3, 130, 32))
    assert int4["keys.0.scale"][1] == (1, 3, 5, 64)  # 130 tokens in groups of 32
    with pytest.raises(ValueError, match="even head_dim"):
        quant.layer_layout("int4", 0, (1, 3, 10, 5))
    assert all(len(quant.layer_layout(e, 0, shape)) == quant.tensors_per_layer(e) for e in quant.ENCODINGS)


@pytest.mark.parametrize("encoding, at_least", [("fp16", 2.0), ("bf16", 2.0), ("int8", 3.5), ("int4", 5.5)])
def test_bytes_per_token_of_the_default_model_shape(encoding, at_least):
    """SmolLM2-135M: 3 KV heads x 64 channels per layer; ratio vs fp32 for 512 tokens."""
    shape = (1, 3, 512, 64)
    stored = sum(torch.empty((), dtype=dtype).element_size() * torch.Size(s).numel()
                 for dtype, s in quant.layer_layout(encoding, 0, shape).values())
    assert 2 * 4 * torch.Size(shape).numel() / stored >= at_least
