"""Top-k divergences: the loss is restricted to ``k`` tokens per position (docs/algorithms.md §0.3).

The class name says whose top-k is the support. As ``k`` grows to the vocabulary size each converges
to its full-vocabulary counterpart and equals it at ``k = V`` (F14). Like every divergence here they
run chunk by chunk from hidden states (:meth:`TokenDivergence.forward`); ``kl`` logs the exact
full-vocabulary reverse KL (the chunk's full logits are at hand), so curves stay comparable.

The two teacher-support losses also run from what a teacher without ``FULL_VOCAB`` reports
(:meth:`TokenDivergence.forward_signals`: its top-K ids and log-probs, and the sampled token's log-prob): the
student side is unchanged, the teacher's log-probs on ``S_k`` are the reported ones, and ``kl`` is then the k1
estimate of the reverse KL (:class:`~lightning_opd.losses.base.TokenLoss`).
"""

from __future__ import annotations

import math

import torch

from lightning_opd.losses.divergences import TeacherSignal, TokenDivergence, TokenLoss, log_probs


def _complement_logsumexp(lp: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``log sum_{v not in idx} exp(lp_v)``: ``(..., V)``, ``(..., k)`` -> ``(...)`` (``-inf`` when k = V)."""
    return lp.scatter(-1, idx, float("-inf")).logsumexp(-1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for log-masses ``x <= 0`` (clamped there), stable at both ends (Mächler 2012: ``expm1``
    above ``-log 2``, ``log1p`` below); ``-inf`` at ``x = 0``."""
    x = x.clamp(max=0.0)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class _TopK(TokenDivergence):
    def __init__(self, k: int = 50, chunk_size: int = 256) -> None:
        super().__init__(chunk_size)
        if k < 1:
            raise ValueError(f"k={k} must be >= 1 (tokens in the top-k support)")
        self.k = int(k)

    def _reported_top_k(self, ids: torch.Tensor, logprobs: torch.Tensor,
                        vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``min(k, V)`` of the teacher's reported top-K: ``(..., K)`` ids and log-probs (most likely
        first) -> ``(..., k)`` long ids and fp32 log-probs.

        Raises:
            ValueError: ``K < min(k, V)`` (the teacher was asked for fewer).
        """
        k = min(self.k, vocab)
        if ids.shape[-1] < k or logprobs.shape != ids.shape:
            raise ValueError(f"{type(self).__name__}(k={self.k}) needs the teacher's top-{k} ids and log-probs, got "
                             f"ids {tuple(ids.shape)} and log-probs {tuple(logprobs.shape)}: score the teacher with "
                             f"top_k >= {k} (a vllm serve endpoint: prompt_logprobs >= {k})")
        return ids[..., :k].long(), logprobs[..., :k].float()

    def _top_k_ids(self, lp: torch.Tensor) -> torch.Tensor:
        """The support ``S_k``: ids of the ``min(k, V)`` largest log-probs, ``(..., V)`` -> ``(..., k)`` (chosen
        without gradient)."""
        return lp.detach().topk(min(self.k, lp.shape[-1]), dim=-1).indices


class _RenormalizedTopKReverseKL(_TopK):
    """Reverse KL on the top-k support of :attr:`support_side`, both distributions renormalised there."""

    #: whose top-k is the support: ``"student"`` or ``"teacher"``
    support_side: str

    def token_terms(self, student_logits, teacher_logits, targets, temperature=1.0) -> TokenLoss:
        lp_s, lp_t = self._common(student_logits, teacher_logits, temperature)
        idx = self._top_k_ids(lp_s if self.support_side == "student" else lp_t)  # (..., k)
        return self._full(_renormalized_reverse_kl(lp_s, lp_t, idx), lp_s, lp_t, targets)


class _TeacherReportedTopK(_TopK):
    """A top-k loss on the teacher's support that also runs from the teacher's reported top-K (``TOP_K``)."""

    def _reported_loss(self, lp_s: torch.Tensor, idx: torch.Tensor, lt: torch.Tensor) -> torch.Tensor:
        """Per-token loss, ``(...)`` nats, from the student's log-probs ``(..., V)`` and the teacher's support ``idx``
        and log-probs ``lt`` on it, ``(..., k)`` each."""
        raise NotImplementedError

    def signal_terms(self, student_logits, targets, temperature=1.0, *, teacher_sampled_logprobs, teacher_topk_ids,
                     teacher_topk_logprobs) -> TokenLoss:
        """:meth:`token_terms` with the teacher's top-K reported: ``(..., K)`` ids and log-probs (nats, at
        ``temperature``), ``(...)`` ``teacher_sampled_logprobs``.

        Raises:
            ValueError: ``K < min(k, V)``.
        """
        lp_s = log_probs(student_logits, temperature)
        idx, lt = self._reported_top_k(teacher_topk_ids, teacher_topk_logprobs, lp_s.shape[-1])
        return self._from_signals(self._reported_loss(lp_s, idx, lt), lp_s, targets, teacher_sampled_logprobs)


def _renormalized_reverse_kl(lp_s: torch.Tensor, lp_t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``sum_{v in S} p~_S(v) (log p~_S(v) - log p~_T(v))`` with both log-probs ``(..., V)`` renormalised on the
    support ``idx`` ``(..., k)``; returns ``(...)`` nats, >= 0."""
    return _renormalized_kl(lp_s.gather(-1, idx), lp_t.gather(-1, idx))


