"""The experiment summary (lightning_opd/analysis/curves.py: the selections; summary.py: the tables they share hand-made
points with, so both are tested here): Same-Step and Least-Time selection, time to a
target, final vs best checkpoint and the per-turn KL by outcome, on hand-made checkpoints whose answers are
worked out in the comments."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from lightning_opd.analysis.curves import (Point, best, final, least_time, load_runs, per_turn_kl, same_step,
                                             time_to_target, updates_per_batch)
from lightning_opd.analysis.summary import summarise


def point(arm, seed, iteration, seconds, wins, sampled=None, own_kl=None):
    """A checkpoint of ``arm`` at ``iteration`` (= optimizer step here) won on the tasks flagged in ``wins``."""
    greedy = {(f"t{i}", seed): float(w) for i, w in enumerate(wins)}
    return Point(arm, seed, iteration, iteration, seconds, greedy,
                 None if sampled is None else {(f"t{i}", seed): v for i, v in enumerate(sampled)}, own_kl)


#   run          (iteration, training s, greedy wins on t0..t3)                                    success
RUNS = {
    "vanilla": {0: [point("vanilla", 0, 4, 100, [0, 0, 0, 0]),                                   # 0.00
                    point("vanilla", 0, 8, 200, [1, 0, 0, 0]),                                   # 0.25
                    point("vanilla", 0, 10, 260, [1, 1, 0, 0])],                                 # 0.50 final
                1: [point("vanilla", 1, 4, 110, [0, 0, 0, 0]),                                   # 0.00
                    point("vanilla", 1, 8, 230, [1, 1, 0, 0]),                                   # 0.50
                    point("vanilla", 1, 9, 255, [1, 0, 0, 0])]},                                 # 0.25 final
    "turnopd": {0: [point("turnopd", 0, 4, 60, [1, 0, 0, 0]),                                    # 0.25
                    point("turnopd", 0, 8, 120, [1, 1, 0, 0]),                                   # 0.50
                    point("turnopd", 0, 12, 180, [1, 1, 1, 0]),                                  # 0.75
                    point("turnopd", 0, 16, 240, [1, 1, 1, 1]),                                  # 1.00
                    point("turnopd", 0, 17, 252, [1, 1, 1, 0])],                                 # 0.75 final
                1: [point("turnopd", 1, 4, 70, [0, 0, 0, 0]),                                    # 0.00
                    point("turnopd", 1, 8, 140, [1, 1, 0, 0]),                                   # 0.50
                    point("turnopd", 1, 12, 210, [1, 1, 1, 1]),                                  # 1.00
                    point("turnopd", 1, 15, 262, [1, 1, 1, 1])]},                                # 1.00 final
}


def chosen(selection):
    return {arm: {seed: p.iteration for seed, p in seeds.items()} for arm, seeds in selection.items()}


def test_same_step_is_the_largest_iteration_every_run_has_evaluated():
    s, sel, exact = same_step(RUNS)
    assert (s, exact) == (8, True)  # iterations {4, 8, 10}, {4, 8, 9}, {4, 8, 12, 16, 17}, {4, 8, 12, 15}: common 4, 8
    assert chosen(sel) == {"vanilla": {0: 8, 1: 8}, "turnopd": {0: 8, 1: 8}}


def test_same_step_without_a_common_iteration_falls_back_to_the_smallest_last_one():
    runs = {"a": {0: [point("a", 0, 4, 10, [1]), point("a", 0, 9, 20, [1])]},
            "b": {0: [point("b", 0, 6, 10, [0]), point("b", 0, 12, 20, [1])]}}
    s, sel, exact = same_step(runs)  # no common iteration; last iterations 9 and 12
    assert (s, exact) == (9, False) and chosen(sel) == {"a": {0: 9}, "b": {0: 6}}


def test_least_time_without_and_with_a_budget():
    t, sel = least_time(RUNS)
    assert t == 252  # last seconds 260, 255, 252, 262
    # vanilla's finals (260 s, 255 s) are past 252 s: their iteration-8 checkpoints; turnopd seed 1's 262 s too
    assert chosen(sel) == {"vanilla": {0: 8, 1: 8}, "turnopd": {0: 17, 1: 12}}
    # with the 250 s budget every run used it (finals 252-262 s read as 250 s): the finals are compared
    t, sel = least_time(RUNS, budget=250)
    assert t == 250 and chosen(sel) == {"vanilla": {0: 10, 1: 9}, "turnopd": {0: 17, 1: 15}}


def test_least_time_needs_training_seconds():
    runs = {"a": {0: [Point("a", 0, 2, 2, None, {("t0", 0): 1.0}, path="a/seed0/eval/step=2.json")]}}
    with pytest.raises(ValueError, match=r"a/seed0/eval/step=2.json: no training seconds"):
        least_time(runs)


def test_a_run_without_a_checkpoint_before_the_common_step_is_named():
    runs = {"a": {0: [point("a", 0, 4, 10, [1])]}, "b": {0: [point("b", 0, 2, 5, [0])]}}
    with pytest.raises(ValueError, match="a seed 0 has no evaluated checkpoint at or before iteration 2"):
        same_step(runs)


def test_time_to_target_is_the_first_checkpoint_reaching_it():
    hit = time_to_target(RUNS["turnopd"][0], 0.75)
    assert (hit.iteration, hit.seconds) == (12, 180)
    assert time_to_target(RUNS["turnopd"][1], 0.75).seconds == 210
    assert time_to_target(RUNS["vanilla"][0], 0.75) is None and time_to_target(RUNS["vanilla"][1], 0.75) is None
    assert time_to_target(RUNS["vanilla"][1], 0.5).iteration == 8  # >= target, not > target


def test_final_and_best():
    assert chosen(final(RUNS)) == {"vanilla": {0: 10, 1: 9}, "turnopd": {0: 17, 1: 15}}
    # best = highest greedy success, earliest on ties (turnopd seed 1: 1.00 at 12 and at 15)
    assert chosen(best(RUNS)) == {"vanilla": {0: 10, 1: 8}, "turnopd": {0: 16, 1: 12}}



def test_the_start_is_iteration_zero_but_never_the_best_nor_a_same_step():
    """A starting student better than every trained checkpoint (training made it worse) is the curve's first
    point and meets a target "at the start", but best is chosen among trained checkpoints and Same-Step among
    trained iterations (the shared start compares nothing: here the grids 4, 8 and 6 never meet, so the fallback
    rule gives S = 6, the smallest last iteration)."""
    from dataclasses import replace
    start = point("a", 0, 0, 0.0, [1, 1, 0, 0])                                                # 0.50
    runs = {"a": {0: [replace(start, start=True), point("a", 0, 4, 10, [1, 0, 0, 0]), point("a", 0, 8, 20, [0, 0, 0, 0])]},
            "b": {0: [replace(start, arm="b", start=True), point("b", 0, 6, 15, [1, 0, 0, 0])]}}
    assert chosen(best(runs)) == {"a": {0: 4}, "b": {0: 6}}  # 0.25 each, not the start's 0.50
    assert time_to_target(runs["a"][0], 0.5).start
    s, sel, exact = same_step(runs)
    assert (s, exact) == (6, False) and chosen(sel) == {"a": {0: 4}, "b": {0: 6}}

def test_summary_tables_and_values():
    s = summarise(RUNS, name="toy", budget=250, targets=[0.75], resamples=200)
    # final: vanilla wins t0,t1 (seed 0) + t0 (seed 1) = 3 of 8; turnopd 3 + 4 = 7 of 8
    fin = s.data["final"]["greedy"]
    assert [a["rate"] for a in fin["arms"]] == [0.375, 0.875] and fin["differences"][0]["difference"] == 0.5
    # best: vanilla 2 + 2 = 4 of 8, turnopd 4 + 4 = 8 of 8
    assert [a["rate"] for a in s.data["best"]["greedy"]["arms"]] == [0.5, 1.0]
    # Same-Step at iteration 8 (the last every run has): vanilla 1 + 2 = 3 of 8, turnopd 2 + 2 = 4 of 8
    assert s.data["same_step"]["iteration"] == 8 and s.data["same_step"]["exact"]
    assert [a["rate"] for a in s.data["same_step"]["greedy"]["arms"]] == [0.375, 0.5]
    assert s.data["least_time"]["seconds"] == 250
    assert s.data["time_to_target"]["turnopd"]["0.75"]["0"] == {"seconds": 180, "iteration": 12, "success": 0.75,
                                                                "previous_seconds": 120, "start": False}
    assert s.data["time_to_target"]["vanilla"]["0.75"] == {"0": None, "1": None}
    md = s.markdown
    assert "### Same-Step: iteration 8 (the largest at which every run has an evaluated checkpoint)" in md and "### Least-Time: 250 training s" in md
    assert "| vanilla | 10, 9 | 260, 255 | - | 0.38 [" in md  # the Least-Time row: finals at their true seconds; no counts
    assert "| vanilla | 0.75 | not reached (best 0.50) | not reached (best 0.50) |" in md
    assert "| turnopd | 0.75 | 180 s (iteration 12; below at 120 s) | 210 s (iteration 12; below at 140 s) |" in md
    assert "selected on the same held-out games it is scored on, so it is optimistic" in md
    # the learning curve: turnopd at iteration 12, both seeds: (180 + 210) / 2 s, (3 + 4) / 8 success
    assert "| turnopd | 12 | 195 | 2 | 0.88 | - |" in md
    assert "| turnopd | 16 | 240 | 1 | 1.00 | - |" in md  # seed 0 only


def test_avg_at_k_compares_only_the_arms_that_sampled():
    """An experiment may sample (Avg@k) only some arms' finals: those arms are compared among themselves, the first
    of them the reference; an arm without samples reads "-" and does not hide the others' Avg@k."""
    from lightning_opd.analysis.summary import selection_table
    sel = {"a": {0: point("a", 0, 4, 10, [0, 0, 0, 0])},                                  # no samples
           "b": {0: point("b", 0, 4, 10, [1, 0, 0, 0], sampled=[0.5, 0.25, 0.0, 0.0])},   # Avg@k 0.75 / 4
           "c": {0: point("c", 0, 4, 10, [1, 1, 0, 0], sampled=[1.0, 0.5, 0.25, 0.0])}}   # Avg@k 1.75 / 4
    md, data = selection_table(sel, resamples=200)
    assert [x["label"] for x in data["sampled"]["arms"]] == ["b", "c"]
    assert [x["rate"] for x in data["sampled"]["arms"]] == [0.1875, 0.4375]
    assert data["sampled"]["differences"][0]["difference"] == 0.25  # c - b: (0.5 + 0.25 + 0.25 + 0) / 4
    a_row, b_row, c_row = md.splitlines()[2:]
    assert a_row.endswith("| 0.00 [0.00, 0.00] (n = 4) | reference | - | - |")
    assert "| 0.19 [" in b_row and b_row.endswith("| reference |")
    assert "| 0.44 [" in c_row and "| +0.25 [" in c_row
    assert [x["rate"] for x in data["greedy"]["arms"]] == [0.0, 0.25, 0.5]  # greedy still compares all three


