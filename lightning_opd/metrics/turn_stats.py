"""Per-sample, per-turn sums of one training step: the input of the TurnOPD diagnostics (§4) and of
the rollout-depth controller (docs/algorithms.md §2.3).

The module fills a :class:`TurnStats` for every step (returned by ``OPDModule.training_step`` as ``outputs["turn_stats"]``) from the same
per-token values the loss used; consumers reduce it across ranks themselves (every field is a sum or
a per-sample value, so ``sum`` over ranks / concatenation is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def per_turn_sums(values: torch.Tensor, turns: torch.Tensor, num_turns: int) -> torch.Tensor:
    """Sum a per-token value per sample and turn.

    Args:
        values: ``(B, T)`` per-token values (already masked: zero where a token does not count).
        turns: ``(B, T)`` zero-based turn index per token (``-1``: not an assistant token).
        num_turns: ``H``, turns tracked; tokens of turn ``>= H`` are ignored.

    Returns:
        ``(B, H)`` float64 sums.
    """
    keep = (turns >= 0) & (turns < num_turns)
    idx = turns.clamp(0, num_turns - 1).long()
    src = torch.where(keep, values.double(), torch.zeros((), dtype=torch.float64, device=values.device))
    return torch.zeros(values.shape[0], num_turns, dtype=torch.float64, device=values.device).scatter_add_(1, idx, src)


@dataclass
class TurnStats:
    """One step's per-turn sums on this rank (``B`` samples, ``H`` tracked turns, zero-based).

    Attributes:
        kl_sum: ``(B, H)`` sum of the per-token reverse KL over the sample's supervised tokens of turn t
            (nats; the exact full-vocabulary value, whatever the loss).
        loss_sum: ``(B, H)`` sum of the weighted per-token loss ``m_i w_i l_i`` of turn t (nats; the
            numerator of the step loss, §0.5).
        tokens: ``(B, H)`` supervised tokens of turn t (after filtering: a dropped sample has 0).
        num_turns: ``(B,)`` turns the episode played.
        success: ``(B,)`` bool, the episode succeeded.
        is_probe: ``(B,)`` bool, a full-depth probe rollout (TurnOPD).
        rollout_cap: ``(B,)`` the turn cap the episode ran under.
        kept: ``(B,)`` bool, the sample reached the loss (has supervised tokens after the step's
            weighting schemes; ``False`` for a sample a filter dropped).
    """

    kl_sum: torch.Tensor
    loss_sum: torch.Tensor
    tokens: torch.Tensor
    num_turns: torch.Tensor
    success: torch.Tensor
    is_probe: torch.Tensor
    rollout_cap: torch.Tensor
    kept: torch.Tensor

    @classmethod
    def cat(cls, parts: list["TurnStats"]) -> "TurnStats":
        """Concatenate the samples of several parts (e.g. the mini-batches of one step), in order."""
        names = ("kl_sum", "loss_sum", "tokens", "num_turns", "success", "is_probe", "rollout_cap", "kept")
        return cls(**{k: torch.cat([getattr(p, k) for p in parts]) for k in names})

    @property
    def num_tracked_turns(self) -> int:
        """``H``."""
        return self.kl_sum.shape[1]

    def survivors(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``(H,)`` samples (of ``rows``, a ``(B,)`` bool selection; default all) still running at turn t,
        i.e. with ``num_turns > t`` (TurnOPD §2.1)."""
        n = self.num_turns if rows is None else self.num_turns[rows]
        t = torch.arange(self.num_tracked_turns, device=n.device)
        return (n[:, None] > t[None, :]).sum(0).double()