def _renormalized_kl(ls: torch.Tensor, lt: torch.Tensor) -> torch.Tensor:
    """``sum_{v in S} p~_S(v) (log p~_S(v) - log p~_T(v))`` from the two log-probs on the support, ``(..., k)`` each
    (any normalisation: renormalised here); returns ``(...)`` nats, >= 0."""
    ls = ls - ls.logsumexp(-1, keepdim=True)
    lt = lt - lt.logsumexp(-1, keepdim=True)
    return (ls.exp() * (ls - lt)).sum(-1)


class StudentTopKRenormalizedReverseKL(_RenormalizedTopKReverseKL):
    """Reverse KL on the student's top-k support, both distributions renormalised there
    (docs/algorithms.md §0.3 "top-k (student support)"; Rethinking-OPD). TurnOPD's paper uses the
    teacher's support instead (:class:`TeacherTopKRenormalizedReverseKL`, §2.6)::

        S_k = top-k(p_S(.|s_t)),   p~(v) = p(v) / sum_{u in S_k} p(u)   for v in S_k
        loss_t = sum_{v in S_k} p~_S(v) (log p~_S(v) - log p~_T(v))

    Exact on its support (no sampling), >= 0; ``S_k`` is chosen without gradient, the gradient flows
    through the student's renormalised log-probs. ``k >= V`` gives exactly the full reverse KL.

    Teacher signal: ``FULL_VOCAB``. The support is the student's top-k, known only at learner time, and the loss
    needs the teacher's log-probs on those ids; a teacher that reports only its own top-k ids (a ``vllm serve``
    endpoint's ``prompt_logprobs``) cannot give them, so this loss runs on a teacher whose logits (hidden states +
    head, chunk by chunk) are at hand, like the full-vocabulary losses.

    Args:
        k: support size (tokens); default 50 (§2.6, PROPOSED).

    Raises:
        ValueError: ``k < 1``.
    """

    teacher_signal = TeacherSignal.FULL_VOCAB
    support_side = "student"


class TeacherTopKRenormalizedReverseKL(_RenormalizedTopKReverseKL, _TeacherReportedTopK):
    """Reverse KL on the **teacher's** top-k support, both distributions renormalised there: TurnOPD's
    ``loss_mode = topk_reverse_kl`` with ``distill_topk = 50`` (arXiv 2607.05804, Table 7; docs/algorithms.md
    §2.6; the renormalisation is PROPOSED, as in §0.3's top-k row)::

        S_k = top-k(p_T(.|s_t)),   p~(v) = p(v) / sum_{u in S_k} p(u)   for v in S_k
        loss_t = sum_{v in S_k} p~_S(v) (log p~_S(v) - log p~_T(v))

    Exact on its support, >= 0. The support follows the teacher (no gradient flows through its choice),
    so tokens the student favours but the teacher does not rank in its top-k are outside the loss; the
    gradient flows through the student's renormalised log-probs. ``k >= V`` gives exactly the full
    reverse KL. Shapes: logits ``(N, V)`` per chunk, loss ``(N,)`` nats per token. Teacher signal: ``TOP_K``
    (the teacher's top-k ids and log-probs; the renormalisation needs nothing else of the teacher):
    :meth:`signal_terms` takes ``S_k`` and ``log p_T`` on it from ``teacher_topk_ids`` / ``teacher_topk_logprobs``
    ``(N, K)`` (the first ``min(k, V)``), the student's log-probs from its own logits; the logged ``kl`` is then the
    k1 estimate from ``teacher_sampled_logprobs`` (:class:`~lightning_opd.losses.base.TokenLoss`), not this loss's
    support-restricted value.

    Args:
        k: support size (tokens); default 50 (the paper's ``distill_topk``).

    Raises:
        ValueError: ``k < 1``.
    """

    teacher_signal = TeacherSignal.TOP_K
    support_side = "teacher"

    def _reported_loss(self, lp_s: torch.Tensor, idx: torch.Tensor, lt: torch.Tensor) -> torch.Tensor:
        return _renormalized_kl(lp_s.gather(-1, idx), lt)


