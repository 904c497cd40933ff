"""StalenessMonitor's producer-side control (PROPOSED, docs/algorithms.md §1.5.1): after every step it hands
Δ_max, or 0 during the synchronous fallback, to ``datamodule.set_lag_bound`` (async only), on a hand-made
sequence of the step's mean freshness."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.losses.freshness import FreshnessReport
from lightning_opd.rollout.weight_sync import SyncConfig


class FakeDataModule:
    """Records the lag bounds handed over; the lead is SyncConfig's (producer_lead 3, pushes every version)."""

    def __init__(self, mode: str):
        self.mode, self.max_allowed_lag, self.bounds = mode, 3, []
        self.sync = SyncConfig(mode, 3) if mode == "async" else SyncConfig()

    def set_lag_bound(self, bound: int) -> int:
        self.bounds.append(bound)
        return self.sync.producer_lead_for(bound)


class FakeModule:
    def __init__(self):
        self.logged: dict[str, float] = {}

    def configure_freshness(self, weighting):
        self.freshness = weighting

    def log(self, key, value, batch_size=1):
        self.logged[key] = value


def _run(dm_mode: str, means: list[float], **kw):
    args = dict(initial_lag_bound=4, patience=2, low_freshness=0.5, high_freshness=0.8, fallback_freshness=0.2)
    monitor = StalenessMonitor(**{**args, **kw})
    dm, module = FakeDataModule(dm_mode), FakeModule()
    trainer = SimpleNamespace(datamodule=dm, log_dir=None, global_step=0, global_rank=0, world_size=1)
    monitor.setup(trainer, module, "fit")
    monitor.on_train_start(trainer, module)
    bounds, leads, fallback = [], [], []
    for f in means:
        monitor.on_train_batch_end(trainer, module, {"freshness": FreshnessReport(stats={"freshness_mean": f})}, None, 0)
        bounds.append(monitor.lag_bound)
        leads.append(module.logged.get("staleness/producer_lead"))
        fallback.append(module.logged.get("staleness/sync_fallback"))
    return monitor, dm, bounds, leads, fallback


MEANS = [0.9, 0.1, 0.1, 0.95, 0.95, 0.95, 0.95]


def test_async_bound_caps_the_producer_and_collapse_falls_back_to_synchronous_generation():
    # 0.9: bound 4 -> 5; 0.1 twice (< floor 0.2, patience 2): fallback, producer limit 0, and Δ_max held at
    # max(5, max_allowed_lag 3) = 5 while it lasts, so the buffered batches are weighed, not dropped for their lag
    # (§7.2; before issue 58 it was set to 1); 0.95 twice (>= low_freshness 0.5): back, Δ_max 1 on the step it leaves;
    # then the adaptive rule: 2, 3
    monitor, dm, bounds, leads, fallback = _run("async", MEANS)
    assert dm.bounds == [4, 5, 5, 0, 0, 1, 2, 3]  # the first at train start
    assert bounds == [5, 5, 5, 5, 1, 2, 3]
    assert leads == [3, 3, 0, 0, 1, 2, 3]  # min(producer_lead 3, limit - (1 - 1))
    assert fallback == [0, 0, 1, 1, 0, 0, 0]
    assert monitor.state_dict()["sync_fallback"] == {"active": False, "streak": 0}


