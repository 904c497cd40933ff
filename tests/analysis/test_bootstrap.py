"""Paired bootstrap (lightning_opd.analysis.bootstrap): hand-worked intervals, the documented resampling (one level
over tasks; two levels over training runs, then tasks, ../shared/docs/algorithms.md §7.3), the t-interval over
runs, verdict strings and pairing errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_opd.analysis.bootstrap import paired_bootstrap, run_verdict, t_interval, verdict


def table(values: dict[str, list[float]]) -> dict[tuple[str, int], float]:
    """``{task: [value of seed 0, seed 1, ...]}`` -> ``{(task, seed): value}``."""
    return {(task, s): v for task, vals in values.items() for s, v in enumerate(vals)}


def test_equal_paired_differences_collapse_the_interval():
    """Every paired difference is +1 turn, so every resample's mean difference is exactly 1: the interval
    is the single number 1, and more turns is worse."""
    base = table({"t0": [2, 4], "t1": [6, 3], "t2": [5, 5], "t3": [1, 8]})
    more = {k: v + 1 for k, v in base.items()}
    res = paired_bootstrap({"a": base, "b": more}, higher_is_better=False, metric="turns")
    (d,) = res.differences
    assert d.difference == 1.0 and d.ci == (1.0, 1.0)
    assert d.verdict == "worse" and d.episodes == 8 and d.tasks == 4
    assert res.arms[0].rate == pytest.approx(34 / 8) and res.arms[1].rate == pytest.approx(42 / 8)
    assert res.arms[0].ci[0] < res.arms[0].rate < res.arms[0].ci[1]  # the arms' own means do vary


def test_one_win_in_ten_tasks_has_the_binomial_interval():
    """One task of ten won: a resample's mean is K/10 with K ~ Binomial(10, 0.1). P(K = 0) = 0.349 > 2.5%,
    so the low end is 0; P(K <= 2) = 0.930 < 97.5% <= P(K <= 3) = 0.987, so the high end is 0.3. With
    10,000 resamples the 97.5% order statistic is 0.3 (the counts below 0.3 and at most 0.3 are ~9298
    and ~9872, each >20 standard deviations from 9750). The difference to an arm that never wins is the
    same distribution, whose interval contains 0."""
    never = table({f"t{i}": [0] for i in range(10)})
    once = {**never, ("t3", 0): 1.0}
    res = paired_bootstrap({"never": never, "once": once})
    assert res.arms[0].ci == (0.0, 0.0)
    assert res.arms[1].rate == pytest.approx(0.1)
    assert res.arms[1].ci == pytest.approx((0.0, 0.3), abs=1e-12)
    (d,) = res.differences
    assert d.difference == pytest.approx(0.1) and d.ci == pytest.approx((0.0, 0.3), abs=1e-12)
    assert d.verdict == "no difference detected at n = 10"


def test_tasks_are_resampled_with_all_their_seeds():
    """Ten tasks x two seeds, one task won on both seeds. Clustered by task the resample mean is still
    K/10, K ~ Bin(10, 0.1): interval [0, 0.3]. Resampling the 20 episodes independently pretends they are
    independent: K/20 with K ~ Bin(20, 0.1), P(K <= 4) = 0.957 < 97.5% <= P(K <= 5) = 0.989: [0, 0.25],
    too narrow."""
    t = table({f"t{i}": [float(i == 3)] * 2 for i in range(10)})
    assert paired_bootstrap({"a": t}, runs="none").arms[0].ci == pytest.approx((0.0, 0.3), abs=1e-12)
    assert paired_bootstrap({"a": t}).arms[0].task_ci == pytest.approx((0.0, 0.3), abs=1e-12)  # seeds as runs
    episode = paired_bootstrap({"a": t}, cluster="episode", runs="none").arms[0]
    assert episode.ci == pytest.approx((0.0, 0.25), abs=1e-12)
    assert episode.episodes == 20 and episode.tasks == 10


def test_fixed_generator_gives_the_documented_resamples():
    """The resamples are ``default_rng(seed).integers(0, C, size=(B, C))`` over sorted tasks; each one's
    statistic is the mean over the episodes of the drawn tasks (all their seeds), worked out here from
    the drawn task counts."""
    a = table({"t0": [1, 1], "t1": [0, 1], "t2": [0, 0]})  # task sums 2, 1, 0 over 2 episodes each
    b = table({"t0": [1, 0], "t1": [1, 1], "t2": [0, 1]})  # task sums 1, 2, 1
    draws = np.random.default_rng(7).integers(0, 3, size=(4, 3))
    sums_a, sums_b = np.array([2.0, 1.0, 0.0]), np.array([1.0, 2.0, 1.0])
    counts = np.stack([np.bincount(row, minlength=3) for row in draws])
    mean_a = counts @ sums_a / (2 * counts.sum(1))
    diff = counts @ (sums_b - sums_a) / (2 * counts.sum(1))
    res = paired_bootstrap({"a": a, "b": b}, resamples=4, seed=7, level=0.5, runs="none")
    assert res.arms[0].ci == pytest.approx(tuple(np.quantile(mean_a, [0.25, 0.75])))
    assert res.differences[0].ci == pytest.approx(tuple(np.quantile(diff, [0.25, 0.75])))
    assert res.differences[0].difference == pytest.approx(1 / 6)
    assert res.differences[0].task_ci == res.differences[0].ci and res.differences[0].t_ci is None
    # the seeds read as training runs: the same one-level interval stays beside the two-level one
    runs = paired_bootstrap({"a": a, "b": b}, resamples=4, seed=7, level=0.5)
    assert runs.differences[0].task_ci == pytest.approx(tuple(np.quantile(diff, [0.25, 0.75])))


def test_same_seed_same_interval_and_pinned_values():
    rng = np.random.default_rng(1)
    a = {(f"t{i}", s): float(rng.random() < 0.3) for i in range(20) for s in range(3)}
    b = {(f"t{i}", s): float(rng.random() < 0.6) for i in range(20) for s in range(3)}
    first = paired_bootstrap({"a": a, "b": b}, seed=3, runs="none")
    again = paired_bootstrap({"a": a, "b": b}, seed=3, runs="none")
    assert first.to_dict() == again.to_dict()
    # golden values of this table and generator (numpy's PCG64 stream is stable across versions)
    assert first.differences[0].difference == pytest.approx(PINNED_DIFF)
    assert first.differences[0].ci == pytest.approx(PINNED_CI, abs=1e-12)
    assert first.differences[0].verdict == "better"


PINNED_DIFF = 18 / 60
PINNED_CI = (8 / 60, 28 / 60)  # every resample holds 60 episodes: its statistic is a multiple of 1/60


# ------------------------------------------------------------------------------ intervals over training runs
def runs_table(per_run: list[list[float]]) -> dict[tuple[str, int], float]:
    """``[[value of task 0, task 1, ...] of run (seed) 0, ... of run 1, ...]`` -> ``{(task, seed): value}``."""
    return {(f"t{i}", r): v for r, vals in enumerate(per_run) for i, v in enumerate(vals)}


def test_runs_that_disagree_widen_the_interval_past_zero():
    """2 runs x 3 tasks. Arm b wins every task in run 0 and none in run 1; the reference wins nothing. Per-run
    differences +1 and 0. Tasks only, runs fixed: every task's two episodes differ by 1 + 0, so every resample of
    tasks has mean 0.5 and the one-level interval is [0.5, 0.5]: "better". Runs, then tasks: a resample draws run 0
    twice (statistic 1, probability 1/4), run 1 twice (0, 1/4) or both (0.5, 1/2), whatever tasks it draws: the
    2.5% and 97.5% points are 0 and 1 (each end holds ~2,500 of 10,000 resamples), so no difference is detected.
    t-interval: mean 0.5, s = sqrt(2) / 2, s / sqrt(2) = 0.5, t_{0.975, 1} = tan(0.475 pi) = 12.706 (df 1: Cauchy),
    so 0.5 -/+ 6.353."""
    ref = runs_table([[0, 0, 0], [0, 0, 0]])
    b = runs_table([[1, 1, 1], [0, 0, 0]])
    res = paired_bootstrap({"ref": ref, "b": b}, runs="seed")
    (d,) = res.differences
    assert d.ci == (0.0, 1.0)  # an interval that ignored the variance between runs would be [0.5, 0.5] here
    assert d.verdict == "no difference detected at n = 2 runs x 3 tasks"
    assert d.task_ci == (0.5, 0.5)  # what the one-level interval says, the runs held fixed
    assert verdict(d.task_ci, 6) == "better"
    assert d.per_run == {0: 1.0, 1: 0.0} and d.runs == 2 and res.runs == [0, 1]
    half = math.tan(0.475 * math.pi) * 0.5
    assert d.t_ci == pytest.approx((0.5 - half, 0.5 + half)) and half == pytest.approx(6.3531, abs=1e-4)
    assert res.arms[1].per_run == {0: 1.0, 1: 0.0} and res.arms[1].ci == (0.0, 1.0)
    assert res.arms[1].task_ci == (0.5, 0.5) and res.arms[1].t_ci == pytest.approx((0.5 - half, 0.5 + half))
    # the same seeds read as episode seeds of one trained policy (the default): the one-level interval decides
    assert paired_bootstrap({"ref": ref, "b": b}, runs="none").differences[0].verdict == "better"
    assert paired_bootstrap({"ref": ref, "b": b}).differences[0].verdict == "better"


def test_t_interval_over_per_run_differences_by_hand():
    """3 runs x 5 tasks; arm b wins 1, 2 and 3 of the 5 tasks in runs 0, 1, 2, the reference none: per-run
    differences 0.2, 0.4, 0.6. Mean 0.4, s = 0.2, s / sqrt(3) = 0.11547; t_{0.975, 2} = 0.95 / sqrt(2 x 0.975 x
    0.025) = 4.30265 (df 2 has a closed form), half-width 0.49683."""
    b = runs_table([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    res = paired_bootstrap({"ref": {k: 0.0 for k in b}, "b": b}, runs="seed")
    (d,) = res.differences
    assert d.per_run == pytest.approx({0: 0.2, 1: 0.4, 2: 0.6}) and d.difference == pytest.approx(0.4)
    t975 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert t975 == pytest.approx(4.30265, abs=1e-5)
    assert d.t_ci == pytest.approx((0.4 - t975 * 0.2 / math.sqrt(3), 0.4 + t975 * 0.2 / math.sqrt(3)))
    assert d.t_ci == pytest.approx((-0.09683, 0.89683), abs=1e-5)
    assert t_interval(np.array([0.2, 0.4, 0.6]), 0.95) == pytest.approx(d.t_ci)
    assert t_interval(np.array([0.3, 0.3]), 0.95) == pytest.approx((0.3, 0.3))  # runs that agree exactly


def test_two_level_resamples_follow_the_documented_draws():
    """The draws of the module docstring, replayed in plain Python: runs_b = integers(0, R, (B, R)), then tasks_b =
    integers(0, T, (B, T)), runs and tasks sorted; a resample holds episode (t, r) (times t drawn) x (times r drawn)
    times. Run 1 lacks task t2 (paired on the shared keys with intersect): a drawn (t2, run 1) holds nothing."""
    a = runs_table([[1, 0, 1], [0, 1, 1]])
    b = runs_table([[1, 1, 1], [1, 1, 0]])
    for t in (a, b):
        del t[("t2", 1)]
    B = 6
    res = paired_bootstrap({"a": a, "b": b}, resamples=B, seed=5, level=0.5, runs="seed")
    rng = np.random.default_rng(5)
    runs_b, tasks_b = rng.integers(0, 2, size=(B, 2)), rng.integers(0, 3, size=(B, 3))
    mean_a, diff = [], []
    for i in range(B):
        drawn = [(f"t{t}", r) for r in runs_b[i] for t in tasks_b[i] if (f"t{t}", r) in a]
        mean_a.append(sum(a[k] for k in drawn) / len(drawn))
        diff.append(sum(b[k] - a[k] for k in drawn) / len(drawn))
    assert res.arms[0].ci == pytest.approx(tuple(np.quantile(mean_a, [0.25, 0.75])))
    assert res.differences[0].ci == pytest.approx(tuple(np.quantile(diff, [0.25, 0.75])))
    assert res.differences[0].per_run == pytest.approx({0: 1 / 3, 1: 1 / 2})
    assert res.arms[0].per_run == pytest.approx({0: 2 / 3, 1: 1 / 2})
    assert res.differences[0].difference == pytest.approx(2 / 5)  # over the 5 paired episodes


def test_tasks_hard_in_every_run_are_drawn_together():
    """2 runs x 4 tasks, both runs alike: b - a is 0, 0, 1, 1 on tasks t0-t3 in each run. The task draw is shared by
    the drawn runs, so a resample's mean difference is K / 4, K ~ Bin(4, 1/2), and K = 0 or 4 each have chance
    1/16 > 2.5%: [0, 1], as wide as the one-level interval (which draws the same tasks with all their seeds).
    Drawing 4 tasks anew in each run would give K / 8, K ~ Bin(8, 1/2), P(K <= 1) = 9/256: [0.125, 0.875],
    "better" from 4 tasks, narrower than with the runs held fixed."""
    a = runs_table([[1, 1, 0, 0]] * 2)
    b = runs_table([[1, 1, 1, 1]] * 2)
    (d,) = paired_bootstrap({"a": a, "b": b}, runs="seed").differences
    assert d.per_run == {0: 0.5, 1: 0.5} and d.t_ci == (0.5, 0.5)
    assert d.ci == (0.0, 1.0) and d.task_ci == (0.0, 1.0)
    assert d.verdict == "no difference detected at n = 2 runs x 4 tasks"


def test_a_verdict_over_runs_needs_the_t_interval_too():
    """3 runs x 4 tasks (reward). The reference scores 0 everywhere; b scores 0.1 on every task of runs 0 and 1 and 1.0
    on every task of run 2: per-run differences +0.1, +0.1, +1.0, of one sign but spread, and no noise between tasks.
    Two-level: the task draw changes nothing, so a resample's mean difference is 0.1 + 0.9 K / 3, K ~ Bin(3, 1/3) the
    times run 2 is drawn. P(K = 0) = 8/27 = 0.296 > 2.5%: the low end is 0.1; P(K <= 2) = 26/27 = 0.963 < 97.5%: the
    high end is 1.0 (K = 3 holds ~370 of the 10,000 resamples, the top 250 sit in it). [0.1, 1.0] excludes 0, and the
    two-level interval alone called it "better". It cannot reach below the smallest run's +0.1, and it spreads the
    runs by their plug-in variance (2/3 of the unbiased one at 3 runs).
    t-interval: mean 0.4, deviations -0.3, -0.3, +0.6, s^2 = 0.54 / 2 = 0.27, s / sqrt(3) = 0.3, t_{0.975, 2} =
    0.95 / sqrt(2 x 0.975 x 0.025) = 4.30265: 0.4 -/+ 1.29080 = [-0.8908, +1.6908], which holds 0: no difference
    detected at n = 3 runs x 4 tasks. Tasks only, runs fixed: every task's mean difference is 0.4: [0.4, 0.4]."""
    ref = runs_table([[0.0] * 4] * 3)
    b = runs_table([[0.1] * 4, [0.1] * 4, [1.0] * 4])
    res = paired_bootstrap({"ref": ref, "b": b}, runs="seed", metric="reward")
    (d,) = res.differences
    assert d.per_run == pytest.approx({0: 0.1, 1: 0.1, 2: 1.0}) and d.difference == pytest.approx(0.4)
    assert d.ci == pytest.approx((0.1, 1.0))  # excludes 0
    assert verdict(d.ci, "3 runs x 4 tasks") == "better"  # what the two-level interval alone said
    t975 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert d.t_ci == pytest.approx((0.4 - t975 * 0.3, 0.4 + t975 * 0.3)) and d.t_ci[0] == pytest.approx(-0.8908, abs=1e-4)
    assert d.task_ci == pytest.approx((0.4, 0.4))
    assert d.verdict == "no difference detected at n = 3 runs x 4 tasks"
    table_md = res.differences_markdown()
    assert ("| b | +0.40 | [+0.10, +1.00] | [-0.89, +1.69] | [+0.40, +0.40] | +0.10 (seed 0), +0.10 (seed 1), +1.00 "
            "(seed 2) | 12 (4) | no difference detected at n = 3 runs x 4 tasks |") in table_md
    assert "| 95% CI (runs, then tasks) | 95% t-interval over runs | 95% CI tasks only, runs fixed |" in table_md
    assert "only when both the two-level CI and the t-interval exclude 0" in res.header()
    # the same spread read as episode seeds of one student: the one-level interval decides alone, as before
    assert paired_bootstrap({"ref": ref, "b": b}, metric="reward").differences[0].verdict == "better"


