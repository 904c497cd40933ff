"""Asynchronous and forced-lag rollouts end to end on the tiny model: version tagging, lag bounds,
that stale batches really come from old weights, crash propagation and shutdown."""

from __future__ import annotations

import signal
import threading
import time

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.losses.divergences import log_probs
from lightning_opd.rollout.producer import ProducerError
from tests.helpers import KeywordEnvFactory
from tests.learner.test_training import RecordingOPD

pytestmark = pytest.mark.timeout(300)


def _dm(**kw):
    args = dict(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4, eval_batch_size=2)
    args.update(kw)
    return RolloutDataModule(**args)


def _trainer(steps):
    return L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)


class RecordingWithLogprobs(RecordingOPD):
    """Also recomputes, for each batch, the behaviour log-probs under the learner's current weights."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.drift = []

    def _check_on_policy(self, batch):
        with torch.no_grad():
            logits = self.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
            lp = log_probs(logits, batch.sampling.temperature).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        mask = batch.loss_mask[:, 1:] > 0
        self.drift.append((lp - batch.behaviour_logprobs[:, 1:])[mask].abs().max().item())
        return super()._check_on_policy(batch)


def test_forced_lag_uses_the_weights_of_version_v_minus_k(model_dirs):
    model = RecordingWithLogprobs(student=model_dirs["student"], teacher=model_dirs["teacher"],
                                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = _dm(forced_lag=2)
    _trainer(6).fit(model, datamodule=dm)
    assert [(v, b) for v, b in model.seen] == [(0, [0, 0]), (1, [0, 0]), (2, [0, 0]), (3, [1, 1]), (4, [2, 2]),
                                               (5, [3, 3])]
    # versions 0 (lag 0) match the learner; lagged batches were really sampled by older weights
    assert model.drift[0] < 1e-4
    assert min(model.drift[1:]) > 1e-3
    assert dm.max_allowed_lag == 2 and sorted(map(int, dm.session.weight_sync.snapshots())) == [4, 5, 6]


def test_sync_hf_run_has_lag_zero_and_no_weight_copy(model_dirs):
    model = RecordingWithLogprobs(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = _dm()
    _trainer(3).fit(model, datamodule=dm)
    assert all(b == [v, v] for v, b in model.seen)
    assert max(model.drift) < 1e-4
    assert dm.generator._own_model is None  # synchronous HF samples from the live student


@pytest.mark.parametrize("producer_lead", [1, 2])
def test_async_lags_are_bounded_and_the_producer_stops(model_dirs, producer_lead):
    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = _dm(mode="async", producer_lead=producer_lead)
    _trainer(6).fit(model, datamodule=dm)
    lags = [v - b for v, bs in model.seen for b in bs]
    assert len(model.seen) == 6 and all(0 <= lag <= producer_lead for lag in lags)
    assert not dm.session.producer.running
    assert not any(t.name == "rollout-producer" and t.is_alive() for t in threading.enumerate())


@pytest.mark.timeout(120)
def test_async_pushes_rarer_than_the_lag_gate_finish(model_dirs):
    """F18 (the issue's case): producer_lead 1 with a push every 3 versions used to leave the learner waiting at
    version 2 for a batch the producer would only start after the push at 3. Batch v is sampled by the push
    at ``(v - 1) // 3 * 3`` or later; the last push is at version 3."""
    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = _dm(mode="async", producer_lead=1, weight_sync_interval=3)
    _trainer(5).fit(model, datamodule=dm)
    assert [v for v, _ in model.seen] == [0, 1, 2, 3, 4]
    for v, behaviour in model.seen:
        assert all(max(0, (v - 1) // 3 * 3) <= b <= v for b in behaviour), (v, behaviour)
    assert dm.generator.policy_version == 3 and dm.max_allowed_lag == 3
    assert not dm.session.producer.running


def test_async_producer_crash_surfaces_in_the_trainer(model_dirs):
    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = _dm(mode="async", producer_lead=1, env=KeywordEnvFactory(reset_error=True), max_env_error_rate=0.0)
    t0 = time.time()
    with pytest.raises(ProducerError, match="EnvironmentFailureError"):
        _trainer(3).fit(model, datamodule=dm)
    assert time.time() - t0 < 60
    assert not any(t.name == "rollout-producer" and t.is_alive() for t in threading.enumerate())


def test_group_ids_are_shared_within_a_group_and_unique_across(model_dirs):
    dm = _dm(episodes_per_step=4, group_size=2)
    specs = dm.sampler.next_episodes(4) + dm.sampler.next_episodes(4)
    assert [s.group_id for s in specs] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert specs[0].task_id == specs[1].task_id and specs[0].seed != specs[1].seed
    with pytest.raises(ValueError, match="multiple of data.init_args.group_size=2"):
        _dm(episodes_per_step=3, group_size=2)
    with pytest.raises(ValueError, match="forced_lag"):
        _dm(mode="async", forced_lag=2)


class RaiseAt(L.Callback):
    def __init__(self, step, exc):
        self.step, self.exc = step, exc

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise self.exc


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("boom in a callback")], ids=["ctrl-c", "error"])
def test_ctrl_c_and_errors_stop_the_producer(model_dirs, exc):
    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = _dm(mode="async", producer_lead=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=10, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[RaiseAt(2, exc)])
    expected = SystemExit if isinstance(exc, KeyboardInterrupt) else RuntimeError
    t0 = time.time()
    handler = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a Ctrl-C: restore it
    try:
        with pytest.raises(expected):
            trainer.fit(model, datamodule=dm)
    finally:
        signal.signal(signal.SIGINT, handler)
    assert time.time() - t0 < 120
    assert not dm.session.producer.running
    assert not any(t.name == "rollout-producer" and t.is_alive() for t in threading.enumerate())


@pytest.mark.timeout(180)
def test_staleness_monitor_falls_back_to_synchronous_generation(model_dirs):
    """Producer-side control end to end (docs/algorithms.md §1.5.1): producer_lead 2, a floor no step can reach
    (fallback after step 0, never back). Batches up to 3 may be made under the lead of 2 (batch 3 needs
    version 1, pushed before the monitor lowers the lead); from batch 4 on each is sampled by its own version."""
    from lightning_opd.callbacks.staleness_monitor import StalenessMonitor

    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = _dm(mode="async", producer_lead=2)
    monitor = StalenessMonitor(fallback_freshness=1.0, low_freshness=1.0, high_freshness=1.0, patience=1)
    trainer = _trainer(6)
    trainer.callbacks.append(monitor)
    trainer.fit(model, datamodule=dm)
    assert [v for v, _ in model.seen] == list(range(6))
    assert all(b == [v, v] for v, b in model.seen[4:]), model.seen
    assert monitor.sync_fallback.active and dm.lead_in_use == 0 and dm.max_allowed_lag == 2
    assert not dm.session.producer.running
