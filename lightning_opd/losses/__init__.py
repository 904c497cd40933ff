"""Per-token divergences and the common aggregation (docs/algorithms.md §0)."""

from lightning_opd.losses.aggregation import aggregate_token_loss
from lightning_opd.losses.chunked import chunked_token_terms
from lightning_opd.losses.divergences import (ForwardKL, FullVocabReverseKL, GeneralizedJSD, SampledTokenReverseKL,
                                              TokenDivergence, TokenLoss, log_probs)
from lightning_opd.losses.topk import StudentTopKRenormalizedReverseKL, TeacherTopKForwardKL

__all__ = ["aggregate_token_loss", "chunked_token_terms", "TokenDivergence", "TokenLoss", "SampledTokenReverseKL",
           "FullVocabReverseKL", "ForwardKL", "GeneralizedJSD", "StudentTopKRenormalizedReverseKL",
           "TeacherTopKForwardKL", "log_probs"]
