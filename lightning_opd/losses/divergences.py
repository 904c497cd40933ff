"""Per-token divergences between student and teacher on the student's own tokens.

A divergence has two levels:

* :meth:`TokenDivergence.token_terms` is the per-token kernel on logits ``(..., V)`` (one chunk of
  tokens at a time; tests and references call it directly);
* :meth:`TokenDivergence.forward` is what training calls: hidden states ``(N, D)`` of the ``N``
  supervised positions and the two LM heads. It runs the kernel chunk by chunk and recomputes each
  chunk's logits in the backward pass (:func:`~lightning_opd.losses.chunked.chunked_token_terms`), so
  peak memory is ``O(chunk_size * V)``, never ``O(B * T * V)``.

Logits are upcast to fp32 *before* temperature and softmax (F05). Both models are scored at the
sampling temperature the batch was generated with (F02). Reduction is the common aggregation of
:mod:`lightning_opd.losses.aggregation` (docs/algorithms.md §0.5).

Directions: reverse KL = KL(student || teacher) = sum_v p_S(v) (log p_S(v) - log p_T(v)) (mode-seeking,
the OPD default); forward KL = KL(teacher || student) = sum_v p_T(v) (log p_T(v) - log p_S(v)). The
gradient flows through the student only (the teacher is frozen).
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
from torch import nn

from lightning_opd.losses.base import TeacherSignal, TokenLoss, entropy_of, gather_token, log_probs
from lightning_opd.losses.chunked import chunked_signal_terms, chunked_token_terms

__all__ = ["TeacherSignal", "TokenLoss", "TokenDivergence", "SampledTokenReverseKL", "FullVocabReverseKL", "ForwardKL",
           "GeneralizedJSD", "log_probs", "entropy_of", "gather_token"]


def _log_mixture(lp_t: torch.Tensor, lp_s: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta p_T + (1 - beta) p_S)`` from log-probs, written around the larger of the two so that it is
    stable and exactly ``lp_s`` where ``lp_t == lp_s`` (teacher = student gives a JSD of exactly 0)."""
    d = lp_t - lp_s
    from_s = lp_s + torch.log1p(beta * torch.expm1(d.clamp(max=0.0)))  # exact where d <= 0
    from_t = lp_t + torch.log1p((1.0 - beta) * torch.expm1((-d).clamp(max=0.0)))  # exact where d > 0
    return torch.where(d <= 0, from_s, from_t)


