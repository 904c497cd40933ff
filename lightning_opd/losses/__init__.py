"""Per-token divergences and the common aggregation (docs/algorithms.md §0)."""

from lightning_opd.losses.aggregation import aggregate_token_loss
from lightning_opd.losses.divergences import (FullVocabReverseKL, SampledTokenReverseKL, TokenDivergence, TokenLoss,
                                              log_probs)

__all__ = ["aggregate_token_loss", "TokenDivergence", "TokenLoss", "SampledTokenReverseKL", "FullVocabReverseKL",
           "log_probs"]
