"""Issue 44's experiment files (designs 2 and 3): benchmarks/experiments/atod_pilot.yaml, atod_quest3.yaml and
fopd_async.yaml load, and their resolved fit configurations are the recipes their headers state: iterations and
optimizer steps, the reward, the warm-up, the annealing horizon, the per-sequence aggregation; the async arms
equal fopd_lag2's recorded sync runs but for the mode and the lead."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from lightning_opd.callbacks.annealing import AnnealingSchedule
from lightning_opd.analysis.curves import updates_per_batch
from lightning_opd.experiments.experiment import load_experiment
from tests.experiments.arm_configs import resolved_arms
from lightning_opd.losses import EpisodeReward
from lightning_opd.rollout.batch import collate_trajectories
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.types import Trajectory

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "benchmarks" / "experiments"
NEW = ("atod_pilot", "atod_quest3", "fopd_async")


@pytest.mark.parametrize("name", NEW)
def test_load_experiment_accepts_the_new_files(name):
    exp = load_experiment(EXPERIMENTS / f"{name}.yaml")
    assert exp.name == name
    for arm in exp.arms:
        for config in arm.configs:
            assert (ROOT / config).is_file(), f"{name}: arm {arm.name!r} names a missing config {config}"


def test_atod_files_evaluate_iterations_8_and_16():
    """16 iterations x 2 updates = 32 optimizer steps; checkpoints every 16 steps = iterations 8 and 16, both
    evaluated, after the start (iteration 0)."""
    pilot, main = (load_experiment(EXPERIMENTS / f"{n}.yaml") for n in ("atod_pilot", "atod_quest3"))
    assert pilot.seeds == [0] and [a.name for a in pilot.arms] == ["grpo"]
    assert main.seeds == [0, 1, 2] and [a.name for a in main.arms] == ["opd", "atod", "grpo"]
    assert main.contrasts == [["atod", "grpo"]]
    for exp in (pilot, main):
        assert exp.checkpoint_every == 16 and exp.evaluate_checkpoints == "all" and exp.evaluate_start
        assert not exp.keep_checkpoints and exp.evaluate == ["--avg-k", "0", "--no-own-traj-kl"]
        for arm in exp.arms:
            assert "--trainer.max_steps=32" in arm.overrides and exp.every(arm) == 16


def test_fopd_async_arms():
    exp = load_experiment(EXPERIMENTS / "fopd_async.yaml")
    lag2 = load_experiment(EXPERIMENTS / "fopd_lag2.yaml")
    assert [a.name for a in exp.arms] == ["sync", "async_plain", "async_fopd"] and exp.seeds == lag2.seeds == [0, 1, 2]
    assert (exp.checkpoint_every, exp.evaluate_checkpoints, exp.evaluate) == (
        lag2.checkpoint_every, lag2.evaluate_checkpoints, lag2.evaluate)
    assert exp.contrasts == [["async_fopd", "async_plain"]]
    for arm in exp.arms[1:]:
        assert {"--data.init_args.mode=async", "--data.init_args.producer_lead=2",
                "--data.init_args.weight_sync_interval=1"} <= set(arm.overrides)


def test_the_atod_reward_is_success_plus_half_the_progress():
    """EpisodeReward(success_weight 1, score_weight 0.5) scores the collated batch's ``rewards``, each episode's sum
    of the environment's per-turn rewards; with reward "progress" those are the shares of the quest's walkthrough
    (tests/envs/test_textworld.py: 1/L per walkthrough step), so a quest of L = 3 gives, by hand: a win in 3 steps
    1 + 0.5 x 1 = 1.5; one step of 3 without a win 0.5 x 1/3 = 1/6; an episode that ended one step farther from the
    goal 0.5 x (-1/3) = -1/6."""
    trajs = []
    for rewards, won in (([1 / 3, 1 / 3, 1 / 3], True), ([1 / 3, 0.0], False), ([0.0, -1 / 3], False)):
        t = Trajectory(task_id="quest3", rewards=list(rewards), success=won)
        for k in range(len(rewards)):
            t.append([5, 6], assistant=False, turn=-1)
            t.append([9, 2], assistant=True, turn=k, logprobs=[-0.5, -0.5])
            t.turn_versions.append(0)
        trajs.append(t)
    batch = collate_trajectories(trajs, SamplingParams(), pad_id=0)
    torch.testing.assert_close(EpisodeReward(1.0, 0.5)(batch), torch.tensor([1.5, 1 / 6, -1 / 6], dtype=torch.float64))


# ------------------------------------------------------------------------------- resolved configurations
def resolved(name: str, tmp_path: Path) -> tuple:
    """Each arm's ``fit --print_config`` with the runner's overlay, for seed 0 (as the runner resolves it)."""
    return resolved_arms(EXPERIMENTS / f"{name}.yaml", tmp_path)


def without_run_paths(config: dict) -> dict:
    """``config`` without what names the run's folder (logger, checkpoint and Timer callbacks, export)."""
    config = copy.deepcopy(config)
    for key in ("default_root_dir", "logger"):
        config["trainer"].pop(key, None)
    config["trainer"]["callbacks"] = [c for c in config["trainer"].get("callbacks") or []
                                      if c["class_path"].rsplit(".", 1)[-1] not in ("Timer", "StepCheckpoint")]
    config["model"]["init_args"].pop("export_dir", None)
    return config


