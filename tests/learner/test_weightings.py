"""``LossWeightings`` (lightning_opd/learner/weightings.py): the learner's token weightings as one object, taking
tensors and a reducer, never the module."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_opd.learner.weightings import LossWeightings, check_behaviour_signal, uses_behaviour_logprobs
from lightning_opd.losses import FullVocabReverseKL, SampledTokenReverseKL
from lightning_opd.losses.base import TokenLoss
from lightning_opd.losses.freshness import FreshnessConfig, FreshnessWeighting
from lightning_opd.losses.off_policy import OffPolicyConfig, TruncatedRatio, UncorrectedOffPolicyError
from lightning_opd.losses.turn_blend import TurnBlendWeighting
from lightning_opd.rollout.weight_sync import SyncConfig, WeightSync
from tests.losses.test_freshness import _batch


def _token_loss(student: torch.Tensor) -> TokenLoss:
    zeros = torch.zeros_like(student)
    return TokenLoss(loss=torch.ones_like(student), kl=zeros, student_logprobs=student, teacher_logprobs=zeros,
                     entropy=zeros)


def test_token_weights_multiply_sample_weights_then_ratio_then_turn_blend():
    """Two rows of 4 supervised tokens: sample weights (2, 0.5), ratios exp(0.5) and exp(1) capped at 2, a turn blend
    at alpha 0 (every weight 1): the product in that order, bit for bit."""
    batch, student = _batch(lags=[1, 1], groups=[0, 1], drift=[0.5, 1.0])
    batch = replace(batch, sample_weight=torch.tensor([2.0, 0.5]))
    w = LossWeightings(SampledTokenReverseKL())
    w.truncated_ratio = TruncatedRatio(2.0)
    w.configure_turn_blend(TurnBlendWeighting(0.0))
    out = w.token_weights(batch, _token_loss(student))
    sample = batch.sample_weight[:, None].expand(-1, batch.input_ids.shape[1] - 1)
    ratio = torch.exp(student - batch.behaviour_logprobs[:, 1:]).clamp(max=2.0)
    blend = TurnBlendWeighting(0.0).token_weights(batch.loss_mask[:, 1:], batch.turn_index[:, 1:], torch.float32)
    expected = sample * ratio if blend is None else sample * ratio * blend
    assert torch.equal(out, expected)
    assert LossWeightings(FullVocabReverseKL()).token_weights(replace(batch, sample_weight=torch.ones(2)),
                                                              _token_loss(student)) is None


def test_the_ratio_is_resolved_from_the_loss_and_the_lag():
    w = LossWeightings(SampledTokenReverseKL())
    w.resolve(0)
    assert w.truncated_ratio is None and not w.uncorrected_off_policy
    w.resolve(2)
    assert isinstance(w.truncated_ratio, TruncatedRatio) and w.max_allowed_lag == 2
    w.configure_freshness(FreshnessWeighting(FreshnessConfig(truncated_ratio=True, ratio_cap=3.0)), max_allowed_lag=0)
    assert w.truncated_ratio.cap == 3.0 and w.needs_learner_logprobs
    with pytest.raises(UncorrectedOffPolicyError, match="freshness.truncated_ratio=false"):
        w.configure_truncated_ratio(False, max_allowed_lag=1)
    mid_fit = LossWeightings(SampledTokenReverseKL())
    mid_fit.resolve(2)  # setup: the data's lag
    with pytest.raises(UncorrectedOffPolicyError):  # a controller's opt-out without a lag is checked at that lag
        mid_fit.configure_truncated_ratio(False)
    assert mid_fit.max_allowed_lag == 2
    opted_out = LossWeightings(SampledTokenReverseKL(), OffPolicyConfig(truncated_ratio=False, allow_uncorrected=True))
    with pytest.warns(UserWarning, match="WITHOUT the importance ratio"):
        opted_out.resolve(1)
    assert opted_out.uncorrected_off_policy


def test_installers_refuse_other_types():
    w = LossWeightings(FullVocabReverseKL())
    with pytest.raises(TypeError, match="configure_freshness"):
        w.configure_freshness(object(), 0)
    with pytest.raises(TypeError, match="configure_turn_blend"):
        w.configure_turn_blend(object())
    assert w.plan_batch("batch", None, None, lambda t: t) == "batch" and w.report() is None  # no freshness: unchanged


def test_off_policy_metrics_without_the_ratio():
    w = LossWeightings(FullVocabReverseKL())
    out = w.off_policy_metrics({"kl": torch.tensor(3.0), "k1": torch.tensor(2.0)}, torch.tensor(4.0), False, 1, 4,
                               lambda t: t, "cpu")
    assert out == {"train/kl_k1": 0.5, "train/truncated_ratio": 0.0, "train/uncorrected_off_policy": 0.0,
                   "train/applied_updates": 1.0, "train/samples_per_update": 4.0}  # no exact KL: no gap


def test_behaviour_signal_needs_a_data_configuration_with_stale_batches():
    assert uses_behaviour_logprobs(SampledTokenReverseKL(signal="behaviour"))
    assert not uses_behaviour_logprobs(FullVocabReverseKL())
    check_behaviour_signal(SampledTokenReverseKL(signal="behaviour"), None)  # unconnected: nothing to check
    check_behaviour_signal(SampledTokenReverseKL(signal="behaviour"), WeightSync(SyncConfig(forced_lag=1)))
    with pytest.raises(ValueError, match="signal=behaviour"):
        check_behaviour_signal(SampledTokenReverseKL(signal="behaviour"), WeightSync(SyncConfig()))
