"""``TeacherTrajectoryKL``: logs ``val/teacher_traj_kl`` (+ per turn) at validation, equal to the direct
computation on the cached teacher trajectories with the student's current weights; 0 for student ==
teacher; works under ``validate`` (the module loads no teacher there) and reuses the cache."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_opd.callbacks.teacher_traj_kl import TeacherTrajectoryKL
from lightning_opd.data import RolloutDataModule
from lightning_opd.evaluation.teacher_kl import trajectory_kl
from lightning_opd.models.loading import load_causal_lm
from lightning_opd.learner import OPDModule
from tests.helpers import KeywordEnvFactory

pytestmark = pytest.mark.timeout(300)


def _run(model_dirs, tmp_path, callback, student=None, fn="fit"):
    model = OPDModule(student=student or model_dirs["student"], teacher=model_dirs["teacher"], max_logged_turns=3,
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), log_text_every_n_steps=0)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=3, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, val_check_interval=2,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0, callbacks=[callback])
    getattr(trainer, fn)(model, datamodule=dm)
    return trainer, model


def test_logged_kl_is_the_students_kl_on_the_teachers_trajectories(model_dirs, tmp_path):
    cb = TeacherTrajectoryKL(cache_dir=str(tmp_path / "cache"))
    trainer, model = _run(model_dirs, tmp_path, cb)
    metrics = trainer.callback_metrics
    teacher = load_causal_lm(model_dirs["teacher"]).eval()
    ref = trajectory_kl(model.student, teacher, cb._trajectories, model.vocab_size)  # the trained student
    assert float(metrics["val/teacher_traj_kl"]) == pytest.approx(ref.mean, rel=1e-5) and ref.mean > 0.01
    assert {k for k in metrics if k.startswith("val/teacher_traj_kl/")} == {
        f"val/teacher_traj_kl/turn_{n:02d}" for n in range(len(ref.per_turn))}
    assert float(metrics["val/teacher_traj_kl/turn_00"]) == pytest.approx(ref.per_turn[0], rel=1e-5)
    assert len(cb._trajectories) == 2 and all(t.num_assistant_tokens for t in cb._trajectories)
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_zero_for_the_teacher_itself_under_validate(model_dirs, tmp_path):
    cb = TeacherTrajectoryKL(cache_dir=str(tmp_path / "cache"), max_tasks=1)
    trainer, model = _run(model_dirs, tmp_path, cb, student=model_dirs["teacher"], fn="validate")
    assert model.teacher_model is None and cb._teacher is not None  # validate: the callback loaded its own teacher
    assert float(trainer.callback_metrics["val/teacher_traj_kl"]) == 0.0 and len(cb._trajectories) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_tasks=0"):
        TeacherTrajectoryKL(max_tasks=0)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        TeacherTrajectoryKL(micro_batch_size=0)
