"""SyncFallback: when f-OPD's producer-side control switches to synchronous generation and back (PROPOSED,
docs/algorithms.md §1.5), on hand-made sequences of the step's mean freshness."""

from __future__ import annotations

import math

import pytest

from lightning_opd.callbacks.lag_control import SyncFallback


def test_enters_after_patience_steps_below_the_floor_and_leaves_after_patience_steps_recovered():
    rule = SyncFallback(floor=0.2, recover=0.5, patience=2)
    means = [0.1, 0.3, 0.1, 0.1, 0.9, math.nan, 0.4, 0.6, 0.7, 0.1]
    #        low  reset low  low->on  1  no info reset  1   2->off  low (streak 1)
    active = [rule.update(f) for f in means]
    assert active == [False, False, False, True, True, True, True, True, False, False]
    assert rule.streak == 1


def test_producer_lag_bound_is_zero_while_synchronous():
    rule = SyncFallback(0.2, 0.5, 1)
    assert rule.producer_lag_bound(4) == 4
    rule.update(0.05)
    assert rule.active and rule.producer_lag_bound(4) == 0
    rule.update(None)  # a step without samples: no information
    assert rule.active and rule.producer_lag_bound(4) == 0


def test_state_round_trip():
    rule = SyncFallback(0.2, 0.5, 3)
    for f in (0.1, 0.1, 0.1, 0.6):
        rule.update(f)
    other = SyncFallback(0.2, 0.5, 3)
    other.load_state_dict(rule.state_dict())
    assert other.state_dict() == {"active": True, "streak": 1} == rule.state_dict()
    assert [other.update(f) for f in (0.6, 0.6)] == [True, False]


@pytest.mark.parametrize(("args", "message"), [
    ((-0.1, 0.5, 1), r"init_args.fallback_freshness=-0.1 must be in \[0, 1\]"),
    ((0.3, 0.2, 1), r"init_args.low_freshness=0.2 must be in \[fallback_freshness=0.3, 1\]"),
    ((0.2, 0.5, 0), r"init_args.patience=0 must be >= 1"),
])
def test_refuses_bad_values_by_key(args, message):
    with pytest.raises(ValueError, match=message):
        SyncFallback(*args)
