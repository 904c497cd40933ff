"""``all_ranks`` (F27) on one process: means are sums over counts (not means of means), counts are summed, extremes
kept, and a statistic no rank has an item for gives its ``empty`` value or NaN. The two-rank reduction itself is
tested on real gloo ranks in tests/test_rank_reduced_metrics.py."""

from __future__ import annotations

import math

import pytest

from lightning_opd.metrics.rank_stats import Max, Mean, Min, Sum, all_ranks


def _identity(x):
    return x


def test_values_on_one_process():
    stats = {"a": Mean(3.0, 4.0), "b": Sum(2.0), "c": Max(5.0), "d": Min(-1.5), "e": Mean(0.0, 0.0),
             "f": Mean(0.0, 0.0, empty=0.0), "g": Max(float("-inf")), "h": Min(float("inf"))}
    out = all_ranks(stats, _identity, _identity)
    assert list(out) == list(stats)
    assert out["a"] == 0.75 and out["b"] == 2.0 and out["c"] == 5.0 and out["d"] == -1.5 and out["f"] == 0.0
    assert math.isnan(out["e"]) and math.isnan(out["g"]) and math.isnan(out["h"])
    assert [stats[k].local for k in "abcd"] == [0.75, 2.0, 5.0, -1.5]


def test_one_reduction_per_op_and_none_without_extremes():
    calls = []

    def recording(x):
        calls.append(x.tolist())
        return x

    all_ranks({"a": Mean(1.0, 2.0), "b": Sum(3.0)}, recording, recording)
    assert calls == [[1.0, 2.0, 3.0]]  # totals, counts and sums in one all-reduce; no max all-reduce


def test_unknown_statistic_is_refused():
    with pytest.raises(TypeError, match="'x' is a float; use Mean, Sum, Max or Min"):
        all_ranks({"x": 1.0}, _identity, _identity)
