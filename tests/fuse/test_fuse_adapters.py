"""Structural adapters (kvwire.fuse.adapters): layer maps, head maps, head_dim projections."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvwire.fuse import adapters

layer_counts = st.integers(min_value=1, max_value=64)


def test_terminal_alignment_pairs_the_last_layers():
    assert adapters.layer_map_terminal(6, 4) == (2, 3, 4, 5)  # S >= T: the sharer's last T layers
    assert adapters.layer_map_terminal(3, 5) == (None, None, 0, 1, 2)  # S < T: the first T - S read nothing
    qwen_to_smollm = adapters.layer_map_terminal(24, 30)
    assert qwen_to_smollm[:6] == (None,) * 6 and qwen_to_smollm[6:] == tuple(range(24))


def test_proportional_alignment_spreads_over_depth():
    assert adapters.layer_map_proportional(6, 4) == (0, 2, 3, 5)
    assert adapters.layer_map_proportional(3, 5) == (0, 0, 1, 2, 2)
    assert adapters.layer_map_proportional(7, 1) == (6,)


@given(layer_counts, layer_counts)
def test_layer_maps_are_monotone_and_end_at_the_last_sharer_layer(S, T):
    for strategy in ("terminal", "proportional"):
        mapped = adapters.layer_map(strategy, S, T)
        assert len(mapped) == T and mapped[-1] == S - 1
        used = [s for s in mapped if s is not None]
        assert used == sorted(used) and all(0 <= s < S for s in used)
    terminal = adapters.layer_map_terminal(S, T)
    assert sum(s is None for s in terminal) == max(0, T - S)
    assert len(set(s for s in terminal if s is not None)) == min(S, T)  # terminal never reads a layer twice


def test_bad_layer_counts_and_strategies_are_refused():
    with pytest.raises(ValueError, match=">= 1"):
        adapters.layer_map_terminal(0, 4)
    with pytest.raises(ValueError, match="unknown layer strategy"):
        adapters.layer_map("diagonal", 4, 4)  # type: ignore[arg-type]


def test_repeat_heads_is_gqa_sharing():
    kv = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(1, 2, 3, 4)  # heads a, b
    out = adapters.repeat_heads(kv, 6)
    assert out.shape == (1, 6, 3, 4)
    for h in range(6):
        assert torch.equal(out[:, h], kv[:, h // 3])  # a, a, a, b, b, b


def test_group_mean_averages_consecutive_heads():
    kv = torch.randn(2, 6, 5, 4)
    out = adapters.group_mean_heads(kv, 2)
    assert torch.allclose(out[:, 0], kv[:, 0:3].mean(dim=1)) and torch.allclose(out[:, 1], kv[:, 3:6].mean(dim=1))


@given(st.integers(1, 4), st.integers(1, 4))
def test_group_mean_undoes_repeat(heads, factor):
    kv = torch.randn(1, heads, 3, 8)
    assert torch.allclose(adapters.group_mean_heads(adapters.repeat_heads(kv, heads * factor), heads), kv)
    assert adapters.match_heads(kv, heads) is kv


def test_head_counts_that_do_not_divide_need_a_projection():
    kv = torch.randn(1, 2, 3, 4)  # Qwen2.5-0.5B has 2 KV heads, SmolLM2-135M has 3
    with pytest.raises(ValueError, match="not a multiple.*projection"):
        adapters.repeat_heads(kv, 3)
    with pytest.raises(ValueError, match="not a multiple.*projection"):
        adapters.group_mean_heads(torch.randn(1, 3, 3, 4), 2)


def test_head_dim_projection_by_a_given_matrix():
    kv = torch.randn(1, 2, 3, 4)
    assert torch.allclose(adapters.project_head_dim(kv, torch.eye(4)), kv)
    keep_two = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    assert torch.equal(adapters.project_head_dim(kv, keep_two), kv[..., :2])
    widen = torch.randn(4, 8)
    assert torch.allclose(adapters.project_head_dim(kv, widen), torch.einsum("bhtd,de->bhte", kv, widen), atol=1e-6)
    with pytest.raises(ValueError, match=r"\[D_in=4, D_out\]"):
        adapters.project_head_dim(kv, torch.eye(3))
