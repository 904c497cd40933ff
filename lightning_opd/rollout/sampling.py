"""The sampling distribution on the trainer side (F02).

Recomputes, from logits, the log-probs of the distribution a generator actually samples from:
fp32 upcast, then temperature, then top-k, then top-p (nucleus) truncation with renormalisation, in
the order Hugging Face's and vLLM's samplers apply them. Used to check that behaviour log-probs and
trainer log-probs describe the same distribution, and for importance ratios.
"""

from __future__ import annotations

import torch

from lightning_opd.rollout.generator import SamplingParams


def sampling_log_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probs of the sampling distribution; ``(..., V)`` logits -> ``(..., V)`` fp32, ``-inf`` outside
    the top-k / top-p support. Greedy (temperature 0) is scored at temperature 1.

    A token is kept by top-p if the probability mass of the tokens strictly more likely than it is
    below ``top_p`` (the most likely token is always kept).
    """
    t = sampling.temperature if sampling.temperature > 0 else 1.0
    scores = logits.float() / t
    if sampling.temperature > 0 and sampling.top_k > 0 and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.temperature > 0 and sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= sampling.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scores, dim=-1)
