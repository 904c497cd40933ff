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


def test_sequence_mean_by_hand():
    """§0.5's option. Rows with per-token losses (4) and (1, 2, 3): token mean (4 + 1 + 2 + 3) / 4 = 2.5;
    sequence mean (4/1 + 6/3) / 2 = 3.0. A row with no supervised token gets weight 0 and is not counted."""
    from lightning_opd.losses.aggregation import sequence_token_weights, supervised_sequences

    loss = torch.tensor([[4.0, 9.0, 9.0], [1.0, 2.0, 3.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    w = sequence_token_weights(mask)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0, 0], [1 / 3, 1 / 3, 1 / 3], [0, 0, 0]]))
    assert int(supervised_sequences(mask)) == 2
    assert aggregate_token_loss(loss, mask, 4).item() == pytest.approx(2.5)
    assert aggregate_token_loss(loss, mask, supervised_sequences(mask), w).item() == pytest.approx(3.0)
    # split into two micro-batches (rows 0 | 1-2): the shares add up to the same sequence mean
    parts = [aggregate_token_loss(loss[r], mask[r], 2, sequence_token_weights(mask[r])) for r in (slice(0, 1), slice(1, 3))]
    assert sum(p.item() for p in parts) == pytest.approx(3.0)
