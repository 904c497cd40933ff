"""benchmarks/run_level_intervals.py: multi-seed verdicts re-derived with intervals that count training runs (issue 58),
on the committed fopd_lag2 evaluations (skipped where they are not in the checkout)."""

from __future__ import annotations

import pytest

from benchmarks.run_level_intervals import RESULTS, Claim, _claims, _row, evaluate_claim

LAG2 = RESULTS / "fopd_lag2" / "lag2_fopd" / "seed0" / "eval" / "step=20.json"


@pytest.mark.skipif(not LAG2.is_file(), reason="the recorded fopd_lag2 evaluations are not in this checkout")
def test_a_gain_from_one_run_in_three_is_not_detected():
    """f-OPD - lag 2 at forced lag 2: +0.32, +0.00, -0.02 per seed. Over tasks with the runs fixed [+0.04, +0.17],
    "better" (the docs' +0.10 [+0.04, +0.17]); with the runs resampled too the interval reaches below 0."""
    claim = Claim("test", "fopd_lag2", (0, 1, 2), "lag2_fopd", "lag2")
    (d,) = evaluate_claim(claim).differences
    assert d.per_run == pytest.approx({0: 0.32, 1: 0.0, 2: -0.02})
    assert d.task_ci == pytest.approx((0.04, 1 / 6))
    assert d.ci[0] < 0 < d.ci[1] and d.verdict == "no difference detected at n = 3 runs x 50 tasks"
    row = _row(claim, evaluate_claim(claim))
    assert row.startswith("| test | fopd_lag2 | lag2_fopd - lag2 | final | success | +0.10 | +0.32, +0.00, -0.02 |")
    assert row.endswith("| [+0.04, +0.17] | better | no difference detected at n = 3 runs x 50 tasks | no difference "
                        "detected at n = 3 runs x 50 tasks |")


def test_every_claim_names_a_known_selection_and_table():
    for c in _claims():
        assert c.selection.partition(":")[0] in ("final", "best", "at", "least_time", "same_step"), c
        assert c.table in ("greedy", "sampled", "teacher_traj_kl") and len(c.seeds) >= 2, c


COLD = RESULTS / "turnopd_cold" / "turnopd" / "seed0" / "eval" / "step=14.json"


@pytest.mark.skipif(not COLD.is_file(), reason="the recorded turnopd_cold evaluations are not in this checkout")
def test_turnopd_at_600_s_needs_the_t_interval_too():
    """TurnOPD - vanilla at 600 s (README's TurnOPD line): +0.46, +0.18, +0.16 per seed. The two-level interval [+0.10,
    +0.48] excludes 0 (it alone said "better"); the t-interval over the three runs, mean 0.267, s = 0.1677, s / sqrt(3)
    = 0.0968, x 4.30265 = 0.4166: [-0.15, +0.68] holds 0, so no difference is detected. At 1200 s (+0.12, +0.14,
    +0.24) both exclude 0: better."""
    at600 = Claim("test", "turnopd_cold", (0, 1, 2), "turnopd", "vanilla", "at:600")
    (d,) = evaluate_claim(at600).differences
    assert d.per_run == pytest.approx({0: 0.46, 1: 0.18, 2: 0.16})
    assert d.ci[0] > 0 and d.t_ci == pytest.approx((0.2667 - 0.4166, 0.2667 + 0.4166), abs=1e-3)
    assert d.verdict == "no difference detected at n = 3 runs x 50 tasks"
    assert _row(at600, evaluate_claim(at600)).endswith(
        "| [-0.15, +0.68] | [+0.18, +0.36] | better | better | no difference detected at n = 3 runs x 50 tasks |")
    (d,) = evaluate_claim(Claim("test", "turnopd_cold", (0, 1, 2), "turnopd", "vanilla", "at:1200")).differences
    assert d.ci[0] > 0 and d.t_ci[0] > 0 and d.verdict == "better"