def test_named_contrasts_at_the_final_checkpoints():
    # three one-seed arms on t0..t3; the reference "a" (first arm) is not part of the contrast
    runs = {"a": {0: [point("a", 0, 4, 10, [0, 0, 0, 0])]},
            "b": {0: [point("b", 0, 4, 10, [1, 1, 0, 0])]},
            "c": {0: [point("c", 0, 4, 10, [0, 1, 0, 0])]}}
    s = summarise(runs, contrasts=[["b", "c"]], resamples=10_000)
    # b - c per task = [1, 0, 0, 0]: mean 0.25; a resampled mean is k/4 with k ~ Binomial(4, 1/4):
    # P(k = 0) = 0.316 > 2.5%, so the 2.5th percentile is 0; P(k >= 3) = 0.051 > 2.5% and P(k = 4) = 0.004 < 2.5%,
    # so the 97.5th is 0.75: CI [0, 0.75], half-width 0.375, no difference detected at n = 4
    d = s.data["final"]["contrasts"]["b - c"]
    assert d["difference"] == 0.25 and tuple(d["ci"]) == (0.0, 0.75) and d["half_width"] == 0.375
    assert (d["label"], d["reference"], d["episodes"], d["tasks"]) == ("b", "c", 4, 4)
    assert "| b - c | +0.25 [+0.00, +0.75] | 0.38 | 4 (4) | no difference detected at n = 4 | +0.25 (seed 0) |" \
        in s.markdown and d["per_seed"] == {"0": 0.25}
    # two seeds that disagree: seed 1 has b - c = -0.5 (c wins t2, t3 where b does not), the pooled +0.25 - 0.5 over 8
    runs2 = {arm: {**seeds, 1: [point(arm, 1, 4, 10, w)]} for (arm, seeds), w in
             zip(runs.items(), ([0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 1]))}
    d2 = summarise(runs2, contrasts=[["b", "c"]], resamples=200).data["final"]["contrasts"]["b - c"]
    assert d2["per_seed"] == {"0": 0.25, "1": -0.5} and d2["difference"] == pytest.approx(-0.125)
    with pytest.raises(ValueError, match=r"contrast \['b', 'x'\]: give two different arm names of \['a', 'b', 'c'\]"):
        summarise(runs, contrasts=[["b", "x"]], resamples=100)


