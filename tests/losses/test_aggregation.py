"""The common aggregation (docs/algorithms.md §0.5): F06 and F07 at the function level."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.losses import aggregate_token_loss


def test_value_worked_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    w = torch.tensor([[2.0, 9.0, 1.0], [1.0, 0.5, 1.0]])
    # (1*2 + 3*1 + 5*0.5) / 3 supervised tokens
    assert aggregate_token_loss(loss, mask, mask.sum(), w).item() == pytest.approx(7.5 / 3)
    assert aggregate_token_loss(loss, mask, mask.sum()).item() == pytest.approx(9.0 / 3)


def test_all_masked_micro_batch_is_zero_with_finite_grad():
    """F06: an all-masked micro-batch (NaN in masked positions too) adds exactly 0 and a 0 gradient."""
    x = torch.tensor([[float("nan"), 1.0], [2.0, float("inf")]], requires_grad=True)
    out = aggregate_token_loss(x * 1.0, torch.zeros(2, 2), 0.0)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(x.grad, torch.zeros(2, 2))


def test_split_invariance():
    """F07: summing micro-batch partial losses with the step's token count equals the whole-batch loss."""
    g = torch.Generator().manual_seed(0)
    loss = torch.rand(4, 9, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.4).float()
    mask[2] = 0  # one all-masked row
    total = aggregate_token_loss(loss, mask, mask.sum())
    parts = sum(aggregate_token_loss(loss[i:i + 1], mask[i:i + 1], mask.sum()) for i in range(4))
    torch.testing.assert_close(parts, total)
    per_mb_mean = sum(aggregate_token_loss(loss[i:i + 1], mask[i:i + 1], mask[i].sum()) for i in range(4)) / 4
    assert not torch.allclose(per_mb_mean, total)  # the per-micro-batch mean (the F07 fault) differs


def test_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"loss \(2, 3\), mask \(2, 4\)"):
        aggregate_token_loss(torch.zeros(2, 3), torch.zeros(2, 4), 1.0)
