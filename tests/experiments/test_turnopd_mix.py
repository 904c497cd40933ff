"""benchmarks/experiments/turnopd_mix_pilot.yaml and turnopd_mix.yaml (issue 63, design 1): the pilot and the arms
load with one budget, one set of marks and one recipe on the mixed games; the arms differ only where the design says
(the fixed cap; the depth controller; the turn-loss blend), and the fixed cap is either the unset placeholder or a cap
below the 16-turn limit."""

from __future__ import annotations

import re

import pytest

from lightning_opd.experiments.experiment import load_experiment
from tests.experiments.arm_configs import ROOT, resolved_arms, without_controllers

PILOT = ROOT / "benchmarks" / "experiments" / "turnopd_mix_pilot.yaml"
ARMS = ROOT / "benchmarks" / "experiments" / "turnopd_mix.yaml"
DEPTH = "conf/callbacks/rollout_depth.yaml"
BLEND = "conf/callbacks/turn_loss_blend_time.yaml"
CAP_FLAG = "--data.init_args.max_turns="


def _mix_games_dir() -> str:
    """The Makefile's MIX_GAMES (what `make games-mix` writes)."""
    return re.search(r"^MIX_GAMES := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_pilot_and_arms_share_budget_marks_and_recipe(tmp_path):
    pilot, exp = load_experiment(PILOT, results=tmp_path), load_experiment(ARMS, results=tmp_path)
    assert [a.name for a in pilot.arms] == ["vanilla", "turnopd"]
    assert [a.name for a in exp.arms] == ["vanilla", "fixed_cap", "depth_only", "turnopd"]  # vanilla first: reference
    assert len(pilot.seeds) == 1 and len(exp.seeds) >= 3 and not set(pilot.seeds) & set(exp.seeds)
    assert pilot.max_time == exp.max_time == 6000
    marks = [pilot.at_seconds(a) for a in pilot.arms] + [exp.at_seconds(a) for a in exp.arms]
    assert all(m == marks[0] for m in marks) and len(marks[0]) >= 3 and marks[0][-1] == exp.max_time
    assert pilot.evaluate_start and exp.evaluate_start and not pilot.keep_checkpoints and not exp.keep_checkpoints
    assert exp.contrasts == [["depth_only", "fixed_cap"], ["turnopd", "depth_only"], ["turnopd", "fixed_cap"]]
    configs = {a.name: a.configs for a in exp.arms}
    assert configs == {"vanilla": ["conf/textworld/opd.yaml"], "fixed_cap": ["conf/textworld/opd.yaml"],
                       "depth_only": ["conf/textworld/opd.yaml", DEPTH],
                       "turnopd": ["conf/textworld/opd.yaml", DEPTH, BLEND]}
    assert {a.name: a.configs for a in pilot.arms} == {k: configs[k] for k in ("vanilla", "turnopd")}
    common = exp.arms[0].overrides
    assert all(a.overrides == common for a in pilot.arms) and exp.arms[2].overrides == exp.arms[3].overrides == common
    fixed = exp.arms[1].overrides
    assert fixed[:-1] == common and fixed[-1].startswith(CAP_FLAG)  # vanilla's, then the cap (the later flag wins)
    assert f"{CAP_FLAG}16" in common and "--data.init_args.eval_max_turns=16" in common  # evaluation at 16 everywhere
    assert f"--data.init_args.env.init_args.games_dir={_mix_games_dir()}" in common
    assert "--model.init_args.student=artifacts/models/smollm2-135m" in common
    cap = int(fixed[-1].removeprefix(CAP_FLAG))
    assert cap == 0 or 2 <= cap < 16  # 0: the placeholder (no fit accepts it); else a cap within [H_min, 16)
    assert "&FIXED_CAP_FROM_PILOT" in ARMS.read_text()


@pytest.mark.slow  # one `lightning-opd fit --print_config` process per arm
@pytest.mark.timeout(900)
def test_arms_resolve_to_one_recipe_that_differs_only_where_the_design_says(tmp_path):
    """Resolved with the runner's overlay: one student, loss, lr, games, turns, context, precision and episodes; the
    Timer's duration is the 6000 s budget (the blend's horizon); fixed_cap differs from vanilla in the training turn
    limit alone; depth_only adds the controller (the paper's rule), turnopd the time blend as well; the pilot's arms
    are the same recipe."""
    exp, configs = resolved_arms(ARMS, tmp_path / "arms")
    _, pilot = resolved_arms(PILOT, tmp_path / "pilot")

    def callbacks(config):
        return {c["class_path"].rsplit(".", 1)[-1]: c["init_args"] for c in config["trainer"]["callbacks"]}

    base = without_controllers(configs["vanilla"])
    fixed = without_controllers(configs["fixed_cap"])
    cap = fixed["data"]["init_args"].pop("max_turns")
    assert cap == 0 or 2 <= cap < 16
    base_turns = base["data"]["init_args"].pop("max_turns")
    assert base_turns == 16 and fixed == base
    assert without_controllers(configs["depth_only"]) == without_controllers(configs["turnopd"]) == \
        without_controllers(configs["vanilla"])
    init, data = configs["vanilla"]["model"]["init_args"], configs["vanilla"]["data"]["init_args"]
    assert init["loss"] == {"class_path": "lightning_opd.losses.TeacherTopKRenormalizedReverseKL",
                            "init_args": {**init["loss"]["init_args"], "k": 50}}
    assert init["optimizer"]["init_args"]["lr"] == 5e-5 and init["teacher"] == "artifacts/models/teacher-textworld"
    assert data["env"]["init_args"]["games_dir"] == _mix_games_dir()
    assert (data["eval_max_turns"], data["max_context_tokens"], data["episodes_per_step"]) == (16, 4096, 4)
    assert configs["vanilla"]["trainer"]["precision"] == "32-true"
    every = callbacks(configs["vanilla"])
    assert every["Timer"]["duration"] == "00:01:40:00"  # 6000 s
    assert every["StepCheckpoint"]["at_seconds"] == [1000.0, 2000.0, 3000.0, 4000.0, 5000.0, 6000.0]
    assert set(callbacks(configs["fixed_cap"])) == set(every) == {"Timer", "StepCheckpoint"}
    assert set(callbacks(configs["depth_only"])) == {"Timer", "StepCheckpoint", "RolloutDepthController"}
    turnopd = callbacks(configs["turnopd"])
    assert set(turnopd) == {"Timer", "StepCheckpoint", "RolloutDepthController", "TurnLossBlend"}
    assert turnopd["TurnLossBlend"]["horizon"] == "time"
    for name in ("depth_only", "turnopd"):
        rule = callbacks(configs[name])["RolloutDepthController"]
        assert (rule["cdf"], rule["solved_floor_quantile"], rule["quantile"], rule["h_min"]) == \
            ("success", None, 0.8, 2), name

    def recipe(config):  # without the seed the runner sets per run
        config = without_controllers(config)
        config.pop("seed_everything", None)
        config["data"]["init_args"].pop("seed")
        return config

    for name in ("vanilla", "turnopd"):
        assert recipe(pilot[name]) == recipe(configs[name]), name
        assert callbacks(pilot[name]).keys() == callbacks(configs[name]).keys(), name
