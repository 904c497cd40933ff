"""benchmarks/run_logs.py: issue 44's validity line for f-OPD in real async (steps at lag >= 1 with an update applied,
skipped and fallback steps, rollouts generated / used) and the per-iteration table (T-DUR's mean weight), on
hand-written TensorBoard logs and on recorded runs (forced lag, real async)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from benchmarks.run_logs import iteration_table, main, run_validity, skipped_steps, validity_report, verdict

ROOT = Path(__file__).resolve().parents[2]
NAN = float("nan")


def _write(run: Path, tags: dict[str, list[float]]) -> None:
    """One value per step (TensorBoard steps 0, 1, ...) of each tag."""
    w = SummaryWriter(str(run / "logs"))
    for tag, values in tags.items():
        for step, v in enumerate(values):
            w.add_scalar(tag, v, step)
    w.close()


# an async f-OPD run of 6 steps: step 3 had no episode with a reply (NaN lag); steps 3 and 4 ran in the fallback
F_OPD = {"rollout/lag_min": [0, 1, 2, NAN, 0, 1], "rollout/lag_mean": [0, 1, 2, NAN, 0, 1.5],
         "rollout/lag_max": [0, 1, 2, NAN, 0, 2], "rollout/producer_lead": [2, 2, 2, 0, 0, 1],
         "staleness/sync_fallback_steps": [0, 0, 0, 1, 2, 2],
         "rollouts/generated_total": [4, 8, 12, 16, 20, 24], "rollouts/used_total": [4, 8, 11, 14, 18, 22]}
# a plain async run (no monitor) of 4 steps, mostly at lag 0
PLAIN = {"rollout/lag_min": [0, 0, 1, 0], "rollout/lag_mean": [0, 0.5, 1, 0], "rollout/lag_max": [0, 1, 1, 0],
         "rollout/producer_lead": [2, 2, 2, 2], "rollouts/generated_total": [4, 8, 12, 16],
         "rollouts/used_total": [4, 8, 12, 16]}


def test_run_validity_by_hand(tmp_path):
    _write(tmp_path / "fopd", F_OPD)
    r = run_validity(tmp_path / "fopd")
    assert (r.steps, r.lag_tag, r.at_lag, r.no_lag) == (6, "rollout/lag_min", 3, 1)  # lag_min 1, 2, 1
    assert r.mean_lag == pytest.approx((0 + 1 + 2 + 0 + 1.5) / 5)  # the NaN step left out
    assert r.mean_lead == pytest.approx(7 / 6) and r.fallback_steps == 2
    assert (r.generated, r.used) == (24, 22) and r.share_at_lag == 0.5
    _write(tmp_path / "plain", PLAIN)
    p = run_validity(tmp_path / "plain")
    assert (p.steps, p.at_lag, p.no_lag, p.fallback_steps, p.generated, p.used) == (4, 1, 0, None, 16, 16)


def test_verdict_needs_half_of_the_steps_at_lag_one(tmp_path):
    _write(tmp_path / "fopd", F_OPD)
    _write(tmp_path / "plain", PLAIN)
    fopd, plain = run_validity(tmp_path / "fopd"), run_validity(tmp_path / "plain")
    assert verdict([fopd]) == ("valid: 3 of 6 steps (50%) at lag >= 1 with an update applied, 0 of 6 skipped (no "
                               "update), 2 of 6 in the synchronous fallback (at least half at lag >= 1)")
    assert verdict([plain]).startswith("NOT valid: 1 of 4 steps (25%) at lag >= 1 with an update applied, 0 of 4 "
                                       "skipped (no update), 0 of 4 in the synchronous fallback")
    assert verdict([fopd, plain]).startswith("NOT valid: 4 of 10 steps (40%)")  # an arm's seeds pooled by step


def test_validity_report_over_an_experiment_folder(tmp_path, capsys):
    for seed in (0, 1):
        _write(tmp_path / "async_fopd" / f"seed{seed}", F_OPD)
    _write(tmp_path / "async_plain" / "seed0", PLAIN)
    text = main(["validity", str(tmp_path), "--arms", "async_plain", "async_fopd"])
    assert "| async_fopd seed1 | 6 | 0 (none logged) | 3 (50%) | 0.90 | 2 | 1.17 | 24 / 22 |" in text
    assert "| async_plain seed0 | 4 | 0 (none logged) | 1 (25%) | 0.38 | - (not logged) | 2.00 | 16 / 16 |" in text
    assert "- async_fopd: valid: 6 of 12 steps (50%)" in text and "- async_plain: NOT valid" in text
    assert capsys.readouterr().out.strip() == text
    with pytest.raises(FileNotFoundError, match="no run with TensorBoard logs"):
        validity_report(tmp_path, ["sync"])


# issue 58 defect 5: a step whose update was skipped trained on nothing, so it is no step "at lag >= 1".
# Counters only (runs before train/applied_updates): the monitor's skipped_steps rises at steps 2 and 4, the
# non-finite counter at step 3, so steps 2, 3, 4 are skipped; of the lag >= 1 steps 1-5 only 1 and 5 applied an update.
COUNTERS = {"rollout/lag_min": [0, 1, 2, 2, 2, 2], "staleness/skipped_steps": [0, 0, 1, 1, 2, 2],
            "train/nonfinite_steps_skipped": [0, 0, 0, 1, 1, 1], "staleness/sync_fallback_steps": [0] * 6,
            "rollouts/generated_total": [4, 8, 12, 16, 20, 24], "rollouts/used_total": [4, 8, 8, 12, 12, 16]}
# train/applied_updates wins where logged: steps 1 and 4 applied nothing (0); the counter, which here says step 2,
# is not read for steps that have the tag. Of the lag >= 1 steps 1-4 only 2 and 3 applied an update.
APPLIED = {"rollout/lag_min": [0, 1, 2, 2, 2], "train/applied_updates": [1, 0, 1, 1, 0],
           "staleness/skipped_steps": [0, 0, 1, 1, 1], "rollouts/generated_total": [4, 8, 12, 16, 20]}


def test_skipped_updates_are_not_steps_at_lag(tmp_path):
    _write(tmp_path / "counters", COUNTERS)
    r = run_validity(tmp_path / "counters")
    assert (r.steps, r.at_lag) == (6, 2)  # 5 counting the skipped steps
    assert (r.skipped, r.skip_source) == (3, "counters")
    _write(tmp_path / "applied", APPLIED)
    a = run_validity(tmp_path / "applied")
    assert (a.steps, a.at_lag) == (5, 2)  # 4 counting the skipped steps
    assert (a.skipped, a.skip_source) == (2, "train/applied_updates")
    # 4 of 11 applied at lag >= 1: below half, so not valid (counting skipped steps would say 9 of 11, valid)
    assert verdict([r, a]) == ("NOT valid: 4 of 11 steps (36%) at lag >= 1 with an update applied, 5 of 11 skipped "
                               "(no update), 0 of 11 in the synchronous fallback: it ran mostly at lag 0, so parity "
                               "with sync says nothing about async")


def test_skipped_steps_mixes_the_tag_and_the_counters_by_step():
    """A run resumed onto code that logs train/applied_updates: steps 0-1 from the counter, 2-3 from the tag."""
    series = {"train/applied_updates": ([2, 3], [0.0, 2.0]), "staleness/skipped_steps": ([0, 1, 2, 3], [0, 1, 1, 1])}
    assert skipped_steps(series, [0, 1, 2, 3]) == ({1, 2}, "train/applied_updates and counters")
    assert skipped_steps({}, [0, 1]) == (set(), "none logged")
    # a counter that starts above 0 rose at its first step (0 before it)
    assert skipped_steps({"train/nonfinite_steps_skipped": ([0, 1], [1.0, 1.0])}, [0, 1]) == ({0}, "counters")


def test_the_recorded_async_runs_count_only_applied_updates():
    """fopd_async (issue 44): async + f-OPD's monitor skipped 7, 3 and 5 steps (staleness/skipped_steps), all at lag
    >= 1, so 10, 16 and 11 of its 20 steps per seed trained at lag >= 1 (37 of 60; 52 of 60 counting skipped steps);
    async plain skipped none (19 of 20 each)."""
    root = ROOT / "benchmarks" / "results" / "fopd_async"
    if not any((root / "async_fopd").rglob("events.out.tfevents.*")):
        pytest.skip("the recorded fopd_async logs are not in this checkout")
    fopd = [run_validity(root / "async_fopd" / f"seed{s}") for s in range(3)]
    assert [r.at_lag for r in fopd] == [10, 16, 11]  # 17, 19, 16 counting the skipped steps
    assert [(r.skipped, r.skip_source) for r in fopd] == [(7, "counters"), (3, "counters"), (5, "counters")]
    plain = [run_validity(root / "async_plain" / f"seed{s}") for s in range(3)]
    assert [(r.skipped, r.at_lag) for r in plain] == [(0, 19)] * 3
    assert verdict(fopd).startswith("valid: 37 of 60 steps (62%) at lag >= 1 with an update applied, 15 of 60 skipped")


def test_a_recorded_forced_lag_run_reads_from_its_older_lag_tag():
    """fopd_lag2's lag2_fopd seed 0 (before rollout/lag_min): forced lag 2 puts step v at lag min(v, 2), so 19 of 20
    steps at lag >= 1; 80 episodes generated, 69 used (its summary.md's 240 / 173 over three seeds)."""
    run = ROOT / "benchmarks" / "results" / "fopd_lag2" / "lag2_fopd" / "seed0"
    if not any(run.rglob("events.out.tfevents.*")):
        pytest.skip("the recorded fopd_lag2 logs are not in this checkout")
    r = run_validity(run)
    assert (r.lag_tag, r.steps, r.at_lag) == ("rollout/lag", 20, 19)
    assert (r.generated, r.used, r.fallback_steps) == (80, 69, None)


def test_iteration_table(tmp_path):
    _write(tmp_path / "atod", {"tdur/mean_weight": [0.25, 0.5, NAN], "schedule/kappa": [1.0, 0.9, 0.8]})
    text = iteration_table(tmp_path / "atod", ["tdur/mean_weight", "schedule/kappa", "schedule/rho"])
    assert text.splitlines() == ["| iteration | tdur/mean_weight | schedule/kappa |", "|---|---|---|",
                                 "| 1 | 0.25 | 1 |", "| 2 | 0.5 | 0.9 |", "| 3 | nan | 0.8 |"]
    with pytest.raises(KeyError, match="none of"):
        iteration_table(tmp_path / "atod", ["grpo/reward_mean"])
