"""Per-token divergences between student and teacher on the student's own tokens.

Every loss takes ``(B, T, V)`` student and teacher logits at the positions that predict the target
tokens, and the ``(B, T)`` target ids (the tokens the student sampled), and returns per-token values;
reduction is the common aggregation in :mod:`lightning_opd.losses.aggregation` (docs/algorithms.md §0.5).
Logits are upcast to fp32 *before* temperature and softmax (F05). Both models are scored at the
sampling temperature the batch was generated with (F02).

Sign convention: reverse KL = KL(student || teacher) = sum_v p_S(v) (log p_S(v) - log p_T(v)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits.float() / temperature)`` over the last dim; ``(..., V)`` -> ``(..., V)`` fp32.

    Raises:
        ValueError: ``temperature <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 to score tokens (greedy rollouts are not trained on)")
    return torch.log_softmax(logits.float() / temperature, dim=-1)


@dataclass
class TokenLoss:
    """Per-token output of a divergence.

    Attributes:
        loss: ``(B, T)`` differentiable per-token loss, to be aggregated with the loss mask.
        kl: ``(B, T)`` detached per-token reverse-KL value for logging (nats): analytic when the loss
            has it, else the sampled (k1) estimate ``log p_S(a) - log p_T(a)``.
        student_logprobs: ``(B, T)`` detached log p_S(a_t) of the target tokens (nats).
        teacher_logprobs: ``(B, T)`` log p_T(a_t) of the target tokens (nats).
        entropy: ``(B, T)`` detached entropy of the student distribution (nats).
    """

    loss: torch.Tensor
    kl: torch.Tensor
    student_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor
    entropy: torch.Tensor


class TokenDivergence(nn.Module):
    """Base class: ``forward(student_logits, teacher_logits, targets, temperature) -> TokenLoss``."""

    #: the per-token ``kl`` is the exact full-vocabulary value (True) or a one-sample estimate (False)
    analytic: bool = False

    def _common(self, student_logits, teacher_logits, targets, temperature):
        lp_s = log_probs(student_logits, temperature)  # (B, T, V)
        lp_t = log_probs(teacher_logits, temperature)  # (B, T, V)
        idx = targets.unsqueeze(-1)
        s_tok = lp_s.gather(-1, idx).squeeze(-1)  # (B, T)
        t_tok = lp_t.gather(-1, idx).squeeze(-1)  # (B, T)
        with torch.no_grad():
            entropy = -(lp_s.exp() * lp_s).sum(-1)  # (B, T)
        return lp_s, lp_t, s_tok, t_tok, entropy


class SampledTokenReverseKL(TokenDivergence):
    """Sampled-token reverse KL in policy-gradient form (docs/algorithms.md §0.2-0.3; [TM], [VERL]).

    With the detached advantage ``A_t = log p_T(a_t) - log p_S(a_t)`` and ``a_t ~ p_S``::

        loss_t = -exp(log p_S(a_t) - sg(log p_S(a_t))) * sg(A_t)

    Its value is the k1 estimate ``log p_S(a_t) - log p_T(a_t)`` and its gradient is
    ``-A_t * grad log p_S(a_t)``, whose expectation over ``a_t ~ p_S`` is the gradient of
    KL(p_S || p_T) at s_t (score-function form; k1 differentiated directly would have expected
    gradient 0, k3 would give the forward-KL gradient, §0.3). Needs only the teacher's log-prob of
    the sampled token; high variance (design.md: 5% vs 60% held-out success for the analytic loss).
    """

    analytic = False

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                temperature: float = 1.0) -> TokenLoss:
        _, _, s_tok, t_tok, entropy = self._common(student_logits, teacher_logits, targets, temperature)
        advantage = (t_tok - s_tok).detach()
        ratio = torch.exp(s_tok - s_tok.detach())  # 1 in value, carries grad log p_S
        loss = -ratio * advantage
        return TokenLoss(loss=loss, kl=(-advantage), student_logprobs=s_tok.detach(), teacher_logprobs=t_tok.detach(),
                         entropy=entropy)


class FullVocabReverseKL(TokenDivergence):
    """Analytic full-vocabulary reverse KL per token (docs/algorithms.md §0.3, "full-vocabulary"; [GKD] λ=1):
    ``sum_v p_S(v|s_t) (log p_S(v|s_t) - log p_T(v|s_t))``, exact and >= 0, gradient through p_S only
    (the teacher is frozen). Materialises ``(B, T, V)`` log-probs of both models.
    """

    analytic = True

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                temperature: float = 1.0) -> TokenLoss:
        lp_s, lp_t, s_tok, t_tok, entropy = self._common(student_logits, teacher_logits, targets, temperature)
        kl = (lp_s.exp() * (lp_s - lp_t.detach())).sum(-1)  # (B, T)
        return TokenLoss(loss=kl, kl=kl.detach(), student_logprobs=s_tok.detach(), teacher_logprobs=t_tok.detach(),
                         entropy=entropy)
