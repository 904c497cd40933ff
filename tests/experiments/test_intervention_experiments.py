"""benchmarks/experiments/intervention_quest5.yaml and hint_teacher.yaml (issue 64's two tables): each loads with its
arms, seeds, budget and evaluation, and each arm's resolved fit configuration differs from its reference only where
the design says (the intervention policy and its schedule, the depth schedule, the teacher's view, its weights)."""

from __future__ import annotations

import pytest

from lightning_opd.experiments.experiment import load_experiment
from lightning_opd.experiments.runner import Runner
from tests.experiments.arm_configs import ROOT, resolved_arms, without_controllers

QUEST5 = ROOT / "benchmarks" / "experiments" / "intervention_quest5.yaml"
HINT = ROOT / "benchmarks" / "experiments" / "hint_teacher.yaml"
TEACHER = "artifacts/models/teacher-textworld"


def test_intervention_quest5_loads_with_an_equal_time_budget_and_marks(tmp_path):
    exp = load_experiment(QUEST5, results=tmp_path)
    assert [a.name for a in exp.arms] == ["vanilla", "annealed", "takeover", "depth"]  # vanilla first: the reference
    assert exp.seeds == [0, 1, 2] and exp.max_time == 2400 and exp.evaluate_at_seconds == [800, 1600]
    assert exp.evaluate_start and not exp.keep_checkpoints
    assert exp.contrasts == [["annealed", "takeover"], ["annealed", "depth"]]
    assert all(a.configs[0] == "conf/textworld/opd.yaml" for a in exp.arms)


def test_hint_teacher_loads_and_evaluates_against_the_trained_teacher(tmp_path):
    exp = load_experiment(HINT, results=tmp_path)
    assert [a.name for a in exp.arms] == ["walkthrough", "hint_frozen", "hint_live"]
    assert exp.seeds == [0, 1, 2] and exp.max_time is None and exp.evaluate_start
    assert exp.contrasts == [["hint_live", "hint_frozen"]]
    # the privileged teacher names no directory: the experiment's own --teacher is the only one evaluate gets
    args = Runner(exp).evaluate_args({"model": {"init_args": {"student": "s", "teacher": {
        "class_path": "lightning_opd.teachers.PrivilegedTeacher", "init_args": {"weights": "frozen"}}}}}, 0)
    assert args.count("--teacher") == 1 and args[args.index("--teacher") + 1] == TEACHER


def _callbacks(config: dict, name: str) -> list[dict]:
    return [c["init_args"] for c in config["trainer"]["callbacks"] if c["class_path"].rsplit(".", 1)[-1] == name]


@pytest.mark.slow  # one `lightning-opd fit --print_config` process per arm
@pytest.mark.timeout(900)
def test_intervention_arms_differ_from_vanilla_only_in_their_policy_or_schedule(tmp_path):
    _, configs = resolved_arms(QUEST5, tmp_path)
    for name, c in configs.items():
        init, data = c["model"]["init_args"], c["data"]["init_args"]
        assert (c["trainer"]["precision"], c["trainer"]["max_steps"], c["trainer"]["limit_val_batches"]) == \
            ("32-true", 60, 0), name
        assert init["student"] == "artifacts/models/student-opd" and init["teacher"] == TEACHER, name
        assert init["loss"]["class_path"].endswith(".FullVocabReverseKL"), name
        assert (data["env"]["init_args"]["games_dir"], data["max_turns"]) == ("artifacts/games/quest5", 12), name
        assert _callbacks(c, "Timer")[0]["duration"] == "00:00:40:00", name  # the runner's 2,400 s budget (DD:HH:MM:SS)

    (anneal,) = _callbacks(configs["annealed"], "AnnealingSchedule")
    assert (anneal["attribute"], anneal["start"], anneal["end"], anneal["steps"], anneal["fraction"]) == \
        ("intervention_prob", 0.5, 0.0, 12, None)  # a horizon in iterations: a time budget reaches it
    (depth,) = _callbacks(configs["depth"], "DepthSchedule")
    assert (depth["start"], depth["horizon"], depth["fraction"], depth["end"]) == (3, 10, None, None)
    policies = {n: (c["data"]["init_args"]["intervention"] or {}).get("class_path", "").rsplit(".", 1)[-1]
                for n, c in configs.items()}
    assert policies == {"vanilla": "", "annealed": "AnnealedIntervention", "takeover": "TakeoverIntervention",
                        "depth": ""}
    assert configs["takeover"]["data"]["init_args"]["intervention"]["init_args"]["after_invalid_actions"] == 2
    assert configs["annealed"]["data"]["init_args"]["intervention"]["init_args"] == {"prob": 0.5, "seed": 0}

    def stripped(config: dict) -> dict:
        config = without_controllers(config)  # a copy without the schedules
        config["data"]["init_args"].pop("intervention")
        config["data"]["init_args"].pop("teacher_generator")
        return config

    assert all(stripped(c) == stripped(configs["vanilla"]) for c in configs.values())
    assert [configs[n]["data"]["init_args"]["teacher_generator"] for n in configs] == [None, "hf", "hf", None]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hint_arms_differ_only_in_the_teachers_view_then_its_weights(tmp_path):
    _, configs = resolved_arms(HINT, tmp_path)
    teachers = {n: c["model"]["init_args"].pop("teacher") for n, c in configs.items()}
    assert {n: (t["init_args"]["view"], t["init_args"]["weights"]) for n, t in teachers.items()} == {
        "walkthrough": ("walkthrough", "frozen"), "hint_frozen": ("next_action", "frozen"),
        "hint_live": ("next_action", "live")}
    assert all(t["class_path"].rsplit(".", 1)[-1] == "PrivilegedTeacher" for t in teachers.values())
    for name, c in configs.items():
        assert (c["trainer"]["precision"], c["trainer"]["max_steps"], c["trainer"]["limit_val_batches"]) == \
            ("32-true", 20, 0), name
        assert c["model"]["init_args"]["student"] == "artifacts/models/smollm2-135m", name
    assert all(without_controllers(c) == without_controllers(configs["walkthrough"]) for c in configs.values())
