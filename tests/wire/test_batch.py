"""Batched packets: rows of different lengths, padded, travel as one packet with their
mask; each row's continuation equals that row run alone."""

from __future__ import annotations

import pytest
import torch

from kvwire import PacketError, hf
from kvwire.wire import codec


def padded(rows, side):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, cols], mask[i, cols] = row, 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_each_row_continues_as_if_alone(tiny_model, side):
    arch, model, spec = tiny_model
    g = torch.Generator().manual_seed(0)
    full = [torch.randint(3, 400, (n,), generator=g) for n in (15, 9, 12)]
    ids, mask = padded([row[:-3] for row in full], side)  # the sender's batch, without each row's last 3
    sender = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
              past_key_values=sender, use_cache=True)
    packet = codec.decode(codec.encode(hf.extract(sender, spec, ids, mask=mask)))
    assert packet.batch_size == 3 and int((packet.mask == 0).sum()) == 3 * ids.shape[1] - sum(len(r) - 3 for r in full)
    new = torch.stack([row[-3:] for row in full])
    if arch == "gemma3" and side == "right":  # sliding windows count slots: inner padding is refused
        with pytest.raises(PacketError, match="pad such batches on the left"):
            hf.generate(model, torch.cat([ids, new], 1), cache=hf.build_cache(packet, model, spec),
                        attention_mask=torch.cat([packet.mask.long(), torch.ones(3, 3, dtype=torch.long)], 1))
        return
    out = hf.generate(model, torch.cat([ids, new], 1), cache=hf.build_cache(packet, model, spec),
                      attention_mask=torch.cat([packet.mask.long(), torch.ones(3, 3, dtype=torch.long)], 1),
                      max_new_tokens=8, eos_ids=frozenset())
    for index, row in enumerate(full):
        alone = hf.generate(model, row[None], max_new_tokens=8, eos_ids=frozenset(), use_cache=False)
        assert out.batch_tokens[index] == alone.tokens, (arch, side, index)
        torch.testing.assert_close(out.batch_first_logits[index], alone.first_logits, atol=1e-4, rtol=0)


def test_packet_positions_skip_padding():
    from tests.support.helpers import packet as make

    p = make(tokens=4, batch=2)
    p.mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.uint8)
    p.start = 10
    assert p.positions().tolist() == [[10, 10, 10, 11], [10, 11, 12, 13]]


def test_sliding_models_refuse_inner_padding(tiny_tokenizer):
    from tests.support import tiny

    model = tiny.model("gemma3", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    ids, mask = padded([torch.arange(3, 12), torch.arange(3, 8)], "right")
    with pytest.raises(PacketError, match="pad such batches on the left"):
        hf.generate(model, ids, attention_mask=mask, max_new_tokens=2)


def test_mask_shape_must_match(tiny_model):
    arch, model, spec = tiny_model
    with pytest.raises(PacketError, match="attention_mask must be"):
        hf.generate(model, torch.arange(3, 10)[None], attention_mask=torch.ones(1, 5), max_new_tokens=2)


def test_batch_mismatch_is_refused(tiny_model):
    arch, model, spec = tiny_model
    ids, mask = padded([torch.arange(3, 12), torch.arange(3, 8)], "left")
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    with pytest.raises(PacketError, match="batch of 2 rows, the input 1"):
        hf.generate(model, torch.arange(3, 20)[None], cache=cache, max_new_tokens=2)
