"""Issue 63, design 2: benchmarks/experiments/atod_pilot_early.yaml (GRPO alone from the early OPD student) and
atod_early.yaml (OPD / ATOD / GRPO from it). The arms differ only in the advantage (kappa, rho, T-DUR and ATOD's
schedule); they share the start, the seeds, GRPO group 8 at temperature 1, 32 iterations of 4 updates; the pilot is the
grpo arm override for override; ATOD's annealing covers the paper's 80/150 of the 32 iterations (17). The start is
`make student-opd-early`, whose fit command (read with `make -n`, nothing run) is the demo's OPD recipe stopped at 10
steps, 32-true, seed 0, AVX2-pinned, exported where both experiments read it."""

from __future__ import annotations

import os
import random
import shlex
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from lightning.fabric.utilities.seed import seed_everything

from lightning_opd.analysis.curves import updates_per_batch
from lightning_opd.callbacks.annealing import AnnealingSchedule
from lightning_opd.experiments.experiment import load_experiment
from tests.experiments.arm_configs import ROOT, resolved_arms, without_controllers

EXPERIMENTS = ROOT / "benchmarks" / "experiments"
PILOT, MAIN = EXPERIMENTS / "atod_pilot_early.yaml", EXPERIMENTS / "atod_early.yaml"
EARLY = "artifacts/models/student-opd-early"
FLAGS = ["--avg-k", "0", "--no-own-traj-kl"]


def override_dict(overrides: list[str]) -> dict[str, str]:
    """``--key=value`` overrides as ``{key: value}`` (a repeated key: the last wins, as in jsonargparse).

    Raises:
        AssertionError: an override not of the form ``--key=value``."""
    out = {}
    for o in overrides:
        assert o.startswith("--") and "=" in o, f"override {o!r} is not --key=value"
        key, value = o[2:].split("=", 1)
        out[key] = value
    return out


# ------------------------------------------------------------------------------------------ the two files
def test_the_pilot_and_the_arms_share_start_seeds_cadence_and_evaluation():
    pilot, main = load_experiment(PILOT), load_experiment(MAIN)
    assert [a.name for a in pilot.arms] == ["grpo"] and pilot.seeds == [0, 1, 2]  # a run-level interval needs runs
    assert [a.name for a in main.arms] == ["opd", "atod", "grpo"] and main.seeds == [0, 1, 2, 3, 4]
    assert main.contrasts == [["atod", "grpo"]]  # besides each arm minus opd
    for exp in (pilot, main):
        assert (exp.checkpoint_every, exp.evaluate_checkpoints, exp.evaluate) == (32, "all", FLAGS), exp.name
        assert exp.evaluate_start and not exp.keep_checkpoints and exp.max_time is None, exp.name
        assert all(exp.every(a) == 32 and exp.evaluated(a) == "all" for a in exp.arms), exp.name
    # the pilot is the grpo arm, so its 3 pairs are that arm's seeds 0-2 (reused: checked and copied, not rerun)
    (arm,) = pilot.arms
    grpo = main.arms[2]
    assert (arm.configs, arm.overrides) == (grpo.configs, grpo.overrides)
    assert grpo.reuse == "atod_pilot_early/grpo" and [a.reuse for a in main.arms[:2]] == [None, None]
    assert set(pilot.seeds) < set(main.seeds)


