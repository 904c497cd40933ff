"""Token-weighted per-turn means, reduced correctly across ranks (docs/style.md lesson 6)."""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch
from torchmetrics import Metric


class PerTurnMean(Metric):
    """Mean of a per-token value for each turn ``0..num_turns-1``, weighted by tokens.

    States are the weighted sum and the weight per turn, both reduced with ``sum`` across ranks, so
    ranks that saw different turns average correctly.

    Args:
        num_turns: number of turns tracked (``K``); tokens of later turns are ignored.

    ``update(values, turns, weights=None)``: ``values``, ``turns``, ``weights`` of shape ``(N,)``
    (any shape, flattened); tokens with ``turns < 0`` (observation tokens) are ignored.
    ``compute()`` returns ``{"mean": (K,), "weight": (K,)}`` synced across ranks: the means (NaN for a
    turn without tokens) and the token weights, so a decision to skip a turn made from ``weight`` is
    the same on every rank. Both keep their turn axis at ``K = 1`` (F17: torchmetrics squeezes a
    one-element result to 0-d, which broke single-turn runs).
    """

    full_state_update = False

    def __init__(self, num_turns: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if num_turns < 1:
            raise ValueError(f"num_turns={num_turns} must be >= 1")
        self.num_turns = num_turns
        self.add_state("total", default=torch.zeros(num_turns, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.zeros(num_turns, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor, turns: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        values, turns = values.detach().reshape(-1).double(), turns.detach().reshape(-1).long()
        w = torch.ones_like(values) if weights is None else weights.detach().reshape(-1).double()
        keep = (turns >= 0) & (turns < self.num_turns) & (w > 0)
        t = turns[keep]
        self.total.index_add_(0, t, values[keep] * w[keep])
        self.weight.index_add_(0, t, w[keep])

    def _wrap_compute(self, compute: Callable) -> Callable:
        # torchmetrics' wrapper (sync, cache) squeezes every one-element tensor of the result; undo that
        # for the (K,) results so K = 1 runs the same indexing as any K (tests/metrics/test_per_turn.py).
        # A rank without rows computes without an update: NaN means and 0 weights are the documented
        # result there, so torchmetrics' "compute before update" warning is dropped.
        wrapped = super()._wrap_compute(compute)

        @functools.wraps(wrapped)
        def per_turn(*args, **kwargs) -> dict[str, torch.Tensor]:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The ``compute`` method of metric", category=UserWarning)
                out = wrapped(*args, **kwargs)
            return {k: v.reshape(self.num_turns) for k, v in out.items()}

        return per_turn

    def compute(self) -> dict[str, torch.Tensor]:
        mean = torch.where(self.weight > 0, self.total / self.weight.clamp(min=1e-30),
                           torch.full_like(self.total, float("nan")))
        return {"mean": mean, "weight": self.weight.clone()}
