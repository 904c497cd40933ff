"""benchmarks/experiments/opd_placebo.yaml (issue 63, design 3): the placebo control and the sign-only loss. The
experiment loads with its arms, seeds, contrasts and evaluation; the placebo arm differs from the real one in the
teacher only (the shuffled teacher over the same directory), the sign-only arm from the sampled one in the loss only;
every arm is evaluated against the real teacher."""

from __future__ import annotations

import pytest
import yaml

from lightning_opd.experiments.experiment import load_experiment
from lightning_opd.experiments.runner import Runner
from tests.experiments.arm_configs import ROOT, resolved_arms, without_controllers

PATH = ROOT / "benchmarks" / "experiments" / "opd_placebo.yaml"
TEACHER = "artifacts/models/teacher-textworld"


def test_it_loads_with_its_arms_seeds_contrasts_and_evaluation(tmp_path):
    exp = load_experiment(PATH, results=tmp_path)
    assert [a.name for a in exp.arms] == ["real", "placebo", "sampled", "sign_only"]  # real first: the reference
    assert exp.seeds == [0, 1, 2] and exp.max_time is None and not exp.keep_checkpoints
    assert exp.contrasts == [["placebo", "real"], ["sign_only", "sampled"]]
    assert exp.evaluate == ["--avg-k", "0", "--no-own-traj-kl"] and exp.teacher_kl
    assert [exp.evaluated(a) for a in exp.arms] == ["last"] * 4
    assert {a.name: a.configs for a in exp.arms} == {
        "real": ["conf/textworld/opd.yaml"],
        "placebo": ["conf/textworld/opd.yaml", "conf/model/teacher_shuffled.yaml"],
        "sampled": ["conf/textworld/opd.yaml", "conf/model/opd_sampled.yaml", "conf/model/lr_warmup2.yaml"],
        "sign_only": ["conf/textworld/opd.yaml", "conf/model/opd_sign_only.yaml", "conf/model/lr_warmup2.yaml"]}
    arms = {a.name: a for a in exp.arms}
    assert arms["placebo"].overrides == arms["real"].overrides
    assert arms["sign_only"].overrides == arms["sampled"].overrides
    assert arms["sampled"].overrides == arms["real"].overrides[:2] + ["--model.init_args.optimizer.init_args.lr=1.0e-4",
                                                                        "--trainer.precision=32-true"]
    assert {"--trainer.precision=32-true", "--trainer.limit_val_batches=0"} <= set(exp.arms[0].overrides)
    for config in {c for a in exp.arms for c in a.configs}:
        assert (ROOT / config).is_file(), config


def test_the_reused_arms_are_the_recipes_they_are_copied_from(tmp_path):
    """real seeds 0-2 are copied from lora_demo's `full` arm and sampled seeds 0-2 from fopd_answer's `sync` arm (the
    YAML's header): that holds only while their configs and overrides are the same, seeds included."""
    exp = load_experiment(PATH, results=tmp_path)
    arms = {a.name: a for a in exp.arms}
    for name, source, source_arm in (("real", "lora_demo", "full"), ("sampled", "fopd_answer", "sync")):
        assert arms[name].reuse == f"{source}/{source_arm}", name  # the runner checks the resolved configs too
        other = load_experiment(ROOT / "benchmarks" / "experiments" / f"{source}.yaml", results=tmp_path)
        them = {a.name: a for a in other.arms}[source_arm]
        assert (arms[name].configs, arms[name].overrides) == (them.configs, them.overrides), name
        assert set(exp.seeds) <= set(other.seeds) and other.evaluate == exp.evaluate, name


def test_the_placebo_shuffles_the_demo_teacher_and_sign_only_takes_the_sampled_rate():
    base = yaml.safe_load((ROOT / "conf/textworld/opd.yaml").read_text())["model"]["init_args"]
    assert base["teacher"] == TEACHER and base["loss"]["class_path"].endswith(".FullVocabReverseKL")
    teacher = yaml.safe_load((ROOT / "conf/model/teacher_shuffled.yaml").read_text())["model"]["init_args"]["teacher"]
    assert teacher == {"class_path": "lightning_opd.teachers.ShuffledTeacher",
                       "init_args": {"path": TEACHER, "seed": 0}}
    sampled, sign = (yaml.safe_load((ROOT / f"conf/model/{n}.yaml").read_text())["model"]["init_args"]
                     for n in ("opd_sampled", "opd_sign_only"))
    assert sign["loss"] == {"class_path": "lightning_opd.losses.SignOnlyReverseKL"}
    assert sign["optimizer"] == sampled["optimizer"]  # the same rate: the arms differ in the advantage only


def test_every_arm_is_evaluated_against_the_real_teacher(tmp_path):
    """The runner's ``--teacher`` for a teacher given as a class is its ``init_args.path`` (the placebo's real
    teacher), none for a class without one (it passed the dict's text before)."""
    runner = Runner(load_experiment(PATH, results=tmp_path))

    def teacher_of(teacher) -> list[str]:
        args = runner.evaluate_args({"model": {"init_args": {"student": "s", "teacher": teacher}}}, 0)
        return args[args.index("--teacher"):args.index("--teacher") + 2] if "--teacher" in args else []

    assert teacher_of(TEACHER) == ["--teacher", TEACHER]
    assert teacher_of({"class_path": "lightning_opd.teachers.ShuffledTeacher",
                       "init_args": {"path": TEACHER, "seed": 0}}) == ["--teacher", TEACHER]
    assert teacher_of({"class_path": "lightning_opd.teachers.RemoteTeacher",
                       "init_args": {"urls": ["http://127.0.0.1:8001"]}}) == []


@pytest.mark.slow  # one `lightning-opd fit --print_config` process per arm
@pytest.mark.timeout(900)
def test_arms_differ_only_where_the_design_says(tmp_path):
    exp, configs = resolved_arms(PATH, tmp_path)
    for name, c in configs.items():
        init = c["model"]["init_args"]
        assert c["trainer"]["precision"] == "32-true" and c["trainer"]["max_steps"] == 20, name
        assert c["trainer"]["limit_val_batches"] == 0, name
        assert init["optimizer"]["init_args"]["lr"] == (5e-5 if name in ("real", "placebo") else 1e-4), name
        warmup = (init.get("lr_scheduler") or {}).get("init_args", {}).get("total_iters")
        assert warmup == (None if name in ("real", "placebo") else 2), name  # issue 62's rate and warm-up
        assert Runner(exp).evaluate_args(c, 0)[-5:-3] == ["--teacher", TEACHER], name  # the real teacher, every arm

    def without(config: dict, key: str) -> dict:
        config = without_controllers(config)  # a copy
        config["model"]["init_args"].pop(key)
        return config

    placebo = configs["placebo"]["model"]["init_args"]["teacher"]
    assert placebo["class_path"].rsplit(".", 1)[-1] == "ShuffledTeacher"  # jsonargparse may name the defining module
    assert (placebo["init_args"]["path"], placebo["init_args"]["seed"]) == (TEACHER, 0)
    assert without(configs["placebo"], "teacher") == without(configs["real"], "teacher")
    losses = {n: configs[n]["model"]["init_args"]["loss"]["class_path"].rsplit(".", 1)[-1]
              for n in ("sampled", "sign_only")}
    assert losses == {"sampled": "SampledTokenReverseKL", "sign_only": "SignOnlyReverseKL"}
    assert without(configs["sign_only"], "loss") == without(configs["sampled"], "loss")
