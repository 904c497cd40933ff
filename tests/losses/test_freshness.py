"""f-OPD diagnostics and freshness (docs/algorithms.md §1.4, PROPOSED) against hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_opd.losses.freshness import freshness_score, staleness_diagnostics, truncated_importance_ratio


def _sample():
    # one sample: turn 0 = 2 tokens, turn 1 = 2 tokens, turn 2 = 1 token; one observation token in between
    d = [0.1, -0.3, 0.0, 0.2, 0.2, -0.5]
    turns = torch.tensor([[0, 0, -1, 1, 1, 2]])
    mask = torch.tensor([[1.0, 1, 0, 1, 1, 1]])
    behaviour = torch.full((1, 6), -1.0)
    student = behaviour + torch.tensor([d])
    student[0, 2] = 5.0  # an observation token: must be ignored
    return student, behaviour, mask, turns


def test_diagnostics_worked_by_hand():
    student, behaviour, mask, turns = _sample()
    diag = staleness_diagnostics(torch.tensor([2]), student, behaviour, mask, turns, lag_cap=8)
    assert diag.delta.item() == pytest.approx(0.25)
    assert diag.rho.item() == pytest.approx(1.3 / 5)  # |0.1|+|0.3|+|0.2|+|0.2|+|0.5|
    # c: turn 0 -> 0; turn 1 -> |0.1-0.3|/2 = 0.1; turn 2 -> |-0.2+0.4|/4 = 0.05; mean over 5 tokens
    assert diag.chi.item() == pytest.approx((2 * 0.0 + 2 * 0.1 + 1 * 0.05) / 5)


def test_score_and_freshness_worked_by_hand():
    student, behaviour, mask, turns = _sample()
    diag = staleness_diagnostics(torch.tensor([2]), student, behaviour, mask, turns, lag_cap=8)
    s, f = freshness_score(diag, tau_rho=0.1, tau_chi=0.1, alpha=4.0, beta=1.0)
    assert s.item() == pytest.approx((0.25 + 2.6 + 0.5) / 3)
    assert f.item() == pytest.approx(1 / (1 + math.exp(4 * (3.35 / 3 - 1))))


def test_synchronous_sample_is_fresh():
    """Lag 0 and identical log-probs: s = 0, f = 1/(1+e^-4) ≈ 0.982 ≥ 0.95 (the lag-0 invariant)."""
    _, behaviour, mask, turns = _sample()
    diag = staleness_diagnostics(torch.tensor([0]), behaviour.clone(), behaviour, mask, turns)
    s, f = freshness_score(diag)
    assert s.item() == 0.0 and f.item() == pytest.approx(1 / (1 + math.exp(-4)))
    assert f.item() >= 0.95


def test_lag_scale_saturates_and_single_turn_has_no_supervision_drift():
    student = torch.tensor([[-1.0, -2.0]])
    behaviour = torch.tensor([[-1.5, -1.0]])
    diag = staleness_diagnostics(torch.tensor([20]), student, behaviour, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long))
    assert diag.delta.item() == 1.0 and diag.chi.item() == 0.0 and diag.rho.item() == pytest.approx(0.75)


def test_truncated_ratio_is_capped_and_detached():
    s = torch.tensor([[0.0, math.log(3.0), math.log(0.5)]], requires_grad=True)
    r = truncated_importance_ratio(s, torch.zeros(1, 3), cap=2.0)
    torch.testing.assert_close(r, torch.tensor([[1.0, 2.0, 0.5]]))
    assert not r.requires_grad
