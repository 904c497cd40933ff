"""Progress display (lightning_opd/callbacks/progress.py): the plain step line worked out by hand, the
held-out episode count, and both bars on a real tiny fit / validation."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_opd.callbacks import progress
from lightning_opd.callbacks.progress import EpisodeProgressBar, StepLinePrinter, held_out_episodes
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from tests.helpers import KeywordEnvFactory


def _trainer(metrics, step=3, max_steps=20):
    return SimpleNamespace(callback_metrics=metrics, max_steps=max_steps, global_step=step, is_global_zero=True)


def test_step_line_by_hand(monkeypatch):
    printer = StepLinePrinter()
    printer._t0, printer._first_step = 100.0, 0
    monkeypatch.setattr(progress, "monotonic", lambda: 223.6)  # 123.6 s for 3 steps: 41.2 s/step
    metrics = {"train/kl": torch.tensor(0.41234), "rollout/success": torch.tensor(0.25),
               "rollout/turns": torch.tensor(5.5), "train/loss": torch.tensor(9.0)}
    # ETA: 17 steps left x 41.2 s = 700.4 s = 11 min 40 s
    assert printer.step_line(_trainer(metrics)) == "step 3/20 | kl 0.412 | success 0.25 | turns 5.5 | 41.2 s/step | ETA 11m40s"
    printer._first_step = 1  # a resumed fit counts its own steps: 123.6 s / 2 = 61.8 s/step, 17 x 61.8 = 1050.6 s
    assert printer.step_line(_trainer({"train/loss": torch.tensor(2.0)})) == "step 3/20 | loss 2 | 61.8 s/step | ETA 17m31s"
    assert printer.step_line(_trainer({}, step=3, max_steps=-1)) == "step 3 | 61.8 s/step"  # no max_steps: no ETA
    sampled = {"train/kl_sampled": torch.tensor(-0.05), "rollout/success": torch.tensor(0.5)}  # a served teacher
    assert printer.step_line(_trainer(sampled)) == "step 3/20 | kl_sampled -0.05 | success 0.5 | 61.8 s/step | ETA 17m31s"


def test_held_out_episodes_by_hand():
    dm = SimpleNamespace(env=SimpleNamespace(eval_tasks=lambda: list(range(50))), eval_batch_size=25)

    def count(world_size=1, limit=1.0, sanity=False, steps=2):
        trainer = SimpleNamespace(datamodule=dm, world_size=world_size, limit_val_batches=limit, limit_test_batches=limit,
                                  sanity_checking=sanity, num_sanity_val_steps=steps)
        return held_out_episodes(trainer)

    assert count() == 50
    assert count(world_size=3) == 17  # ceil(50 / 3): rank 0's share
    assert count(limit=1) == 25  # one batch of eval_batch_size episodes
    assert count(limit=0.5) is None  # a fraction of a stream of unknown length
    assert count(sanity=True, steps=1) == 25
    assert held_out_episodes(SimpleNamespace(datamodule=None)) is None


def _fit_parts(model_dirs):
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                           eval_batch_size=1, seed=0)
    return model, dm


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_plain_lines_on_a_real_fit(model_dirs, capsys):
    model, dm = _fit_parts(model_dirs)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, val_check_interval=2, check_val_every_n_epoch=None,
                        num_sanity_val_steps=0, log_every_n_steps=1, callbacks=[StepLinePrinter()])
    trainer.fit(model, datamodule=dm)
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 1/2", "step 2/2"]
    assert all(" | kl " in line and " | success " in line and " | turns " in line and " s/step | ETA " in line
               for line in steps)
    (val,) = [line for line in lines if line.startswith("validation: ")]
    assert val.startswith("validation: 2/2 episodes in ") and " | val/success " in val  # two tasks, one per batch


class _Recording(EpisodeProgressBar):
    def on_validation_end(self, trainer, pl_module):
        self.seen = (self.val_progress_bar.total, self.val_progress_bar.n, self.val_progress_bar.unit)
        super().on_validation_end(trainer, pl_module)


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_validation_bar_counts_episodes(model_dirs):
    model, dm = _fit_parts(model_dirs)
    bar = _Recording()
    L.Trainer(accelerator="cpu", logger=False, enable_model_summary=False, callbacks=[bar]).validate(model, datamodule=dm)
    assert bar.seen == (2, 2, " episodes")  # 2 held-out tasks in 2 batches of one: 2/2, not 2/--
