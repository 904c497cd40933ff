"""What the runner adds to every fit (lightning_opd/experiments/checkpointing.py), with Lightning's own Trainer on
its ``BoringModel``: the final step is checkpointed when the interval does not divide it, checkpoints carry the
Timer's training seconds, and a fit resumed from a checkpoint whose seconds already exceed the budget stops
at once (no fresh budget). No wall-clock is measured: the resumed seconds are written into the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

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


# ------------------------------------------------------------------------------ training-second marks
class CountingTimer(Timer):
    """Lightning's Timer with training seconds counted, not measured: 10 s per optimizer step of this fit, on top
    of the count restored from the checkpoint (its ``_offset``), so the marks fall on known steps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0

    @property
    def state_key(self):
        return "Timer"  # saved where the real Timer's state goes (read by train_seconds)

    def time_elapsed(self, stage="train"):
        return self._offset + 10.0 * self.steps if stage == "train" else 0.0

    def on_train_batch_end(self, trainer, *args, **kwargs):
        self.steps += 1  # the step just ended: its 10 s count before the budget check and the marks
        super().on_train_batch_end(trainer, *args, **kwargs)


class SaveLog(StepCheckpoint):
    """StepCheckpoint that lists the files it writes (to show that no step is written twice)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saved = []

    def _save_checkpoint(self, trainer, filepath):
        self.saved.append(Path(filepath).name)
        super()._save_checkpoint(trainer, filepath)


def fit_marks(tmp_path, max_steps, at_seconds, duration=None, ckpt_path=None, every=4):
    checkpoint = SaveLog(dirpath=tmp_path / "checkpoints", filename="step={step}", auto_insert_metric_name=False,
                         every_n_train_steps=every, save_top_k=-1, save_last="link", enable_version_counter=False,
                         at_seconds=at_seconds, marks_file=str(tmp_path / "at_seconds.json"))
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=max_steps, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[CountingTimer(duration=duration, verbose=False), checkpoint])
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer, checkpoint


def marks(tmp_path):
    return json.loads((tmp_path / "at_seconds.json").read_text())["marks"]


def test_the_first_step_reaching_each_mark_is_saved_once(tmp_path):
    """10 s per step, marks 25 s and 40 s, a checkpoint every 4 steps, 6 steps: 25 s is first reached at step 3
    (30 s), 40 s at step 4 (40 s), which the 4-step cadence saves too: written once. Files: steps 3, 4 and the
    final 6; each checkpoint carries the marks reached by then."""
    _, cb = fit_marks(tmp_path, max_steps=6, at_seconds=[25, 40])
    assert cb.saved == ["step=3.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert marks(tmp_path) == [{"mark": 25.0, "step": 3, "seconds": 30.0}, {"mark": 40.0, "step": 4, "seconds": 40.0}]
    three = load(tmp_path / "checkpoints" / "step=3.ckpt")
    assert train_seconds(three) == 30.0
    (state,) = [v for k, v in three["callbacks"].items() if k.startswith("SaveLog")]
    assert state["at_seconds_reached"] == [{"mark": 25.0, "step": 3, "seconds": 30.0}]  # saved with its own mark


def test_a_mark_on_the_budgets_last_step_is_the_final_checkpoint_written_once(tmp_path):
    """Budget 50 s: the Timer stops the fit at step 5 (50 s), the step that reaches the 50 s mark; the mark's
    save is the final checkpoint (the end of the fit writes nothing more). A mark past the fit's end (max_steps)
    stays unreached."""
    _, cb = fit_marks(tmp_path, max_steps=10, at_seconds=[25, 50], duration={"seconds": 50})
    assert cb.saved == ["step=3.ckpt", "step=4.ckpt", "step=5.ckpt"]
    assert [(m["mark"], m["step"]) for m in marks(tmp_path)] == [(25.0, 3), (50.0, 5)]
    fit_marks(tmp_path / "short", max_steps=2, at_seconds=[15, 50])
    assert marks(tmp_path / "short") == [{"mark": 15.0, "step": 2, "seconds": 20.0},
                                         {"mark": 50.0, "step": None, "seconds": None}]


def test_a_resumed_fit_does_not_save_a_reached_mark_again(tmp_path):
    """First fit: 3 steps (30 s), the 25 s mark saved at step 3 (also the final). A killed attempt then recorded
    a 40 s mark at step 5 in at_seconds.json but died before any checkpoint held it; the resumed fit (from step 3,
    30 s) rewrites the record from its restored state, reaches 40 s at step 4 and saves steps 4 and 6 only."""
    fit_marks(tmp_path, max_steps=3, at_seconds=[25, 40])
    stale = [{"mark": 25.0, "step": 3, "seconds": 30.0}, {"mark": 40.0, "step": 5, "seconds": 50.0}]
    (tmp_path / "at_seconds.json").write_text(json.dumps({"marks": stale}))
    trainer, cb = fit_marks(tmp_path, max_steps=6, at_seconds=[25, 40], ckpt_path=tmp_path / "checkpoints" / "last.ckpt")
    assert cb.saved == ["step=4.ckpt", "step=6.ckpt"]
    assert marks(tmp_path) == [{"mark": 25.0, "step": 3, "seconds": 30.0}, {"mark": 40.0, "step": 4, "seconds": 40.0}]


def test_marks_need_a_timer_and_valid_seconds(tmp_path):
    checkpoint = StepCheckpoint(dirpath=tmp_path, every_n_train_steps=2, at_seconds=[10])
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=1, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint])
    with pytest.raises(ValueError, match="needs a lightning.pytorch.callbacks.Timer"):
        trainer.fit(BoringModel())
    for bad, message in (([0], "0 is not a positive"), ([600, 600], "600 does not increase"),
                         ([1200, 600], "600 does not increase"), (["600"], "'600' is not a positive"),
                         (600, "must be a list")):
        with pytest.raises(ValueError, match=message):
            StepCheckpoint(dirpath=tmp_path, at_seconds=bad)
