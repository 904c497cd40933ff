"""``AppliedLags`` (lightning_opd/learner/lags.py): lags in applied updates and the on-policy check (§7.2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_opd.learner.lags import AppliedLags, OffPolicyBatchError
from lightning_opd.losses.freshness import NO_LAG


def test_skipped_versions_age_no_batch():
    """Learner at 5, version 4 published by a step without an applied update: behaviour 3, 4, 5, -1 -> 1, 1, 0,
    NO_LAG."""
    lags = AppliedLags()
    lags.skipped_versions = [4]
    batch = SimpleNamespace(behaviour_version=torch.tensor([3, 4, 5, -1]))
    assert lags.sample_lags(5, batch).tolist() == [1, 1, 0, NO_LAG]
    assert lags.check(5, batch, allowed=2, strict=True) == 1


def test_check_refuses_a_batch_beyond_the_allowed_lag():
    batch = SimpleNamespace(behaviour_version=torch.tensor([2, -1]))
    with pytest.raises(OffPolicyBatchError, match="allowed lag 0"):
        AppliedLags().check(3, batch, allowed=0, strict=True)
    assert AppliedLags().check(3, batch, allowed=0, strict=False) == 1


def test_record_step_keeps_what_a_lag_can_still_count():
    lags = AppliedLags()
    lags.record_step(1, applied=0, strict=True, max_allowed_lag=2)
    lags.record_step(2, applied=1, strict=True, max_allowed_lag=2)
    assert lags.skipped_versions == [1]
    lags.record_step(3, applied=1, strict=True, max_allowed_lag=2)
    assert lags.skipped_versions == []
