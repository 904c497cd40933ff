"""torchmetrics for OPD: token-weighted per-turn means (``kl/turn_NN``)."""

from lightning_opd.metrics.per_turn import PerTurnMean
from lightning_opd.metrics.turn_stats import TurnStats, per_turn_sums

__all__ = ["PerTurnMean", "TurnStats", "per_turn_sums"]
