"""What every per-token loss shares: the fp32 log-prob primitives, :class:`TokenLoss` (the per-token output) and
:class:`TeacherSignal` (what a loss needs of the teacher, the teacher seam of :mod:`lightning_opd.teachers`).

Kept apart from :mod:`lightning_opd.losses.divergences` so that the chunked head pass
(:mod:`lightning_opd.losses.chunked`) and the divergences both build on it without importing each other.
Logits are upcast to fp32 *before* temperature and softmax (F05).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch


class TeacherSignal(str, Enum):
    """What a loss needs of the teacher at each of the ``N`` scored positions (each loss class names one in its
    ``teacher_signal`` attribute; each teacher of :mod:`lightning_opd.teachers` lists those it ``provides``).

    Members (log-probs in nats, at the batch's sampling temperature, F02):

    * ``SAMPLED_TOKEN``: ``log p_T(a_t)`` of the sampled token, ``(N,)``
      (``SampledTokenReverseKL``, ATOD's ``ClippedSurrogate``, T-DUR's teacher term).
    * ``TOP_K``: the teacher's own ``K`` most likely ids ``(N, K)`` and their log-probs ``(N, K)``
      (``TeacherTopKRenormalizedReverseKL``, ``TeacherTopKForwardKL``; what ``prompt_logprobs=K`` of a
      ``vllm serve`` endpoint returns, beside the sampled token's log-prob).
    * ``FULL_VOCAB``: ``log p_T(v)`` for every ``v`` of the shared vocabulary, ``(N, V)``, never built at once:
      handed over as hidden states and an LM head that the loss applies chunk by chunk
      (``FullVocabReverseKL``, ``ForwardKL``, ``GeneralizedJSD``, and ``StudentTopKRenormalizedReverseKL``, whose
      support, the student's top-k ids, is known only at learner time).
    """

    SAMPLED_TOKEN = "sampled_token"
    TOP_K = "top_k"
    FULL_VOCAB = "full_vocab"


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits.float() / temperature)`` over the last dim; ``(..., V)`` -> ``(..., V)`` fp32.

    Raises:
        ValueError: ``temperature <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 to score tokens (greedy rollouts are not trained on)")
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def entropy_of(lp: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_v p log p`` (nats) of log-probs ``(..., V)`` -> ``(...)``, detached."""
    with torch.no_grad():
        return -(lp.exp() * lp).sum(-1)


def gather_token(lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``lp[..., targets]``: ``(..., V)`` log-probs and ``(...)`` ids -> ``(...)``."""
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@dataclass
class TokenLoss:
    """Per-token output of a divergence (shape ``S`` = the targets' shape: ``(N,)`` or ``(B, T)``).

    Attributes:
        loss: ``S`` differentiable per-token loss, to be aggregated with the loss mask.
        kl: ``S`` detached reverse KL(p_S || p_T) per token, for logging and the per-turn diagnostics (nats),
            whatever the loss (TurnOPD §2.1 needs the full value): the exact full-vocabulary value when the teacher
            gives ``FULL_VOCAB`` (``TokenDivergence.forward``); from a teacher without it
            (``TokenDivergence.forward_signals``) the sampled-token (k1) estimate ``log p_S(a_t) - log p_T(a_t)``,
            unbiased for the full reverse KL over tokens sampled from p_S, one token can be < 0 (PROPOSED,
            docs/algorithms.md §6.5; the learner logs it as ``train/kl_sampled``, never as ``train/kl``).
        student_logprobs: ``S`` detached log p_S(a_t) of the target tokens (nats).
        teacher_logprobs: ``S`` log p_T(a_t) of the target tokens (nats).
        entropy: ``S`` detached entropy of the student distribution (nats).
    """

    loss: torch.Tensor
    kl: torch.Tensor
    student_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor
    entropy: torch.Tensor

    FIELDS = ("loss", "kl", "student_logprobs", "teacher_logprobs", "entropy")

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "TokenLoss":
        """Apply ``fn`` to every field."""
        return TokenLoss(*(fn(getattr(self, f)) for f in self.FIELDS))
