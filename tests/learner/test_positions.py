"""lightning_opd/learner/positions.py: supervised positions, per-position scores, the micro-batch layout."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.learner.positions import micro_batch_layout, per_position, supervised_positions
from tests.losses.test_freshness import _batch


def test_supervised_positions_are_never_empty():
    batch, _ = _batch(lags=[0, 0], groups=[0, 1], drift=[0.0, 0.0], tokens=2)
    rows, cols = supervised_positions(batch)
    assert rows.tolist() == [0, 0, 1, 1] and cols.tolist() == [1, 2, 1, 2]
    empty = batch.masked_rows(1)
    assert [t.tolist() for t in supervised_positions(empty)] == [[0], [0]]


def test_per_position_puts_scores_back_and_drops_padding():
    batch, _ = _batch(lags=[0, 0], groups=[0, 1], drift=[0.0, 0.0], tokens=2)
    micro = batch.split(1) + [batch.masked_rows(1)]
    out = per_position(batch, micro, 2, lambda mb, rows, cols, temp: cols.float() + 10 * rows.float())
    assert out.tolist() == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]


def test_micro_batch_layout():
    assert micro_batch_layout(None, None) == (1, None)
    assert micro_batch_layout(None, 600) == (None, 600)
    with pytest.raises(ValueError, match="are both set"):
        micro_batch_layout(2, 600)
    with pytest.raises(ValueError, match="micro_batch_size=0 must be >= 1"):
        micro_batch_layout(0, None)
