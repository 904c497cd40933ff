"""f-OPD diagnostics and freshness (docs/algorithms.md §1.4, PROPOSED) against hand-worked values."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from lightning_opd.losses.freshness import (NO_LAG, FreshnessConfig, FreshnessWeighting, freshness_score,
                                            staleness_diagnostics)
from lightning_opd.losses.weighting import BatchPlan
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.rollout.generator import SamplingParams


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
    # default balance w = (2, 1/3, 1/3): s = 2 * 0.25 + (2.6 + 0.5) / 3
    s, f = freshness_score(diag, tau_rho=0.1, tau_chi=0.1, alpha=4.0, beta=1.0)
    assert s.item() == pytest.approx(0.5 + 3.1 / 3)
    assert f.item() == pytest.approx(1 / (1 + math.exp(4 * (0.5 + 3.1 / 3 - 1))))
    # §1.4's equal thirds: (0.25 + 2.6 + 0.5) / 3
    s, _ = freshness_score(diag, lag_weight=1 / 3, rho_weight=1 / 3, chi_weight=1 / 3)
    assert s.item() == pytest.approx(3.35 / 3)
    # weights 1, 0.5, 2 and tolerances 0.2, 0.05: 0.25 + 0.5 * 0.26 / 0.2 + 2 * 0.05 / 0.05
    s, _ = freshness_score(diag, tau_rho=0.2, tau_chi=0.05, lag_weight=1.0, rho_weight=0.5, chi_weight=2.0)
    assert s.item() == pytest.approx(0.25 + 0.65 + 2.0)


@pytest.mark.parametrize(("lag", "expect"), [
    (0, 1 / (1 + math.exp(-4))),  # s = 0: 0.982
    (1, 1 / (1 + math.exp(-3))),  # s = 2/8 = 0.25: 0.953
    (4, 0.5),  # half the cap: s = 1 = beta
    (8, 1 / (1 + math.exp(4))),  # the cap: s = 2, f = 0.018 < min_freshness 0.05
])
def test_default_balance_lag_alone(lag, expect):
    """No drift: f = sigmoid(4 - lag) with w_δ = 2 (§1.5); with §1.4's equal thirds lag 8 scored 0.935."""
    diag = staleness_diagnostics(torch.tensor([lag]), torch.full((1, 3), -1.0), torch.full((1, 3), -1.0),
                                 torch.ones(1, 3), torch.zeros(1, 3, dtype=torch.long))
    assert freshness_score(diag)[1].item() == pytest.approx(expect)
    if lag == 8:
        assert expect < 0.05
        old = freshness_score(diag, lag_weight=1 / 3, rho_weight=1 / 3, chi_weight=1 / 3)[1].item()
        assert old == pytest.approx(1 / (1 + math.exp(-8 / 3)))  # 0.935: the "lag barely counts"


def test_age_only_ignores_the_drifts():
    student, behaviour, mask, turns = _sample()  # rho = 0.26, chi = 0.05: large drifts
    diag = staleness_diagnostics(torch.tensor([2]), student, behaviour, mask, turns, lag_cap=8)
    s, f = freshness_score(diag, score="age_only")
    assert s.item() == pytest.approx(0.5) and f.item() == pytest.approx(1 / (1 + math.exp(-2)))  # 0.881
    s, _ = freshness_score(diag, score="age_only", lag_weight=1.0)
    assert s.item() == pytest.approx(0.25)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"score": "drift_only"}, "freshness.score='drift_only': choose one of full, age_only"),
    ({"rho_weight": -0.5}, "freshness.rho_weight=-0.5 must be >= 0"),
    ({"tau_chi": 0.0}, "freshness.tau_chi=0.0 must be > 0"),
    ({"lag_cap": 0}, "freshness.lag_cap=0 must be >= 1"),
    ({"min_freshness": 1.0}, "freshness.min_freshness=1.0 must be in [0, 1)"),
    ({"ratio_cap": 0.0}, "freshness.ratio_cap=0.0 must be > 0"),
])
def test_bad_score_knobs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        FreshnessConfig(**kwargs)


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


