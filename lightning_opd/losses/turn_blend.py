"""TurnOPD's progressive turn-normalised loss budgeting (arXiv 2607.05804 §5.2; docs/algorithms.md §2.4):
the per-token weights and the loss-side component ``OPDModule`` applies (second of its weightings,
:mod:`lightning_opd.losses.weighting`).

Vanilla OPD spends the loss budget by tokens, so the long, early turns dominate. The blend moves each
trajectory's budget from token-level (``q_t = n_t / N``) towards turn-balanced (``q_t = 1 / T``)::

    w_i = N q_t^blend / n_t = (1 - α) + α N / (T n_t)      for token i of turn t

per sample: ``N`` its supervised tokens, ``T`` its observed turns (turns with at least one supervised
token), ``n_t`` the supervised tokens of turn t. ``Σ_i w_i = N`` per sample, so the step's normalisation
(§0.5) is unchanged and α = 0 is exactly vanilla OPD. A micro-batch holds whole samples, so the weights do
not depend on the micro-batch size. α is decided by the ``TurnLossBlend`` callback (its schedule over
training) and handed over with :meth:`TurnBlendWeighting.set_alpha`.

PROPOSED in docs/algorithms.md, not from the paper: the per-token rescaling ``w_i = N q_t / n_t`` (follows
a public re-implementation; the paper's batch aggregation is unknown) and composing with other weights by
multiplication (§0.5).
"""

from __future__ import annotations

import torch


def blend_weights(loss_mask: torch.Tensor, turn_index: torch.Tensor, alpha: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token turn-blend weights ``(1 - α) + α N / (T n_t)``.

    Args:
        loss_mask: ``(b, L)`` 1 on supervised tokens (e.g. ``loss_mask[:, 1:]``, the target positions).
        turn_index: ``(b, L)`` zero-based turn of each token, aligned with ``loss_mask``; -1 elsewhere.
        alpha: α in [0, 1].

    Returns:
        ``(b, L)`` weights; 1 at positions that are not supervised; exactly 1 everywhere when α = 0.
    """
    sup = (loss_mask > 0) & (turn_index >= 0)
    if alpha == 0 or not bool(sup.any()):
        return torch.ones(loss_mask.shape, dtype=dtype, device=loss_mask.device)
    idx = torch.where(sup, turn_index, torch.zeros_like(turn_index)).long()  # (b, L)
    h = int(idx.max()) + 1
    counts = torch.zeros(loss_mask.shape[0], h, dtype=torch.float64, device=loss_mask.device)
    counts.scatter_add_(1, idx, sup.double())  # (b, H): n_t per sample
    n_total = counts.sum(1, keepdim=True)  # (b, 1): N
    observed = (counts > 0).sum(1, keepdim=True).double()  # (b, 1): T
    n_t = counts.gather(1, idx).clamp(min=1)  # (b, L): n_t of each token's turn
    w = (1 - alpha) + alpha * n_total / (observed.clamp(min=1) * n_t)
    return torch.where(sup, w, torch.ones_like(w)).to(dtype)


class TurnBlendWeighting:
    """Turn-blended per-token loss weights at the current α (TurnOPD §5.2).

    Args:
        alpha: α in [0, 1] until :meth:`set_alpha` changes it (0: vanilla OPD).

    Raises:
        ValueError: ``alpha`` outside [0, 1].
    """

    def __init__(self, alpha: float = 0.0) -> None:
        self.alpha = 0.0
        self.set_alpha(alpha)

    def set_alpha(self, alpha: float) -> None:
        """α for the next micro-batches (a schedule's value, unitless).

        Raises:
            ValueError: ``alpha`` outside [0, 1].
        """
        alpha = float(alpha)
        if not 0 <= alpha <= 1:
            raise ValueError(f"turn-blend alpha={alpha} must be in [0, 1]")
        self.alpha = alpha

    def token_weights(self, mask: torch.Tensor, turns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """``(b, T-1)`` weights of one micro-batch's target positions (``mask`` = ``loss_mask[:, 1:]``, ``turns``
        = ``turn_index[:, 1:]``), in ``dtype``; ``None`` (all 1, vanilla OPD) when α = 0."""
        if self.alpha == 0:
            return None
        return blend_weights(mask, turns, self.alpha, dtype)