class TokenDivergence(nn.Module):
    """Base class of the per-token divergences.

    Attributes:
        teacher_signal: what the loss's objective needs of the teacher (:class:`~lightning_opd.losses.base.
            TeacherSignal`); ``OPDModule`` refuses a teacher that does not provide it, naming both. A subclass
            that does not set it needs ``FULL_VOCAB`` (the most a teacher gives).
        sampled_token_estimator: the per-token term is a sampled-token (policy-gradient) estimate, unbiased only on
            tokens drawn by the policy being trained: on stale tokens (lag >= 1) the learner applies the truncated
            importance ratio by default (:mod:`lightning_opd.losses.off_policy`, docs/algorithms.md §7.1). ``False``
            for a loss that sums over the vocabulary or a top-k set at each visited state. ``None`` (the default of a
            subclass that does not say): derived from ``teacher_signal``, true exactly for ``SAMPLED_TOKEN`` (a loss
            that reads only the teacher's log-prob of the sampled token can only be a sampled-token estimate), so a
            new loss of that kind is corrected on stale tokens without having to declare it.

    Two paths, the same objective:

    * :meth:`forward` / :meth:`token_terms`: the teacher gives ``FULL_VOCAB`` (hidden states + head, the in-process
      teacher): every loss, ``kl`` the exact full-vocabulary reverse KL.
    * :meth:`forward_signals` / :meth:`signal_terms`: the teacher gives only per-position signals (a ``vllm serve``
      endpoint's ``prompt_logprobs``): the losses whose ``teacher_signal`` is ``SAMPLED_TOKEN`` or ``TOP_K``
      implement :meth:`signal_terms`; they need the sampled token's log-prob besides (``teacher_logprobs``) and log
      as ``kl`` its k1 estimate ``log p_S(a_t) - log p_T(a_t)`` (:class:`~lightning_opd.losses.base.TokenLoss`;
      PROPOSED, docs/algorithms.md §6.5). Fed the same teacher distribution, both paths give the same loss.

    Args:
        chunk_size: tokens per chunk in :meth:`forward` (peak memory ~ a few ``chunk_size x V`` fp32
            tensors; time is nearly flat above a few hundred).

    Raises:
        ValueError: ``chunk_size < 1``.
    """

    teacher_signal: ClassVar[TeacherSignal] = TeacherSignal.FULL_VOCAB
    sampled_token_estimator: ClassVar[bool | None] = None

    def __init__(self, chunk_size: int = 256) -> None:
        super().__init__()
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1 (tokens per chunk)")
        self.chunk_size = chunk_size

    def token_terms(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                    temperature: float = 1.0) -> TokenLoss:
        """The per-token kernel: ``(..., V)`` student and teacher logits (any float dtype; the teacher is
        not differentiated) and ``(...)`` target ids -> :class:`TokenLoss` of shape ``(...)``."""
        raise NotImplementedError

    def forward(self, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, targets: torch.Tensor,
                student_head: Callable[[torch.Tensor], torch.Tensor],
                teacher_head: Callable[[torch.Tensor], torch.Tensor], temperature: float = 1.0,
                **extras: torch.Tensor | None) -> TokenLoss:
        """Per-token loss from hidden states, chunk by chunk with recomputation (see module docstring).

        Args:
            student_hidden: ``(N, D)`` student final hidden states at the positions predicting ``targets``.
            teacher_hidden: ``(N, D_T)`` teacher final hidden states at the same positions (no grad).
            targets: ``(N,)`` the sampled token ids.
            student_head, teacher_head: ``(n, D) -> (n, V)`` LM heads (cut to the shared vocabulary, F01b).
            temperature: sampling temperature of the batch (> 0).
            extras: ``(N,)`` per-token inputs for losses whose ``token_terms`` takes them (keyword
                arguments, e.g. :class:`~lightning_opd.losses.grpo.ClippedSurrogate`); none for divergences.

        Returns:
            :class:`TokenLoss` with ``(N,)`` fields.
        """
        return chunked_token_terms(self, student_hidden, teacher_hidden, targets, student_head, teacher_head,
                                   temperature, self.chunk_size, extras)

    def signal_terms(self, student_logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                     teacher_sampled_logprobs: torch.Tensor, **inputs: torch.Tensor) -> TokenLoss:
        """The per-token kernel from the teacher's reported signals: ``(..., V)`` student logits, ``(...)`` target
        ids, ``(...)`` ``teacher_sampled_logprobs`` (``log p_T(a_t)``, nats, at ``temperature``) and, for a ``TOP_K``
        loss, ``teacher_topk_ids`` / ``teacher_topk_logprobs`` ``(..., K)`` -> :class:`TokenLoss` of shape ``(...)``.

        Raises:
            NotImplementedError: a loss that needs the teacher's full vocabulary (``teacher_signal = FULL_VOCAB``).
        """
        raise NotImplementedError(
            f"{type(self).__name__} needs the teacher's {self.teacher_signal.value} log-probs (hidden states and "
            "head): it runs only through forward() with a teacher that provides full_vocab")

    def forward_signals(self, student_hidden: torch.Tensor, targets: torch.Tensor,
                        student_head: Callable[[torch.Tensor], torch.Tensor], temperature: float = 1.0, *,
                        teacher_sampled_logprobs: torch.Tensor, teacher_topk_ids: torch.Tensor | None = None,
                        teacher_topk_logprobs: torch.Tensor | None = None, **extras: torch.Tensor | None) -> TokenLoss:
        """Per-token loss from the student's hidden states and the teacher's reported signals, chunk by chunk with
        recomputation (:func:`~lightning_opd.losses.chunked.chunked_signal_terms`; the student side of
        :meth:`forward`, unchanged).

        Args:
            student_hidden: ``(N, D)`` student final hidden states at the positions predicting ``targets``.
            targets: ``(N,)`` the sampled token ids.
            student_head: ``(n, D) -> (n, V)`` LM head (cut to the shared vocabulary, F01b).
            temperature: sampling temperature of the batch (> 0), the one the teacher scored at.
            teacher_sampled_logprobs: ``(N,)`` ``log p_T(a_t)`` (nats; ``TeacherScores.sampled_logprobs``).
            teacher_topk_ids, teacher_topk_logprobs: ``(N, K)`` the teacher's top-K ids (long, most likely first) and
                log-probs (nats; ``TeacherScores.topk_*``), for ``TOP_K`` losses (``K >= min(k, V)``).
            extras: ``(N,)`` per-token inputs of the loss (as in :meth:`forward`).

        Returns:
            :class:`TokenLoss` with ``(N,)`` fields; ``kl`` is the k1 estimate (see the class docstring).

        Raises:
            NotImplementedError: a ``FULL_VOCAB`` loss (:meth:`signal_terms`).
            ValueError: inputs that disagree on ``N``; a top-K narrower than the loss's ``k``.
        """
        inputs = {"teacher_sampled_logprobs": teacher_sampled_logprobs, "teacher_topk_ids": teacher_topk_ids,
                  "teacher_topk_logprobs": teacher_topk_logprobs, **extras}
        return chunked_signal_terms(self, student_hidden, targets, student_head, temperature, self.chunk_size, inputs)

    @staticmethod
    def _from_signals(loss: torch.Tensor, lp_s: torch.Tensor, targets: torch.Tensor,
                      teacher_sampled_logprobs: torch.Tensor) -> TokenLoss:
        """Wrap a :meth:`signal_terms` ``loss`` with the detached diagnostics; ``kl`` is the k1 estimate
        ``log p_S(a_t) - log p_T(a_t)`` (the full reverse KL needs the teacher's whole distribution)."""
        with torch.no_grad():
            s_tok = gather_token(lp_s, targets)
            t_tok = teacher_sampled_logprobs.to(s_tok.dtype)
            return TokenLoss(loss=loss, kl=s_tok - t_tok, student_logprobs=s_tok, teacher_logprobs=t_tok,
                             entropy=entropy_of(lp_s))

    @staticmethod
    def _common(student_logits, teacher_logits, temperature):
        """``(lp_s, lp_t)``: fp32 log-probs at ``temperature``; the teacher's detached."""
        return log_probs(student_logits, temperature), log_probs(teacher_logits, temperature).detach()

    @staticmethod
    def _full(loss, lp_s, lp_t, targets) -> TokenLoss:
        """Wrap ``loss`` with the detached diagnostics. Computed *after* the loss on purpose: in the
        chunked backward, checkpoint's recomputation stops once the loss's saved tensors are rebuilt,
        so the diagnostics are not recomputed."""
        with torch.no_grad():
            kl = (lp_s.exp() * (lp_s - lp_t)).sum(-1)
            return TokenLoss(loss=loss, kl=kl, student_logprobs=gather_token(lp_s, targets),
                             teacher_logprobs=gather_token(lp_t, targets), entropy=entropy_of(lp_s))


