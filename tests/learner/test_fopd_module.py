"""f-OPD inside ``OPDModule`` (issue 39, docs/algorithms.md §6.2 and F17): M3's truncated ratio is
``sg(min(π_old/π_b, C))`` with π_old the learner before the step's first update, so with several PPO updates per
batch the surrogate's own ratio is not counted twice (lag 0: every weight exactly 1 on every update), and rows
without a reply (behaviour version -1) have no lag in ``plan_batch``: they are never dropped for it and never
decide their GRPO group's fate."""

from __future__ import annotations

import math
from dataclasses import replace

import lightning as L
import pytest
import torch

from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import ATODModule, OPDModule
from lightning_opd.losses.freshness import NO_LAG, FreshnessConfig, FreshnessWeighting
from tests.helpers import KeywordEnvFactory
from tests.losses.test_freshness import no_reply_batch


class ExactBehaviour(ATODModule):
    """ATOD with the behaviour log-probs of every supervised token set to the learner's before the step's first
    update (an exact generator at lag 0; the generator's own numerics are not the subject here), recording on every
    micro-batch of every update M3's weights, the current log-probs and π_old of the supervised tokens."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._token_weights, self.weightings.token_weights = self.weightings.token_weights, self.token_weights

    def plan_batch(self, batch, student_logprobs=None):
        blp = batch.behaviour_logprobs.clone()
        blp[:, 1:] = torch.where(batch.loss_mask[:, 1:] > 0, student_logprobs, blp[:, 1:])
        return super().plan_batch(replace(batch, behaviour_logprobs=blp), student_logprobs)

    def token_weights(self, batch, token_loss):  # wraps LossWeightings.token_weights
        weights = self._token_weights(batch, token_loss)
        keep = batch.loss_mask[:, 1:] > 0
        self.seen.append((self.trainer.global_step, weights[keep].detach().clone(),
                          token_loss.student_logprobs[keep].detach().clone(), batch.old_logprobs[:, 1:][keep].clone()))
        return weights


@pytest.mark.timeout(300)
def test_truncated_ratio_is_one_at_lag_zero_on_every_ppo_update(model_dirs):
    """Synchronous (lag 0), ATOD with 2 PPO epochs x 2 mini-batches (4 updates per rollout batch), micro-batches of
    1 row, M3 on, 2 rollout batches: π_b = π_old, so sg(min(π_old/π_b, 2)) = exp(0) = 1 on every supervised token of
    every micro-batch of every update. Before, π_θ of the current forward replaced π_old: from the second update on
    π_θ ≠ π_old (asserted below), so the weight was π_θ/π_old, the surrogate's ratio a second time."""
    L.seed_everything(0)
    model = ExactBehaviour(student=model_dirs["student"], teacher=model_dirs["teacher"], ppo_epochs=2,
                           ppo_mini_batches=2, micro_batch_size=1)
    mon = StalenessMonitor(FreshnessConfig(truncated_ratio=True, weighting=False, filtering=False), adaptive_lag=False)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=4, max_turns=3, max_new_tokens=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[mon])
    trainer.fit(model, datamodule=dm)
    assert model.policy_version == 2 and len(model.seen) == 2 * 4 * 2  # batches x updates x micro-batches
    for step, weights, _, _ in model.seen:
        assert weights.numel() > 0 and torch.equal(weights, torch.ones_like(weights)), step
    moved = [not torch.equal(current, old) for step, _, current, old in model.seen if step % 4 != 0]
    assert all(moved)  # after an update of the batch, π_θ differs from π_old: the old weight was not 1
    assert trainer.callback_metrics["train/ratio_mean"].item() == 1.0
    assert trainer.callback_metrics["train/ratio_clip_frac"].item() == 0.0


def test_plan_batch_gives_a_row_without_a_reply_no_lag(model_dirs):
    """Learner at version 5, bound 4, GRPO groups of 2; row 1 has no reply (behaviour version -1, no sampled token)
    and shares group 0 with row 0 (lag 1). Before: its lag 5 - (-1) = 6 > 4 dropped group 0 whole (rows 0 and 1)
    and entered the statistics (lag_max 6, lag_mean (1 + 6 + 1 + 1) / 4 = 2.25). Now nothing is dropped and the
    statistics are those of rows 0, 2, 3: lag 1, f = sigmoid(4 - 2/8 * 4) = sigmoid(3) = 0.9526."""
    module = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    module.configure_freshness(FreshnessWeighting(FreshnessConfig(min_freshness=0.05), lag_bound=4))
    module.policy_version = 5
    batch, student = no_reply_batch()
    planned = module.plan_batch(batch, student)
    assert torch.equal(planned.loss_mask, batch.loss_mask)  # group 0 survives
    st = module.weightings.freshness.report().stats
    assert (st["lag_mean"], st["lag_max"], st["dropped_samples"], st["dropped_groups"]) == (1.0, 1.0, 0.0, 0.0)
    assert st["freshness_min"] == pytest.approx(1 / (1 + math.exp(-3)))
    torch.testing.assert_close(planned.sample_weight[[0, 2, 3]], torch.ones(3))  # equal freshness: weights 1
    assert module.lags.sample_lags(module.policy_version, batch).tolist() == [1, NO_LAG, 1, 1]