# ------------------------------------------------------------------ FreshnessWeighting (M1, M2)
def _batch(lags, groups, drift, version=10, tokens=4):
    """One turn of ``tokens`` sampled tokens per sample; behaviour log-prob = -1, learner = -1 + drift."""
    b = len(lags)
    t = tokens + 2
    mask = torch.zeros(b, t)
    mask[:, 2:] = 1
    turns = torch.where(mask > 0, torch.zeros(b, t, dtype=torch.long), torch.full((b, t), -1))
    batch = RolloutBatch(input_ids=torch.zeros(b, t, dtype=torch.long), attention_mask=torch.ones(b, t, dtype=torch.long),
                         loss_mask=mask, turn_index=turns, behaviour_logprobs=-mask,
                         behaviour_version=torch.tensor([version - lag for lag in lags]),
                         rewards=torch.zeros(b), success=torch.zeros(b), num_turns=torch.ones(b, dtype=torch.long),
                         group_id=torch.tensor(groups), is_probe=torch.zeros(b, dtype=torch.bool),
                         rollout_cap=torch.full((b,), 8), sampling=SamplingParams())
    student = (-1.0 + torch.tensor(drift, dtype=torch.float32)[:, None]).expand(b, t - 1).clone()
    return batch, student


def _fresh(lag, rho, cap=8, tau=0.1, alpha=4.0, beta=1.0):
    s = 2 * min(lag / cap, 1.0) + rho / tau / 3  # the default balance w = (2, 1/3, 1/3), single turn (chi = 0)
    return 1 / (1 + math.exp(alpha * (s - beta)))


def no_reply_batch():
    """Four samples at learner version 5 in GRPO groups [0, 0, 1, 1], lag 1 and no drift, except row 1, which has
    no reply (behaviour version -1, no sampled token); returns ``(batch, student_logprobs)``."""
    batch, student = _batch(lags=[1, 6, 1, 1], groups=[0, 0, 1, 1], drift=[0.0, 0.0, 0.0, 0.0], version=5)
    mask = batch.loss_mask.clone()
    mask[1] = 0
    batch = replace(batch, loss_mask=mask, turn_index=torch.where(mask > 0, batch.turn_index, -1),
                    behaviour_logprobs=-mask)
    assert batch.behaviour_version.tolist() == [4, -1, 4, 4]
    return batch, student


def _plan(weighting, batch, student, version=10):
    """What ``OPDModule.plan_batch`` hands the weighting (target positions; lag NO_LAG for a row without a reply),
    with a one-process reducer."""
    v = batch.behaviour_version
    lag = torch.where(v >= 0, (version - v).clamp(min=0), torch.full_like(v, NO_LAG))
    calls = []

    def reduce_sum(x):
        calls.append(x.shape)
        return x

    plan = weighting.plan(lag, student, batch.behaviour_logprobs[:, 1:], batch.loss_mask[:, 1:], batch.turn_index[:, 1:],
                          batch.group_id, reduce_sum)
    # exactly one all-reduce per batch when measuring (F19: the same on every rank); none otherwise (configuration)
    assert calls == ([(7,)] if student is not None else [])
    return plan


def test_m1_weights_are_freshness_over_step_mean():
    mon = FreshnessWeighting(FreshnessConfig(filtering=False), lag_bound=4)
    batch, student = _batch(lags=[0, 2, 8], groups=[0, 1, 2], drift=[0.0, 0.05, 0.2])
    plan = _plan(mon, batch, student)
    f = torch.tensor([_fresh(0, 0.0), _fresh(2, 0.05), _fresh(8, 0.2)], dtype=torch.float64)
    expect = f / f.mean()  # equal token counts: token-weighted mean = plain mean
    torch.testing.assert_close(plan.sample_weight.double(), expect, atol=1e-6, rtol=0)
    assert plan.keep is None
    assert plan.stats["lag_max"] == 8.0 and plan.stats["freshness_min"] == pytest.approx(float(f.min()))
    assert mon.report().stats == plan.stats and torch.equal(mon.report().keep, torch.ones(3, dtype=torch.bool))