class SampledTokenReverseKL(TokenDivergence):
    """Sampled-token reverse KL in policy-gradient form (docs/algorithms.md §0.2-0.3; [TM], [VERL]).

    Support: the sampled token only. With the detached advantage ``A_t = log p_T(a_t) - log p_S(a_t)``
    and ``a_t ~ p_S``::

        loss_t = -exp(log p_S(a_t) - sg(log p_S(a_t))) * sg(A_t)

    Its value is the k1 estimate ``log p_S(a_t) - log p_T(a_t)`` and its gradient is
    ``-A_t * grad log p_S(a_t)``, whose expectation over ``a_t ~ p_S`` is the gradient of
    KL(p_S || p_T) at s_t (score-function form; k1 differentiated directly would have expected
    gradient 0, k3 would give the forward-KL gradient, §0.3). Needs only the teacher's log-prob of
    the sampled token; high variance (design.md: 5% vs 60% held-out success for the analytic loss).
    With a ``FULL_VOCAB`` teacher the logged ``kl`` is still the exact reverse KL (the chunk's full logits are at
    hand anyway); with a teacher that reports ``log p_T(a_t)`` only (:meth:`signal_terms`: the same loss from
    ``teacher_sampled_logprobs`` ``(N,)``), its k1 estimate, which here is also the loss's value.

    Args:
        signal: ``"recomputed"`` (default): ``A_t`` uses the learner's ``log p_S(a_t)``, recomputed at learner time.
            ``"behaviour"``: the "vanilla async" baseline, the failure f-OPD starts from (docs/algorithms.md
            §1.4-§1.5): ``A_t = log p_T(a_t) - log π_b(a_t)`` with the stale rollout-time log-prob ``π_b`` of the
            batch (``OPDModule`` passes it as ``behaviour_logprobs``): value ``log π_b(a_t) - log p_T(a_t)``,
            gradient ``-(log p_T(a_t) - log π_b(a_t)) * grad log p_S(a_t)``; identical to ``"recomputed"`` when
            ``π_b = p_S`` (lag 0), so ``OPDModule`` refuses it where every batch has lag 0.
        chunk_size: see :class:`TokenDivergence`.

    Raises:
        ValueError: an unknown ``signal``.
    """

    SIGNALS = ("recomputed", "behaviour")
    teacher_signal = TeacherSignal.SAMPLED_TOKEN
    sampled_token_estimator = True

    def __init__(self, signal: str = "recomputed", chunk_size: int = 256) -> None:
        super().__init__(chunk_size)
        if signal not in self.SIGNALS:
            raise ValueError(f"model.init_args.loss.init_args.signal={signal!r}: use 'recomputed' (learner-time "
                             "log-probs) or 'behaviour' (the stale rollout-time log-probs, the vanilla-async baseline)")
        self.signal = signal

    @property
    def uses_behaviour_logprobs(self) -> bool:
        """The loss needs the batch's rollout-time log-probs (``behaviour_logprobs`` keyword input)."""
        return self.signal == "behaviour"

    def policy_advantage(self, advantage: torch.Tensor) -> torch.Tensor:
        """The detached per-token factor of the policy-gradient term, from ``A_t`` ``(...)`` (nats): ``A_t`` itself here;
        a subclass may reshape it (:class:`~lightning_opd.losses.sign_only.SignOnlyReverseKL`: its sign)."""
        return advantage

    def token_terms(self, student_logits, teacher_logits, targets, temperature=1.0,
                    behaviour_logprobs: torch.Tensor | None = None) -> TokenLoss:
        """Per-token terms; ``behaviour_logprobs``: ``(...)`` log π_b of ``targets`` (nats), required with
        ``signal="behaviour"``.

        Raises:
            ValueError: ``signal="behaviour"`` without ``behaviour_logprobs``.
        """
        lp_s, lp_t = self._common(student_logits, teacher_logits, temperature)
        s_tok = gather_token(lp_s, targets)
        if self.uses_behaviour_logprobs and behaviour_logprobs is None:
            raise ValueError("SampledTokenReverseKL(signal='behaviour') needs behaviour_logprobs (the batch's "
                             "rollout-time log-probs of the sampled tokens)")
        reference = behaviour_logprobs.to(s_tok) if self.uses_behaviour_logprobs else s_tok
        advantage = self.policy_advantage((gather_token(lp_t, targets) - reference).detach())
        ratio = torch.exp(s_tok - s_tok.detach())  # 1 in value, carries grad log p_S
        return self._full(-ratio * advantage, lp_s, lp_t, targets)

    def signal_terms(self, student_logits, targets, temperature=1.0, *, teacher_sampled_logprobs,
                     behaviour_logprobs: torch.Tensor | None = None) -> TokenLoss:
        """:meth:`token_terms` with ``log p_T(a_t)`` given: ``teacher_sampled_logprobs`` ``(...)`` nats.

        Raises:
            ValueError: ``signal="behaviour"`` without ``behaviour_logprobs``.
        """
        lp_s = log_probs(student_logits, temperature)
        s_tok = gather_token(lp_s, targets)
        if self.uses_behaviour_logprobs and behaviour_logprobs is None:
            raise ValueError("SampledTokenReverseKL(signal='behaviour') needs behaviour_logprobs (the batch's "
                             "rollout-time log-probs of the sampled tokens)")
        reference = behaviour_logprobs.to(s_tok) if self.uses_behaviour_logprobs else s_tok
        advantage = self.policy_advantage((teacher_sampled_logprobs.to(s_tok) - reference).detach())
        ratio = torch.exp(s_tok - s_tok.detach())  # 1 in value, carries grad log p_S
        return self._from_signals(-ratio * advantage, lp_s, targets, teacher_sampled_logprobs)