def test_the_arms_differ_in_kappa_rho_and_atods_config_only():
    main = load_experiment(MAIN)
    arms = {a.name: override_dict(a.overrides) for a in main.arms}
    coefficients = {n: (o.pop("model.init_args.kappa", None), o.pop("model.init_args.rho", None))
                    for n, o in arms.items()}
    assert coefficients == {"opd": ("1.0", "0.0"), "atod": (None, None), "grpo": ("0.0", "1.0")}
    assert arms["opd"] == arms["atod"] == arms["grpo"]
    recipe = arms["atod"]
    assert recipe["model.init_args.student"] == EARLY
    # 32 rollout iterations of 2 tasks x group 8, each 1 epoch x 4 mini-batches = 4 optimizer updates: 128 steps
    assert (recipe["data.init_args.episodes_per_step"], recipe["data.init_args.group_size"]) == ("16", "8")
    assert float(recipe["data.init_args.temperature"]) >= 1.0
    assert (recipe["model.init_args.ppo_epochs"], recipe["model.init_args.ppo_mini_batches"]) == ("1", "4")
    updates = int(recipe["model.init_args.ppo_epochs"]) * int(recipe["model.init_args.ppo_mini_batches"])
    assert (recipe["trainer.max_steps"], int(recipe["trainer.max_steps"]) // updates) == ("128", 32)
    assert recipe["trainer.precision"] == "32-true" and recipe["trainer.limit_val_batches"] == "0"
    assert (recipe["model.init_args.reward.init_args.success_weight"],
            recipe["model.init_args.reward.init_args.score_weight"]) == ("1.0", "0.5")
    assert recipe["data.init_args.env.init_args.reward"] == "progress"
    assert {a.name: a.configs for a in main.arms} == {
        "opd": ["conf/textworld/grpo.yaml", "conf/model/lr_warmup2.yaml"],
        "atod": ["conf/textworld/atod.yaml", "conf/model/lr_warmup2.yaml"],
        "grpo": ["conf/textworld/grpo.yaml", "conf/model/lr_warmup2.yaml"]}


def test_atods_schedule_anneals_over_17_of_the_32_iterations():
    """atod.yaml's schedules take the paper's fraction 80/150 = 0.5333 of the fit's rollout iterations (128 optimizer
    steps // 4 updates = 32): round(17.07) = 17, so iteration s (0-based) trains at kappa 1 - 0.9 s/17 and rho
    1 + s/17 up to s = 17, then 0.1 and 2.0. The horizon is set by the callback's own setup (stubs for trainer and
    module)."""
    callbacks = yaml.safe_load((ROOT / "conf/textworld/atod.yaml").read_text())["trainer"]["callbacks"]
    module = SimpleNamespace(kappa=1.0, rho=1.0, set_kappa=lambda v: None, set_rho=lambda v: None, updates_per_batch=4)
    schedules = {}
    for c in callbacks:
        assert c["class_path"] == "lightning_opd.callbacks.annealing.AnnealingSchedule"
        s = AnnealingSchedule(**c["init_args"])
        s.setup(SimpleNamespace(max_steps=128), module, "fit")
        schedules[s.attribute] = s
    assert (schedules["kappa"].horizon, schedules["rho"].horizon) == (17, 17)
    assert [schedules["kappa"].value_at(s) for s in range(32)] == pytest.approx(
        [1 - 0.9 * s / 17 for s in range(17)] + [0.1] * 15)
    assert [schedules["rho"].value_at(s) for s in range(32)] == pytest.approx([1 + s / 17 for s in range(17)] + [2.0] * 15)
    assert schedules["kappa"].value_at(16) == pytest.approx(0.153, abs=5e-4)  # iteration 17, the last annealed


# -------------------------------------------------------------------------------- the Makefile's start
def make_fit(target: str) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """The ``lightning-opd fit`` line ``make -n -B target`` prints (nothing runs), as (environment assignments,
    config files, ``--key=value`` overrides).

    Raises:
        AssertionError: not exactly one fit line, or one that is not ``[VAR=value ...] .../lightning-opd fit ...``."""
    out = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lines = [line for line in out.splitlines() if " fit --config " in line]
    assert len(lines) == 1, f"make -n -B {target}: expected one fit line, got {lines}"
    words = shlex.split(lines[0])
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0].endswith("lightning-opd") and words[1] == "fit", words[:2]
    configs, rest = [], words[2:]
    while rest and rest[0] == "--config":
        configs.append(rest[1])
        rest = rest[2:]
    return env, configs, override_dict(rest)


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_student_opd_early_is_the_demo_fit_stopped_at_step_10():
    env, configs, early = make_fit(f"{EARLY}/config.json")
    demo_env, demo_configs, demo = make_fit("artifacts/models/student-opd/config.json")
    assert env == demo_env == {"ATEN_CPU_CAPABILITY": "avx2", "LIGHTNING_OPD_CPU_ISA": "avx2"}  # one file per CPU kind
    assert configs == demo_configs == ["conf/textworld/opd.yaml"]
    assert early == {"trainer.logger.init_args.save_dir": "runs/student_opd_early",
                     "trainer.logger.init_args.name": "opd", "trainer.limit_val_batches": "0",
                     "model.init_args.export_dir": EARLY, "trainer.precision": "32-true",
                     "trainer.max_steps": "10", "seed_everything": "0", "data.init_args.seed": "0"}
    # against `make student-opd`: the step count and the seeds written out; its own log folder and export
    assert set(early) - set(demo) == {"trainer.max_steps", "seed_everything", "data.init_args.seed"}
    assert {k for k in demo if demo[k] != early[k]} == {"trainer.logger.init_args.save_dir", "model.init_args.export_dir"}
    # the recipe in conf/textworld/opd.yaml: analytic reverse KL at lr 5e-5, 4 episodes of <= 8 turns on quest-3,
    # 20 steps of which the early fit takes 10, data seed 0 and no seed_everything (LightningCLI's default True)
    conf = yaml.safe_load((ROOT / "conf/textworld/opd.yaml").read_text())
    init, data = conf["model"]["init_args"], conf["data"]["init_args"]
    assert init["loss"]["class_path"] == "lightning_opd.losses.FullVocabReverseKL"
    assert init["optimizer"]["init_args"]["lr"] == 5e-5 and init.get("lr_scheduler") is None
    assert (data["episodes_per_step"], data["max_turns"], data["env"]["init_args"]["games_dir"]) == (
        4, 8, "artifacts/games/quest3")
    assert conf["trainer"]["max_steps"] == 20 and data["seed"] == 0 and "seed_everything" not in conf
    # both experiments continue what this target exports
    assert {override_dict(a.overrides)["model.init_args.student"]
            for p in (PILOT, MAIN) for a in load_experiment(p).arms} == {early["model.init_args.export_dir"]}


