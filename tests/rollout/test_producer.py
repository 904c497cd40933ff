"""RolloutProducer on scripted timelines: how far ahead it runs, back-pressure, errors, shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_opd.rollout.producer import ProducerError, RolloutProducer
from lightning_opd.rollout.types import Trajectory

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


@pytest.mark.parametrize("max_lag", [1, 2, 4])
def test_async_runs_at_most_max_lag_versions_ahead(max_lag):
    tl = Timeline()
    p = RolloutProducer(tl.make_batch, lambda: tl.version, mode="async", max_lag=max_lag, capacity=16, poll_seconds=0.01)
    p.start()
    try:
        # learner at version 0: batches 0..max_lag may be made (batch i needs version >= i - max_lag)
        assert _wait(lambda: len(tl.made) == max_lag + 1)
        time.sleep(0.1)
        assert len(tl.made) == max_lag + 1 and tl.made == [0] * (max_lag + 1)
        for v in (1, 2, 3):
            tl.version = v
            p.notify_version()
            assert _wait(lambda: len(tl.made) == max_lag + 1 + v)
            time.sleep(0.05)
            assert len(tl.made) == max_lag + 1 + v
        # consumed in order; lag of batch i consumed at version i is i - made_version <= max_lag
        for i in range(4):
            batch = p.next_batch(timeout=5)
            assert i - batch[0].turn_versions[0] <= max_lag
    finally:
        p.stop()
    assert not p.running


def test_back_pressure_blocks_a_full_buffer():
    tl = Timeline()
    p = RolloutProducer(tl.make_batch, lambda: 10**9, mode="async", max_lag=1, capacity=2, poll_seconds=0.01)
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
    p = RolloutProducer(tl.make_batch, lambda: tl.version, mode="sync")
    tl.version = 3
    assert p.next_batch()[0].turn_versions == [3] and not p.running


def test_producer_crash_reraises_in_the_learner_with_traceback_within_seconds():
    def boom():
        raise ValueError("engine exploded")

    p = RolloutProducer(boom, lambda: 0, mode="async", max_lag=1, poll_seconds=0.05)
    t0 = time.time()
    with pytest.raises(ProducerError, match="ValueError: engine exploded") as err:
        p.next_batch(timeout=10)
    assert time.time() - t0 < 3
    assert isinstance(err.value.__cause__, ValueError)
    assert "in boom" in str(err.value)  # the producer's traceback is quoted
    p.stop()


def test_stop_does_not_hang_while_the_producer_waits():
    tl = Timeline()
    p = RolloutProducer(tl.make_batch, lambda: 0, mode="async", max_lag=1, capacity=1, poll_seconds=0.05)
    p.start()
    assert _wait(lambda: len(tl.made) == 2)  # buffer full, producer blocked on put
    t0 = time.time()
    p.stop(timeout=5)
    assert time.time() - t0 < 2 and not p.running
    assert threading.active_count() >= 1


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="mode='fast'"):
        RolloutProducer(lambda: [], lambda: 0, mode="fast")
    with pytest.raises(ValueError, match="max_lag=0"):
        RolloutProducer(lambda: [], lambda: 0, mode="async", max_lag=0)
