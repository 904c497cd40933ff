"""The vanilla-async signal of SampledTokenReverseKL (signal="behaviour"): the advantage from the stale
rollout-time log-prob, A_t = log p_T(a_t) - log pi_b(a_t), hand-worked on a two-token vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_opd.losses import FullVocabReverseKL, SampledTokenReverseKL


def _terms(loss, behaviour=None):
    """p_S = (1/2, 1/2), p_T = (3/4, 1/4), sampled token 0: ``(loss value, d loss / d student logits)``."""
    z = torch.zeros(1, 2, requires_grad=True)
    teacher = torch.tensor([[math.log(3.0), 0.0]])
    out = loss.token_terms(z, teacher, torch.tensor([0]), 1.0,
                           **({} if behaviour is None else {"behaviour_logprobs": torch.tensor([behaviour])}))
    out.loss.sum().backward()
    return out.loss.item(), z.grad[0].tolist()


def test_recomputed_signal_by_hand():
    # A = log 3/4 - log 1/2 = log 1.5; value -A; grad -A (onehot(0) - p_S) = -log 1.5 * (1/2, -1/2)
    value, grad = _terms(SampledTokenReverseKL())
    a = math.log(1.5)
    assert value == pytest.approx(-a)
    assert grad == pytest.approx([-a / 2, a / 2])


def test_behaviour_signal_by_hand():
    # pi_b(a) = 1/4 at rollout time: A_b = log 3/4 - log 1/4 = log 3; value -log 3; grad -log 3 * (1/2, -1/2)
    value, grad = _terms(SampledTokenReverseKL(signal="behaviour"), behaviour=math.log(0.25))
    a = math.log(3.0)
    assert value == pytest.approx(-a)
    assert grad == pytest.approx([-a / 2, a / 2])
    # the gradient is the recomputed one scaled by A_b / A = log 3 / log 1.5, as the formula says
    assert grad[0] / _terms(SampledTokenReverseKL())[1][0] == pytest.approx(math.log(3.0) / math.log(1.5))


def test_at_lag_zero_both_signals_are_identical():
    """pi_b = p_S (the batch was sampled by the weights being trained): the same value and gradient, bit for bit."""
    assert _terms(SampledTokenReverseKL(signal="behaviour"), behaviour=math.log(0.5)) == _terms(SampledTokenReverseKL())


def test_through_the_chunked_forward():
    """The training path (hidden states, heads, chunks of 2 with recomputation) passes the behaviour log-probs
    token by token: value = log pi_b - log p_T on every token."""
    torch.manual_seed(0)
    h_s, h_t = torch.randn(5, 4, requires_grad=True), torch.randn(5, 4)
    head = torch.nn.Linear(4, 7, bias=False)
    targets = torch.tensor([0, 3, 6, 2, 2])
    lp_b = -torch.rand(5) * 3
    out = SampledTokenReverseKL(signal="behaviour", chunk_size=2)(h_s, h_t, targets, head, head,
                                                                 behaviour_logprobs=lp_b)
    assert torch.allclose(out.loss, lp_b - out.teacher_logprobs, atol=1e-6)
    out.loss.sum().backward()
    expected = torch.autograd.grad(-((out.teacher_logprobs - lp_b) * torch.log_softmax(head(h_s), -1)
                                     .gather(-1, targets[:, None])[:, 0]).sum(), h_s)[0]
    assert torch.allclose(h_s.grad, expected, atol=1e-6)


def test_refusals():
    with pytest.raises(ValueError, match=r"model.init_args.loss.init_args.signal='stale': use 'recomputed'"):
        SampledTokenReverseKL(signal="stale")
    with pytest.raises(ValueError, match="needs behaviour_logprobs"):
        SampledTokenReverseKL(signal="behaviour").token_terms(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([0]))
    assert not getattr(FullVocabReverseKL(), "uses_behaviour_logprobs", False)  # the analytic loss has no such signal
