"""Per-sample, per-turn sums (TurnStats) at every size down to one turn and no rows (F17)."""

from __future__ import annotations

import torch

from lightning_opd.metrics import TurnStats, per_turn_sums


def _stats(kl_sum, num_turns):
    b, h = kl_sum.shape
    return TurnStats(kl_sum=kl_sum, loss_sum=kl_sum.clone(), tokens=torch.ones(b, h, dtype=torch.float64),
                     num_turns=num_turns, success=torch.zeros(b, dtype=torch.bool),
                     is_probe=torch.zeros(b, dtype=torch.bool), rollout_cap=num_turns.clone(),
                     kept=torch.ones(b, dtype=torch.bool))


def test_per_turn_sums_worked_by_hand():
    values = torch.tensor([[1.0, 2.0, 4.0, 8.0], [16.0, 32.0, 64.0, 0.0]])
    turns = torch.tensor([[-1, 0, 1, 2], [0, 0, 1, -1]])
    assert per_turn_sums(values, turns, 2).tolist() == [[2.0, 4.0], [48.0, 64.0]]  # turn 2 beyond H: ignored


def test_one_turn_one_token_one_row():
    """H = 1, a one-token reply, one episode: (1, 1) sums and a (1,) survivor count."""
    sums = per_turn_sums(torch.tensor([[0.0, 0.25]]), torch.tensor([[-1, 0]]), 1)
    assert sums.shape == (1, 1) and sums.tolist() == [[0.25]]
    stats = _stats(sums, torch.tensor([1]))
    assert stats.num_tracked_turns == 1 and stats.survivors().tolist() == [1.0]
    assert stats.tokens.sum(0).shape == (1,)


def test_no_rows():
    """A rank with no rows: (0, H) sums, H survivors all 0, concatenation with other parts works."""
    empty = per_turn_sums(torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.long), 3)
    assert empty.shape == (0, 3)
    stats = _stats(empty, torch.zeros(0, dtype=torch.long))
    assert stats.survivors().tolist() == [0.0, 0.0, 0.0] and stats.tokens.sum(0).tolist() == [0.0, 0.0, 0.0]
    both = TurnStats.cat([stats, _stats(torch.ones(2, 3, dtype=torch.float64), torch.tensor([1, 3]))])
    assert both.survivors().tolist() == [2.0, 1.0, 1.0]
