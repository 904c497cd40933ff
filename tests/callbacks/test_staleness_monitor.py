"""StalenessMonitor (f-OPD, PROPOSED §1.4): M1 weights, M2 group filter, M3 ratio and adaptive bound,
state, and the lag-0 invariant on a real synchronous fit."""

from __future__ import annotations

import math
from dataclasses import replace

import lightning as L
import pytest
import torch

from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.data import RolloutDataModule
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.losses.divergences import TokenLoss
from lightning_opd.learner import OPDModule
from lightning_opd.rollout.generator import SamplingParams
from tests.helpers import KeywordEnvFactory


class FakeModule:
    def __init__(self, version):
        self.policy_version = version

    def reduce_sum(self, x):
        return x


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
    s = (min(lag / cap, 1.0) + rho / tau) / 3
    return 1 / (1 + math.exp(alpha * (s - beta)))


def test_m1_weights_are_freshness_over_step_mean():
    mon = StalenessMonitor(filtering=False, max_lag=4)
    batch, student = _batch(lags=[0, 2, 8], groups=[0, 1, 2], drift=[0.0, 0.05, 0.2])
    plan = mon.prepare(FakeModule(10), batch, student)
    f = torch.tensor([_fresh(0, 0.0), _fresh(2, 0.05), _fresh(8, 0.2)], dtype=torch.float64)
    expect = f / f.mean()  # equal token counts: token-weighted mean = plain mean
    torch.testing.assert_close(plan.sample_weight.double(), expect, atol=1e-6, rtol=0)
    assert plan.keep is None
    assert mon._last["lag_max"] == 8.0 and mon._last["freshness_min"] == pytest.approx(float(f.min()))


def test_m2_drops_whole_groups_on_lag_or_freshness():
    mon = StalenessMonitor(weighting=False, max_lag=4, min_freshness=0.05)
    # group 0: fine; group 1: one member lag 5 > 4; group 2: one member with drift 1.0 (s = 10/3, f ~ 9e-5)
    batch, student = _batch(lags=[0, 1, 1, 5, 0, 0], groups=[0, 0, 1, 1, 2, 2], drift=[0, 0, 0, 0, 0, 1.0])
    plan = mon.prepare(FakeModule(10), batch, student)
    assert plan.keep.tolist() == [True, True, False, False, False, False]
    assert mon._last["dropped_samples"] == 4.0 and mon._last["dropped_groups"] == 2.0
    assert plan.sample_weight is None


def test_m3_truncated_ratio_per_token():
    mon = StalenessMonitor(weighting=False, filtering=False, truncated_ratio=True)
    batch, _ = _batch(lags=[0, 0], groups=[0, 1], drift=[0, 0])
    lp = torch.full((2, 5), -1.0)
    lp[0, 2] = -1.0 + math.log(3.0)  # ratio 3 -> capped at 2
    lp[1, 3] = -1.0 + math.log(0.5)
    out = TokenLoss(loss=lp, kl=lp, student_logprobs=lp, teacher_logprobs=lp, entropy=lp)
    w = mon.token_weights(None, batch, out)
    assert w[0, 2].item() == pytest.approx(2.0) and w[1, 3].item() == pytest.approx(0.5) and w[0, 4].item() == 1.0
    assert mon._ratio_stats[1] == 1.0 and mon._ratio_stats[2] == 8.0


@pytest.mark.parametrize(("freshness", "bounds"), [
    ([0.4, 0.4, 0.4], [4, 4, 3]),  # three low steps in a row -> one down
    ([0.4, 0.4, 0.6, 0.4, 0.4, 0.4], [4, 4, 4, 4, 4, 3]),  # the streak restarts
    ([0.9, 0.9, 0.9, 0.9, 0.9], [5, 6, 7, 8, 8]),  # up to lag_cap
    ([0.4] * 12, [4, 4, 3, 3, 3, 2, 2, 2, 1, 1, 1, 1]),  # down to 1
])
def test_adaptive_lag_bound_table(freshness, bounds):
    mon = StalenessMonitor(max_lag=4, lag_cap=8)
    seen = []
    for f in freshness:
        mon._last = {"freshness_mean": f}
        mon._update_bound()
        seen.append(mon.max_lag_bound)
    assert seen == bounds


def test_state_roundtrip_and_key():
    mon = StalenessMonitor(max_lag=4)
    mon.max_lag_bound, mon.low_streak = 2, 1
    other = StalenessMonitor(max_lag=4)
    other.load_state_dict(mon.state_dict())
    assert (other.max_lag_bound, other.low_streak) == (2, 1)
    assert mon.state_key == "StalenessMonitor{'lag_cap': 8, 'tau_rho': 0.1, 'tau_chi': 0.1, 'alpha': 4.0, 'beta': 1.0}"


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="max_lag=9"):
        StalenessMonitor(max_lag=9, lag_cap=8)
    with pytest.raises(ValueError, match="tau_rho=0"):
        StalenessMonitor(tau_rho=0)


class Spy(StalenessMonitor):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.history = []

    def prepare(self, module, batch, student_logprobs):
        plan = super().prepare(module, batch, student_logprobs)
        self.history.append((self.last_freshness.clone(), self.last_keep.clone()))
        return plan


@pytest.mark.timeout(300)
def test_lag_zero_invariant_on_a_synchronous_fit(model_dirs):
    """Synchronous rollouts: every freshness >= 0.95 and nothing dropped."""
    spy = Spy()
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=4, max_turns=3, max_new_tokens=4)
    L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, callbacks=[spy]).fit(model, datamodule=dm)
    assert len(spy.history) == 3
    for fresh, keep in spy.history:
        assert fresh.min().item() >= 0.95 and keep.all()
    assert spy.max_lag_bound == 7  # f̄ > 0.8 three times: 4 -> 7
