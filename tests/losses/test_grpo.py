"""GRPO group advantages on scripted rewards (incl. the all-equal and one-episode groups), F13 checks of the
reward function, the hybrid advantage (T-DUR never reaches the GRPO term) and the clipped surrogate's value
and gradient in the clipped and unclipped regions with ratios away from 1 (docs/algorithms.md §3.1)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_opd.losses import SampledTokenReverseKL
from lightning_opd.losses.grpo import (ClippedSurrogate, EpisodeReward, RewardFunctionError, clipped_surrogate,
                                       compute_rewards, group_advantages, hybrid_advantage)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 0.0, 5.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3])
    out = group_advantages(rewards, groups, eps=0.0)
    # group 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 2: mean 1, std sqrt(2)
    s = 1 / math.sqrt(2)
    expect = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, s, -s, 0.0])
    torch.testing.assert_close(out.advantage, expect, rtol=0, atol=1e-6)
    assert (out.groups, out.equal_groups, out.invalid_groups, out.invalid_rewards) == (4, 2, 0, 0)
    # the all-equal group and the one-episode group are exactly 0, not eps-noise
    assert torch.equal(out.advantage[4:8], torch.zeros(4)) and out.advantage[10].item() == 0.0
    with_eps = group_advantages(rewards, groups, eps=1e-6).advantage
    assert with_eps[0].item() == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-6)


def test_equal_rewards_that_do_not_average_exactly_still_give_zero():
    out = group_advantages(torch.tensor([0.1, 0.1, 0.1]), torch.zeros(3, dtype=torch.long))
    assert torch.equal(out.advantage, torch.zeros(3)) and out.equal_groups == 1


def test_f13_non_finite_reward_zeroes_its_group_and_is_counted():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, float("inf"), 0.0])
    out = group_advantages(rewards, torch.tensor([0, 0, 1, 1, 2, 2]), eps=0.0)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(out.advantage, torch.tensor([0.0, 0.0, -s, s, 0.0, 0.0]))
    assert torch.isfinite(out.advantage).all()
    assert (out.invalid_groups, out.invalid_rewards, out.equal_groups) == (2, 2, 0)


def _batch(b=4):
    return SimpleNamespace(size=b, success=torch.tensor([1.0, 0.0, 1.0, 0.0])[:b], rewards=torch.tensor([2.0, 1.0, 0.0, 0.0])[:b])


def test_episode_reward_success_and_score():
    torch.testing.assert_close(EpisodeReward(1.0, 0.5)(_batch()), torch.tensor([2.0, 0.5, 1.0, 0.0], dtype=torch.float64))
    assert torch.equal(compute_rewards(EpisodeReward(), _batch()), torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64))


def _raises(batch):
    raise ZeroDivisionError("no score")


@pytest.mark.parametrize(("fn", "message"), [
    (_raises, r"reward function _raises raised ZeroDivisionError: no score \(batch of 4 episodes\)"),
    (lambda b: torch.zeros(3), r"returned shape \(3,\); expected \(4,\), one reward per episode"),
    (lambda b: torch.zeros(4, 1), r"returned shape \(4, 1\); expected \(4,\)"),
    (lambda b: [1.0] * 5, r"returned shape \(5,\); expected \(4,\)"),
    (lambda b: None, "returned None; expected 4 rewards"),
    (lambda b: ["won", "lost", "won", "lost"], "not a sequence of numbers"),
])
def test_f13_bad_reward_function_is_a_clear_error(fn, message):
    with pytest.raises(RewardFunctionError, match=message) as err:
        compute_rewards(fn, _batch())
    if fn is _raises:
        assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_f13_none_and_nan_entries_become_the_counted_fallback():
    r = compute_rewards(lambda b: [1.0, None, float("nan"), 0.0], _batch())
    assert r[0].item() == 1.0 and r[3].item() == 0.0 and torch.isnan(r[1:3]).all()
    out = group_advantages(r, torch.tensor([0, 0, 1, 1]))
    assert torch.equal(out.advantage, torch.zeros(4)) and out.invalid_rewards == 2 and out.invalid_groups == 2


def test_hybrid_advantage_and_tdur_only_on_the_opd_term():
    teacher, old = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    kappa, w, rho_adv = 1.0, torch.tensor([0.5, 0.5]), 0.3
    torch.testing.assert_close(hybrid_advantage(teacher, old, kappa * w, rho_adv), torch.tensor([0.55, -0.2]))
    # kappa = 0: the turn weights cannot change anything (they multiply only the OPD term)
    for weights in (torch.tensor([0.2, 1.0]), torch.tensor([1.0, 0.0])):
        assert torch.equal(hybrid_advantage(teacher, old, 0.0 * weights, torch.tensor([0.3, -0.7])),
                           torch.tensor([0.3, -0.7]))


# (advantage, ratio, expected loss, expected d loss / d logp, clipped) with eps = 0.2
SURROGATE_CASES = [
    (2.0, 1.5, -2.4, 0.0, True),    # A > 0, ratio above 1 + eps: clipped at 1.2 * A, no gradient
    (2.0, 0.5, -1.0, -1.0, False),  # A > 0, ratio below 1 - eps: min is the unclipped ratio * A
    (-1.0, 0.5, 0.8, 0.0, True),    # A < 0, ratio below 1 - eps: clipped at 0.8 * A
    (-1.0, 1.5, 1.5, 1.5, False),   # A < 0, ratio above 1 + eps: unclipped, gradient -A * ratio
    (1.0, 1.1, -1.1, -1.1, False),  # inside the clip range
    (0.0, 2.0, 0.0, 0.0, False),    # zero advantage
]


@pytest.mark.parametrize(("adv", "ratio", "loss", "grad", "clipped"), SURROGATE_CASES)
def test_clipped_surrogate_value_and_gradient(adv, ratio, loss, grad, clipped):
    old = torch.tensor([-1.3], dtype=torch.float64)
    logp = (old + math.log(ratio)).clone().requires_grad_(True)
    a = torch.tensor([adv], dtype=torch.float64)
    out, r, c = clipped_surrogate(logp, old, a, clip_eps=0.2)
    out.sum().backward()
    assert out.item() == pytest.approx(loss, abs=1e-12) and logp.grad.item() == pytest.approx(grad, abs=1e-12)
    assert r.item() == pytest.approx(ratio) and bool(c.item()) is clipped
    # the same value as the textbook min form
    ref = -torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
    assert out.item() == pytest.approx(ref.item(), abs=1e-12)


def test_surrogate_without_extras_is_exactly_sampled_token_opd():
    torch.manual_seed(0)
    s_logits = torch.randn(7, 11, requires_grad=True)
    t_logits, targets = torch.randn(7, 11), torch.randint(0, 11, (7,))
    outs, grads = [], []
    for loss in (ClippedSurrogate(), SampledTokenReverseKL()):
        s_logits.grad = None
        out = loss.token_terms(s_logits, t_logits, targets, temperature=0.7)
        out.loss.sum().backward()
        outs.append(out.loss.detach())
        grads.append(s_logits.grad.clone())
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


def test_surrogate_kernel_with_old_logprobs_and_advantages():
    """Value by hand: A = opd_weight (log p_T - old) + grpo_term, loss = -min(ratio A, clip(ratio) A)."""
    torch.manual_seed(1)
    s_logits = torch.randn(5, 9, requires_grad=True)
    t_logits, targets = torch.randn(5, 9), torch.randint(0, 9, (5,))
    lp_s = torch.log_softmax(s_logits.detach(), -1).gather(-1, targets[:, None])[:, 0]
    lp_t = torch.log_softmax(t_logits, -1).gather(-1, targets[:, None])[:, 0]
    old = lp_s + torch.tensor([0.5, -0.5, 0.05, 0.0, 1.0])  # ratios e^-0.5, e^0.5, e^-0.05, 1, e^-1
    opd_w, grpo = torch.tensor([0.5, 1.0, 0.0, 0.2, 1.0]), torch.tensor([1.0, -2.0, 0.3, 0.0, 0.0])
    out = ClippedSurrogate(clip_eps=0.2).token_terms(s_logits, t_logits, targets, opd_weight=opd_w, grpo_term=grpo,
                                                     old_logprobs=old)
    a = opd_w * (lp_t - old) + grpo
    ratio = torch.exp(lp_s - old)
    torch.testing.assert_close(out.loss.detach(), -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a))
    assert ClippedSurrogate(0.1).clip_eps == 0.1
    for bad in (0.0, 1.0, -0.2):
        with pytest.raises(ValueError, match=f"clip_eps={bad} must be in"):
            ClippedSurrogate(bad)