class FullVocabReverseKL(TokenDivergence):
    """Analytic full-vocabulary reverse KL per token (docs/algorithms.md §0.3 "full-vocabulary"; [GKD]
    D = reverse KL, λ = 1): ``sum_v p_S(v|s_t) (log p_S(v|s_t) - log p_T(v|s_t))``, exact and >= 0.
    Support: the whole vocabulary; estimator: exact expectation (no sampling); gradient through p_S.
    """

    teacher_signal = TeacherSignal.FULL_VOCAB

    def token_terms(self, student_logits, teacher_logits, targets, temperature=1.0) -> TokenLoss:
        lp_s, lp_t = self._common(student_logits, teacher_logits, temperature)
        loss = (lp_s.exp() * (lp_s - lp_t)).sum(-1)
        return self._full(loss, lp_s, lp_t, targets)


class ForwardKL(TokenDivergence):
    """Analytic full-vocabulary forward KL per token, ``KL(p_T || p_S) = sum_v p_T(v) (log p_T(v) -
    log p_S(v))`` (docs/algorithms.md §0.1, [GKD] D = forward KL): mass-covering, exact, >= 0; gradient
    ``-sum_v p_T(v) grad log p_S(v)`` (the student's cross-entropy against the teacher's distribution).
    ``kl`` logs the reverse KL, like every loss, so curves stay comparable.
    """

    teacher_signal = TeacherSignal.FULL_VOCAB

    def token_terms(self, student_logits, teacher_logits, targets, temperature=1.0) -> TokenLoss:
        lp_s, lp_t = self._common(student_logits, teacher_logits, temperature)
        loss = (lp_t.exp() * (lp_t - lp_s)).sum(-1)
        return self._full(loss, lp_s, lp_t, targets)


