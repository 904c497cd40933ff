"""T-DUR turn weights of ATOD (arXiv 2606.27814 Eq. 13-16; docs/algorithms.md §3.3).

For turn k of a trajectory with N_k supervised (generated) tokens, from sampled-token log-probs only::

    d_k = mean_t |log π_θ(a_t) − log π_T(a_t)|     disagreement (Eq. 13, nats)
    h_k = mean_t (−log π_θ(a_t))                    uncertainty (Eq. 14, nats)
    x̃_k = (x_k − min_j x_j) / (max_j x_j − min_j x_j) over the trajectory's turns; 0.5 if the range < 1e-8  (Eq. 15)
    w_k = 1 − (1 − d̃_k)(1 − h̃_k)                    soft-OR fusion (Eq. 16), in [0, 1]

A single-turn trajectory gets w = 0.75 (both normalisations fall back to 0.5). The weights multiply
only the OPD term of the hybrid advantage (§3.1), never the GRPO term.

PROPOSED in docs/algorithms.md, not from the paper: π_θ here is the old policy, i.e. the same
log-probs that define Δlogp_t (see ``ClippedSurrogate`` for their source); turns are the zero-based
``turn_index`` runs of supervised tokens, and a turn without supervised tokens is not a turn of the
trajectory (it takes no part in the min-max).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TurnWeights:
    """T-DUR output for ``B`` trajectories, ``K`` turns (zero-based), ``L`` token positions.

    Attributes:
        token_weight: ``(B, L)`` w of each token's turn; 1 at positions that are not supervised.
        turn_weight: ``(B, K)`` w_k (0 where the turn is absent).
        present: ``(B, K)`` bool, the trajectory has supervised tokens in turn k.
        disagreement: ``(B, K)`` d_k (nats); uncertainty: ``(B, K)`` h_k (nats).
    """

    token_weight: torch.Tensor
    turn_weight: torch.Tensor
    present: torch.Tensor
    disagreement: torch.Tensor
    uncertainty: torch.Tensor

    def mean_weight(self, rows: torch.Tensor | None = None) -> float:
        """Mean w_k over the present (trajectory, turn) pairs of ``rows`` (``(B,)`` bool; default all);
        0 when there is none."""
        present = self.present if rows is None else self.present & rows[:, None]
        n = int(present.sum())
        return float(self.turn_weight[present].sum()) / n if n else 0.0


def _min_max(x: torch.Tensor, present: torch.Tensor, eps: float, fallback: float) -> torch.Tensor:
    """Per-row min-max of ``x`` ``(B, K)`` over ``present`` entries; rows with range < eps -> fallback."""
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    lo = torch.where(present, x, inf).min(dim=1, keepdim=True).values
    hi = torch.where(present, x, -inf).max(dim=1, keepdim=True).values
    span = hi - lo
    flat = ~(span >= eps)  # also rows without any present turn (span = -inf)
    scaled = (x - torch.where(flat, torch.zeros_like(lo), lo)) / torch.where(flat, torch.ones_like(span), span)
    return torch.where(flat, torch.full_like(x, fallback), scaled)


def tdur_weights(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                 turns: torch.Tensor, eps: float = 1e-8, fallback: float = 0.5) -> TurnWeights:
    """T-DUR weights (Eq. 13-16) of every supervised token.

    Args:
        student_logprobs: ``(B, L)`` log π_θ of the sampled tokens (nats; old policy, see module docstring).
        teacher_logprobs: ``(B, L)`` log π_T of the same tokens (nats).
        mask: ``(B, L)`` 1 on supervised tokens.
        turns: ``(B, L)`` zero-based turn of each token (-1 off the mask).
        eps: min-max denominator below which the fallback applies (paper: 1e-8).
        fallback: normalised value used then (paper: 0.5).

    Returns:
        :class:`TurnWeights` (float64).
    """
    sup = (mask > 0) & (turns >= 0)
    b, device = mask.shape[0], mask.device
    k = int(turns[sup].max()) + 1 if bool(sup.any()) else 1
    idx = torch.where(sup, turns, torch.zeros_like(turns)).long()
    m = sup.double()
    zero = torch.zeros((), dtype=torch.float64, device=device)
    s, t = student_logprobs.double(), teacher_logprobs.double()
    n = torch.zeros(b, k, dtype=torch.float64, device=device).scatter_add_(1, idx, m)
    d_sum = torch.zeros_like(n).scatter_add_(1, idx, torch.where(sup, (s - t).abs(), zero))
    h_sum = torch.zeros_like(n).scatter_add_(1, idx, torch.where(sup, -s, zero))
    present = n > 0
    d, h = d_sum / n.clamp(min=1), h_sum / n.clamp(min=1)
    d_n, h_n = _min_max(d, present, eps, fallback), _min_max(h, present, eps, fallback)
    w = torch.where(present, 1 - (1 - d_n) * (1 - h_n), zero)
    token_w = torch.where(sup, w.gather(1, idx), torch.ones((), dtype=torch.float64, device=device))
    return TurnWeights(token_weight=token_w, turn_weight=w, present=present, disagreement=d, uncertainty=h)
