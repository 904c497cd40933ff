"""The truncated importance ratio and when it is on (docs/algorithms.md §7.1, PROPOSED) against hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_opd.losses import (ClippedSurrogate, FullVocabReverseKL, SampledTokenReverseKL, TeacherSignal,
                                  TeacherTopKRenormalizedReverseKL)
from lightning_opd.losses.off_policy import (OffPolicyConfig, TruncatedRatio, UncorrectedOffPolicyError,
                                             is_sampled_token_estimator, resolve_truncated_ratio)


def test_ratio_is_capped_detached_and_its_statistics_are_over_the_mask():
    old = torch.tensor([[0.0, math.log(3.0), math.log(0.5), 5.0]], requires_grad=True)
    behaviour = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is off the mask: not in the statistics
    estimate = torch.tensor([[0.2, 1.0, -0.4, 9.0]])
    ratio = TruncatedRatio(cap=2.0)
    r = ratio.token_weights(old, behaviour, mask, estimate)
    torch.testing.assert_close(r, torch.tensor([[1.0, 2.0, 0.5, 2.0]]))
    assert not r.requires_grad
    # ratios 1, 2 (clipped), 0.5 over 3 tokens; sum r * k1 = 0.2 + 2.0 - 0.2 = 2.0
    total, clipped, n, weighted = ratio.sums
    assert (total, clipped, n) == (3.5, 1.0, 3.0) and weighted == pytest.approx(2.0)
    ratio.step_sums().mul_(2)  # what an in-place all-reduce does to the tensor it is given: not this rank's sums
    assert ratio.sums[:3] == (3.5, 1.0, 3.0)
    ratio.start_step()
    assert ratio.sums == (0.0, 0.0, 0.0, 0.0)


def test_which_losses_are_sampled_token_estimators():
    assert is_sampled_token_estimator(SampledTokenReverseKL())
    assert is_sampled_token_estimator(ClippedSurrogate())
    assert not is_sampled_token_estimator(FullVocabReverseKL())
    assert not is_sampled_token_estimator(TeacherTopKRenormalizedReverseKL(k=4))

    class NewSampledLoss(FullVocabReverseKL):  # a new loss that reads only log p_T(a_t) and declares nothing
        teacher_signal = TeacherSignal.SAMPLED_TOKEN

    class NewTopKLoss(FullVocabReverseKL):
        teacher_signal = TeacherSignal.TOP_K

    assert is_sampled_token_estimator(NewSampledLoss()) and not is_sampled_token_estimator(NewTopKLoss())


def test_a_learner_that_accepts_any_lag_treats_a_sampled_token_loss_as_stale():
    """``strict_on_policy=false``: batches are not refused beyond max_allowed_lag, so any batch may be stale."""
    assert resolve_truncated_ratio(SampledTokenReverseKL(), 0, None, False, strict_lag=False) is True
    assert resolve_truncated_ratio(FullVocabReverseKL(), 0, None, False, strict_lag=False) is False


@pytest.mark.parametrize("loss, max_lag, expected", [
    (SampledTokenReverseKL(), 0, False),   # on-policy: nothing to correct
    (SampledTokenReverseKL(), 2, True),    # stale sampled tokens: part of the estimator
    (FullVocabReverseKL(), 2, False),      # analytic: only the state distribution is stale
    (TeacherTopKRenormalizedReverseKL(k=4), 3, False),
])
def test_auto_is_on_exactly_for_a_sampled_token_loss_at_lag_one_or_more(loss, max_lag, expected):
    assert resolve_truncated_ratio(loss, max_lag, None, allow_uncorrected=False) is expected


def test_turning_it_off_for_stale_sampled_tokens_is_refused_with_the_keys_unless_opted_out():
    with pytest.raises(UncorrectedOffPolicyError) as err:
        resolve_truncated_ratio(SampledTokenReverseKL(), 2, False, allow_uncorrected=False)
    message = str(err.value)
    for needle in ("model.init_args.off_policy.truncated_ratio=false", "SampledTokenReverseKL", "2 versions old",
                   "model.init_args.off_policy.allow_uncorrected=true"):
        assert needle in message
    assert resolve_truncated_ratio(SampledTokenReverseKL(), 2, False, allow_uncorrected=True) is False
    assert resolve_truncated_ratio(SampledTokenReverseKL(), 0, False, allow_uncorrected=False) is False
    assert resolve_truncated_ratio(FullVocabReverseKL(), 2, False, allow_uncorrected=False) is False
    assert resolve_truncated_ratio(FullVocabReverseKL(), 0, True, allow_uncorrected=False) is True


def test_config_refuses_a_non_positive_cap():
    with pytest.raises(ValueError, match=r"model.init_args.off_policy.ratio_cap=0"):
        OffPolicyConfig(ratio_cap=0)