def test_m2_drops_whole_groups_on_lag_or_freshness():
    mon = FreshnessWeighting(FreshnessConfig(weighting=False, min_freshness=0.05), lag_bound=4)
    # group 0: fine; group 1: one member lag 5 > 4; group 2: one member with drift 1.0 (s = 10/3, f ~ 9e-5)
    batch, student = _batch(lags=[0, 1, 1, 5, 0, 0], groups=[0, 0, 1, 1, 2, 2], drift=[0, 0, 0, 0, 0, 1.0])
    plan = _plan(mon, batch, student)
    assert plan.keep.tolist() == [True, True, False, False, False, False]
    assert plan.stats["dropped_samples"] == 4.0 and plan.stats["dropped_groups"] == 2.0
    assert plan.sample_weight is None
    mon.set_lag_bound(5)  # a controller raised the bound: group 1 stays
    assert _plan(mon, batch, student).keep.tolist() == [True, True, True, True, False, False]
    with pytest.raises(ValueError, match=r"lag bound 9 must be in \[1, freshness.lag_cap=8\]"):
        mon.set_lag_bound(9)


def test_bound_input_is_the_mean_over_all_samples_before_filtering():
    """Issue 18: drifts 0 / 0.8 / 0.8 / 0.8 nats at lag 0, three samples dropped. f̄ for the adaptive bound is
    the token-weighted mean over all four samples (equal token counts: the plain mean), not the survivor's."""
    mon = FreshnessWeighting(lag_bound=4)
    batch, student = _batch(lags=[0, 0, 0, 0], groups=[0, 1, 2, 3], drift=[0.0, 0.8, 0.8, 0.8])
    plan = _plan(mon, batch, student)
    fresh, stale = 1 / (1 + math.exp(-4)), 1 / (1 + math.exp(4 * (0.8 / 0.1 / 3 - 1)))  # 0.982, 0.00127
    assert plan.keep.tolist() == [True, False, False, False]
    assert plan.stats["freshness_mean"] == pytest.approx((fresh + 3 * stale) / 4)  # 0.2465
    assert plan.stats["freshness_kept_mean"] == pytest.approx(fresh)  # M1's f̄: the kept sample
    assert plan.stats["kept_tokens"] == 4.0 and plan.stats["would_drop_samples"] == 3.0
    torch.testing.assert_close(plan.sample_weight[0].double(), torch.tensor(1.0, dtype=torch.float64))


def test_measure_only_weighting_decides_nothing_but_reports_what_m2_would_drop():
    mon = FreshnessWeighting(FreshnessConfig(weighting=False, filtering=False), measure=True, lag_bound=4)
    batch, student = _batch(lags=[0, 5, 0, 0], groups=[0, 1, 2, 3], drift=[0.0, 0.0, 0.8, 0.0])
    plan = _plan(mon, batch, student)
    assert plan.keep is None and plan.sample_weight is None
    assert plan.stats["dropped_samples"] == 0.0 and plan.stats["would_drop_samples"] == 2.0
    report = mon.report()
    assert report.keep.all() and report.diagnostics.lag.tolist() == [0.0, 5.0, 0.0, 0.0]
    torch.testing.assert_close(report.diagnostics.rho, torch.tensor([0.0, 0.0, 0.8, 0.0], dtype=torch.float64))
    assert report.score[1].item() == pytest.approx(2 * 5 / 8)


def test_no_kept_token_anywhere_reports_zero_kept_tokens():
    mon = FreshnessWeighting(lag_bound=1)
    batch, student = _batch(lags=[2, 3], groups=[0, 1], drift=[0.0, 0.0])
    plan = _plan(mon, batch, student)
    assert plan.keep.tolist() == [False, False] and plan.stats["kept_tokens"] == 0.0
    assert math.isnan(plan.stats["freshness_kept_mean"])
    # s = 2 * 2/8 = 0.5 and 2 * 3/8 = 0.75: f = sigmoid(2), sigmoid(1); the bound still reads the step's mean
    assert plan.stats["freshness_mean"] == pytest.approx((1 / (1 + math.exp(-2)) + 1 / (1 + math.exp(-1))) / 2)


