"""Per-token divergences, the common aggregation (docs/algorithms.md §0) and ATOD's clipped surrogate (§3)."""

from lightning_opd.losses.aggregation import aggregate_token_loss
from lightning_opd.losses.chunked import chunked_sampled_logprobs, chunked_token_terms
from lightning_opd.losses.divergences import (ForwardKL, FullVocabReverseKL, GeneralizedJSD, SampledTokenReverseKL,
                                              TeacherSignal, TokenDivergence, TokenLoss, log_probs)
from lightning_opd.losses.grpo import ClippedSurrogate, EpisodeReward
from lightning_opd.losses.sign_only import SignOnlyReverseKL
from lightning_opd.losses.topk import (StudentTopKRenormalizedReverseKL, TeacherTopKForwardKL,
                                       TeacherTopKRenormalizedReverseKL)

__all__ = ["aggregate_token_loss", "chunked_token_terms", "chunked_sampled_logprobs", "TeacherSignal", "TokenDivergence",
           "TokenLoss",
           "SampledTokenReverseKL", "FullVocabReverseKL", "ForwardKL", "GeneralizedJSD",
           "StudentTopKRenormalizedReverseKL", "TeacherTopKForwardKL", "TeacherTopKRenormalizedReverseKL", "ClippedSurrogate", "EpisodeReward", "log_probs",
           "SignOnlyReverseKL"]
