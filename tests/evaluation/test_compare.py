"""Paired bootstrap (lightning_opd.evaluation.compare): hand-worked intervals, the documented resampling,
verdict strings, pairing errors and the ``lightning-opd compare`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_opd.cli import main as cli_main
from lightning_opd.evaluation.compare import load_arms, paired_bootstrap, verdict


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
    assert paired_bootstrap({"a": t}).arms[0].ci == pytest.approx((0.0, 0.3), abs=1e-12)
    episode = paired_bootstrap({"a": t}, cluster="episode").arms[0]
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
    res = paired_bootstrap({"a": a, "b": b}, resamples=4, seed=7, level=0.5)
    assert res.arms[0].ci == pytest.approx(tuple(np.quantile(mean_a, [0.25, 0.75])))
    assert res.differences[0].ci == pytest.approx(tuple(np.quantile(diff, [0.25, 0.75])))
    assert res.differences[0].difference == pytest.approx(1 / 6)


def test_same_seed_same_interval_and_pinned_values():
    rng = np.random.default_rng(1)
    a = {(f"t{i}", s): float(rng.random() < 0.3) for i in range(20) for s in range(3)}
    b = {(f"t{i}", s): float(rng.random() < 0.6) for i in range(20) for s in range(3)}
    first = paired_bootstrap({"a": a, "b": b}, seed=3)
    again = paired_bootstrap({"a": a, "b": b}, seed=3)
    assert first.to_dict() == again.to_dict()
    # golden values of this table and generator (numpy's PCG64 stream is stable across versions)
    assert first.differences[0].difference == pytest.approx(PINNED_DIFF)
    assert first.differences[0].ci == pytest.approx(PINNED_CI, abs=1e-12)
    assert first.differences[0].verdict == "better"


PINNED_DIFF = 18 / 60
PINNED_CI = (8 / 60, 28 / 60)  # every resample holds 60 episodes: its statistic is a multiple of 1/60


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


# ----------------------------------------------------------------------------------------- the command
def write_eval(path, name, successes: dict[tuple[str, int], float], turns: float = 3.0):
    records = [{"task_id": t, "seed": s, "success": v, "turns": turns} for (t, s), v in successes.items()]
    sampled = [{**r, "sample": j} for r in records for j in range(2)]
    path.write_text(json.dumps({"config": {}, "students": [{"name": name, "greedy": records, "sampled": sampled}]}))
    return path


def test_compare_command_prints_the_table_and_writes_json(tmp_path, capsys):
    before = {(f"t{i}", 0): 0.0 for i in range(10)}
    after = {k: 1.0 for k in before}
    write_eval(tmp_path / "before.json", "smollm2", before)
    write_eval(tmp_path / "after.json", "student-opd", after)
    cli_main(["compare", f"before={tmp_path / 'before.json'}", str(tmp_path / "after.json"),
              "--json", str(tmp_path / "cmp.json")])
    out = capsys.readouterr().out
    assert "| before | 0.00 | [0.00, 0.00] | 10 (10) |" in out
    assert "| student-opd | 1.00 | [1.00, 1.00] | 10 (10) |" in out
    assert "| student-opd | +1.00 | [+1.00, +1.00] | 10 (10) | better |" in out
    saved = json.loads((tmp_path / "cmp.json").read_text())
    assert saved["differences"][0]["verdict"] == "better" and saved["resamples"] == 10_000


def test_compare_merges_seed_files_into_one_arm(tmp_path):
    for s in range(3):
        write_eval(tmp_path / f"seed{s}.json", "opd", {(f"t{i}", s): float(i < s) for i in range(4)})
    arms = load_arms([f"opd={','.join(str(tmp_path / f'seed{s}.json') for s in range(3))}"])
    assert list(arms) == ["opd"] and len(arms["opd"]) == 12 and arms["opd"][("t1", 2)] == 1.0
    with pytest.raises(ValueError, match="'t0', seed 0 is already in another file"):
        load_arms([f"x={tmp_path / 'seed0.json'},{tmp_path / 'seed0.json'}"])
    with pytest.raises(ValueError, match="used twice"):
        load_arms([str(tmp_path / "seed0.json"), str(tmp_path / "seed1.json")])


def test_sampled_table_averages_the_k_samples(tmp_path):
    path = tmp_path / "e.json"
    records = [{"task_id": "t0", "seed": 0, "sample": j, "success": float(j == 0)} for j in range(4)]
    path.write_text(json.dumps({"students": [{"name": "s", "greedy": [], "sampled": records}]}))
    assert load_arms([str(path)], table="sampled") == {"s": {("t0", 0): 0.25}}


def test_compare_json_is_never_replaced_without_force(tmp_path, capsys):
    keys = {(f"t{i}", 0): 0.0 for i in range(4)}
    write_eval(tmp_path / "a.json", "a", keys)
    (tmp_path / "cmp.json").write_text("kept")
    with pytest.raises(SystemExit) as exc:
        cli_main(["compare", str(tmp_path / "a.json"), "--json", str(tmp_path / "cmp.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--json {tmp_path / 'cmp.json'} exists; pass --force to replace it" in err and "| a |" not in err
    assert (tmp_path / "cmp.json").read_text() == "kept"
    cli_main(["compare", str(tmp_path / "a.json"), "--json", str(tmp_path / "cmp.json"), "--force"])
    assert json.loads((tmp_path / "cmp.json").read_text())["arms"][0]["label"] == "a"
