"""``SignOnlyReverseKL``: the sampled-token OPD policy gradient with only the sign of its advantage.

Source: issue 63, design 3 (a 2026 report that a sign-only advantage works as well as the KL; the report itself is
not available to us). PROPOSED, docs/algorithms.md §8.2: not from a paper. It asks whether OPD's gain needs the
teacher's graded per-token judgement or only which direction each sampled token should move.
"""

from __future__ import annotations

import torch

from lightning_opd.losses.divergences import SampledTokenReverseKL


class SignOnlyReverseKL(SampledTokenReverseKL):
    """Sampled-token reverse KL in policy-gradient form, with the advantage replaced by its sign.

    PROPOSED, docs/algorithms.md §8.2 (issue 63). With ``A_t = log p_T(a_t) - log p_S(a_t)`` (nats, detached; the
    learner-time student log-prob, or the rollout-time one with ``signal="behaviour"``, as in
    :class:`~lightning_opd.losses.divergences.SampledTokenReverseKL`) and ``a_t ~ p_S``::

        loss_t = -exp(log p_S(a_t) - sg(log p_S(a_t))) * sg(sign(A_t)),   sign(0) = 0

    Its value is ``-sign(A_t)`` (in {-1, 0, 1}) and its gradient ``-sign(A_t) * grad log p_S(a_t)``: the sampled
    token's log-prob is pushed up where the teacher likes it more than the student does, down where less, by the
    same amount whatever the size of the gap. That is not the gradient of a divergence: its expectation over
    ``a_t ~ p_S`` is ``-sum_a p_S(a) sign(log p_T(a) - log p_S(a)) grad log p_S(a)``, which, like the reverse KL's, is
    0 where ``p_S = p_T`` (every sign 0). Only the advantage changes: the teacher signal (``SAMPLED_TOKEN``), both paths
    (:meth:`token_terms` with a ``FULL_VOCAB`` teacher, :meth:`signal_terms` with a served one), the logged ``kl``
    (the exact reverse KL, or its k1 estimate from a teacher without ``FULL_VOCAB``) and the off-policy treatment (a
    sampled-token estimator: the truncated ratio applies on stale tokens, docs/algorithms.md §7.1) are those of
    ``SampledTokenReverseKL``.

    Deliberate simplification: no dead zone. ``sign`` is discontinuous at 0: a gap of 1e-7 nats counts as much as one
    of 5 nats (only exact equality gives 0).

    Args:
        signal, chunk_size: see :class:`~lightning_opd.losses.divergences.SampledTokenReverseKL`.

    Raises:
        ValueError: an unknown ``signal``.
    """

    def policy_advantage(self, advantage: torch.Tensor) -> torch.Tensor:
        """``sign(A_t)`` ``(...)``, detached: -1, 0 (where ``A_t = 0``) or 1."""
        return torch.sign(advantage).detach()