def test_per_turn_kl_is_token_weighted_over_seeds():
    nan = None  # a turn without tokens is NaN in evaluate, null once written as JSON
    a = {"won": {"episodes": 1, "per_turn": [0.2, 0.4], "tokens_per_turn": [10, 5]},
         "failed": {"episodes": 2, "per_turn": [1.0], "tokens_per_turn": [4]}}
    b = {"won": {"episodes": 1, "per_turn": [0.5], "tokens_per_turn": [10]},
         "failed": {"episodes": 3, "per_turn": [nan, 2.0], "tokens_per_turn": [0, 6]}}
    kl = per_turn_kl([point("x", 0, 1, 1, [1], own_kl=a), point("x", 1, 1, 1, [1], own_kl=b)])
    # won: turn 0 (0.2*10 + 0.5*10) / 20 = 0.35, turn 1 0.4; mean (2 + 2 + 5) / 25 = 0.36
    assert kl["won"]["per_turn"] == pytest.approx([0.35, 0.4]) and kl["won"]["mean"] == pytest.approx(0.36)
    assert kl["won"]["tokens_per_turn"] == [20, 5] and kl["won"]["episodes"] == 2
    # failed: turn 0 only seed 0's 4 tokens (1.0), turn 1 seed 1's 6 tokens (2.0); mean (4 + 12) / 10 = 1.6
    assert kl["failed"]["per_turn"] == pytest.approx([1.0, 2.0]) and kl["failed"]["mean"] == pytest.approx(1.6)
    assert kl["failed"]["episodes"] == 5
    assert json.loads(summarise({"x": {0: [point("x", 0, 1, 1, [1], own_kl=b)]}}, resamples=20).to_json())[
        "own_traj_kl"]["x"]["won"]["per_turn"] == [0.5]
    assert kl["measured"] == 2
    empty = per_turn_kl([point("x", 0, 1, 1, [1])])
    assert empty["won"]["episodes"] == 0 and math.isnan(empty["won"]["mean"]) and empty["measured"] == 0
    s = summarise({"x": {0: [point("x", 0, 1, 1, [1], own_kl=a)]}, "y": {0: [point("y", 0, 1, 1, [0], own_kl=b)]}},
                  resamples=50)
    assert "| x | 1 of 1 | won | 1 | 0.267 | 0.200 | 0.400 |" in s.markdown  # (2 + 2) / 15
    assert "| y | 1 of 1 | failed | 3 | 2.000 | - | 2.000 |" in s.markdown


