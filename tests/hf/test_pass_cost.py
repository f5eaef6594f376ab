"""What a forward pass costs a model here, in tokens prefilled (kvwire.hf.pass_cost): the figure that prices a
splice's extra passes against prefilling the upstream tokens (kvwire.kv.splice.estimate)."""

from __future__ import annotations

import math

import pytest

from kvwire import hf
from kvwire.hf.pass_cost import LONG, SHORT, fit
from kvwire.hf.weights import KERNEL_ROWS
from kvwire.kv.splice import FIXED_TOKENS, Recompute, estimate


def test_a_pass_cost_is_the_line_through_two_prefill_timings():
    # 16 tokens in 0.21 s, 64 in 0.45 s: 5 ms a token, and 0.13 s (26 tokens' worth) whatever the rows
    cost = fit(0.21, 0.45, short=16, long=64)
    assert cost.token_s == pytest.approx(0.005) and cost.fixed_tokens == pytest.approx(26)
    assert fit(0.05, 0.45, short=16, long=64).fixed_tokens == 0.0  # noise put the intercept below zero: no fixed part
    flat = fit(0.3, 0.3, short=16, long=64)  # rows cost nothing (an accelerator's pass): all fixed, yet finite
    assert flat.token_s > 0 and 1e6 < flat.fixed_tokens < math.inf
    with pytest.raises(ValueError, match="0 < short < long"):
        fit(0.1, 0.2, short=64, long=16)
    with pytest.raises(ValueError, match="finite"):
        hf.PassCost(math.nan, 0.01)
    with pytest.raises(ValueError, match="finite"):
        hf.PassCost(10.0, 0.0)
    assert "26 tokens" in cost.describe() and "5.0 ms a token" in cost.describe()
    # by default the line goes through SHORT and LONG tokens, both longer than int8's kernel takes (weights.KERNEL_ROWS)
    assert fit(0.45, 0.77) == fit(0.45, 0.77, short=SHORT, long=LONG) and SHORT > max(KERNEL_ROWS.values())


def test_a_model_s_pass_cost_is_measured_once_and_remembered(tiny_model):
    _, model, _ = tiny_model
    cost = hf.measure_pass_cost(model, repeats=1)
    assert 0 < cost.token_s < 1 and 0 <= cost.fixed_tokens < math.inf
    assert hf.known_pass_cost(model) is cost and hf.measure_pass_cost(model) is cost


def test_a_measured_pass_cost_prices_a_splice_s_extra_passes():
    """Two upstream turns of 70 tokens after a 300-token exact prefix: the prior (a pass worth 100 tokens, fitted
    to the default model in fp32) says prefill them; a model whose pass costs 20 tokens' worth splices them. A
    splice whose recompute shares the turn's own pass (``through``) pays one extra pass (the selection's probe),
    otherwise two."""
    spans, r = [(305, 375), (375, 445)], Recompute(0.15)
    prior = estimate(500, 300, spans, r, 24)
    assert not prior.splice_pays and prior.prefill_tokens == 200
    cheap = hf.PassCost(fixed_tokens=20, token_s=0.006)
    separate = estimate(500, 300, spans, r, 24, cheap)
    through = estimate(500, 300, spans, r, 24, cheap, through=True)
    assert through.splice_pays and separate.splice_pays
    assert separate.splice_tokens - through.splice_tokens == pytest.approx(20)  # the recompute's own pass
    assert prior.splice_tokens - through.splice_tokens == pytest.approx(FIXED_TOKENS - 20)
    # R = 0 selects nothing: no probe, and through the turn's pass there is no extra pass at all
    assert estimate(500, 300, spans, Recompute(0.0), 24, cheap, through=True).splice_tokens == pytest.approx(
        through.splice_tokens - 20 - 4 - 21)  # the probe's pass and its 4 rows, and the 21 recomputed tokens