def test_an_unseeded_fit_is_seeded_0():
    """What `make student-opd` gets without --seed_everything: LightningCLI's default True calls Lightning's
    ``seed_everything()`` with no seed, which takes 0 when PL_GLOBAL_SEED is unset, so the early fit's explicit 0 is
    the demo fit's seed."""
    saved = os.environ.pop("PL_GLOBAL_SEED", None), random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        assert seed_everything(verbose=False) == 0
    finally:
        os.environ.pop("PL_GLOBAL_SEED", None)
        if saved[0] is not None:
            os.environ["PL_GLOBAL_SEED"] = saved[0]
        random.setstate(saved[1])
        np.random.set_state(saved[2])
        torch.set_rng_state(saved[3])


# ------------------------------------------------------------------------------- resolved configurations
@pytest.mark.slow  # one `lightning-opd fit --print_config` process per arm (4)
@pytest.mark.timeout(900)
def test_resolved_arms_differ_only_where_the_design_says(tmp_path):
    exp, configs = resolved_arms(MAIN, tmp_path / "main")
    _, pilot = resolved_arms(PILOT, tmp_path / "pilot")
    assert without_controllers(pilot["grpo"]) == without_controllers(configs["grpo"])
    stripped = {}
    for name, c in configs.items():
        init, data = c["model"]["init_args"], c["data"]["init_args"]
        assert c["model"]["class_path"] == "lightning_opd.learner.ATODModule", name
        assert (c["trainer"]["max_steps"], updates_per_batch(c), c["trainer"]["precision"]) == (128, 4, "32-true"), name
        assert exp.every(exp.arms[0]) // updates_per_batch(c) == 8  # checkpoints at iterations 8, 16, 24, 32
        assert (data["episodes_per_step"], data["group_size"], data["temperature"], data["seed"]) == (16, 8, 1.0, 0), name
        assert (init["student"], init["teacher"]) == (EARLY, "artifacts/models/teacher-textworld"), name
        assert init["loss"]["init_args"]["clip_eps"] == 0.2 and init["aggregation"] == "sequence", name
        s = without_controllers(c)
        stripped[name] = s
        coefficients = tuple(s["model"]["init_args"].pop(k) for k in ("kappa", "rho", "tdur"))
        assert coefficients == {"opd": (1.0, 0.0, False), "atod": (1.0, 1.0, True), "grpo": (0.0, 1.0, False)}[name]
    assert stripped["opd"] == stripped["atod"] == stripped["grpo"]
    schedules = [a["init_args"] for a in configs["atod"]["trainer"]["callbacks"]
                 if a["class_path"].endswith("AnnealingSchedule")]
    assert [(s["attribute"], s["start"], s["end"], s["steps"], s["fraction"]) for s in schedules] == [
        ("kappa", 1.0, 0.1, None, 0.5333), ("rho", 1.0, 2.0, None, 0.5333)]
    assert not any(a["class_path"].endswith("AnnealingSchedule") for n in ("opd", "grpo")
                   for a in configs[n]["trainer"]["callbacks"] or [])