@pytest.mark.parametrize(("ci", "t_ci", "higher", "expected"), [
    ((0.05, 0.30), (0.01, 0.40), True, "better"), ((0.05, 0.30), (0.01, 0.40), False, "worse"),
    ((-0.30, -0.05), (-0.40, -0.01), True, "worse"), ((-0.30, -0.05), (-0.40, -0.01), False, "better"),
    ((0.05, 0.30), (-0.10, 0.40), True, "no difference detected at n = 3 runs x 50 tasks"),  # t-interval holds 0
    ((-0.05, 0.30), (0.10, 0.10), True, "no difference detected at n = 3 runs x 50 tasks"),  # two-level holds 0
    ((0.05, 0.30), (-0.40, -0.10), True, "no difference detected at n = 3 runs x 50 tasks"),  # opposite sides
])
def test_run_verdict_needs_both_intervals_on_one_side(ci, t_ci, higher, expected):
    assert run_verdict(ci, t_ci, "3 runs x 50 tasks", higher) == expected


@pytest.mark.parametrize(("ci", "higher", "expected"), [
    ((0.05, 0.30), True, "better"), ((-0.30, -0.05), True, "worse"),
    ((0.05, 0.30), False, "worse"), ((-0.30, -0.05), False, "better"),
    ((-0.10, 0.20), True, "no difference detected at n = 150"),
    ((0.0, 0.20), True, "no difference detected at n = 150"),  # 0 is inside a closed interval
    ((0.0, 0.0), True, "no difference detected at n = 150"),
])
def test_verdict_strings(ci, higher, expected):
    assert verdict(ci, 150, higher) == expected


