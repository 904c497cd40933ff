"""The seam through which weighting schemes reach the loss (docs/algorithms.md §0.5).

A scheme (freshness, turn-loss blend, ...) is registered on the module with
``OPDModule.set_weighting(name, scheme)``. For every rollout batch the module asks each scheme for a
:class:`BatchPlan` (per-sample keep flags and weights, decided on the whole step before any
backward pass), then for per-token weights of each micro-batch. Weights multiply; dropped samples
leave the loss and the token count. With no scheme registered every weight is 1 (vanilla OPD).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class BatchPlan:
    """Per-sample decisions for one rollout batch (``B`` samples).

    Attributes:
        keep: ``(B,)`` bool, ``False`` drops the sample (its tokens leave the loss and the count).
        sample_weight: ``(B,)`` float multiplier applied to every token of the sample.
    """

    keep: torch.Tensor | None = None
    sample_weight: torch.Tensor | None = None


@runtime_checkable
class Weighting(Protocol):
    """A weighting scheme. ``needs_student_logprobs``: ``prepare`` needs the learner's log-probs of the
    sampled tokens for the whole batch (the module computes them in a no-grad pre-pass)."""

    needs_student_logprobs: bool

    def prepare(self, module, batch, student_logprobs: torch.Tensor | None) -> BatchPlan:
        """Decide per-sample keep flags / weights for ``batch``; ``student_logprobs`` is ``(B, T-1)``."""

    def token_weights(self, module, micro_batch, token_loss) -> torch.Tensor | None:
        """``(b, T-1)`` per-token weights for one micro-batch (``None``: all 1)."""
