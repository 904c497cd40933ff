"""benchmarks/experiments/turnopd_cold.yaml (issue 44, design 1): the experiment loads with its arms, marks and
checks, and its arms differ only in their controllers; the controller is the paper's rule and the blend's
horizon is the experiment's 1200 s budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_opd.experiments.experiment import load_experiment
from tests.experiments.arm_configs import resolved_arms, without_controllers

ROOT = Path(__file__).resolve().parents[2]
PATH = ROOT / "benchmarks" / "experiments" / "turnopd_cold.yaml"


def test_it_loads_with_its_arms_marks_and_checks(tmp_path):
    exp = load_experiment(PATH, results=tmp_path)
    assert [a.name for a in exp.arms] == ["vanilla", "turnopd", "depth_only"]  # vanilla first: the reference
    assert exp.seeds == [0, 1, 2] and exp.max_time == 1200 and exp.evaluate_start and not exp.keep_checkpoints
    assert [exp.at_seconds(a) for a in exp.arms] == [[600.0, 1200.0]] * 3
    assert [exp.evaluated(a) for a in exp.arms] == ["last"] * 3  # the marks' checkpoints and the final only
    assert exp.validity_max_cap == 7 and exp.contrasts == [["turnopd", "depth_only"]]
    assert {a.name: a.configs for a in exp.arms} == {
        "vanilla": ["conf/textworld/opd.yaml"],
        "turnopd": ["conf/textworld/opd.yaml", "conf/callbacks/rollout_depth.yaml",
                    "conf/callbacks/turn_loss_blend_time.yaml"],
        "depth_only": ["conf/textworld/opd.yaml", "conf/callbacks/rollout_depth.yaml"]}
    assert all(a.overrides == exp.arms[0].overrides for a in exp.arms)
    assert "--model.init_args.student=artifacts/models/smollm2-135m" in exp.arms[0].overrides
    for config in {c for a in exp.arms for c in a.configs}:
        assert (ROOT / config).is_file(), config


def test_the_controller_is_the_papers_rule_and_the_blend_runs_on_training_seconds():
    (depth,) = yaml.safe_load((ROOT / "conf/callbacks/rollout_depth.yaml").read_text())["trainer"]["callbacks+"]
    assert depth["class_path"] == "lightning_opd.callbacks.rollout_depth.RolloutDepthController"
    rule = depth["init_args"]
    assert (rule["cdf"], rule["solved_floor_quantile"]) == ("success", None)  # success CDF only, no floor
    assert (rule["quantile"], rule["min_successes"], rule["ema"], rule["warmup"], rule["probe_interval"],
            rule["h_min"]) == (0.8, 8, 0.3, 3, 8, 2)
    (blend,) = yaml.safe_load((ROOT / "conf/callbacks/turn_loss_blend_time.yaml").read_text())["trainer"]["callbacks+"]
    assert blend["init_args"] == {"start": 0.0, "end": 1.0, "horizon": "time"}  # horizon: the Timer's duration


@pytest.mark.slow  # one `lightning-opd fit --print_config` process per arm (imports torch, Lightning, transformers)
@pytest.mark.timeout(900)
def test_the_arms_resolve_to_one_recipe_but_the_controllers(tmp_path):
    """Each arm's fit configuration with the runner's overlay: same student, loss, lr, games, turns, context and
    episodes; the Timer's duration (the blend's horizon) is 1200 s; the checkpoints are asked to mark 600 s and
    1200 s; only the controllers differ."""
    exp, configs = resolved_arms(PATH, tmp_path)

    def callbacks(config):
        return {c["class_path"].rsplit(".", 1)[-1]: c["init_args"] for c in config["trainer"]["callbacks"]}

    assert all(without_controllers(c) == without_controllers(configs["vanilla"]) for c in configs.values())
    init, data = configs["vanilla"]["model"]["init_args"], configs["vanilla"]["data"]["init_args"]
    assert init["student"] == "artifacts/models/smollm2-135m" and init["teacher"] == "artifacts/models/teacher-textworld"
    assert init["loss"] == {"class_path": "lightning_opd.losses.TeacherTopKRenormalizedReverseKL",
                            "init_args": {**init["loss"]["init_args"], "k": 50}}
    assert init["optimizer"]["init_args"]["lr"] == 5e-5
    assert data["env"]["init_args"]["games_dir"] == "artifacts/games/quest3"
    assert (data["max_turns"], data["max_context_tokens"], data["episodes_per_step"]) == (12, 3072, 4)
    assert configs["vanilla"]["trainer"]["max_steps"] == 80
    every = callbacks(configs["vanilla"])
    assert every["Timer"]["duration"] == "00:00:20:00"  # 1200 s: the budget and the time-blend's horizon
    assert every["StepCheckpoint"]["at_seconds"] == [600.0, 1200.0]
    assert set(callbacks(configs["vanilla"])) == {"Timer", "StepCheckpoint"}
    assert set(callbacks(configs["depth_only"])) == {"Timer", "StepCheckpoint", "RolloutDepthController"}
    turnopd = callbacks(configs["turnopd"])
    assert set(turnopd) == {"Timer", "StepCheckpoint", "RolloutDepthController", "TurnLossBlend"}
    assert turnopd["TurnLossBlend"]["horizon"] == "time"
    for name in ("turnopd", "depth_only"):
        rule = callbacks(configs[name])["RolloutDepthController"]
        assert (rule["cdf"], rule["solved_floor_quantile"]) == ("success", None), name
