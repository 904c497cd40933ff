"""SyncConfig (the one place the mode / lag keys are checked, naming ``data.init_args`` keys) and WeightSync
(forced-lag copies, async pushes) against a recording generator. The DataModule-level lag gate is tested in
tests/data/test_weight_sync.py."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.rollout.weight_sync import SyncConfig, WeightSync


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(mode="fast"), "data.init_args.mode='fast': use 'sync' or 'async'"),
    (dict(mode="sync", producer_lead=-1), r"data.init_args.producer_lead=-1 must be >= 0"),
    (dict(mode="async", producer_lead=0), r"data.init_args.producer_lead=0 must be >= 1 in async mode"),
    (dict(mode="async", weight_sync_interval=0), r"data.init_args.weight_sync_interval=0 must be >= 1"),
    (dict(mode="async", forced_lag=1), r"data.init_args.forced_lag=1 needs data.init_args.mode=sync"),
    (dict(mode="sync", forced_lag=-1), r"data.init_args.forced_lag=-1 needs"),
])
def test_config_refuses_bad_keys_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyncConfig(**kwargs)


@pytest.mark.parametrize(("kwargs", "lead", "allowed", "manages"), [
    (dict(), 0, 0, False),
    (dict(mode="sync", producer_lead=3), 0, 0, False),  # the lead is unused in sync mode
    (dict(mode="sync", forced_lag=2), 0, 2, True),
    (dict(mode="async", producer_lead=2), 2, 2, True),
    (dict(mode="async", producer_lead=1, weight_sync_interval=3), 1, 3, True),  # lead + interval - 1
])
def test_the_three_quantities(kwargs, lead, allowed, manages):
    cfg = SyncConfig(**kwargs)
    assert (cfg.active_producer_lead, cfg.max_allowed_lag, cfg.manages_weights) == (lead, allowed, manages)


@pytest.mark.parametrize(("kwargs", "leads"), [
    # lead = min(producer_lead, max(0, bound - (interval - 1))) for bounds 0..5
    (dict(mode="async", producer_lead=3), [0, 1, 2, 3, 3, 3]),
    (dict(mode="async", producer_lead=3, weight_sync_interval=2), [0, 0, 1, 2, 3, 3]),
    (dict(mode="async", producer_lead=2, weight_sync_interval=3), [0, 0, 0, 1, 2, 2]),
    (dict(mode="sync", forced_lag=2), [0, 0, 0, 0, 0, 0]),  # the forced lag is the treatment: untouched
])
def test_lead_for_a_lag_bound(kwargs, leads):
    """Producer-side control: the largest lead whose batches stay within the bound, never above producer_lead."""
    cfg = SyncConfig(**kwargs)
    assert [cfg.producer_lead_for(bound) for bound in range(6)] == leads
    for bound, lead in enumerate(leads):  # the lag a batch can reach under that lead is within the bound...
        if cfg.mode == "async" and bound >= cfg.weight_sync_interval - 1:
            assert lead + cfg.weight_sync_interval - 1 <= bound
            assert lead == cfg.producer_lead or lead + cfg.weight_sync_interval - 1 == bound  # ...and the largest


def test_lead_for_refuses_a_negative_bound():
    with pytest.raises(ValueError, match="lag_bound=-1 must be >= 0"):
        SyncConfig("async", 2).producer_lead_for(-1)


class Recorder:
    follow_policy = True

    def __init__(self):
        self.pushed = []

    def push_weights(self, state, version):
        self.pushed.append((version, int(state["w"])))


def _state(v):
    calls = []

    def state():
        calls.append(v)
        return {"w": torch.tensor(v)}
    return state, calls


def test_async_pushes_at_the_first_update_and_every_interval():
    ws, gen, woken = WeightSync(SyncConfig("async", 1, 2)), Recorder(), []
    ws.attach(gen, on_version=lambda: woken.append(1))
    assert gen.follow_policy is False
    gathered = []
    for v in (3, 4, 5, 6):  # a run resumed at version 3: pushed at once, then at multiples of 2
        state, calls = _state(v)
        ws.on_policy_update(v, state)
        gathered += calls
    assert gen.pushed == [(3, 3), (4, 4), (6, 6)] and gathered == [3, 4, 6] and len(woken) == 4
    ws.before_producer_start(6, _state(6)[0], generator_version=6)  # already there: no push
    ws.restore({})
    ws.before_producer_start(6, _state(6)[0], generator_version=6)  # after a restore: still held by the engine
    assert gen.pushed[-1] == (6, 6) and len(gen.pushed) == 3
    ws.before_producer_start(7, _state(7)[0], generator_version=6)
    assert gen.pushed[-1] == (7, 7)


def test_forced_lag_keeps_copies_and_pushes_the_lagged_one():
    ws, gen = WeightSync(SyncConfig("sync", forced_lag=2)), Recorder()
    ws.attach(gen)
    for v in range(5):
        ws.on_policy_update(v, _state(v)[0])
    assert sorted(map(int, ws.snapshots())) == [2, 3, 4] and gen.pushed == []
    ws.before_batch(4)  # learner at 4 samples with version 2
    ws.before_batch(4)  # already pushed: nothing more
    assert gen.pushed == [(2, 2)]
    with pytest.raises(RuntimeError, match=r"no copy of version 5 \(have \[2, 3, 4\]\)"):
        ws.before_batch(7)
    ws.restore(ws.snapshots())
    ws.before_batch(4)  # a restore pushes again, whatever the generator claims
    assert gen.pushed == [(2, 2), (2, 2)]


def test_forced_lag_evaluation_plays_the_current_weights():
    """Learner at 4 with forced lag 2: training batches sample version 2, held-out evaluation version 4 (its
    copy); the next batch pushes 2 again. Without a copy (validate before any update) the live state is pushed."""
    ws, gen = WeightSync(SyncConfig("sync", forced_lag=2)), Recorder()
    ws.attach(gen)
    for v in range(5):
        ws.on_policy_update(v, _state(v)[0])
    ws.before_batch(4)
    live, calls = _state(99)
    ws.before_evaluation(4, live)
    ws.before_evaluation(4, live)  # already held: nothing more
    ws.before_batch(4)
    assert gen.pushed == [(2, 2), (4, 4), (2, 2)] and calls == []
    fresh = WeightSync(SyncConfig("sync", forced_lag=2))
    fresh.attach(gen)
    fresh.before_evaluation(0, live)
    assert gen.pushed[-1] == (0, 99) and calls == [99]
    plain = WeightSync(SyncConfig())
    plain.attach(gen)
    plain.before_evaluation(3, live)  # plain sync follows the live student: no push
    assert len(gen.pushed) == 4


def test_async_evaluation_pushes_the_learners_version():
    """F29: async with a push every 2 versions, the generator holds version 2 while the learner is at 3; held-out
    evaluation pushes the live state as version 3 (once), and the next interval push (4) goes on as before."""
    ws, gen = WeightSync(SyncConfig("async", 1, 2)), Recorder()
    ws.attach(gen)
    for v in range(4):
        ws.on_policy_update(v, _state(v)[0])
    assert gen.pushed == [(0, 0), (2, 2)]
    live, calls = _state(3)
    ws.before_evaluation(3, live)
    ws.before_evaluation(3, live)  # already held: nothing more
    assert gen.pushed == [(0, 0), (2, 2), (3, 3)] and calls == [3] and ws.pushed_version == 3
    ws.on_policy_update(4, _state(4)[0])
    assert gen.pushed[-1] == (4, 4)


def test_plain_sync_never_pushes_or_gathers():
    ws, gen = WeightSync(SyncConfig()), Recorder()
    ws.attach(gen)
    state, calls = _state(1)
    ws.on_policy_update(1, state)
    ws.before_batch(1)
    assert gen.pushed == [] and calls == [] and gen.follow_policy is True


def test_lead_in_use_is_the_weight_syncs_and_the_configured_lead_stays():
    """``producer_lead`` is the configured lead; ``lead_in_use`` the one in force (what the learner logs, async
    only: ``async_lead``)."""
    ws = WeightSync(SyncConfig("async", 3))
    assert (ws.config.producer_lead, ws.lead_in_use, ws.async_lead) == (3, 3, 3)
    assert ws.set_lag_bound(1) == 1 == ws.lead_in_use == ws.async_lead and ws.config.producer_lead == 3
    sync = WeightSync(SyncConfig(forced_lag=1))
    assert sync.set_lag_bound(4) == 0 and sync.async_lead is None


def test_sampler_metrics_are_the_generators_stats():
    ws = WeightSync(SyncConfig())
    assert ws.sampler_metrics() == {}  # nothing attached

    class Served:
        stats = {"requests": 2, "seconds": 0.5}

    ws.attach(Served())
    assert ws.sampler_metrics() == {"sampler/requests": 2.0, "sampler/seconds": 0.5}
