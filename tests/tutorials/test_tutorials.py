"""The tutorials in ``tutorials/`` run and say what they claim.

Slow (real SmolLM2 + TextWorld; need ``make model games teacher``): tutorials 1-3 run as subprocesses with
``--tiny`` and their printed output is checked (per-turn KL table, held-out success table, the last
``schedule/*``, ``controller/*`` and ``staleness/*`` values, the report PNG).

Fast (tiny random models, no artifacts): tutorial 1's missing-artifact message, tutorial 2's environment and
expert, tutorial 3's overlay composition (the same callbacks as the per-controller overlays in
``conf/callbacks/``), and tutorial 4's GPU config: ``--print_config`` in a subprocess, then every object built
from the YAML with ``OPDCLI(run=False)``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from lightning_opd.callbacks.annealing import AnnealingSchedule
from lightning_opd.callbacks.rollout_depth import RolloutDepthController
from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.cli import OPDCLI
from lightning_opd.data import RolloutDataModule
from lightning_opd.losses import ClippedSurrogate, FullVocabReverseKL
from lightning_opd.models.fsdp import FSDP2Strategy
from lightning_opd.learner import OPDModule
from lightning_opd.rollout import HFGenerator
from lightning_opd.rollout.vllm import VLLMGenerator

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "tutorials"
CONF = ROOT / "conf"
GPU_YAML = TUTORIALS / "configs" / "gpu_fsdp_vllm.yaml"
NEEDS = {"artifacts/models/smollm2-135m/config.json": "model", "artifacts/games/quest3/manifest.json": "games",
         "artifacts/models/teacher-textworld/config.json": "teacher"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.filterwarnings("ignore:No seed found")


def load_tutorial(name: str):
    """Import ``tutorials/<name>.py`` as a module (file names start with a digit: not importable by name)."""
    if str(TUTORIALS) not in sys.path:  # tutorials import their shared tutorials/prerequisites.py
        sys.path.insert(0, str(TUTORIALS))
    spec = importlib.util.spec_from_file_location(f"tutorial_{name}", TUTORIALS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tutorial(script: str, *args: str, timeout: int = 840) -> str:
    """``python tutorials/<script> *args`` from the repository root; returns stdout (asserts exit 0)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(TUTORIALS / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def artifacts():
    missing = [p for p in NEEDS if not (ROOT / p).exists()]
    if missing:
        pytest.fail(f"missing {missing}: run `make model games teacher` first")


@pytest.fixture(scope="module")
def fake_games(tmp_path_factory) -> Path:
    """A ``make-games`` output holding only ``manifest.json`` (all ``TextWorldEnvFactory`` reads when built)."""
    root = tmp_path_factory.mktemp("games")
    games = [{"task_id": f"{split}-s{seed:05d}", "split": split, "file": f"{split}/{split}-s{seed:05d}.z8", "seed": seed,
              "hash": f"hash{seed}", "walkthrough": ["go east", "take key"], "objective": "Find the key."}
             for split, seed in (("train", 0), ("train", 1), ("eval", 2))]
    (root / "manifest.json").write_text(json.dumps({"spec": {}, "seed": 0, "num_train": 2, "num_eval": 1, "games": games}))
    return root


def build(configs: list[Path], model_dirs: dict, games: Path, tmp: Path, extra: list[str] = ()) -> OPDCLI:
    """``OPDCLI(run=False)`` on the configs, with tiny local models and games, logs and exports under ``tmp``."""
    args = [a for c in configs for a in ("--config", str(c))]
    args += [f"--model.init_args.student={model_dirs['student']}", f"--model.init_args.teacher={model_dirs['teacher']}",
             f"--data.init_args.env.init_args.games_dir={games}", f"--trainer.logger.init_args.save_dir={tmp / 'logs'}",
             f"--model.init_args.export_dir={tmp / 'export'}", *extra]
    return OPDCLI(args=args, run=False)


# ------------------------------------------------------------------------------------ 1. quickstart
def test_01_missing_artifacts_name_the_make_targets(tmp_path):
    quickstart = load_tutorial("01_quickstart")
    with pytest.raises(SystemExit) as exc:
        quickstart.check_artifacts(tmp_path)
    message = str(exc.value.code)
    assert "make model games teacher" in message
    assert "artifacts/models/teacher-textworld/config.json  (make teacher)" in message
    (tmp_path / "artifacts/models/smollm2-135m").mkdir(parents=True)
    (tmp_path / "artifacts/models/smollm2-135m/config.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"make games teacher$"):
        quickstart.check_artifacts(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_01_quickstart_tiny_prints_per_turn_kl(artifacts, tmp_path):
    tmp_path = tmp_path.resolve()  # the tutorial prints resolved paths
    out = run_tutorial("01_quickstart.py", "--tiny", "--out", str(tmp_path))
    rows = re.findall(r"^\s*kl/turn_(\d+)\s+(\S+)\s+(\S+)\s*$", out, re.MULTILINE)
    assert rows and rows[0][0] == "00", out
    for turn, first, last in rows:
        if turn == "00":  # every episode has a turn 0: logged at the first and the last step
            assert float(first) >= 0 and float(last) >= 0 and math.isfinite(float(first) + float(last))
        for value in (first, last):
            assert value == "-" or float(value) >= 0
    assert re.search(r"^\s*val/success\s+[01]\.\d+", out, re.MULTILINE), out
    run_dir = re.search(r"^run directory: (.+)$", out, re.MULTILINE).group(1)
    assert Path(run_dir).is_relative_to(tmp_path) and list(Path(run_dir).glob("events.out.tfevents.*"))
    assert f"tensorboard --logdir {tmp_path}" in out and f"lightning-opd report {run_dir}" in out
    assert (tmp_path / "student-quickstart" / "model.safetensors").exists()


# ------------------------------------------------------------------------------------ 2. custom env
def test_02_guess_number_env_and_binary_search_expert(tokenizer):
    tutorial = load_tutorial("02_custom_env")
    env = tutorial.GuessNumberEnvFactory(high=16)
    assert set(env.train_tasks()).isdisjoint(env.eval_tasks()) and len(env.train_tasks() + env.eval_tasks()) == 16
    assert env.expert_actions("16") == ["8", "12", "14", "15", "16"]
    assert max(len(env.expert_actions(t)) for t in env.train_tasks() + env.eval_tasks()) == 5  # log2(16) + 1
    episode = env.make("5")
    episode.reset()
    assert episode.parse_action("I guess 7, then 9") == "7" and episode.parse_action("no idea") == ""
    assert episode.step("").invalid_action and episode.step("17").invalid_action
    step = episode.step("7")
    assert step.observation == "7 is too high. The number is between 1 and 6." and not step.done
    assert episode.step("5").won
    # the tutorial's own check, on the tiny tokenizer: every expert episode is won
    assert tutorial.check_with_expert(env, tokenizer) == 5
    # 4.: its privileged context reaches a PrivilegedTeacher's view of an episode, never the student's
    from lightning_opd.rollout import AgentLoop, EpisodeSpec, SamplingParams
    from lightning_opd.rollout.chat import ChatFormat
    from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies
    from lightning_opd.teachers.privileged_views import teacher_view

    assert env.provides_privileged_context and env.privileged_context("5") == "The secret number is 5."
    traj = AgentLoop(env, ScriptedGenerator(tokenizer, walkthrough_replies({"5": env.expert_actions("5")})), tokenizer,
                     max_turns=5).run([EpisodeSpec("5")], SamplingParams())[0]
    chat = ChatFormat(tokenizer, env.system_prompt)
    view, offset = teacher_view(traj, env.privileged_context("5"), chat)
    n = len(chat.first_prompt(traj.messages[0]["content"]))
    assert "number is 5" in tokenizer.decode(view) and "number is 5" not in tokenizer.decode(traj.token_ids)
    assert offset > 0 and view[n + offset:] == traj.token_ids[n:]  # the student's replies, token for token


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_02_custom_env_tiny_trains_teacher_then_student(artifacts, tmp_path):
    tmp_path = tmp_path.resolve()
    out = run_tutorial("02_custom_env.py", "--tiny", "--self-distill", "--out", str(tmp_path))
    assert "expert check: 16/16 episodes won, at most 5 turns" in out
    success = dict(re.findall(r"^\s*(student before|teacher|student after|self-distilled)\s+([01]\.\d\d)\s*$", out,
                              re.MULTILINE))
    assert set(success) == {"student before", "teacher", "student after", "self-distilled"}, out
    assert (tmp_path / "student-self-distill" / "model.safetensors").exists()
    assert all(0.0 <= float(v) <= 1.0 for v in success.values())
    assert (tmp_path / "teacher" / "model.safetensors").exists()
    assert (tmp_path / "student-opd" / "model.safetensors").exists()
    assert list((tmp_path / "opd").rglob("events.out.tfevents.*"))


# ---------------------------------------------------------------------------------- 3. controllers
def _callbacks(cli, kind):
    return [c for c in cli.trainer.callbacks if isinstance(c, kind)]


def _settings(cli, kind) -> list[tuple]:
    """The init arguments of every ``kind`` callback, as stored on the instances (a ``StalenessMonitor``'s
    ``freshness``: its ``FreshnessConfig`` as a dict, without M3's ``truncated_ratio``, which the tutorial turns on
    and conf/callbacks/staleness_monitor.yaml keeps off)."""
    def value(c, p):
        v = getattr(c, p, None)
        if p == "freshness" and isinstance(c, StalenessMonitor):
            return tuple((k, x) for k, x in asdict(v.config).items() if k != "truncated_ratio")
        return v
    params = [p for p in inspect.signature(kind).parameters if p != "self"]
    return sorted(tuple((p, value(c, p)) for p in params) for c in _callbacks(cli, kind))


def test_03_overlay_composes_all_three_controllers(model_dirs, fake_games, isolate):
    """The tutorial's overlay on grpo.yaml builds; it equals composing conf/callbacks/*.yaml with the same
    three model/data overrides."""
    overlay = build([CONF / "textworld/grpo.yaml", TUTORIALS / "03_compose_controllers.yaml"], model_dirs, fake_games,
                    isolate)
    assert isinstance(overlay.model.loss_fn, ClippedSurrogate) and overlay.model.tdur and overlay.model.kappa == 1.0
    assert overlay.datamodule.mode == "async" and overlay.datamodule.producer_lead == 2
    assert {c.attribute for c in _callbacks(overlay, AnnealingSchedule)} == {"kappa", "rho"}
    assert len(_callbacks(overlay, RolloutDepthController)) == 1 and len(_callbacks(overlay, StalenessMonitor)) == 1
    composed = build([CONF / "textworld/grpo.yaml", CONF / "callbacks/annealing.yaml", CONF / "callbacks/rollout_depth.yaml",
                      CONF / "callbacks/staleness_monitor.yaml"], model_dirs, fake_games, isolate,
                     ["--model.init_args.kappa=1.0", "--model.init_args.tdur=true", "--data.init_args.mode=async"])
    for kind in (AnnealingSchedule, RolloutDepthController, StalenessMonitor):
        assert _settings(overlay, kind) == _settings(composed, kind), kind.__name__
    truncated = [m.freshness.config.truncated_ratio for m in _callbacks(overlay, StalenessMonitor)]
    assert truncated == [True] and not _callbacks(composed, StalenessMonitor)[0].freshness.config.truncated_ratio
    assert composed.datamodule.mode == "async" and composed.model.tdur


def test_03_overlay_on_atod_is_refused_as_the_yaml_says(model_dirs, fake_games, isolate):
    """atod.yaml already has both AnnealingSchedules: the overlay's second pair has the same state keys."""
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `AnnealingSchedule`"):
        build([CONF / "textworld/atod.yaml", TUTORIALS / "03_compose_controllers.yaml"], model_dirs, fake_games, isolate)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_03_compose_controllers_tiny_logs_every_controller(artifacts, tmp_path):
    tmp_path = tmp_path.resolve()
    out = run_tutorial("03_compose_controllers.py", "--tiny", "--out", str(tmp_path))
    last = {f"{kind}/{name}": float(value) for kind, name, value in
            re.findall(r"^\s*(schedule|controller|staleness)/(\w+)\s+(\S+)\s+\(step \d+\)\s*$", out, re.MULTILINE)}
    # 2 rollout iterations, horizon round(0.5333 * 2) = 1: the second batch trains with the end values
    assert last["schedule/kappa"] == pytest.approx(0.1) and last["schedule/rho"] == pytest.approx(2.0), out
    assert 2 <= last["controller/cap"] <= 3 and last["controller/probe"] == 1.0  # warm-up: every batch a probe
    assert 0.0 <= last["staleness/freshness_mean"] <= 1.0 and last["staleness/lag_max"] >= 0
    png = Path(re.search(r"^report: (.+\.png)$", out, re.MULTILINE).group(1))
    assert png.is_relative_to(tmp_path) and png.read_bytes()[:8] == PNG_MAGIC
    assert png.with_name("report.html").exists()


# --------------------------------------------------------------------------------------- 4. scaling
def test_04_print_config_resolves_the_gpu_yaml(tmp_path):
    """``lightning-opd fit --config tutorials/configs/gpu_fsdp_vllm.yaml --print_config`` as a user runs it:
    parsing only, so the placeholder model directories need not exist."""
    proc = subprocess.run([sys.executable, "-m", "lightning_opd", "fit", "--config", str(GPU_YAML), "--print_config"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout)
    trainer, model, data = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
    assert trainer["accelerator"] == "gpu" and trainer["devices"] == 8 and trainer["num_nodes"] == 1
    assert trainer["strategy"]["class_path"] == "lightning_opd.models.fsdp.FSDP2Strategy"
    assert model["fsdp_mixed_precision"] == "bfloat16" and model["teacher_dtype"] == "bfloat16"
    assert data["max_turns"] == 12 and "max_logged_turns" not in model  # linked at build time, no frozen copy
    assert data["generator"]["class_path"] == "lightning_opd.rollout.vllm.VLLMGenerator"
    assert data["generator"]["init_args"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("generator", ["vllm", "hf"])
def test_04_gpu_yaml_builds_model_data_and_strategy(generator, model_dirs, fake_games, isolate):
    """Every object of the GPU config, built from the YAML. Overridden, because this runs without a GPU: the
    accelerator and device count (``cpu`` x 1: a ``gpu`` Trainer cannot be built on a machine without one) and the
    placeholder model/games directories (tiny local stand-ins). The strategy is the YAML's FSDP2Strategy.
    ``hf``: the README's HF-generator variant (``--data.init_args.generator=...HFGenerator``)."""
    raw = yaml.safe_load(GPU_YAML.read_text())
    assert raw["trainer"]["accelerator"] == "gpu" and raw["trainer"]["devices"] > 1
    extra = ["--trainer.accelerator=cpu", "--trainer.devices=1"]
    if generator == "hf":
        extra.append("--data.init_args.generator=lightning_opd.rollout.HFGenerator")
    cli = build([GPU_YAML], model_dirs, fake_games, isolate, extra)
    assert isinstance(cli.trainer.strategy, FSDP2Strategy)
    assert cli.trainer.strategy._save_distributed_checkpoint is True
    assert cli.trainer.max_steps == raw["trainer"]["max_steps"] and cli.trainer.num_nodes == 1
    model = cli.model
    assert isinstance(model, OPDModule) and model.fsdp_mixed_precision == "bfloat16"
    assert model.teacher_dtype == "bfloat16" and model.dtype_name == "float32" and model.gradient_checkpointing
    assert isinstance(model.loss_fn, FullVocabReverseKL) and model.loss_fn.chunk_size == 1024
    assert model.micro_batch_size == 2 and model.step_metrics.num_turns == 12
    assert model.student is None and model.teacher_model is None  # weights load in configure_model (sharded at fit)
    dm = cli.datamodule
    assert isinstance(dm, RolloutDataModule) and dm.episodes_per_step == 16 and dm.max_turns == 12
    assert dm.mode == "sync" and dm.sampling.max_new_tokens == 64 and dm.max_context_tokens == 6144
    if generator == "vllm":
        gen = dm.generator
        assert isinstance(gen, VLLMGenerator) and gen.llm is None  # the engine starts at the first rollout
        assert gen.dtype == "bfloat16" and gen.kv_cache_memory_bytes == 16 << 30 and gen.max_model_len == 8192
        assert gen.max_model_len >= dm.max_context_tokens + dm.sampling.max_new_tokens
    else:
        assert isinstance(dm.generator, HFGenerator)


def test_04_slurm_script_matches_the_yaml():
    script = (TUTORIALS / "configs" / "slurm_fsdp_vllm.sbatch").read_text()
    tasks = int(re.search(r"--ntasks-per-node=(\d+)", script).group(1))
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", script).group(1))
    assert f"--trainer.devices={tasks}" in script and f"--trainer.num_nodes={nodes}" in script
    assert "tutorials/configs/gpu_fsdp_vllm.yaml" in script