def test_per_turn_kl_table_says_which_runs_measured_it():
    """An arm whose finals were evaluated without the own-trajectory KL reads "not measured", not 0 episodes;
    an arm measured in one seed of two says so (the token weights come from that seed only)."""
    a = {"won": {"episodes": 1, "per_turn": [0.2], "tokens_per_turn": [10]},
         "failed": {"episodes": 0, "per_turn": [], "tokens_per_turn": []}}
    runs = {"x": {0: [point("x", 0, 1, 1, [1], own_kl=a)], 1: [point("x", 1, 1, 1, [1])]},
            "y": {0: [point("y", 0, 1, 1, [0])], 1: [point("y", 1, 1, 1, [0])]}}
    md = summarise(runs, resamples=20).markdown
    assert "| x | 1 of 2 | won | 1 | 0.200 | 0.200 |" in md
    assert "| y | 0 of 2 | not measured (evaluated without the own-trajectory KL) | - | - | - |" in md
    assert "| y | 0 of 2 | won" not in md


def write_eval(path, seed, step, wins, seconds, teacher_wins=None, sampled=None, rollouts=None):
    greedy = [{"task_id": f"t{i}", "seed": seed, "success": w} for i, w in enumerate(wins)]
    student = {"name": "arm", "global_step": step, "train_seconds": seconds, "greedy": greedy, "rollouts": rollouts,
               "sampled": None if sampled is None else [{"task_id": f"t{i}", "seed": seed, "success": v, "sample": j}
                                                        for i, vs in enumerate(sampled) for j, v in enumerate(vs)],
               "summary": {}}
    teacher = None if teacher_wins is None else {
        "episodes": [{"task_id": f"t{i}", "seed": seed, "success": w} for i, w in enumerate(teacher_wins)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"students": [student], "teacher": teacher}))


