"""GRPO group advantages, ATOD's hybrid advantage and the clipped surrogate (docs/algorithms.md §3.1).

ATOD (arXiv 2606.27814, Eq. 8) trains one PPO-style clipped surrogate on a hybrid per-token advantage::

    A_t = κ · (log π_T(a_t|s_t) − log π_old(a_t|s_t)) · w_k(t)  +  ρ · Â_i^GRPO      (detached)
    Â_i^GRPO = (r_i − mean_g r) / (std_g r + ε_A)                                    (group g of episode i)
    η_t = π_θ(a_t|s_t) / π_old(a_t|s_t),   ℓ_t = −min(η_t A_t, clip(η_t, 1 − ε, 1 + ε) A_t)

and the per-token ℓ_t then go through the common token-mean aggregation (§0.5, PROPOSED there instead
of the paper's per-sequence mean, so that ρ = 0, w = 1 is exactly plain OPD). κ = 0 is plain GRPO with
token-mean aggregation; κ = 1, ρ = 0, w = 1 with one update per batch is exactly the sampled-token
OPD of :class:`~lightning_opd.losses.SampledTokenReverseKL` (η = 1 in value, the same gradient).

Deliberate choices (PROPOSED in docs/algorithms.md or here, not from the paper):

1. ε = 0.2 (verl default), ε_A = 1e-6; ``std`` is the unbiased (Bessel) standard deviation, as verl's
   GRPO advantage computes it.
2. A group whose rewards are all equal, including a group of one episode, gets advantage exactly 0
   (no baseline to compare with); :class:`GroupAdvantages` counts such groups. A configuration under
   which every group is like that (``rho > 0`` with ``data.group_size = 1``, greedy rollouts, an
   all-zero reward) is refused at setup (F22, :meth:`lightning_opd.learner.atod.ATODModule.setup`).
3. F13 (docs/faults.md): a reward function that raises, returns ``None`` or the wrong number of values
   is an error (:class:`RewardFunctionError`) naming the function and the expected count; a
   non-finite (NaN, inf) or ``None`` reward of one episode is a counted fallback: its whole group gets
   advantage 0 (a group cannot be normalised around an unknown reward). Advantages are never NaN.
4. Old log-probs π_old: see :class:`ClippedSurrogate` (one documented source).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lightning_opd.losses.divergences import TeacherSignal, TokenDivergence, TokenLoss, gather_token, log_probs


class RewardFunctionError(RuntimeError):
    """The episode reward function raised or returned something other than one value per episode (F13)."""


class EpisodeReward:
    """Episode reward from the environment: ``r_i = success_weight · success_i + score_weight · score_i``.

    ``success_i`` is 1 for a won episode, ``score_i`` the episode's total environment reward (TextWorld:
    points scored). Subclass and override :meth:`__call__` for another reward; the module checks what it
    returns (F13, see the module docstring).

    Args:
        success_weight: reward of a won episode (points per success).
        score_weight: reward per point of environment score.
    """

    def __init__(self, success_weight: float = 1.0, score_weight: float = 0.0) -> None:
        self.success_weight, self.score_weight = float(success_weight), float(score_weight)

    def __call__(self, batch) -> torch.Tensor:
        """``(B,)`` rewards of ``batch`` (a :class:`~lightning_opd.rollout.batch.RolloutBatch`)."""
        return self.success_weight * batch.success.double() + self.score_weight * batch.rewards.double()


def compute_rewards(fn: Callable, batch) -> torch.Tensor:
    """Call the reward function and check its output (F13).

    Returns:
        ``(B,)`` float64 rewards; NaN marks an episode without a usable reward (``None``, NaN or inf),
        which :func:`group_advantages` turns into a zero-advantage group.

    Raises:
        RewardFunctionError: ``fn`` raised (chained), returned ``None``, something that is not numbers, or
            not exactly one value per episode.
    """
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    b = batch.size
    try:
        out = fn(batch)
    except Exception as err:  # noqa: BLE001 - re-raised with context
        raise RewardFunctionError(f"reward function {name} raised {type(err).__name__}: {err} "
                                  f"(batch of {b} episodes)") from err
    if out is None:
        raise RewardFunctionError(f"reward function {name} returned None; expected {b} rewards, one per episode")
    try:
        if isinstance(out, torch.Tensor):
            values = out.detach().to("cpu", torch.float64)
        else:
            values = torch.tensor([float("nan") if v is None else float(v) for v in out], dtype=torch.float64)
    except (TypeError, ValueError) as err:
        raise RewardFunctionError(f"reward function {name} returned {type(out).__name__} that is not a "
                                  f"sequence of numbers: {err}") from err
    if values.dim() != 1 or values.shape[0] != b:
        raise RewardFunctionError(f"reward function {name} returned shape {tuple(values.shape)}; expected ({b},), "
                                  "one reward per episode")
    return torch.where(torch.isfinite(values), values, torch.full_like(values, float("nan"))).to(batch.success.device)


@dataclass
class GroupAdvantages:
    """Group-normalised advantages of one batch.

    Attributes:
        advantage: ``(B,)`` float32 Â_i (unitless), 0 for equal-reward and invalid groups.
        groups: number of groups in the batch.
        equal_groups: groups whose (valid) rewards are all equal (advantage 0), incl. one-episode groups.
        invalid_groups: groups with at least one non-finite reward (advantage 0, F13 fallback).
        invalid_rewards: episodes with a non-finite reward.
    """

    advantage: torch.Tensor
    groups: int
    equal_groups: int
    invalid_groups: int
    invalid_rewards: int


def group_advantages(rewards: torch.Tensor, group_id: torch.Tensor, eps: float = 1e-6) -> GroupAdvantages:
    """``Â_i = (r_i − mean_g) / (std_g + eps)`` within each group (unbiased std), §3.1.

    Args:
        rewards: ``(B,)`` episode rewards (NaN: no usable reward, see :func:`compute_rewards`).
        group_id: ``(B,)`` GRPO group of each episode.
        eps: ε_A, added to the standard deviation.

    Raises:
        ValueError: shapes differ or ``eps < 0``.
    """
    if rewards.shape != group_id.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_id {tuple(group_id.shape)} must both be (B,)")
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    r = rewards.double()
    adv = torch.zeros_like(r)
    groups = torch.unique(group_id)
    equal = invalid = 0
    for g in groups:
        rows = group_id == g
        rg = r[rows]
        if not torch.isfinite(rg).all():
            invalid += 1
            continue
        if bool((rg == rg[0]).all()):  # exactly 0, also for one-episode groups (no baseline)
            equal += 1
            continue
        adv[rows] = (rg - rg.mean()) / (rg.std() + eps)
    return GroupAdvantages(advantage=adv.float(), groups=int(groups.numel()), equal_groups=equal,
                           invalid_groups=invalid, invalid_rewards=int((~torch.isfinite(r)).sum()))


def hybrid_advantage(teacher_logprobs: torch.Tensor, old_logprobs: torch.Tensor, opd_weight: torch.Tensor | float,
                     grpo_term: torch.Tensor | float) -> torch.Tensor:
    """ATOD's Eq. 8, detached: ``opd_weight · (log π_T − log π_old) + grpo_term`` per token.

    Args:
        teacher_logprobs, old_logprobs: ``S`` log-probs of the sampled tokens (nats).
        opd_weight: ``S`` (or scalar) κ · w_k(t), the OPD coefficient times the T-DUR turn weight.
        grpo_term: ``S`` (or scalar) ρ · Â_i of the token's episode (T-DUR never enters it).
    """
    return ((teacher_logprobs - old_logprobs) * opd_weight + grpo_term).detach()


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantage: torch.Tensor,
                      clip_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate ``−min(η A, clip(η, 1−ε, 1+ε) A)``, ``η = exp(logp − old)``.

    Written as a selection so that the gradient is exactly ``−A ∇η`` where the unclipped term is the
    minimum and exactly 0 where the clipped one is (``A > 0, η > 1+ε`` or ``A < 0, η < 1−ε``); the value
    equals the ``min`` form everywhere.

    Args:
        logprobs: ``S`` differentiable log π_θ of the sampled tokens.
        old_logprobs: ``S`` log π_old (no gradient).
        advantage: ``S`` detached advantages.
        clip_eps: ε.

    Returns:
        ``(loss, ratio, clipped)``: ``S`` loss, detached ratio η, bool mask of the clipped tokens.
    """
    ratio = torch.exp(logprobs - old_logprobs.detach())
    clipped = ((advantage > 0) & (ratio > 1 + clip_eps)) | ((advantage < 0) & (ratio < 1 - clip_eps))
    bounded = ratio.detach().clamp(1 - clip_eps, 1 + clip_eps) * advantage
    return -torch.where(clipped, bounded, ratio * advantage), ratio.detach(), clipped


