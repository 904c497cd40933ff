"""Top-k divergences: the loss is restricted to ``k`` tokens per position (docs/algorithms.md §0.3).

The class name says whose top-k is the support. As ``k`` grows to the vocabulary size each converges
to its full-vocabulary counterpart and equals it at ``k = V`` (F14). Like every divergence here they
run chunk by chunk from hidden states (:meth:`TokenDivergence.forward`); ``kl`` logs the exact
full-vocabulary reverse KL (the chunk's full logits are at hand), so curves stay comparable.
"""

from __future__ import annotations

import torch

from lightning_opd.losses.divergences import TeacherSignal, TokenDivergence, TokenLoss


def _complement_logsumexp(lp: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``log sum_{v not in idx} exp(lp_v)``: ``(..., V)``, ``(..., k)`` -> ``(...)`` (``-inf`` when k = V)."""
    return lp.scatter(-1, idx, float("-inf")).logsumexp(-1)


class _TopK(TokenDivergence):
    def __init__(self, k: int = 50, chunk_size: int = 256) -> None:
        super().__init__(chunk_size)
        if k < 1:
            raise ValueError(f"k={k} must be >= 1 (tokens in the top-k support)")
        self.k = int(k)


def _renormalized_reverse_kl(lp_s: torch.Tensor, lp_t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``sum_{v in S} p~_S(v) (log p~_S(v) - log p~_T(v))`` with both log-probs ``(..., V)`` renormalised on the
    support ``idx`` ``(..., k)``; returns ``(...)`` nats, >= 0."""
    ls = lp_s.gather(-1, idx)
    ls = ls - ls.logsumexp(-1, keepdim=True)
    lt = lp_t.gather(-1, idx)
    lt = lt - lt.logsumexp(-1, keepdim=True)
    return (ls.exp() * (ls - lt)).sum(-1)


class StudentTopKRenormalizedReverseKL(_TopK):
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

    def token_terms(self, student_logits, teacher_logits, targets, temperature=1.0) -> TokenLoss:
        lp_s, lp_t = self._common(student_logits, teacher_logits, temperature)
        idx = lp_s.detach().topk(min(self.k, lp_s.shape[-1]), dim=-1).indices  # (..., k)
        return self._full(_renormalized_reverse_kl(lp_s, lp_t, idx), lp_s, lp_t, targets)


class TeacherTopKRenormalizedReverseKL(_TopK):
    """Reverse KL on the **teacher's** top-k support, both distributions renormalised there: TurnOPD's
    ``loss_mode = topk_reverse_kl`` with ``distill_topk = 50`` (arXiv 2607.05804, Table 7; docs/algorithms.md
    §2.6; the renormalisation is PROPOSED, as in §0.3's top-k row)::

        S_k = top-k(p_T(.|s_t)),   p~(v) = p(v) / sum_{u in S_k} p(u)   for v in S_k
        loss_t = sum_{v in S_k} p~_S(v) (log p~_S(v) - log p~_T(v))

    Exact on its support, >= 0. The support follows the teacher (no gradient flows through its choice),
    so tokens the student favours but the teacher does not rank in its top-k are outside the loss; the
    gradient flows through the student's renormalised log-probs. ``k >= V`` gives exactly the full
    reverse KL. Shapes: logits ``(N, V)`` per chunk, loss ``(N,)`` nats per token. Teacher signal: ``TOP_K``
    (the teacher's top-k ids and log-probs; the renormalisation needs nothing else of the teacher).

    Args:
        k: support size (tokens); default 50 (the paper's ``distill_topk``).

    Raises:
        ValueError: ``k < 1``.
    """

    teacher_signal = TeacherSignal.TOP_K

    def token_terms(self, student_logits, teacher_logits, targets, temperature=1.0) -> TokenLoss:
        lp_s, lp_t = self._common(student_logits, teacher_logits, temperature)
        idx = lp_t.detach().topk(min(self.k, lp_t.shape[-1]), dim=-1).indices  # (..., k)
        return self._full(_renormalized_reverse_kl(lp_s, lp_t, idx), lp_s, lp_t, targets)


class TeacherTopKForwardKL(_TopK):
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
    log-probs; the student's comes from its own logits.

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
        idx = lp_t.topk(min(self.k, lp_t.shape[-1]), dim=-1).indices  # (..., k)
        lt = lp_t.gather(-1, idx)
        loss = (lt.exp() * (lt - lp_s.gather(-1, idx))).sum(-1)
        if self.tail_bucket and idx.shape[-1] < lp_t.shape[-1]:  # k >= V: no tail
            tail_t, tail_s = _complement_logsumexp(lp_t, idx), _complement_logsumexp(lp_s, idx)
            loss = loss + tail_t.exp() * (tail_t - tail_s)
        return self._full(loss, lp_s, lp_t, targets)
