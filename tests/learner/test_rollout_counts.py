"""rollouts/generated vs rollouts/used per step and cumulative (issue 18), with a stand-in for the freshness
filter that drops the second episode of every batch, and the totals across a checkpoint."""

from __future__ import annotations

from dataclasses import replace

import lightning as L
import pytest

from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from tests.helpers import KeywordEnvFactory

pytestmark = pytest.mark.timeout(300)


class DropSecondEpisode(OPDModule):
    """M2 stand-in: every batch's second episode loses its loss mask; records what the counters log."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.logged: list[dict[str, float]] = []

    def plan_batch(self, batch, student_logprobs=None):
        mask = batch.loss_mask.clone()
        mask[1:2] = 0
        return replace(batch, loss_mask=mask)

    def log_rollout_counts(self, batch):
        values = super().log_rollout_counts(batch)
        self.logged.append(values)
        return values


def test_generated_and_used_per_step_and_cumulative(model_dirs):
    model = DropSecondEpisode(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=3, max_turns=2, max_new_tokens=4,
                           eval_batch_size=2)
    L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0).fit(model, datamodule=dm)
    assert model.logged == [
        {"rollouts/generated": 3, "rollouts/used": 2, "rollouts/generated_total": 3 * k, "rollouts/used_total": 2 * k}
        for k in (1, 2, 3)]
    checkpoint = {}
    model.on_save_checkpoint(checkpoint)
    assert checkpoint["rollout_totals"] == {"generated": 9, "used": 6}
    resumed = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    assert resumed.step_metrics.rollout_totals == {"generated": 0, "used": 0}
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.step_metrics.rollout_totals == {"generated": 9, "used": 6}
