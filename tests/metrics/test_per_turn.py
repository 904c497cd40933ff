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