class ClippedSurrogate(TokenDivergence):
    """ATOD's hybrid objective: the clipped surrogate on ``A_t = κ Δlogp_t w_k(t) + ρ Â_i`` (§3.1, Eq. 8).

    Support: the sampled token only (like :class:`~lightning_opd.losses.SampledTokenReverseKL`); the
    logged ``kl`` is the exact reverse KL. ``ATODModule`` supplies, per supervised token,
    ``opd_weight = κ · w_k(t)``, ``grpo_term = ρ · Â_i`` and ``old_logprobs`` (as keyword inputs of
    :meth:`token_terms`, sliced chunk by chunk). Without them the defaults ``opd_weight = 1``,
    ``grpo_term = 0`` and π_old = sg(π_θ) make it exactly the sampled-token OPD loss.

    Old log-probs (the one documented source): the learner's own log-probs of the sampled tokens,
    recomputed by the trainer at collection time, i.e. in a no-grad pass over the rollout batch before
    its first optimizer update (verl's ``compute_log_prob``), at the batch's sampling temperature. With
    one update per batch and no T-DUR, the pass is skipped and sg(log π_θ) is used: the same weights,
    so the same value, without the rounding of a second forward. Staleness between the behaviour policy
    and the learner (asynchronous rollouts) is corrected by the truncated ratio π_old/π_b, on by default at lag >= 1
    (:mod:`lightning_opd.losses.off_policy`, docs/algorithms.md §7.1), which composes as a weight (§0.5).

    Teacher signal: ``SAMPLED_TOKEN`` (the advantage reads ``log π_T(a_t)`` only): with a teacher that reports only
    that, :meth:`signal_terms` computes the same loss from ``teacher_sampled_logprobs`` ``(N,)`` and logs as ``kl``
    the k1 estimate ``log π_θ(a_t) − log π_T(a_t)`` (PROPOSED, docs/algorithms.md §6.5).

    Args:
        clip_eps: ε of the clip range [1 − ε, 1 + ε] (PROPOSED 0.2, verl default; not reported by ATOD).
        chunk_size: see :class:`TokenDivergence`.

    Raises:
        ValueError: ``clip_eps`` not in (0, 1).
    """

    teacher_signal = TeacherSignal.SAMPLED_TOKEN
    sampled_token_estimator = True  # stale tokens (lag >= 1) take the truncated ratio pi_old/pi_b (§7.1)

    def __init__(self, clip_eps: float = 0.2, chunk_size: int = 256) -> None:
        super().__init__(chunk_size)
        if not 0 < clip_eps < 1:
            raise ValueError(f"clip_eps={clip_eps} must be in (0, 1)")
        self.clip_eps = float(clip_eps)

    def token_terms(self, student_logits, teacher_logits, targets, temperature=1.0, *, opd_weight=None,
                    grpo_term=None, old_logprobs=None) -> TokenLoss:
        lp_s, lp_t = self._common(student_logits, teacher_logits, temperature)
        loss, _, _ = self._surrogate(gather_token(lp_s, targets), gather_token(lp_t, targets), opd_weight, grpo_term,
                                     old_logprobs)
        return self._full(loss, lp_s, lp_t, targets)

    def signal_terms(self, student_logits, targets, temperature=1.0, *, teacher_sampled_logprobs, opd_weight=None,
                     grpo_term=None, old_logprobs=None) -> TokenLoss:
        """:meth:`token_terms` with ``log π_T(a_t)`` given: ``teacher_sampled_logprobs`` ``(...)`` nats."""
        lp_s = log_probs(student_logits, temperature)
        loss, _, _ = self._surrogate(gather_token(lp_s, targets), teacher_sampled_logprobs.to(lp_s.dtype), opd_weight,
                                     grpo_term, old_logprobs)
        return self._from_signals(loss, lp_s, targets, teacher_sampled_logprobs)

    def ratio_stats(self, token_loss: TokenLoss, opd_weight: torch.Tensor | None = None,
                    grpo_term: torch.Tensor | None = None,
                    old_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The importance ratios and clip decisions behind ``token_loss`` (an output of this loss), for the
        ``ppo/*`` statistics: the same computation as :meth:`token_terms`, on its detached log-probs.

        Args:
            token_loss: ``S`` output of this loss (its ``student_logprobs`` and ``teacher_logprobs``).
            opd_weight, grpo_term, old_logprobs: ``S`` the keyword inputs the loss was given.

        Returns:
            ``(ratio, clipped)``: ``S`` detached η and the bool mask of clipped tokens.
        """
        _, ratio, clipped = self._surrogate(token_loss.student_logprobs, token_loss.teacher_logprobs, opd_weight,
                                            grpo_term, old_logprobs)
        return ratio, clipped

    def _surrogate(self, student_lp: torch.Tensor, teacher_lp: torch.Tensor, opd_weight, grpo_term, old_logprobs):
        """``clipped_surrogate`` on the hybrid advantage of ``S`` sampled-token log-probs (defaults: κ w = 1,
        ρ Â = 0, π_old = sg(π_θ))."""
        old = student_lp.detach() if old_logprobs is None else old_logprobs
        advantage = hybrid_advantage(teacher_lp, old, 1.0 if opd_weight is None else opd_weight,
                                     0.0 if grpo_term is None else grpo_term)
        return clipped_surrogate(student_lp, old, advantage, self.clip_eps)