def test_load_runs_reads_iterations_seconds_sampled_and_teacher(tmp_path):
    """ATOD-style runs take 2 optimizer updates per rollout batch (fit_config.yaml), so step 8 is iteration 4."""
    run = tmp_path / "atod" / "seed0"
    run.mkdir(parents=True)
    (run / "fit_config.yaml").write_text(yaml.safe_dump({"model": {"init_args": {"ppo_epochs": 1, "ppo_mini_batches": 2}}}))
    write_eval(run / "eval" / "step=8.json", 0, 8, [1, 0], 40.0, teacher_wins=[1, 1], sampled=[[1, 0], [0, 0]])
    write_eval(run / "eval" / "step=16.json", 0, 16, [1, 1], 80.0, teacher_wins=[1, 1], sampled=[[1, 1], [1, 0]])
    (run / "eval" / "notes.json").write_text("{}")  # not an evaluation: ignored
    runs = load_runs(tmp_path, ["atod", "missing"], [0, 1])
    assert list(runs) == ["atod"] and list(runs["atod"]) == [0]
    p8, p16 = runs["atod"][0]
    assert (p8.step, p8.iteration, p8.seconds, p8.success, p8.avg_at_k) == (8, 4, 40.0, 0.5, 0.25)
    assert p16.teacher == {("t0", 0): 1.0, ("t1", 0): 1.0} and p16.avg_at_k == 0.75
    s = summarise(runs, resamples=50)
    assert "against the teacher's own greedy episodes" in s.markdown
    # final (step 16) wins both tasks like the teacher: difference 0; at step 8 it trails by one task of two
    assert s.data["final"]["teacher"]["atod"]["differences"][0]["difference"] == 0.0
    assert updates_per_batch({"model": {"init_args": {}}}) == 1


