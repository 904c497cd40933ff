"""Token weightings of the loss (docs/algorithms.md §0.5): loss-side components the module holds.

``OPDModule`` holds at most one component of each kind (in ``LossWeightings``, :mod:`lightning_opd.learner.weightings`),
installed through named setters (``configure_freshness``, ``configure_turn_blend``), and applies them in this fixed
order, which is
also the order of their collectives on every rank, whatever the order of the callbacks that install them:

1. freshness, :class:`~lightning_opd.losses.freshness.FreshnessWeighting` (f-OPD M1/M2/M3): once per
   rollout batch, :meth:`~lightning_opd.losses.freshness.FreshnessWeighting.plan` (one all-reduce through
   the reducer it is given) decides per-sample keep flags and weights; per micro-batch, the M3 truncated
   ratio (no collective);
2. turn blend, :class:`~lightning_opd.losses.turn_blend.TurnBlendWeighting` (TurnOPD §5.2): per
   micro-batch token weights (no collective).

Weights multiply in that order (sample weights first); dropped samples leave the loss and the token
count. With neither installed every weight is 1 (vanilla OPD). T-DUR (ATOD §3.3,
:mod:`~lightning_opd.losses.tdur`) is not one of them: it weights only the OPD term of the hybrid
advantage, inside ``ATODModule``.

Components take explicit inputs (tensors and, where a cross-rank sum is needed, a reducer), never the
module. The values a controller decides (the lag bound, the blend's α) reach them through their own
named setters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

#: Sums a tensor over data-parallel ranks (identity on one process), e.g. ``OPDModule.reduce_sum``.
Reducer = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class BatchPlan:
    """Per-sample decisions for one rollout batch (``B`` samples).

    Attributes:
        keep: ``(B,)`` bool, ``False`` drops the sample (its tokens leave the loss and the count); ``None``: keep all.
        sample_weight: ``(B,)`` float multiplier applied to every token of the sample; ``None``: all 1.
        stats: the diagnostics of the decision (plain floats, logged by the controller that reads them).
    """

    keep: torch.Tensor | None = None
    sample_weight: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)
