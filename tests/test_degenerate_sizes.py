"""F17 (docs/faults.md): every size down to 1 runs the same path as the common case. A fit with one turn
(H = 1, so every per-turn tensor has one element), one episode per step, one-token replies, and a batch
with no rows at all (every environment failed at reset) or no supervised token (no reply fits the
context) trains, logs finite metrics and, where nothing is supervised, has loss 0 and leaves the
weights unchanged. Each size runs with the default loss and with ATOD's hybrid loss (collection-time
pass, T-DUR, two updates per batch)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_opd.data import RolloutDataModule
from lightning_opd.losses import ClippedSurrogate
from lightning_opd.learner import ATODModule, OPDModule
from lightning_opd.analysis.report import read_scalars
from tests.helpers import KeywordEnvFactory

# name -> (RolloutDataModule overrides, OPDModule overrides, supervised tokens expected)
SIZES = {
    "one_turn": (dict(max_turns=1), dict(max_logged_turns=1), True),
    "one_episode": (dict(episodes_per_step=1), {}, True),
    "one_token_reply": (dict(max_new_tokens=1), {}, True),
    "all_ones": (dict(max_turns=1, episodes_per_step=1, max_new_tokens=1), dict(max_logged_turns=1), True),
    "no_rows": (dict(env=KeywordEnvFactory(reset_error=True), max_env_error_rate=1.0), {}, False),
    "no_supervised_token": (dict(max_context_tokens=8), {}, False),  # the first prompt alone is longer
}
LOSSES = {"reverse_kl": {}, "atod": dict(loss=ClippedSurrogate(), kappa=0.5, tdur=True, ppo_epochs=2)}


class StepLosses(L.Callback):
    """The loss every rollout batch returned."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("size", SIZES)
def test_fit_runs_at_every_degenerate_size(model_dirs, tmp_path, size, loss):
    data_kw, model_kw, supervised = SIZES[size]
    dm = RolloutDataModule(**{**dict(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2,
                                     max_new_tokens=4, eval_batch_size=2, seed=0), **data_kw})
    cls = ATODModule if loss == "atod" else OPDModule
    model = cls(student=model_dirs["student"], teacher=model_dirs["teacher"], **model_kw, **LOSSES[loss])
    model.configure_model()
    before = {k: v.clone() for k, v in model.student.state_dict().items()}
    logger, losses = TensorBoardLogger(str(tmp_path), name="run"), StepLosses()
    trainer = L.Trainer(accelerator="cpu", max_steps=2 * model.updates_per_batch, logger=logger, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[losses])
    trainer.fit(model, datamodule=dm)
    logger.experiment.flush()

    assert model.policy_version == 2 and len(losses.losses) == 2
    assert all(math.isfinite(v) for v in losses.losses)
    series = {tag: dict(zip(*steps_values)) for tag, steps_values in read_scalars(logger.log_dir).items()}
    for tag, values in series.items():
        for step, value in values.items():
            # NaN is the documented value of kl/turn_NN at a step where no episode reached turn NN, and of
            # rollout/lag_mean and lag_min at a step where no episode has a reply (none reached turn 0)
            unreached = tag.startswith("kl/turn_") and series[f"turn/survivors_{tag[-2:]}"][step] == 0
            no_reply = (tag in ("rollout/lag_mean", "rollout/lag_min")
                        and series.get("turn/survivors_00", {}).get(step, 0) == 0)
            assert math.isfinite(value) or unreached or no_reply, (tag, step, value)
    if supervised:
        assert sorted(series["kl/turn_00"]) == [0, 1] and all(math.isfinite(v) for v in series["kl/turn_00"].values())
        assert all(v > 0 for v in series["train/supervised_tokens"].values())
        if data_kw.get("max_turns") == 1:
            assert not any(tag.startswith(("kl/turn_01", "turn/survivors_01")) for tag in series)
    else:
        assert losses.losses == [0.0, 0.0]
        assert set(series["train/supervised_tokens"].values()) == {0.0}
        assert not any(tag.startswith("kl/turn_") for tag in series)  # no turn ever reached: no key
        after = model.student.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