def test_summary_needs_a_seed_every_arm_has():
    runs = {"a": {0: [point("a", 0, 1, 1, [1])]}, "b": {1: [point("b", 1, 1, 1, [0])]}}
    with pytest.raises(ValueError, match="no seed is evaluated in every arm"):
        summarise(runs)
    with pytest.raises(ValueError, match="nothing to summarise"):
        summarise({})
    runs["b"][0] = [point("b", 0, 1, 1, [0])]
    assert "Left out (not evaluated in every arm): b seed 1." in summarise(runs, resamples=20).markdown


def test_final_table_sums_rollouts_generated_and_used_over_seeds(tmp_path):
    """f-OPD's filter drops samples: the table shows episodes generated / used up to each final checkpoint,
    summed over seeds (8 + 8 generated, 5 + 7 used), and "-" for an arm whose files carry no counts."""
    for seed, used in ((0, 5), (1, 7)):
        write_eval(tmp_path / "fopd" / f"seed{seed}" / "eval" / "step=2.json", seed, 2, [1, 0], 10.0,
                   rollouts={"generated": 8, "used": used})
        write_eval(tmp_path / "old" / f"seed{seed}" / "eval" / "step=2.json", seed, 2, [0, 0], 10.0)
    s = summarise(load_runs(tmp_path, ["fopd", "old"], [0, 1]), resamples=20)
    assert "| fopd | 2, 2 | 10, 10 | 16 / 12 | 0.50 [" in s.markdown
    assert "| old | 2, 2 | 10, 10 | - | 0.00 [" in s.markdown
    assert s.data["final"]["points"]["fopd"]["1"]["rollouts"] == {"generated": 8, "used": 7}


def test_the_arms_at_each_training_second_mark():
    """Each run's point marked for 600 s and 1200 s (the runner's evaluate_at_seconds), whatever its iteration:
    at 600 s a (step 5, 610 s) wins t0, b (step 12, 604 s) t0-t2: b - a = +0.50 (per task 0, 1, 1, 0); at 1200 s
    a (1205 s) wins t0, t1 and b's final (1100 s: max_steps ended it first) all four: +0.50 again, b flagged."""
    def marked(arm, step, seconds, wins, at):
        return Point(arm, 0, step, step, seconds, {(f"t{i}", 0): float(w) for i, w in enumerate(wins)}, at_seconds=at)

    runs = {"a": {0: [marked("a", 5, 610, [1, 0, 0, 0], {600.0: True}), marked("a", 9, 1205, [1, 1, 0, 0], {1200.0: True})]},
            "b": {0: [marked("b", 12, 604, [1, 1, 1, 0], {600.0: True}),
                      marked("b", 20, 1100, [1, 1, 1, 1], {1200.0: False})]}}
    s = summarise(runs, marks=[600, 1200, 900], contrasts=[["b", "a"]], resamples=200)
    at600, at1200 = s.data["at_seconds"]["600"], s.data["at_seconds"]["1200"]
    assert {arm: p["0"]["step"] for arm, p in at600["points"].items()} == {"a": 5, "b": 12}
    assert at600["contrasts"]["b - a"]["difference"] == 0.5 and at600["not_reached"] == []
    assert at1200["contrasts"]["b - a"]["per_seed"] == {"0": 0.5} and at1200["not_reached"] == ["b seed 0 (1100 s)"]
    assert "900" not in s.data["at_seconds"]
    md = s.markdown
    assert "| b | 12 | 604 | - | 0.75 [" in md.split("### At 600 training s")[1]
    assert "### At 900 training s: not available (a seed 0 has no checkpoint evaluated for the 900 s mark)" in md


