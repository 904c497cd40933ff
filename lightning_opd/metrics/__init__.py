"""torchmetrics for OPD: token-weighted per-turn means (``kl/turn_NN``)."""

from lightning_opd.metrics.per_turn import PerTurnMean

__all__ = ["PerTurnMean"]