class TeacherTopKForwardKL(_TeacherReportedTopK):
    """Forward KL on the teacher's top-k support, not renormalised (docs/algorithms.md §0.3 "top-k
    (teacher support, forward KL)"; verl ``forward_kl_topk``, default k = 32)::

        S_k = top-k(p_T(.|s_t)),   loss_t = sum_{v in S_k} p_T(v) (log p_T(v) - log p_S(v))
        + tail_bucket:  p_T(tail) (log p_T(tail) - log p_S(tail)),   p(tail) = 1 - sum_{v in S_k} p(v)

    Without the tail bucket the sum is a truncated forward KL (it can be slightly negative when the
    student puts more mass on ``S_k`` than the teacher); with it, it is the exact forward KL between
    the two distributions coarsened to ``S_k`` + one "everything else" token, hence >= 0 and <= the
    full forward KL. The tail log-masses are computed as a log-sum-exp over the complement (stable
    when the tail is tiny). ``k >= V`` gives exactly the full forward KL (the tail is empty).

    Teacher signal: ``TOP_K``: the teacher's tail mass is ``1 - sum_{v in S_k} p_T(v)``, from its top-k
    log-probs; the student's comes from its own logits. :meth:`signal_terms` does exactly that from the reported
    ``teacher_topk_ids`` / ``teacher_topk_logprobs`` ``(N, K)`` (the first ``min(k, V)``): ``log p_T(tail) =
    log(1 - exp(logsumexp(top-k log-probs)))`` (stable ``log1mexp``; a tail that rounds to 0 adds 0), the student's
    tail as a log-sum-exp over its complement. The tail bucket is verl's optional term of ``forward_kl_topk``
    (docs/algorithms.md §0.3), off by default as there; with ``tail_bucket=True`` this is the issue's "top-k forward
    KL with a tail bucket". The logged ``kl`` is then the k1 estimate of the reverse KL from
    ``teacher_sampled_logprobs`` (:class:`~lightning_opd.losses.base.TokenLoss`).

    Args:
        k: support size (tokens); default 32 (verl).
        tail_bucket: add the tail term.

    Raises:
        ValueError: ``k < 1``.
    """

    teacher_signal = TeacherSignal.TOP_K

    def __init__(self, k: int = 32, tail_bucket: bool = False, chunk_size: int = 256) -> None:
        super().__init__(k, chunk_size)
        self.tail_bucket = tail_bucket

    def token_terms(self, student_logits, teacher_logits, targets, temperature=1.0) -> TokenLoss:
        lp_s, lp_t = self._common(student_logits, teacher_logits, temperature)
        idx = self._top_k_ids(lp_t)  # (..., k)
        lt = lp_t.gather(-1, idx)
        loss = (lt.exp() * (lt - lp_s.gather(-1, idx))).sum(-1)
        if self.tail_bucket and idx.shape[-1] < lp_t.shape[-1]:  # k >= V: no tail
            tail_t, tail_s = _complement_logsumexp(lp_t, idx), _complement_logsumexp(lp_s, idx)
            loss = loss + tail_t.exp() * (tail_t - tail_s)
        return self._full(loss, lp_s, lp_t, targets)

    def _reported_loss(self, lp_s: torch.Tensor, idx: torch.Tensor, lt: torch.Tensor) -> torch.Tensor:
        loss = (lt.exp() * (lt - lp_s.gather(-1, idx))).sum(-1)
        if self.tail_bucket and idx.shape[-1] < lp_s.shape[-1]:  # k >= V: no tail
            tail_t, tail_s = _log1mexp(lt.logsumexp(-1)), _complement_logsumexp(lp_s, idx)
            loss = loss + torch.where(tail_t > float("-inf"), tail_t.exp() * (tail_t - tail_s), 0.0)
        return loss
