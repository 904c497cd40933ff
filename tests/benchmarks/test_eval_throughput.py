"""The evaluation benchmark's accounting on the tiny models (HF backend, 2 quest-3 games, 2 turns): every generate
call, every KL trunk forward (the teacher's once, the teacher-as-student none) and the environment seconds are
counted; nothing is timed against a target."""

from pathlib import Path

import pytest

from benchmarks.eval_throughput import main

pytestmark = pytest.mark.timeout(300)


def test_counts_the_demo_evaluation_s_work(model_dirs, capsys):
    games = Path(__file__).resolve().parents[2] / "artifacts/games/quest3"
    out = main(["--model", model_dirs["student"], "--teacher", model_dirs["teacher"], "--games", str(games),
                "--students", f"before={model_dirs['student']}", f"teacher={model_dirs['teacher']}",
                "--limit", "2", "--max-turns", "2", "--backend", "hf", "--no-save"])
    roof, gen = out["roofline"], out["roofline"]["generation"]
    assert out["tasks"] == 2 and out["engine_starts"] == 0
    # the teacher's 2 episodes and the student's 2, each 1-2 turns: at least one prefill per policy and turn
    assert gen["passes"] >= 2 and gen["prefill_tokens"] > 0 and gen["sampled_tokens"] > 0
    # KL trunk forwards: the teacher's on its 2 trajectories, then the student's; the teacher scoring itself: none
    assert roof["kl_trunk_passes"] == 4 and roof["kl_scored_tokens"] > 0
    assert out["teacher_traj_kl"]["teacher"] == 0.0 and out["teacher_traj_kl"]["before"] > 0
    assert out["env_s"] > 0 and roof["roofline_s"] == pytest.approx(
        gen["roofline_s"] + roof["kl_roofline_s"] + roof["env_s"])
    assert 0 < out["fraction"] and out["other_s"] >= 0
    assert "of the roofline" in capsys.readouterr().out
