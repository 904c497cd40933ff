"""conf/model/lr_warmup2.yaml (issue 44's "lr 1e-5 with a 2-update linear warm-up"): LinearLR(start_factor 1/3,
total_iters 2), stepped by the learner once per applied optimizer update, so updates 1, 2, 3, ... run at L/3, 2L/3,
L, L, ... (worked out by hand in the file's header), also when one rollout batch makes several updates (ATOD)."""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import ATODModule
from lightning_opd.losses import ClippedSurrogate, EpisodeReward
from tests.helpers import KeywordEnvFactory

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
LR = 1e-5
BY_HAND = [LR / 3, 2 * LR / 3, LR, LR, LR, LR]  # the rate each of updates 1-6 runs at


def warmup_factory():
    """The file's ``lr_scheduler`` as the factory the CLI hands the module (``optimizer -> scheduler``)."""
    node = yaml.safe_load((ROOT / "conf" / "model" / "lr_warmup2.yaml").read_text())
    node = node["model"]["init_args"]["lr_scheduler"]
    module, _, name = node["class_path"].rpartition(".")
    return functools.partial(getattr(importlib.import_module(module), name), **node["init_args"])


def test_the_file_is_linear_lr_over_two_updates():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = warmup_factory()(opt)
    used = []
    for _ in range(6):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert used == pytest.approx(BY_HAND, rel=1e-12, abs=0)


class LrRecording(ATODModule):
    """Records the learning rate every applied optimizer update runs at (before the step)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.lrs: list[float] = []

    def apply_update(self, opt, sched, loss, clip, filtered):
        self.lrs.append(opt.optimizer.param_groups[0]["lr"])
        return super().apply_update(opt, sched, loss, clip, filtered)


def test_atod_steps_the_warm_up_once_per_optimizer_update(model_dirs):
    """3 rollout batches x 2 updates (ppo_mini_batches 2), GRPO (kappa 0, rho 1) as in atod_pilot.yaml: the
    warm-up spans the first batch's two updates; the scheduler is stepped by the module only (manual optimization:
    Lightning steps none), once per update, not per batch."""
    model = LrRecording(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=ClippedSurrogate(),
                        kappa=0.0, rho=1.0, ppo_mini_batches=2, reward=EpisodeReward(1.0, 0.5),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=LR), lr_scheduler=warmup_factory(),
                        aggregation="sequence", log_text_every_n_steps=0)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=4, group_size=2, max_turns=2,
                           max_new_tokens=4, eval_batch_size=2, seed=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 6 and model.policy_version == 3
    assert model.lrs == pytest.approx(BY_HAND, rel=1e-12, abs=0)
    # train/lr is logged after a batch's updates: the rate of the next update (LR after batch 1's two updates)
    assert trainer.callback_metrics["train/lr"].item() == pytest.approx(LR, rel=1e-6)