def test_m2_counts_drops_by_the_lag_bound_apart_from_drops_by_freshness():
    """Issue 39 item 2: bound 1; group 0 = lags 2 and 0 (the lag-2 member fails the bound, its mate goes with it),
    group 1 kept, group 2 = drift 1.0 nats (s = 1.0 / 0.1 / 3, f = 9e-5 < 0.05). By the bound: 1 sample; by
    freshness: 1; the mate: the rest of the 3 dropped. The freshness test alone would have kept group 0's 2 x 4
    tokens."""
    mon = FreshnessWeighting(FreshnessConfig(weighting=False, min_freshness=0.05), lag_bound=1)
    batch, student = _batch(lags=[2, 0, 0, 0], groups=[0, 0, 1, 2], drift=[0.0, 0.0, 0.0, 1.0])
    plan = _plan(mon, batch, student)
    assert plan.keep.tolist() == [False, False, True, False]
    st = plan.stats
    assert (st["dropped_samples"], st["dropped_by_lag_bound"], st["dropped_by_freshness"]) == (3.0, 1.0, 1.0)
    assert st["lag_bound_dropped_tokens"] == 8.0 and st["kept_tokens"] == 4.0
    # every sample over the bound, all fresh (f = sigmoid(4 - 2) = 0.881): the bound alone emptied the step
    batch, student = _batch(lags=[2, 2], groups=[0, 1], drift=[0.0, 0.0])
    st = _plan(mon, batch, student).stats
    assert (st["kept_tokens"], st["lag_bound_dropped_tokens"], st["dropped_by_lag_bound"]) == (0.0, 8.0, 2.0)
    # every sample stale, all within the bound: freshness emptied it, not the bound
    batch, student = _batch(lags=[0, 0], groups=[0, 1], drift=[1.0, 1.0])
    st = _plan(mon, batch, student).stats
    assert (st["kept_tokens"], st["lag_bound_dropped_tokens"], st["dropped_by_freshness"]) == (0.0, 0.0, 2.0)
    # filtering off: nothing dropped, nothing counted (would_drop_samples still says what M2 would do)
    off = FreshnessWeighting(FreshnessConfig(weighting=False, filtering=False), measure=True, lag_bound=1)
    batch, student = _batch(lags=[2, 0], groups=[0, 1], drift=[0.0, 0.0])
    st = _plan(off, batch, student).stats
    assert (st["dropped_by_lag_bound"], st["lag_bound_dropped_tokens"], st["would_drop_samples"]) == (0.0, 0.0, 1.0)


def test_a_sample_without_a_reply_has_no_lag_and_never_decides_its_group():
    """Issue 39 item 4: learner at version 5, bound 4; row 1 has no reply (behaviour version -1, no sampled token)
    and shares GRPO group 0 with row 0. Before: lag 5 - (-1) = 6 > 4 dropped group 0 and counted lag 6 in the
    statistics. Now: every row kept; lag statistics over rows 0, 2, 3 only (lag 1 each: δ = 1/8, s = 2/8,
    f = sigmoid(4 - 1) = 0.9526)."""
    mon = FreshnessWeighting(FreshnessConfig(min_freshness=0.05), lag_bound=4)
    batch, student = no_reply_batch()
    plan = _plan(mon, batch, student, version=5)
    f1 = 1 / (1 + math.exp(-3))
    assert plan.keep.tolist() == [True, True, True, True]
    st = plan.stats
    assert (st["lag_mean"], st["lag_max"], st["delta"]) == (1.0, 1.0, 1 / 8)
    assert st["freshness_min"] == pytest.approx(f1) and st["freshness_mean"] == pytest.approx(f1)
    assert (st["dropped_samples"], st["dropped_groups"], st["would_drop_samples"], st["kept_tokens"]) == (0, 0, 0, 12)
    assert mon.report().diagnostics.lag.tolist() == [1.0, NO_LAG, 1.0, 1.0]  # the per-sample records say "no lag"
    # a threshold above any score's freshness (0.99 > 0.982): rows 0, 2, 3 fail it, row 1 (no score) never does; it
    # goes only with its group
    strict = FreshnessWeighting(FreshnessConfig(min_freshness=0.99), lag_bound=4)
    st = _plan(strict, batch, student, version=5).stats
    assert (st["dropped_by_freshness"], st["dropped_samples"]) == (3.0, 4.0)
