"""The common aggregation of every per-token loss (docs/algorithms.md §0.5, PROPOSED there).

    L = sum_i m_i w_i l_i / max(1, sum_i m_i)

``m`` = loss mask (1 on sampled assistant tokens), ``w`` = product of the weighting schemes (1 by
default), and the denominator is the number of supervised tokens of the *whole optimizer step* (all
micro-batches, all data-parallel ranks), so the gradient does not depend on how the step is split
(F07) and an all-masked micro-batch adds exactly 0 (F06).

Option (docs/algorithms.md §0.5, for reproducing ATOD as published): the per-sequence mean

    L = sum_seq (1 / |M_seq|) sum_{i in seq} m_i w_i l_i / (sequences in the step, all ranks)

computed by the same function with per-token weights :func:`sequence_token_weights` (``1 / |M_seq|``) and
the step's sequence count as the denominator; a sequence never spans micro-batches, so it keeps the same
split invariance.
"""

from __future__ import annotations

import torch


def aggregate_token_loss(token_loss: torch.Tensor, mask: torch.Tensor, step_tokens: torch.Tensor | float,
                         weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of masked, weighted per-token losses divided by the step's supervised-token count.

    Args:
        token_loss: ``(B, T)`` per-token loss (may hold NaN/inf at masked positions).
        mask: ``(B, T)`` 1 on supervised tokens, 0 elsewhere.
        step_tokens: supervised tokens of the whole optimizer step (all micro-batches and ranks);
            clamped to at least 1.
        weights: ``(B, T)`` per-token weights (default 1).

    Returns:
        Scalar loss (a partial sum: the micro-batch's share of the step loss).

    Raises:
        ValueError: shapes differ.
    """
    if token_loss.shape != mask.shape or (weights is not None and weights.shape != mask.shape):
        raise ValueError(f"shapes differ: loss {tuple(token_loss.shape)}, mask {tuple(mask.shape)}, "
                         f"weights {None if weights is None else tuple(weights.shape)}")
    keep = mask > 0
    values = token_loss if weights is None else token_loss * weights
    values = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    denom = torch.as_tensor(step_tokens, dtype=values.dtype, device=values.device).clamp(min=1.0)
    return values.sum() / denom


def sequence_token_weights(mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` per-token weights ``m_i / |M_seq|`` (0 where masked; a row without supervised tokens gets 0).

    With :func:`aggregate_token_loss` and the step's number of sequences (rows with at least one supervised
    token, all micro-batches and ranks) as ``step_tokens``, the loss is the per-sequence mean of §0.5's option.

    Args:
        mask: ``(B, T)`` 1 on supervised tokens, 0 elsewhere.
    """
    keep = (mask > 0).to(torch.float32)
    return keep / keep.sum(dim=-1, keepdim=True).clamp(min=1.0)


def supervised_sequences(mask: torch.Tensor) -> torch.Tensor:
    """Number of rows of ``mask`` ``(B, T)`` with at least one supervised token (a 0-d integer tensor)."""
    return (mask > 0).any(dim=-1).sum()
