"""TurnOPD end to end on the tiny models: RolloutDepthController and TurnLossBlend in one synchronous
``Trainer.fit``; probe batches run at full depth, the others at the cap the controller decided."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_opd.callbacks.rollout_depth import RolloutDepthController
from lightning_opd.callbacks.turn_loss_blend import TurnLossBlend
from lightning_opd.data import RolloutDataModule
from tests.helpers import KeywordEnvFactory
from tests.learner.test_training import RecordingOPD

pytestmark = pytest.mark.timeout(300)


class Batches(RecordingOPD):
    """Also records, per step, the DataModule's cap when the batch was pulled and the batch's flags."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.batches = []

    def _check_on_policy(self, batch):
        self.batches.append((self.trainer.datamodule.max_turns, batch.is_probe.tolist(), batch.rollout_cap.tolist()))
        return super()._check_on_policy(batch)


class CapsAfterStep(L.Callback):
    def __init__(self, ctrl):
        self.ctrl, self.caps = ctrl, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.caps.append(self.ctrl.cap)


def test_fit_with_depth_controller_and_turn_blend(model_dirs):
    h_max, steps = 4, 4
    model = Batches(student=model_dirs["student"], teacher=model_dirs["teacher"], max_logged_turns=h_max)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=9), episodes_per_step=2, max_turns=h_max, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    ctrl = RolloutDepthController(h_min=1, warmup=2, probe_interval=3)  # probes at k = 0, 1, 3
    blend = TurnLossBlend()
    caps = CapsAfterStep(ctrl)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[ctrl, blend, caps])
    trainer.fit(model, datamodule=dm)

    assert model.weightings.turn_blend is blend.weighting and model.weightings.freshness is None and blend.horizon == steps
    probes = [k for k, (_, flags, _) in enumerate(model.batches) if all(flags)]
    assert probes == [0, 1, 3] and all(not any(f) for k, (_, f, _) in enumerate(model.batches) if k not in probes)
    for k, (dm_cap, flags, rollout_caps) in enumerate(model.batches):
        if k in probes:
            assert rollout_caps == [h_max, h_max]  # probes carry full depth
        else:  # a non-probe batch runs at the cap the controller set after the previous step
            assert rollout_caps == [caps.caps[k - 1]] * 2 == [dm_cap] * 2
    assert caps.caps[1] < h_max  # the controller lowered the cap (random KL sits on the early turns)
    assert dm.max_turns == ctrl.cap == caps.caps[-1] and ctrl.h_max == h_max
    metrics = trainer.callback_metrics
    assert float(metrics["turn_blend/alpha"]) == pytest.approx(0.75)  # k = 3 of K = 4
    assert float(metrics["controller/cap"]) == ctrl.cap and float(metrics["controller/probe"]) == 1.0


def _fit(model_dirs, tmp_path, steps, ckpt_path=None, save=False):
    model = Batches(student=model_dirs["student"], teacher=model_dirs["teacher"], max_logged_turns=4)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=9), episodes_per_step=2, max_turns=4, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    ctrl, blend = RolloutDepthController(h_min=1, warmup=1, probe_interval=2), TurnLossBlend(total_steps=4)
    ckpt = [L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)] if save else []
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_checkpointing=save, callbacks=[ctrl, blend, *ckpt])
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model, ctrl


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_continues_the_controller_and_the_probe_schedule(model_dirs, tmp_path):
    """4 steps uninterrupted == 2 steps + resume + 2 steps: batches (caps, probe flags) and controller state."""
    full, full_ctrl = _fit(model_dirs, tmp_path / "full", 4)
    _fit(model_dirs, tmp_path / "half", 2, save=True)
    resumed, ctrl = _fit(model_dirs, tmp_path / "resumed", 4, ckpt_path=str(tmp_path / "half" / "last.ckpt"))
    assert resumed.batches == full.batches[2:]  # (DataModule cap, probe flags, rollout caps) per step
    assert ctrl.state_dict() == full_ctrl.state_dict()
