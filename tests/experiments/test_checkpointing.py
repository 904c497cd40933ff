"""What the runner adds to every fit (lightning_opd/experiments/checkpointing.py), with Lightning's own Trainer on
its ``BoringModel``: the final step is checkpointed when the interval does not divide it, checkpoints carry the
Timer's training seconds, and a fit resumed from a checkpoint whose seconds already exceed the budget stops
at once (no fresh budget). No wall-clock is measured: the resumed seconds are written into the checkpoint."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_opd.experiments.checkpointing import StepCheckpoint
from lightning_opd.models.checkpoints import train_seconds

pytestmark = pytest.mark.timeout(120)


def fit(tmp_path, max_steps: int, duration=None, ckpt_path=None) -> L.Trainer:
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=max_steps, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[Timer(duration=duration, verbose=False),
                                   StepCheckpoint(dirpath=tmp_path / "checkpoints", filename="step={step}",
                                                  auto_insert_metric_name=False, every_n_train_steps=2,
                                                  save_top_k=-1, save_last=True, enable_version_counter=False)])
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_final_step_is_saved_with_its_training_seconds(tmp_path):
    fit(tmp_path, max_steps=3)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=2.ckpt", "step=3.ckpt"]
    two, three = load(folder / "step=2.ckpt"), load(folder / "step=3.ckpt")
    assert (two["global_step"], three["global_step"]) == (2, 3)
    assert 0 < train_seconds(two) <= train_seconds(three)
    assert load(folder / "last.ckpt")["global_step"] == 3


def test_a_resumed_fit_keeps_its_spent_budget(tmp_path):
    fit(tmp_path, max_steps=2)
    folder = tmp_path / "checkpoints"
    state = load(folder / "last.ckpt")
    state["callbacks"]["Timer"]["time_elapsed"]["train"] = 700.0  # this run had trained 700 s by step 2
    torch.save(state, folder / "last.ckpt")
    trainer = fit(tmp_path, max_steps=10, duration="00:00:10:00", ckpt_path=folder / "last.ckpt")  # 600 s budget
    assert trainer.global_step == 2  # the spent 700 s count: not a single step more
    (timer,) = [c for c in trainer.callbacks if isinstance(c, Timer)]
    assert timer.time_elapsed("train") >= 700.0  # the count continued from the checkpoint
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=2.ckpt"]  # nothing new, no step=2-v1


def test_train_seconds_without_a_timer_is_none():
    assert train_seconds({"callbacks": {}}) is None and train_seconds({}) is None
    assert train_seconds({"callbacks": {"Timer": {"time_elapsed": {"train": 12.5, "validate": 1.0}}}}) == 12.5