def test_sync_and_forced_lag_runs_keep_the_plain_adaptive_rule():
    """No producer to control: nothing handed over, no fallback; the bound moves as before (two low steps
    lower it by one)."""
    _, dm, bounds, leads, fallback = _run("sync", MEANS)
    assert dm.bounds == [] and set(leads) == {None} and set(fallback) == {None}
    assert bounds == [5, 5, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("kw", [dict(producer_control=False), dict(mode="measure")])
def test_switched_off_or_measure_only_changes_nothing(kw):
    _, dm, _, _, _ = _run("async", MEANS, **kw)
    assert dm.bounds == []


def test_fallback_off_still_caps_the_lead():
    _, dm, _, _, fallback = _run("async", MEANS, fallback_freshness=None)
    assert dm.bounds == [4, 5, 5, 4, 5, 6, 7, 8] and set(fallback) == {0.0}


def test_fallback_state_survives_a_checkpoint():
    monitor, _, _, _, _ = _run("async", MEANS[:4])  # in the fallback, one recovered step counted
    state = monitor.state_dict()
    assert state["sync_fallback"] == {"active": True, "streak": 1} and state["lag_bound"] == 5
    other = StalenessMonitor(initial_lag_bound=4, patience=2, fallback_freshness=0.2)
    other.load_state_dict(state)
    assert other.sync_fallback.state_dict() == {"active": True, "streak": 1} and other.lag_bound == 5


def test_entering_the_fallback_weighs_the_buffered_batches_instead_of_dropping_them():
    """§7.2: the batches buffered when the fallback starts (lag 2 and 3 here, producer lead 3) are weighed by their
    freshness (M1) and filtered only by it (M2); a batch at zero drift is kept. Before issue 58 the bound fell to 1
    on entry and M2 dropped all of them for their lag."""
    monitor, dm, _, _, fallback = _run("async", [0.9, 0.1, 0.1])
    assert fallback[-1] == 1 and dm.bounds[-1] == 0  # in the fallback: the producer waits for fresh weights
    lag = torch.tensor([2, 3, 2])
    behaviour = torch.full((3, 4), -1.0)
    learner = behaviour.clone()
    learner[2] += 0.02  # a little drift on the third sample, none on the first two
    plan = monitor.freshness.plan(lag, learner, behaviour, torch.ones(3, 4), torch.zeros(3, 4, dtype=torch.long),
                                  torch.tensor([0, 1, 2]), lambda x: x)
    assert plan.keep.tolist() == [True, True, True] and plan.stats["dropped_samples"] == 0.0
    # M1: f_i / f̄ (equal token counts): the lag-3 sample weighs less than the lag-2 one at zero drift
    w = plan.sample_weight
    assert w[1] < w[0] and w[2] < w[0] and float((w * 4).sum() / 12) == pytest.approx(1.0, rel=1e-6)


def test_steps_run_in_the_fallback_are_counted_and_the_count_survives_a_checkpoint():
    """MEANS: the fallback is on after steps 2 and 3 (fallback == [0, 0, 1, 1, 0, 0, 0]), so the steps that RAN in it
    (it was on when they began) are 3 and 4: sync_fallback_step [0, 0, 0, 1, 1, 0, 0], cumulative
    [0, 0, 0, 1, 2, 2, 2]."""
    monitor = StalenessMonitor(initial_lag_bound=4, patience=2, low_freshness=0.5, high_freshness=0.8,
                               fallback_freshness=0.2)
    dm, module = FakeDataModule("async"), FakeModule()
    trainer = SimpleNamespace(datamodule=dm, log_dir=None, global_step=0, global_rank=0, world_size=1)
    monitor.setup(trainer, module, "fit")
    monitor.on_train_start(trainer, module)
    ran, count = [], []
    for f in MEANS:
        report = FreshnessReport(stats={"freshness_mean": f})
        monitor.on_train_batch_end(trainer, module, {"freshness": report}, None, 0)
        ran.append(module.logged["staleness/sync_fallback_step"])
        count.append(module.logged["staleness/sync_fallback_steps"])
    assert ran == [0, 0, 0, 1, 1, 0, 0] and count == [0, 0, 0, 1, 2, 2, 2]
    other = StalenessMonitor(initial_lag_bound=4, patience=2, fallback_freshness=0.2)
    other.load_state_dict(monitor.state_dict())
    assert other.sync_fallback_steps == 2


def test_no_fallback_no_count():
    """A synchronous run logs no fallback keys; an async one whose fallback is off logs a count that stays 0."""
    monitor, _, _, _, _ = _run("sync", MEANS)
    assert monitor.sync_fallback_steps == 0
    assert not any(k.startswith("staleness/sync_fallback") for k in monitor_logged(monitor, "sync"))
    monitor, _, _, _, _ = _run("async", MEANS, fallback_freshness=None)
    assert monitor.sync_fallback_steps == 0 and monitor_logged(monitor, "async")["staleness/sync_fallback_steps"] == 0


def monitor_logged(monitor, dm_mode: str) -> dict[str, float]:
    """What ``monitor`` logs for one more step (freshness 0.9) in a run of ``dm_mode``."""
    module = FakeModule()
    trainer = SimpleNamespace(datamodule=FakeDataModule(dm_mode), log_dir=None, global_step=0, global_rank=0,
                              world_size=1)
    monitor.on_train_batch_end(trainer, module, {"freshness": FreshnessReport(stats={"freshness_mean": 0.9})}, None, 0)
    return module.logged