def test_missing_keys_are_named_unless_intersecting():
    a = table({"t0": [1, 0], "t1": [1, 1], "t2": [0, 0]})
    b = {k: v for k, v in a.items() if k != ("t1", 1)}
    with pytest.raises(ValueError, match=r"'b' lacks 1 of the 6 .*t1/seed 1.*--intersect"):
        paired_bootstrap({"a": a, "b": b})
    res = paired_bootstrap({"a": a, "b": b}, intersect=True)
    assert res.arms[0].episodes == 5 and res.arms[0].unpaired == 1
    assert res.notes == ["a: 1 episodes without a pair left out"]


def test_bad_values_and_arguments_are_errors():
    a = table({"t0": [1.0]})
    with pytest.raises(ValueError, match=r"arm 'b': value nan at task 't0', seed 0"):
        paired_bootstrap({"a": a, "b": {("t0", 0): float("nan")}})
    with pytest.raises(ValueError, match="share no"):
        paired_bootstrap({"a": a, "b": {("t1", 0): 1.0}}, intersect=True)
    with pytest.raises(ValueError, match="cluster"):
        paired_bootstrap({"a": a}, cluster="seed")
    with pytest.raises(ValueError, match="level"):
        paired_bootstrap({"a": a}, level=95)
    with pytest.raises(ValueError, match="runs='task'"):
        paired_bootstrap({"a": a}, runs="task")
