"""Off-policy correction of sampled-token losses: the truncated token-level importance ratio and when it is on.

Source: docs/algorithms.md §7.1 (PROPOSED after the async runs) with the ratio of §1.4 M3 (TIS-style, PROPOSED).
A loss whose per-token term is a **sampled-token estimator** (the policy-gradient form ``A_t · log π_θ(a_t|s_t)``,
``A_t = log π_T − log π_θ`` at the sampled token; :class:`~lightning_opd.losses.SampledTokenReverseKL`, ATOD's
:class:`~lightning_opd.losses.ClippedSurrogate`) estimates the reverse KL only under the policy that drew ``a_t``.
On tokens drawn by an older policy π_b (asynchronous rollouts, a forced lag) it is biased; measured here at lag 2,
lr 1e-4: 4 of 6 runs collapsed without the ratio. So for such a loss, whenever the data configuration can hand the
learner a batch at lag >= 1, the truncated ratio ``r_t = sg(min(π_old/π_b, C))`` is part of the estimator, in plain
async as in f-OPD. A loss that sums over the vocabulary (or a top-k set) at each visited state has no sampled-token
term: only the state distribution is stale and the ratio stays off unless asked for (§1.5).

The learner (``OPDModule``) owns one :class:`TruncatedRatio` when the ratio is on (its ``off_policy`` argument,
:class:`OffPolicyConfig`; the ``StalenessMonitor``'s ``freshness.truncated_ratio`` sets it through
``LossWeightings.configure_truncated_ratio``, :mod:`lightning_opd.learner.weightings`) and decides with
:func:`resolve_truncated_ratio` at setup.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_opd.losses.base import TeacherSignal


class UncorrectedOffPolicyError(ValueError):
    """A sampled-token loss would train on tokens of an older policy without the importance ratio."""


@dataclass(frozen=True)
class OffPolicyConfig:
    """The learner's off-policy correction (``model.init_args.off_policy``; PROPOSED, docs/algorithms.md §7.1).

    Args:
        truncated_ratio: ``None`` (default, "auto"): on for a sampled-token loss when the data configuration can
            produce a lag >= 1 (``data.init_args.mode=async`` or ``forced_lag >= 1``), off otherwise; ``True``:
            on for any loss; ``False``: off (refused for a sampled-token loss at lag >= 1 unless
            ``allow_uncorrected``).
        ratio_cap: C of ``sg(min(π_old/π_b, C))`` (> 0, unitless).
        allow_uncorrected: the explicit opt-out: train a sampled-token loss on stale tokens without the ratio (the
            vanilla-async baseline of an ablation). Logged every step as ``train/uncorrected_off_policy`` = 1 and
            warned about at setup.

    A ``StalenessMonitor`` whose ``freshness.truncated_ratio`` is set (not ``null``) replaces ``truncated_ratio`` and
    ``ratio_cap`` here (``OPDModule.configure_freshness``); ``allow_uncorrected`` is read only here.

    Raises:
        ValueError: ``ratio_cap <= 0`` (naming ``model.init_args.off_policy.ratio_cap``).
    """

    truncated_ratio: bool | None = None
    ratio_cap: float = 2.0
    allow_uncorrected: bool = False

    def __post_init__(self) -> None:
        if not self.ratio_cap > 0:
            raise ValueError(f"model.init_args.off_policy.ratio_cap={self.ratio_cap} must be > 0 (the cap C of "
                             "the truncated ratio min(pi_old/pi_b, C))")


def is_sampled_token_estimator(loss) -> bool:
    """Whether ``loss``'s per-token term is a sampled-token (policy-gradient) estimator, whose value at tokens of an
    older policy needs the importance ratio (§7.1): its class attribute ``sampled_token_estimator``, or when that is
    ``None`` (not declared) whether its ``teacher_signal`` is ``SAMPLED_TOKEN``."""
    declared = getattr(loss, "sampled_token_estimator", None)
    if declared is not None:
        return bool(declared)
    return getattr(loss, "teacher_signal", None) == TeacherSignal.SAMPLED_TOKEN


def resolve_truncated_ratio(loss, max_lag: int, requested: bool | None, allow_uncorrected: bool,
                            key: str = "model.init_args.off_policy.truncated_ratio", strict_lag: bool = True) -> bool:
    """Whether the learner applies the truncated ratio (PROPOSED, docs/algorithms.md §7.1).

    Args:
        loss: the learner's per-token loss (a ``TokenDivergence``).
        max_lag: the largest lag a batch of the data configuration can have (versions; 0 = every batch on-policy).
        requested: the setting (``None``: auto, on exactly for a sampled-token loss at ``max_lag >= 1``).
        allow_uncorrected: the explicit opt-out (``model.init_args.off_policy.allow_uncorrected``).
        key: the configuration key that said ``requested`` (named in the error).
        strict_lag: batches are refused beyond ``max_lag`` (the learner's ``strict_on_policy``); ``False``: any batch
            may be stale, so a sampled-token loss is treated as at lag >= 1 whatever ``max_lag``.

    Returns:
        ``True`` when the ratio is applied.

    Raises:
        UncorrectedOffPolicyError: ``requested is False`` for a sampled-token loss with ``max_lag >= 1`` and no
            opt-out; the message names the loss, the lag and the keys.
    """
    sampled = is_sampled_token_estimator(loss)
    max_lag = max_lag if strict_lag else max(max_lag, 1)
    if requested is None:
        return sampled and max_lag >= 1
    if not requested and sampled and max_lag >= 1 and not allow_uncorrected:
        raise UncorrectedOffPolicyError(
            f"{key}=false with loss {type(loss).__name__} (a sampled-token estimator) on batches up to {max_lag} "
            "versions old (data.init_args.mode=async or data.init_args.forced_lag >= 1): without the importance "
            "ratio the loss is biased on stale tokens (4 of 6 such runs collapsed, docs/algorithms.md §7.1). Remove "
            f"the setting (it is on by default), or use a loss without a sampled-token term (lightning_opd.losses."
            "FullVocabReverseKL, TeacherTopKRenormalizedReverseKL), or opt out explicitly with "
            "model.init_args.off_policy.allow_uncorrected=true (logged as train/uncorrected_off_policy)")
    return bool(requested)


class TruncatedRatio:
    """The truncated token-level importance ratio ``r_t = sg(min(π_old(a_t|s_t) / π_b(a_t|s_t), C))`` (TIS-style;
    docs/algorithms.md §1.4 M3, §7.1; PROPOSED), multiplied into the per-token loss, and its statistics per step.

    π_old is the policy that started the step's updates (§6.2): at lag 0 (π_b = π_old) every weight is 1, and with
    K > 1 PPO updates the surrogate's own ratio π_θ/π_old is not counted twice.

    Args:
        cap: C (> 0).

    Raises:
        ValueError: ``cap <= 0``.
    """

    def __init__(self, cap: float = 2.0) -> None:
        if not cap > 0:
            raise ValueError(f"truncated ratio cap {cap} must be > 0")
        self.cap = float(cap)
        self._sums: torch.Tensor | None = None  # (4,) fp64 on the tokens' device, this step and rank: sum of ratios,
        # clipped tokens, tokens, sum r * k1 (summed on the device: no host sync per micro-batch)

    def start_step(self) -> None:
        """Reset the step's statistics (before the first micro-batch)."""
        self._sums = None

    def token_weights(self, old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                      estimate: torch.Tensor | None = None) -> torch.Tensor:
        """``(b, T-1)`` ratios of one micro-batch (no gradient); their sum and clipped count over the ``mask`` tokens
        enter the step's statistics (:attr:`sums`).

        Args:
            old_logprobs: ``(b, T-1)`` log π_old of the sampled tokens (nats).
            behaviour_logprobs: ``(b, T-1)`` log π_b recorded at rollout time (nats).
            mask: ``(b, T-1)`` loss mask of the target positions.
            estimate: ``(b, T-1)`` the per-token sampled-token KL estimate ``log π_θ(a_t) - log π_T(a_t)`` (nats), whose
                ratio-weighted sum enters :attr:`sums` (the corrected off-policy indicator); ``None``: not summed.
        """
        ratio = torch.exp(old_logprobs.detach() - behaviour_logprobs.detach()).clamp(max=self.cap)
        m = (mask > 0).to(torch.float64)
        r = ratio.double()
        weighted = (r * estimate.detach().double() * m).sum() if estimate is not None else r.new_zeros(())
        step = torch.stack([(r * m).sum(), ((r >= self.cap) * m).sum(), m.sum(), weighted])
        self._sums = step if self._sums is None else self._sums + step
        return ratio

    def step_sums(self, device: torch.device | str | None = None) -> torch.Tensor:
        """This rank's ``(4,)`` fp64 ``(sum of ratios, clipped tokens, supervised tokens, sum of ratio x estimate)``
        since :meth:`start_step`, on ``device`` (zeros when no micro-batch was weighted), to be reduced over ranks
        before dividing (F27)."""
        sums = self._sums.clone() if self._sums is not None else torch.zeros(4, dtype=torch.float64)  # a copy: an
        # all-reduce works in place, and these are this rank's sums
        return sums.to(device) if device is not None else sums

    @property
    def sums(self) -> tuple[float, float, float, float]:
        """:meth:`step_sums` as plain numbers (one host sync)."""
        return tuple(float(x) for x in self.step_sums("cpu"))