class GeneralizedJSD(TokenDivergence):
    """Generalised Jensen-Shannon divergence (docs/algorithms.md §0.1; [GKD] Eq. for JSD(β))::

        JSD(β) = β KL(p_T || M) + (1 - β) KL(p_S || M),   M = β p_T + (1 - β) p_S,   0 < β < 1

    Support: the whole vocabulary; exact. The formula itself tends to 0 at both ends (M becomes one of
    the two distributions), so the endpoints are defined explicitly, as TRL does: ``beta=0`` is the
    forward KL(p_T || p_S) and ``beta=1`` the reverse KL(p_S || p_T) (these are also the limits of
    JSD(β)/β as β -> 0 and of JSD(β)/(1-β) as β -> 1). ``beta=0.5`` is the symmetric JSD, bounded by log 2.

    Raises:
        ValueError: ``beta`` outside [0, 1].
    """

    teacher_signal = TeacherSignal.FULL_VOCAB

    def __init__(self, beta: float = 0.5, chunk_size: int = 256) -> None:
        super().__init__(chunk_size)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta={beta} must be in [0, 1] (0 = forward KL, 1 = reverse KL)")
        self.beta = float(beta)

    def token_terms(self, student_logits, teacher_logits, targets, temperature=1.0) -> TokenLoss:
        lp_s, lp_t = self._common(student_logits, teacher_logits, temperature)
        b = self.beta
        if b == 0.0:
            loss = (lp_t.exp() * (lp_t - lp_s)).sum(-1)
        elif b == 1.0:
            loss = (lp_s.exp() * (lp_s - lp_t)).sum(-1)
        else:
            lp_m = _log_mixture(lp_t, lp_s, b)
            loss = b * (lp_t.exp() * (lp_t - lp_m)).sum(-1) + (1 - b) * (lp_s.exp() * (lp_s - lp_m)).sum(-1)
        return self._full(loss, lp_s, lp_t, targets)
