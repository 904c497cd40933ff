"""RolloutProducer on scripted timelines: how far ahead it runs, back-pressure, errors, shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_opd.rollout.producer import ProducerError, RolloutProducer
from lightning_opd.rollout.types import Trajectory
from lightning_opd.rollout.weight_sync import SyncConfig

pytestmark = pytest.mark.timeout(60)


class Timeline:
    """A learner whose version the test sets; batches record the learner version when they were made."""

    def __init__(self):
        self.version = 0
        self.made = []

    def make_batch(self):
        self.made.append(self.version)
        t = Trajectory(task_id="t")
        t.turn_versions.append(self.version)
        return [t]


def _wait(cond, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("producer_lead", [1, 2, 4])
def test_async_runs_at_most_producer_lead_versions_ahead(producer_lead):
    tl = Timeline()
    p = RolloutProducer(tl.make_batch, lambda: tl.version, SyncConfig("async", producer_lead), capacity=16, poll_seconds=0.01)
    p.start()
    try:
        # learner at version 0: batches 0..producer_lead may be made (batch i needs version >= i - producer_lead)
        assert _wait(lambda: len(tl.made) == producer_lead + 1)
        time.sleep(0.1)
        assert len(tl.made) == producer_lead + 1 and tl.made == [0] * (producer_lead + 1)
        for v in (1, 2, 3):
            tl.version = v
            p.notify_version()
            assert _wait(lambda: len(tl.made) == producer_lead + 1 + v)
            time.sleep(0.05)
            assert len(tl.made) == producer_lead + 1 + v
        # consumed in order; lag of batch i consumed at version i is i - made_version <= producer_lead
        for i in range(4):
            batch = p.next_batch(timeout=5)
            assert i - batch[0].turn_versions[0] <= producer_lead
    finally:
        p.stop()
    assert not p.running


def test_lag_gate_waits_for_the_last_push_at_or_before_index_minus_producer_lead():
    """producer_lead 1, pushes every 3 versions: batch i needs the push at ``(i - 1) // 3 * 3``, and after a start
    (resume) at version 4 never less than 4 (F18)."""
    p = RolloutProducer(lambda: [], lambda: 0, SyncConfig("async", 1, 3))
    assert [p.required_version(i) for i in range(9)] == [0, 0, 0, 0, 3, 3, 3, 6, 6]
    p.start_version = 4
    assert [p.required_version(i) for i in range(4, 9)] == [4, 4, 4, 6, 6]


@pytest.mark.parametrize("interval", [2, 3, 5])
def test_pushes_rarer_than_the_lag_never_deadlock(interval):
    """The weights move only at multiples of ``interval`` (> producer_lead + 1): the learner at version v still gets
    batch v, sampled by the push at ``(v - 1) // interval * interval`` or a later one."""
    tl = Timeline()
    weights = lambda: tl.version // interval * interval  # noqa: E731 - the last push
    p = RolloutProducer(lambda: [Trajectory(task_id="t", turn_versions=[weights()])], weights,
                        SyncConfig("async", 1, interval), poll_seconds=0.01)
    p.start()
    try:
        for v in range(2 * interval + 2):
            batch = p.next_batch(timeout=5)
            assert max(0, (v - 1) // interval * interval) <= batch[0].turn_versions[0] <= v
            tl.version = v + 1
            p.notify_version()
    finally:
        p.stop()


def test_set_lead_holds_back_and_releases_the_lag_gate():
    """Producer-side control on a scripted timeline (producer_lead 3, pushes every version): the producer runs 3
    versions ahead (batches 0-3 at version 0); lead 0 holds batch 4 until version 4 (synchronous: lag 0), then
    lead 2 lets batches 5 and 6 go at version 4 (batch i needs version i - 2) and holds batch 7."""
    tl = Timeline()
    p = RolloutProducer(tl.make_batch, lambda: tl.version, SyncConfig("async", 3), capacity=16, poll_seconds=0.01)
    p.start()
    try:
        assert _wait(lambda: len(tl.made) == 4)
        p.set_lead_in_use(0)
        for v in (1, 2, 3):
            tl.version = v
            p.notify_version()
            time.sleep(0.05)
        assert tl.made == [0, 0, 0, 0]  # with lead 3 batches 4-6 would have been made at versions 1-3
        tl.version = 4
        p.notify_version()
        assert _wait(lambda: len(tl.made) == 5)
        time.sleep(0.05)
        assert tl.made == [0, 0, 0, 0, 4]
        p.set_lead_in_use(2)  # wakes the thread itself: no version change needed
        assert _wait(lambda: len(tl.made) == 7)
        time.sleep(0.1)
        assert tl.made == [0, 0, 0, 0, 4, 4, 4]
        lags = [i - p.next_batch(timeout=5)[0].turn_versions[0] for i in range(7)]
        assert lags == [0, 1, 2, 3, 0, 1, 2]  # batch i is consumed at version i
    finally:
        p.stop()


@pytest.mark.parametrize("lead", [-1, 4])
def test_set_lead_refuses_a_lead_outside_the_configured_one(lead):
    p = RolloutProducer(lambda: [], lambda: 0, SyncConfig("async", 3))
    with pytest.raises(ValueError, match=rf"producer lead {lead} must be in \[0, data.init_args.producer_lead=3\]"):
        p.set_lead_in_use(lead)


def test_back_pressure_blocks_a_full_buffer():
    tl = Timeline()
    p = RolloutProducer(tl.make_batch, lambda: 10**9, SyncConfig("async", 1), capacity=2, poll_seconds=0.01)
    p.start()
    try:
        assert _wait(lambda: len(p.buffer) == 2)
        time.sleep(0.1)
        assert len(tl.made) == 3  # two buffered, the third made and waiting to be put
        p.next_batch(timeout=5)
        assert _wait(lambda: len(tl.made) == 4)
    finally:
        p.stop()


def test_sync_mode_generates_on_demand():
    tl = Timeline()
    p = RolloutProducer(tl.make_batch, lambda: tl.version, SyncConfig())
    tl.version = 3
    assert p.next_batch()[0].turn_versions == [3] and not p.running


def test_producer_crash_reraises_in_the_learner_with_traceback_within_seconds():
    def boom():
        raise ValueError("engine exploded")

    p = RolloutProducer(boom, lambda: 0, SyncConfig("async", 1), poll_seconds=0.05)
    t0 = time.time()
    with pytest.raises(ProducerError, match="ValueError: engine exploded") as err:
        p.next_batch(timeout=10)
    assert time.time() - t0 < 3
    assert isinstance(err.value.__cause__, ValueError)
    assert "in boom" in str(err.value)  # the producer's traceback is quoted
    p.stop()


def test_stop_does_not_hang_while_the_producer_waits():
    tl = Timeline()
    p = RolloutProducer(tl.make_batch, lambda: 0, SyncConfig("async", 1), capacity=1, poll_seconds=0.05)
    p.start()
    assert _wait(lambda: len(tl.made) == 2)  # buffer full, producer blocked on put
    t0 = time.time()
    p.stop(timeout=5)
    assert time.time() - t0 < 2 and not p.running
    assert threading.active_count() >= 1
