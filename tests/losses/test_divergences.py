"""Divergences against fp64 references, F01c (teacher = student -> 0), F05 (bf16 teacher) and the
sampled estimator's gradient against the analytic reverse-KL gradient."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.losses import FullVocabReverseKL, SampledTokenReverseKL, log_probs

LOSSES = [FullVocabReverseKL, SampledTokenReverseKL]


def _ref_reverse_kl(s: torch.Tensor, t: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    ls = torch.log_softmax(s.double() / temperature, -1)
    lt = torch.log_softmax(t.double() / temperature, -1)
    return (ls.exp() * (ls - lt)).sum(-1)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
def test_full_vocab_reverse_kl_matches_fp64(temperature):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 50, generator=g) * 3, torch.randn(2, 5, 50, generator=g) * 3
    targets = torch.randint(0, 50, (2, 5), generator=g)
    out = FullVocabReverseKL().token_terms(s, t, targets, temperature)
    torch.testing.assert_close(out.kl.double(), _ref_reverse_kl(s, t, temperature), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss.detach(), out.kl)
    ref_s = torch.log_softmax(s.double() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(out.student_logprobs.double(), ref_s, atol=1e-5, rtol=1e-5)


def test_bf16_teacher_upcast_before_softmax():
    """F05: a bf16 teacher is upcast to fp32 before temperature/softmax; the KL stays >= 0 and matches the
    fp64 reference computed from the same bf16 values."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 7, 200, generator=g) * 4
    t = (s + 0.01 * torch.randn(3, 7, 200, generator=g)).to(torch.bfloat16)  # nearly equal: tiny KL
    out = FullVocabReverseKL().token_terms(s, t, torch.zeros(3, 7, dtype=torch.long), 1.0)
    ref = _ref_reverse_kl(s, t.double())
    assert out.kl.dtype == torch.float32
    assert out.kl.min().item() >= -1e-7
    torch.testing.assert_close(out.kl.double(), ref, atol=2e-6, rtol=1e-3)


@pytest.mark.parametrize("loss_cls", LOSSES)
def test_teacher_equal_student_gives_exactly_zero(loss_cls):
    """F01c: identical logits -> per-token KL exactly 0 for every loss variant."""
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 6, 40, generator=g)
    out = loss_cls().token_terms(s.clone().requires_grad_(), s.clone(), torch.randint(0, 40, (2, 6), generator=g), 1.0)
    assert torch.equal(out.kl, torch.zeros_like(out.kl))
    assert torch.equal(out.loss.detach().abs(), torch.zeros_like(out.kl))


def test_sampled_value_is_k1_estimate():
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(1, 4, 10, generator=g), torch.randn(1, 4, 10, generator=g)
    a = torch.randint(0, 10, (1, 4), generator=g)
    out = SampledTokenReverseKL().token_terms(s, t, a, 1.0)
    k1 = (torch.log_softmax(s, -1) - torch.log_softmax(t, -1)).gather(-1, a[..., None]).squeeze(-1)
    torch.testing.assert_close(out.loss.detach(), k1)
    torch.testing.assert_close(out.kl.double(), _ref_reverse_kl(s, t), atol=1e-6, rtol=1e-5)  # logged: exact KL


def test_sampled_gradient_matches_analytic_reverse_kl_gradient():
    """E_{a~p_S}[grad of the PG loss] = grad KL(p_S || p_T) (score-function identity), on small random logits."""
    torch.manual_seed(4)
    v, n = 6, 400_000
    z = (torch.randn(v) * 1.5).requires_grad_()
    teacher = torch.randn(v) * 1.5
    exact = torch.autograd.grad(_ref_reverse_kl(z.double(), teacher.double()).float(), z)[0]

    z_mc = z.detach().clone().requires_grad_()
    a = torch.multinomial(torch.softmax(z_mc.detach(), -1), n, replacement=True)  # a ~ p_S
    out = SampledTokenReverseKL().token_terms(z_mc.expand(1, n, v), teacher.expand(1, n, v), a.view(1, n), 1.0)
    mc = torch.autograd.grad(out.loss.mean(), z_mc)[0]
    # per-sample gradient std is O(1); 400k samples -> standard error ~ 0.003
    torch.testing.assert_close(mc, exact, atol=0.015, rtol=0.0)
    assert exact.abs().max() > 0.05  # the check is not vacuous


def test_k1_differentiated_directly_would_be_wrong():
    """The reason for the PG form (§0.3 caution): differentiating the k1 value log p_S(a) - log p_T(a)
    directly has expected gradient 0, not the reverse-KL gradient."""
    torch.manual_seed(5)
    v, n = 6, 400_000
    z = (torch.randn(v) * 1.5).requires_grad_()
    teacher = torch.randn(v) * 1.5
    a = torch.multinomial(torch.softmax(z.detach(), -1), n, replacement=True)
    k1 = (torch.log_softmax(z, -1) - torch.log_softmax(teacher, -1))[a].mean()
    naive = torch.autograd.grad(k1, z)[0]
    torch.testing.assert_close(naive, torch.zeros(v), atol=0.01, rtol=0.0)


def test_log_probs_rejects_zero_temperature():
    with pytest.raises(ValueError, match="temperature=0"):
        log_probs(torch.zeros(2, 3), 0.0)
