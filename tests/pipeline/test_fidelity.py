"""How an approximate mode's output is compared with a reference: free-running token agreement,
teacher-forced KL, and teacher-forced agreement (the share of positions whose most likely token is
the reference's), which counts one flipped near-tie once instead of every token after it."""

from __future__ import annotations

import torch

from kvwire.evals.fidelity import measure, token_agreement


def test_token_agreement_counts_positions_and_names_the_first_difference():
    assert token_agreement([1, 2, 3, 4], [1, 2, 9, 4, 5]) == (3 / 5, 2)
    assert token_agreement([1, 2], [1, 2]) == (1.0, None)
    assert token_agreement([1, 2], [1, 2, 3]) == (2 / 3, 2)  # a longer answer differs where the other stopped
    assert token_agreement([], []) == (1.0, None)


def test_one_flipped_near_tie_shifts_free_running_agreement_but_counts_once_teacher_forced():
    torch.manual_seed(0)
    reference = torch.randn(10, 50)
    reference_ids = reference.argmax(-1).tolist()
    candidate = reference.clone()
    runner_up = reference[2].topk(2).indices[1]
    candidate[2, runner_up] = reference[2].max() + 0.05  # a near-tie at position 2 flips
    # free running, the flip changes every later token (here: shifted by one)
    shifted = reference_ids[:2] + [int(runner_up)] + reference_ids[2:9]
    fidelity = measure(reference_ids, shifted, reference, candidate)
    assert fidelity.first_divergence == 2 and fidelity.agreement < 0.5
    assert fidelity.forced_agreement == 0.9  # teacher forced: 9 of 10 positions pick the reference's token
    assert 0 < fidelity.kl < 0.1
    same = measure(reference_ids, reference_ids, reference, reference)
    assert same.forced_agreement == 1.0 and abs(same.kl) < 1e-12 and same.to_json()["forced_agreement"] == 1.0
    assert measure(reference_ids, shifted).forced_agreement is None  # no logits: not measured
