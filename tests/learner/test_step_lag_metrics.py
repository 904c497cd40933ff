"""Per-step asynchrony logs (issue 44, design 3): the realised lag (``rollout/lag_min``, ``lag_mean``, ``lag_max``),
the producer's lead (``rollout/producer_lead``, async only) and the synchronous fallback
(``staleness/sync_fallback_step``, ``staleness/sync_fallback_steps``), read from what the module logs at every step
of real fits on the tiny models."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from lightning_opd.learner.step_metrics import StepMetrics
from tests.helpers import KeywordEnvFactory

pytestmark = pytest.mark.timeout(300)
LAGS = ("rollout/lag_min", "rollout/lag_mean", "rollout/lag_max")


class LogRecording(OPDModule):
    """Records every value logged during training, by step (0-based: the version the step trained, i.e. the
    module's ``policy_version`` minus 1 once ``training_step`` moved it)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps: dict[int, dict[str, float]] = {}

    def log(self, name, value, *args, **kwargs):
        if self.trainer.training:
            self.steps.setdefault(self.policy_version - 1, {})[name] = float(value)
        return super().log(name, value, *args, **kwargs)

    def series(self, key: str) -> list[float | None]:
        return [self.steps[s].get(key) for s in sorted(self.steps)]


def _fit(model_dirs, steps: int, callbacks=(), **data) -> LogRecording:
    model = LogRecording(student=model_dirs["student"], teacher=model_dirs["teacher"], log_text_every_n_steps=0)
    dm = RolloutDataModule(**{**dict(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                                     eval_batch_size=2, seed=0), **data})
    L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
              callbacks=list(callbacks)).fit(model, datamodule=dm)
    return model


def test_forced_lag_two_logs_lags_zero_one_two_two(model_dirs):
    """forced_lag 2: the step at version v trains on episodes of version max(0, v - 2), so every episode of steps
    0, 1, 2, 3 is 0, 1, 2, 2 versions behind; a synchronous mode logs no producer lead."""
    model = _fit(model_dirs, 4, forced_lag=2)
    for key in LAGS:
        assert model.series(key) == [0.0, 1.0, 2.0, 2.0], key
    assert "rollout/producer_lead" not in model.steps[0]


def test_sync_run_logs_lag_zero(model_dirs):
    model = _fit(model_dirs, 2)
    for key in LAGS:
        assert model.series(key) == [0.0, 0.0], key


def test_async_without_a_monitor_logs_the_configured_lead_and_bounded_lags(model_dirs):
    model = _fit(model_dirs, 4, mode="async", producer_lead=2)
    assert model.series("rollout/producer_lead") == [2.0] * 4
    for step in model.steps.values():
        low, mean, high = (step[k] for k in LAGS)
        assert 0 <= low <= mean <= high <= 2  # max_allowed_lag = producer_lead + 1 - 1
    assert not any(k.startswith("staleness/") for step in model.steps.values() for k in step)


def test_async_fallback_steps_are_counted_and_their_batches_have_lag_zero(model_dirs):
    """The producer-side control's fallback forced after step 0 (a freshness floor of 1 no step reaches, patience 1;
    as tests/test_async.py): step 0 asked for its batch under the lead of 2 (Δ_max 4 at train start), steps 1-5 under
    lead 0 and ran in the fallback (1 each, 5 in all); from step 4 on every batch is played by the learner's own
    version (lag 0; batches up to 3 may have been made under the lead of 2)."""
    monitor = StalenessMonitor(fallback_freshness=1.0, low_freshness=1.0, high_freshness=1.0, patience=1)
    model = _fit(model_dirs, 6, callbacks=[monitor], mode="async", producer_lead=2)
    assert model.series("rollout/producer_lead") == [2.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert model.series("staleness/sync_fallback") == [1.0] * 6  # the state after each step
    assert model.series("staleness/sync_fallback_step") == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert model.series("staleness/sync_fallback_steps") == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    for key in LAGS:
        assert model.series(key)[4:] == [0.0, 0.0], key
    assert monitor.state_dict()["sync_fallback_steps"] == 5


def test_lag_mean_and_min_leave_out_rows_without_a_reply():
    """A row whose context was full before the first turn (behaviour version -1) has no lag (F17): with every row
    like that the step's lag mean and min are NaN, not 0; otherwise over the rows with a reply (lags 3 and 1)."""
    one_process = SimpleNamespace(device="cpu", reduce_sum=lambda t: t, reduce_max=lambda t: t)
    record = SimpleNamespace(batch=SimpleNamespace(trajectories=[]), lag_max=0, lags=torch.tensor([-1, -1]),
                             lead_in_use=None)
    values = StepMetrics._rollout_values(one_process, record)
    assert math.isnan(values["rollout/lag_mean"]) and math.isnan(values["rollout/lag_min"])
    assert "rollout/producer_lead" not in values
    record.lags, record.lead_in_use = torch.tensor([-1, 3, 1]), 2
    values = StepMetrics._rollout_values(one_process, record)
    assert (values["rollout/lag_mean"], values["rollout/lag_min"], values["rollout/producer_lead"]) == (2.0, 1.0, 2.0)
