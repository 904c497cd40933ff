"""F29: held-out evaluation inside an asynchronous fit plays the learner's current weights, and the version it
played is logged (``val/policy_version``, ``val/version_gap``)."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_opd.data import RolloutDataModule
from tests.helpers import KeywordEnvFactory
from tests.learner.test_training import RecordingOPD


class PlayedVersions(L.Callback):
    """Per validation: the learner's version, the behaviour versions of the held-out episodes, and the logged
    ``val/policy_version`` / ``val/version_gap``."""

    def __init__(self):
        self.played, self.logged = [], []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.played.append((pl_module.policy_version, batch.behaviour_version.tolist()))

    def on_validation_epoch_end(self, trainer, pl_module):
        self.logged.append(pl_module.policy_version)

    def on_validation_end(self, trainer, pl_module):
        m = trainer.callback_metrics  # None: not logged
        self.logged[-1] = (self.logged[-1], *(float(m[k]) if k in m else None for k in ("val/policy_version",
                                                                                        "val/version_gap")))


@pytest.mark.timeout(300)
def test_async_evaluation_plays_the_learners_version(model_dirs):
    """producer_lead 1, a push every 2 versions, validation after every step (versions 1..5). On main the generator
    held the last even push at odd versions (learner 1 played by 0, 3 by 2, 5 by 4) and nothing said so; now
    every held-out episode is played by the learner's version, the logged version equals it, the gap is 0, and
    training batches stay within max_allowed_lag = 1 + 2 - 1 = 2."""
    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                           eval_batch_size=2, mode="async", producer_lead=1, weight_sync_interval=2)
    rec = PlayedVersions()
    L.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=1, check_val_every_n_epoch=None,
              limit_val_batches=1, callbacks=[rec]).fit(model, datamodule=dm)
    assert rec.played == [(v, [v, v]) for v in range(1, 6)]
    assert rec.logged == [(v, float(v), 0.0) for v in range(1, 6)]
    assert [v for v, _ in model.seen] == [0, 1, 2, 3, 4]
    assert all(0 <= v - b <= 2 for v, bs in model.seen for b in bs), model.seen
    assert not dm.session.producer.running