@pytest.mark.slow  # one `lightning-opd fit --print_config` process per arm
@pytest.mark.timeout(900)
def test_atod_recipes_resolve_as_stated(tmp_path):
    exp, configs = resolved("atod_quest3", tmp_path / "main")
    _, pilot = resolved("atod_pilot", tmp_path / "pilot")
    # the pilot is the grpo arm, path for path
    assert without_run_paths(pilot["grpo"]) == without_run_paths(configs["grpo"])
    for name, c in configs.items():
        init, data = c["model"]["init_args"], c["data"]["init_args"]
        assert c["model"]["class_path"] == "lightning_opd.learner.ATODModule", name
        # 16 rollout iterations: 32 optimizer steps / (1 epoch x 2 mini-batches); checkpoints at iterations 8, 16
        assert (c["trainer"]["max_steps"], updates_per_batch(c)) == (32, 2), name
        assert exp.every(exp.arms[0]) // updates_per_batch(c) == 8
        assert (data["episodes_per_step"], data["group_size"], data["temperature"]) == (8, 4, 1.0), name
        # reward = 1 x success + 0.5 x the episode's summed env reward, which is the quest's progress
        assert (init["reward"]["class_path"], init["reward"]["init_args"]) == (
            "lightning_opd.losses.EpisodeReward", {"success_weight": 1.0, "score_weight": 0.5}), name
        assert data["env"]["init_args"]["reward"] == "progress", name
        assert data["env"]["init_args"]["games_dir"] == "artifacts/games/quest3", name
        assert (data["max_turns"], data["max_context_tokens"], data["max_new_tokens"]) == (8, 2048, 16), name
        assert init["optimizer"]["init_args"]["lr"] == 1e-5 and init["aggregation"] == "sequence", name
        assert init["lr_scheduler"] == {"class_path": "torch.optim.lr_scheduler.LinearLR", "init_args": {
            "start_factor": 1 / 3, "end_factor": 1.0, "total_iters": 2, "last_epoch": -1}}, name
        assert init["student"] == "artifacts/models/student-opd", name
        assert init["teacher"] == "artifacts/models/teacher-textworld", name
        assert c["trainer"]["limit_val_batches"] == 0, name
    schedules = {name: [a["init_args"] for a in c["trainer"]["callbacks"]
                        if a["class_path"].endswith("AnnealingSchedule")] for name, c in configs.items()}
    coefficients = {name: (c["model"]["init_args"]["kappa"], c["model"]["init_args"]["rho"],
                           c["model"]["init_args"]["tdur"], [s["attribute"] for s in schedules[name]])
                    for name, c in configs.items()}
    assert coefficients == {"opd": (1.0, 0.0, False, []), "atod": (1.0, 1.0, True, ["kappa", "rho"]),
                            "grpo": (0.0, 1.0, False, [])}
    # over 9 of the 16 iterations: iteration s (0-based) trains at kappa 1 - 0.1 s up to s = 9, then 0.1
    kappa, rho = (AnnealingSchedule(**s) for s in schedules["atod"])
    assert (kappa.horizon, rho.horizon, kappa.fraction, rho.fraction) == (9, 9, None, None)
    assert [kappa.value_at(s) for s in range(16)] == pytest.approx([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
                                                                   + [0.1] * 7)
    assert [rho.value_at(s) for s in range(16)] == pytest.approx([1 + s / 9 for s in range(9)] + [2.0] * 7)


def recorded_sync(seed: int) -> dict:
    """fopd_lag2's recorded sync run of ``seed`` (its fit_config.yaml), run paths dropped."""
    path = ROOT / "benchmarks" / "results" / "fopd_lag2" / "sync" / f"seed{seed}" / "fit_config.yaml"
    if not path.is_file():
        pytest.skip("fopd_lag2's recorded sync runs are not in this checkout")
    config = without_run_paths(yaml.safe_load(path.read_text()))
    config["trainer"]["callbacks"] = config["trainer"]["callbacks"] or None
    # seeds 1 and 2 were fit after the environment's reward key came (its default, "score": seed 0's behaviour)
    assert config["data"]["init_args"]["env"]["init_args"].pop("reward", "score") == "score"
    return config


def as_recorded(config: dict) -> dict:
    """``config`` (resolved today) in the recorded runs' terms: run paths dropped, the keys added since with the
    recorded behaviour as their value removed (max_nonfinite_steps 3: none of those runs' 20 steps had a non-finite
    loss or gradient; the environment's reward "score": the only reward then), producer_lead under its old name."""
    config = without_run_paths(config)
    init, data = config["model"]["init_args"], config["data"]["init_args"]
    assert init.pop("max_nonfinite_steps") == 3 and data["env"]["init_args"].pop("reward") == "score"
    # issue 58's off-policy correction: the recorded runs had no ratio without a monitor asking for it; at lag 0 (sync)
    # the default (auto: off on-policy) is that behaviour, and the async arms pin it off with the explicit opt-out
    off_policy = init.pop("off_policy")
    assert off_policy == (None if data.get("mode", "sync") == "sync" and not data.get("forced_lag")
                          else {"truncated_ratio": False, "ratio_cap": 2.0, "allow_uncorrected": True}), off_policy
    data["max_lag"] = data.pop("producer_lead")
    config["trainer"]["callbacks"] = config["trainer"]["callbacks"] or None
    # issue 61: the recorded runs were fp32 (precision unset) and padded; the configs now say `auto` (the runner picks
    # once per experiment, precision.json: a rerun meant to reproduce them passes --trainer.precision=32-true) and
    # packing is off by default
    assert config["trainer"]["precision"] == "auto" and init.pop("pack_sequences") is False
    config["trainer"]["precision"] = None
    # issue 65: a LoRA student is opt-in (null: full fine-tuning, as recorded)
    assert init.pop("lora") is None
    # issue 64: teacher intervention is opt-in (null: the student plays every turn and trains on all of them, as recorded)
    assert init.pop("teacher_turn_loss") is None
    assert data.pop("intervention") is None and data.pop("teacher_generator") is None
    return config


@pytest.mark.slow  # one `lightning-opd fit --print_config` process per arm
@pytest.mark.timeout(900)
def test_async_arms_are_the_recorded_sync_recipe_but_for_the_mode_and_the_lead(tmp_path):
    _, configs = resolved("fopd_async", tmp_path)
    recorded = recorded_sync(0)
    for seed in (1, 2):  # the three recorded runs differ in their seed only
        other = recorded_sync(seed)
        assert (other["seed_everything"], other["data"]["init_args"]["seed"]) == (seed, seed)
        other["seed_everything"] = other["data"]["init_args"]["seed"] = 0
        assert other == recorded, seed
    assert as_recorded(configs["sync"]) == recorded
    for name in ("async_plain", "async_fopd"):
        mine = as_recorded(configs[name])
        data = mine["data"]["init_args"]
        assert (data["mode"], data["max_lag"], data["weight_sync_interval"]) == ("async", 2, 1), name
        data["mode"], data["max_lag"] = "sync", 1  # the recorded sync run's
        monitors = [c for c in mine["trainer"]["callbacks"] or [] if c["class_path"].endswith("StalenessMonitor")]
        assert len(monitors) == (1 if name == "async_fopd" else 0), name
        mine["trainer"]["callbacks"] = None
        assert mine == recorded, name
    (monitor,) = [c["init_args"] for c in configs["async_fopd"]["trainer"]["callbacks"]
                  if c["class_path"].endswith("StalenessMonitor")]
    f = monitor["freshness"]
    # truncated_ratio null since issue 58 (the learner's setting, pinned off above with the opt-out, as recorded)
    assert (f["tau_rho"], f["tau_chi"], f["score"], f["weighting"], f["filtering"], f["truncated_ratio"]) == (
        0.2036, 0.176, "full", True, True, None)
    # the adaptive bound and the producer-side control at their defaults (StalenessMonitor's signature)
    assert (monitor["initial_lag_bound"], monitor["adaptive_lag"], monitor["producer_control"],
            monitor["fallback_freshness"], monitor["low_freshness"], monitor["high_freshness"], monitor["patience"],
            monitor["mode"]) == (None, True, True, 0.2, 0.5, 0.8, 3, "control")
