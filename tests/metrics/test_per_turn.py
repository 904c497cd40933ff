from __future__ import annotations

import math

import pytest
import torch

from lightning_opd.metrics import PerTurnMean


def test_token_weighted_means_worked_by_hand():
    m = PerTurnMean(num_turns=3)
    m.update(torch.tensor([1.0, 3.0, 10.0, -1.0]), torch.tensor([0, 0, 1, -1]))  # turn -1 ignored
    m.update(torch.tensor([2.0]), torch.tensor([0]), torch.tensor([2.0]))
    out = m.compute()
    assert out["mean"][0].item() == pytest.approx((1 + 3 + 2 * 2) / 4)
    assert out["mean"][1].item() == 10.0 and math.isnan(out["mean"][2].item())
    assert out["weight"].tolist() == [4.0, 1.0, 0.0]


def test_turns_beyond_capacity_are_ignored_and_reset_clears():
    m = PerTurnMean(num_turns=2)
    m.update(torch.tensor([5.0, 7.0]), torch.tensor([1, 2]))
    assert m.compute()["weight"].tolist() == [0.0, 1.0]
    m.reset()
    assert m.compute()["weight"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="num_turns=0"):
        PerTurnMean(0)


def test_one_turn_keeps_its_turn_axis():
    """F17: torchmetrics squeezes one-element results to 0-d; at K = 1 the result is still (1,)."""
    m = PerTurnMean(num_turns=1)
    m.update(torch.tensor([1.0, 2.0, 9.0, 4.0]), torch.tensor([0, 0, 1, -1]), torch.tensor([1.0, 3.0, 1.0, 1.0]))
    out = m.compute()
    assert out["mean"].shape == (1,) and out["weight"].shape == (1,)
    assert out["mean"].tolist() == [(1 * 1 + 2 * 3) / 4] and out["weight"].tolist() == [4.0]
    assert out["weight"].nonzero().max().item() == 0  # what step_logging indexes with


def test_compute_without_update_is_nan_and_silent(recwarn):
    """A rank without rows computes (a collective) without updating: NaN means, 0 weights, no warning."""
    for k in (1, 3):
        out = PerTurnMean(num_turns=k).compute()
        assert out["mean"].shape == (k,) and out["mean"].isnan().all() and out["weight"].tolist() == [0.0] * k
    assert not [w for w in recwarn if "compute" in str(w.message)]


def test_turn_keys_at_one_turn():
    """``kl/turn_00`` is logged when the only tracked turn is reached, and kept once reached."""
    from lightning_opd.learner.step_metrics import StepMetrics

    logging = StepMetrics(max_logged_turns=1)
    assert logging._turn_keys(torch.tensor([False])) == 0
    assert logging._turn_keys(torch.tensor([True])) == 1
    assert logging._turn_keys(torch.tensor([False])) == 1
