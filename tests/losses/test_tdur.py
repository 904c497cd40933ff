"""T-DUR turn weights (ATOD Eq. 13-16, docs/algorithms.md §3.3) on hand-worked trajectories, with the
single-turn and equal-values fallbacks."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.losses.tdur import tdur_weights

# per position: turn (-1 = prompt/observation/padding), student log-prob, teacher log-prob
ROWS = [
    # 3 turns: d = [0.2, 0.6, 1.0] -> [0, 0.5, 1]; h = [1.0, 0.5, 3.0] -> [0.2, 0, 1]; w = [0.2, 0.5, 1.0]
    [(-1, 0, 0), (0, -1.0, -1.2), (0, -1.0, -0.8), (-1, 0, 0), (1, -0.5, -1.1), (-1, 0, 0), (2, -2.0, -3.0),
     (2, -4.0, -3.0)],
    # one turn: both normalisations fall back to 0.5 -> w = 1 - 0.5 * 0.5 = 0.75
    [(-1, 0, 0), (0, -0.3, -2.0), (0, -0.1, -0.2), (-1, 0, 0), (-1, 0, 0), (-1, 0, 0), (-1, 0, 0), (-1, 0, 0)],
    # equal disagreement d = [0.5, 0.5] -> 0.5 (fallback); h = [1, 2] -> [0, 1]; w = [0.5, 1.0]; turn 1 has
    # no supervised token and is not a turn of the trajectory
    [(-1, 0, 0), (0, -1.0, -1.5), (-1, 0, 0), (2, -2.0, -1.5), (-1, 0, 0), (-1, 0, 0), (-1, 0, 0), (-1, 0, 0)],
    # nothing supervised (e.g. dropped by a staleness filter)
    [(-1, 0, 0)] * 8,
]
EXPECT_TURN = [[0.2, 0.5, 1.0], [0.75, 0.0, 0.0], [0.5, 0.0, 1.0], [0.0, 0.0, 0.0]]


def _tensors():
    turns = torch.tensor([[p[0] for p in r] for r in ROWS])
    s = torch.tensor([[p[1] for p in r] for r in ROWS], dtype=torch.float64)
    t = torch.tensor([[p[2] for p in r] for r in ROWS], dtype=torch.float64)
    return s, t, (turns >= 0).float(), turns


def test_tdur_by_hand():
    s, t, mask, turns = _tensors()
    out = tdur_weights(s, t, mask, turns)
    torch.testing.assert_close(out.disagreement[0], torch.tensor([0.2, 0.6, 1.0], dtype=torch.float64))
    torch.testing.assert_close(out.uncertainty[0], torch.tensor([1.0, 0.5, 3.0], dtype=torch.float64))
    torch.testing.assert_close(out.turn_weight, torch.tensor(EXPECT_TURN, dtype=torch.float64))
    assert out.present.tolist() == [[True] * 3, [True, False, False], [True, False, True], [False] * 3]
    expect_tok = torch.ones(4, 8, dtype=torch.float64)
    for i, row in enumerate(ROWS):
        for j, (k, _, _) in enumerate(row):
            if k >= 0:
                expect_tok[i, j] = EXPECT_TURN[i][k]
    torch.testing.assert_close(out.token_weight, expect_tok)
    assert out.mean_weight() == pytest.approx((0.2 + 0.5 + 1.0 + 0.75 + 0.5 + 1.0) / 6)
    assert out.mean_weight(torch.tensor([False, True, False, False])) == pytest.approx(0.75)


def test_all_equal_turns_fall_back_to_075_and_weights_stay_in_unit_interval():
    mask = torch.ones(1, 4)
    turns = torch.tensor([[0, 1, 2, 3]])
    same = torch.full((1, 4), -0.7)
    out = tdur_weights(same, same - 0.1, mask, turns)
    torch.testing.assert_close(out.turn_weight, torch.full((1, 4), 0.75, dtype=torch.float64))
    torch.manual_seed(0)
    s, t = -torch.rand(3, 20) * 5, -torch.rand(3, 20) * 5
    rand = tdur_weights(s, t, torch.ones(3, 20), torch.randint(0, 4, (3, 20)))
    assert ((rand.token_weight >= 0) & (rand.token_weight <= 1)).all()
    # soft-OR: w >= max(d~, h~); the max turn of each normalised score gets w = 1
    assert torch.allclose(rand.turn_weight.max(dim=1).values, torch.ones(3, dtype=torch.float64))


def test_range_just_below_eps_uses_the_fallback():
    s = torch.tensor([[-1.0, -1.0 - 5e-9]], dtype=torch.float64)  # h differs by 5e-9 < 1e-8
    out = tdur_weights(s, s.clone(), torch.ones(1, 2), torch.tensor([[0, 1]]))  # d = 0 in both turns
    torch.testing.assert_close(out.turn_weight, torch.full((1, 2), 0.75, dtype=torch.float64))
