"""The vanilla-async baseline in the module: SampledTokenReverseKL(signal="behaviour") takes the batch's
rollout-time log-probs as its OPD signal (loss_inputs), refused where every batch has lag 0, and under
forced lag the log-probs it gets come from the older weights."""

from __future__ import annotations

from dataclasses import replace

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from lightning_opd.learner.weightings import check_behaviour_signal
from lightning_opd.losses import SampledTokenReverseKL
from lightning_opd.losses.divergences import log_probs
from lightning_opd.rollout.weight_sync import SyncConfig, WeightSync
from tests.helpers import KeywordEnvFactory
from tests.learner.test_module import make_batch, step_grads
from tests.learner.test_training import RecordingOPD

pytestmark = pytest.mark.timeout(300)


def _module(model_dirs, signal):
    m = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=SampledTokenReverseKL(signal=signal))
    m.configure_model()
    return m


def _with_behaviour(module, batch, drift: float):
    """The batch with behaviour log-probs = the learner's minus ``drift`` on supervised tokens (nats)."""
    lp = module.student_logprobs(batch)
    blp = batch.behaviour_logprobs.clone()
    blp[:, 1:] = torch.where(batch.loss_mask[:, 1:] > 0, lp - drift, blp[:, 1:])
    return replace(batch, behaviour_logprobs=blp)


def _mean_logprob_grads(module, batch):
    """grad of (1/N) sum over supervised tokens of log p_S(a_t): what the drift term multiplies."""
    module.student.zero_grad(set_to_none=True)
    logits = module.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    lp = log_probs(logits, 1.0).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:]
    ((lp * mask).sum() / mask.sum()).backward()
    return {n: p.grad.clone() for n, p in module.student.named_parameters() if p.grad is not None}


def test_signal_changes_loss_and_gradient_as_the_formula_says(model_dirs, tokenizer):
    """loss_b = loss - drift per token, grad_b = grad - drift * grad mean log p_S (token mean, §0.5); drift 0
    (lag 0): the same loss and gradient as the recomputed signal."""
    recomputed, stale = _module(model_dirs, "recomputed"), _module(model_dirs, "behaviour")
    batch = make_batch(tokenizer)
    mask = batch.loss_mask[:, 1:] > 0
    base_out, _, _ = recomputed.token_losses(batch)
    base_sums, base_grads = step_grads(recomputed, batch)
    for drift in (0.0, 0.3):
        b = _with_behaviour(stale, batch, drift)
        out, _, _ = stale.token_losses(b)
        assert torch.allclose(out.loss[mask], base_out.loss[mask] - drift, atol=1e-5)
        sums, grads = step_grads(stale, b)
        direction = _mean_logprob_grads(stale, batch)
        assert sums["loss"].item() == pytest.approx(base_sums["loss"].item() - drift, abs=1e-5)
        for name, g in grads.items():
            assert torch.allclose(g, base_grads[name] - drift * direction[name], atol=1e-5), name
    assert stale.loss_inputs(batch)["behaviour_logprobs"].shape == batch.loss_mask[:, 1:].shape
    assert recomputed.loss_inputs(batch) == {}


@pytest.mark.parametrize(("config", "refused"), [
    (SyncConfig(), True), (SyncConfig(forced_lag=2), False), (SyncConfig("async", 1), False)])
def test_refused_where_every_batch_has_lag_zero(model_dirs, config, refused):
    m = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"],
                  loss=SampledTokenReverseKL(signal="behaviour"))
    m.weight_sync = WeightSync(config)
    if refused:
        with pytest.raises(ValueError, match=r"model.init_args.loss.init_args.signal=behaviour .* data.init_args.mode="
                                             r"sync and data.init_args.forced_lag=0"):
            check_behaviour_signal(m.loss_fn, m.weight_sync)
    else:
        check_behaviour_signal(m.loss_fn, m.weight_sync)
    m.weight_sync = WeightSync(SyncConfig())  # the recomputed signal is fine anywhere
    m.loss_fn = SampledTokenReverseKL()
    check_behaviour_signal(m.loss_fn, m.weight_sync)


class StaleSignalRecorder(RecordingOPD):
    """Records, per step, the largest |behaviour log-prob fed to the loss - learner log-prob| (nats)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.signal_drift = []

    def loss_inputs(self, batch):
        inputs = super().loss_inputs(batch)
        if batch.loss_mask[:, 1:].sum() > 0:
            mask = batch.loss_mask[:, 1:] > 0
            lp = self.student_logprobs(batch)
            self.signal_drift.append((self.policy_version, (lp - inputs["behaviour_logprobs"])[mask].abs().max().item()))
        return inputs


def _trainer(steps):
    return L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)


def _dm(**kw):
    return RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                             eval_batch_size=2, **kw)


def test_forced_lag_feeds_the_loss_log_probs_of_the_older_weights(model_dirs):
    """forced_lag=1: the batch of version v >= 1 was sampled by version v - 1, so the log-probs the stale
    signal uses differ from the learner's (the weights moved with lr 1e-2), while version 0's match."""
    model = StaleSignalRecorder(student=model_dirs["student"], teacher=model_dirs["teacher"],
                                loss=SampledTokenReverseKL(signal="behaviour"),
                                optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    _trainer(3).fit(model, datamodule=_dm(forced_lag=1))
    assert [v for v, _ in model.seen] == [0, 1, 2] and [b for _, b in model.seen] == [[0, 0], [0, 0], [1, 1]]
    drift = dict(model.signal_drift)
    assert drift[0] < 1e-4 and drift[1] > 1e-3 and drift[2] > 1e-3


def test_plain_sync_fit_refuses_the_stale_signal(model_dirs):
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"],
                      loss=SampledTokenReverseKL(signal="behaviour"))
    with pytest.raises(ValueError, match="data.init_args.forced_lag=k"):
        _trainer(1).fit(model, datamodule=_dm())