def test_two_seeds_are_compared_as_training_runs():
    """RUNS' finals: vanilla wins t0, t1 (seed 0) and t0 (seed 1); turnopd t0-t2 (seed 0) and t0-t3 (seed 1): per-run
    differences +0.25 and +0.75. Over tasks with the runs fixed the per-task mean differences are 0, 0.5, 1, 0.5
    (a resample of 4 is all t0 with chance 1/256 < 2.5%: the CI excludes 0); with the runs resampled too, seed 0
    drawn twice (b - a = 0, 0, 1, 0 on t0-t3) and 4 tasks among t0, t1, t3 give 0 with chance 1/4 x (3/4)^4 = 7.9%:
    no difference at n = 2 runs x 4 tasks. t-interval: mean 0.5, s / sqrt(2) = 0.25, t_{0.975, 1} = tan(0.475 pi) =
    12.706: [-2.68, +3.68]."""
    s = summarise(RUNS, resamples=10_000)
    fin = s.data["final"]["greedy"]["differences"][0]
    assert fin["per_run"] == {0: 0.25, 1: 0.75} and fin["verdict"] == "no difference detected at n = 2 runs x 4 tasks"
    assert fin["ci"][0] <= 0 < fin["task_ci"][0]  # the one-level interval alone would have said "better"
    assert fin["t_ci"] == pytest.approx((0.5 - 0.25 * math.tan(0.475 * math.pi), 0.5 + 0.25 * math.tan(0.475 * math.pi)))
    final_md = s.markdown[s.markdown.index("### Final checkpoint"):s.markdown.index("### Best checkpoint")]
    assert ("| 0.88 [0.50, 1.00] (n = 2 runs x 4 tasks) | +0.50 [+0.00, +1.00], t-interval [-2.68, +3.68] no difference "
            "detected at n = 2 runs") in final_md
    assert ("| turnopd | +0.50 | [+0.00, +1.00] | [-2.68, +3.68] | [+0.12, +0.88] | +0.25 (seed 0), +0.75 (seed 1) | "
            "8 (4) | no difference detected at n = 2 runs x 4 tasks |") in final_md


def test_a_summary_verdict_over_runs_needs_the_t_interval_too():
    """3 seeds x 10 tasks, final checkpoints. The reference wins nothing; b wins t0-t4 in seeds 0 and 1 and all 10 tasks
    in seed 2: per-run differences +0.5, +0.5, +1.0. Two-level: the smallest resample means come from drawing seeds 0
    and 1 only (chance 8/27) and few of t0-t4 among the 10 drawn tasks: mean <= 0.2 with chance 8/27 x 56/1024 =
    0.016 < 2.5%, so the interval excludes 0 (its low end is above 0.2). t-interval: mean 2/3, s = sqrt(1/12), s /
    sqrt(3) = 1/6, t_{0.975, 2} = 4.30265: 2/3 -/+ 0.71711 = [-0.05, +1.38], which holds 0: no difference detected
    at n = 3 runs x 10 tasks, with both intervals in the summary's cell."""
    wins = {0: [1] * 5 + [0] * 5, 1: [1] * 5 + [0] * 5, 2: [1] * 10}
    runs = {"ref": {sd: [point("ref", sd, 4, 100, [0] * 10)] for sd in range(3)},
            "b": {sd: [point("b", sd, 4, 100, wins[sd])] for sd in range(3)}}
    s = summarise(runs, resamples=10_000)
    d = s.data["final"]["greedy"]["differences"][0]
    assert d["per_run"] == pytest.approx({0: 0.5, 1: 0.5, 2: 1.0}) and d["ci"][0] > 0.2
    t975 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert d["t_ci"] == pytest.approx((2 / 3 - t975 / 6, 2 / 3 + t975 / 6)) and d["t_ci"][0] < 0
    assert d["verdict"] == "no difference detected at n = 3 runs x 10 tasks"
    final_md = s.markdown[s.markdown.index("### Final checkpoint"):s.markdown.index("### Best checkpoint")]
    assert ", t-interval [-0.05, +1.38] no difference detected at n = 3 runs x 10 tasks |" in final_md
