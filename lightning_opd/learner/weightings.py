"""``LossWeightings``: the learner's token weightings of the loss, as one object the module holds.

Three components, applied in a fixed order (:mod:`lightning_opd.losses.weighting`), whatever the order of the
callbacks that install them:

1. f-OPD's freshness weighting (:class:`~lightning_opd.losses.freshness.FreshnessWeighting`, docs/algorithms.md
   §1.4 M1/M2): once per rollout batch, :meth:`LossWeightings.plan_batch` (one all-reduce) drops samples and weights
   the kept ones; installed by the ``StalenessMonitor`` (``OPDModule.configure_freshness``);
2. the truncated importance ratio ``sg(min(π_old/π_b, C))`` (§1.4 M3, §7.1;
   :class:`~lightning_opd.losses.off_policy.TruncatedRatio`): decided at setup from ``model.init_args.off_policy``
   or a controller's override (:meth:`LossWeightings.configure_truncated_ratio`), the loss and the largest lag the data can
   produce (:meth:`LossWeightings.resolve`);
3. TurnOPD's turn blend (:class:`~lightning_opd.losses.turn_blend.TurnBlendWeighting`, §2.4), installed by the
   ``TurnLossBlend`` callback (``OPDModule.configure_turn_blend``).

It takes the learner's log-probs, lags and reducer as inputs, never the module. Beside it, the check of the other
stale signal, the rollout-time log-probs (:func:`check_behaviour_signal`).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from lightning_opd.losses.divergences import TokenDivergence, TokenLoss
from lightning_opd.losses.freshness import FreshnessReport, FreshnessWeighting
from lightning_opd.losses.off_policy import (OffPolicyConfig, TruncatedRatio, is_sampled_token_estimator,
                                             resolve_truncated_ratio)
from lightning_opd.losses.turn_blend import TurnBlendWeighting
from lightning_opd.losses.weighting import Reducer
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.rollout.weight_sync import WeightSync


class LossWeightings:
    """The freshness weighting, the truncated ratio and the turn blend of one learner (module docstring).

    Args:
        loss: the learner's per-token loss (whether it is a sampled-token estimator decides the ratio's default).
        off_policy: ``model.init_args.off_policy`` (default :class:`OffPolicyConfig`).
        strict_lag: batches beyond ``max_allowed_lag`` are refused (the learner's ``strict_on_policy``); ``False``:
            any batch may be stale.

    Attributes:
        freshness: the installed freshness weighting (``None``: none).
        turn_blend: the installed turn blend (``None``: none).
        truncated_ratio: the ratio applied to every micro-batch's tokens (``None``: off); decided by :meth:`resolve`.
        max_allowed_lag: the lag (versions) of the last :meth:`resolve` (0 before any).
    """

    def __init__(self, loss: TokenDivergence, off_policy: OffPolicyConfig | None = None,
                 strict_lag: bool = True) -> None:
        self.loss = loss
        self.off_policy = off_policy if off_policy is not None else OffPolicyConfig()
        self.strict_lag = strict_lag
        self.freshness: FreshnessWeighting | None = None
        self.turn_blend: TurnBlendWeighting | None = None
        self.truncated_ratio: TruncatedRatio | None = None
        self.max_allowed_lag = 0
        self._ratio_override: tuple[bool, float, str] | None = None  # a controller's (on, cap, key)

    # ---------------------------------------------------------------------------------- installation
    def configure_freshness(self, weighting: FreshnessWeighting | None, max_allowed_lag: int) -> None:
        """Install (``None``: remove) the freshness weighting; its ``config.truncated_ratio`` (M3), when not ``None``,
        replaces the ratio setting (:meth:`configure_truncated_ratio`, resolved at ``max_allowed_lag``).

        Raises:
            TypeError: ``weighting`` is not a :class:`~lightning_opd.losses.freshness.FreshnessWeighting`.
            UncorrectedOffPolicyError: see :meth:`resolve`.
        """
        if weighting is not None and not isinstance(weighting, FreshnessWeighting):
            raise TypeError(f"configure_freshness: expected a FreshnessWeighting, got {type(weighting).__name__}")
        self.freshness = weighting
        config = weighting.config if weighting is not None else None  # M3 set there: applied here (§7.1)
        self.configure_truncated_ratio(config.truncated_ratio if config is not None else None,
                                       config.ratio_cap if config is not None else 2.0, max_allowed_lag=max_allowed_lag)

    def configure_turn_blend(self, weighting: TurnBlendWeighting | None) -> None:
        """Install (``None``: remove) the turn blend, applied after the freshness weights and the ratio.

        Raises:
            TypeError: ``weighting`` is not a :class:`~lightning_opd.losses.turn_blend.TurnBlendWeighting`.
        """
        if weighting is not None and not isinstance(weighting, TurnBlendWeighting):
            raise TypeError(f"configure_turn_blend: expected a TurnBlendWeighting, got {type(weighting).__name__}")
        self.turn_blend = weighting

    def configure_truncated_ratio(self, truncated_ratio: bool | None, ratio_cap: float = 2.0,
                                  key: str = "StalenessMonitor init_args.freshness.truncated_ratio",
                                  max_allowed_lag: int | None = None) -> None:
        """A controller's setting of the ratio: ``None`` leaves ``off_policy`` in force; ``True``/``False`` replace its
        ``truncated_ratio`` (and ``ratio_cap``), ``key`` naming it. Resolved now at ``max_allowed_lag`` (versions;
        ``None``: the lag of the last :meth:`resolve`, so a controller's call mid-fit is checked against the data's
        lag) and again at setup with the data's lag.

        Raises:
            UncorrectedOffPolicyError: see :meth:`resolve`.
        """
        self._ratio_override = None if truncated_ratio is None else (bool(truncated_ratio), float(ratio_cap), key)
        self.resolve(self.max_allowed_lag if max_allowed_lag is None else max_allowed_lag)

    def resolve(self, max_allowed_lag: int) -> None:
        """Decide the truncated ratio (PROPOSED, docs/algorithms.md §7.1) from the override or ``off_policy``, the
        loss and ``max_allowed_lag`` (the largest lag a batch of the data configuration can have, versions). Sets
        :attr:`truncated_ratio`; warns when the explicit opt-out leaves a sampled-token loss uncorrected.

        Raises:
            UncorrectedOffPolicyError: the ratio turned off for a sampled-token loss at lag >= 1 without
                ``model.init_args.off_policy.allow_uncorrected=true`` (naming the key that turned it off).
        """
        cfg = self.off_policy
        requested, cap, key = cfg.truncated_ratio, cfg.ratio_cap, "model.init_args.off_policy.truncated_ratio"
        if self._ratio_override is not None:
            requested, cap, key = self._ratio_override
        self.max_allowed_lag = int(max_allowed_lag)
        on = resolve_truncated_ratio(self.loss, self.max_allowed_lag, requested, cfg.allow_uncorrected, key,
                                     strict_lag=self.strict_lag)
        self.truncated_ratio = TruncatedRatio(cap) if on else None
        if self.uncorrected_off_policy:
            warnings.warn(f"{type(self.loss).__name__} trains on batches up to {self.max_allowed_lag} versions old "
                          "WITHOUT the importance ratio (model.init_args.off_policy.allow_uncorrected=true): the "
                          "sampled-token estimate is biased on stale tokens (docs/algorithms.md §7.1); logged as "
                          "train/uncorrected_off_policy", stacklevel=3)

    @property
    def uncorrected_off_policy(self) -> bool:
        """A sampled-token loss trains on possibly stale tokens without the ratio (the explicit opt-out)."""
        return (self.truncated_ratio is None and is_sampled_token_estimator(self.loss)
                and (self.max_allowed_lag >= 1 or not self.strict_lag))

    @property
    def needs_learner_logprobs(self) -> bool:
        """The freshness weighting needs the learner's ``(B, T-1)`` log-probs before the first update."""
        return self.freshness is not None and self.freshness.needs_learner_logprobs

    # ------------------------------------------------------------------------------------------ a step
    def plan_batch(self, batch: RolloutBatch, lags: torch.Tensor, learner_logprobs: torch.Tensor | None,
                   reduce_sum: Reducer) -> RolloutBatch:
        """Apply the freshness weighting's :class:`~lightning_opd.losses.weighting.BatchPlan` (one all-reduce on every
        rank): dropped samples get an all-zero loss mask, kept ones its per-sample weights (in ``batch.sample_weight``).
        Without it, ``batch`` unchanged.

        Args:
            batch: the step's rollout batch.
            lags: ``(B,)`` long lag of each row in applied updates (``NO_LAG``, -1, for a row without a reply: never
                dropped for its lag, F17).
            learner_logprobs: ``(B, T-1)`` learner log-probs of the sampled tokens (nats; ``None`` when the weighting
                does not need them).
            reduce_sum: sum over data-parallel ranks.
        """
        if self.freshness is None:
            return batch
        plan = self.freshness.plan(lags, learner_logprobs, batch.behaviour_logprobs[:, 1:], batch.loss_mask[:, 1:],
                                   batch.turn_index[:, 1:], batch.group_id, reduce_sum)
        keep = torch.ones(batch.size, dtype=torch.bool, device=batch.input_ids.device)
        weight = batch.sample_weight.clone()
        if plan.keep is not None:
            keep &= plan.keep.to(keep.device)
        if plan.sample_weight is not None:
            weight = weight * plan.sample_weight.to(weight)
        return replace(batch, loss_mask=batch.loss_mask * keep[:, None].to(batch.loss_mask), sample_weight=weight)

    def start_step(self) -> None:
        """Reset the ratio's step statistics (before the step's first micro-batch)."""
        if self.truncated_ratio is not None:
            self.truncated_ratio.start_step()

    def token_weights(self, batch: RolloutBatch, token_loss: TokenLoss) -> torch.Tensor | None:
        """``(b, T-1)`` weights of one micro-batch: its per-sample weights (the freshness weighting's M1) times the
        truncated ratio (M3) and then the turn blend's per-token weights (the fixed order of
        :mod:`lightning_opd.losses.weighting`); ``None`` when all are 1.

        The ratio is ``sg(min(π_old/π_b, C))`` (docs/algorithms.md §6.2): π_old from ``batch.old_logprobs`` (the
        learner's log-probs before the step's first update, set by ``ATODModule`` when it makes several updates
        per batch), else from ``token_loss`` (one update per batch: the current forward is π_old), so the
        surrogate's ratio π_θ/π_old is never counted twice."""
        weights = None
        if not torch.all(batch.sample_weight == 1):
            weights = batch.sample_weight[:, None].expand(-1, batch.input_ids.shape[1] - 1)
        mask = batch.loss_mask[:, 1:]
        parts = []
        if self.truncated_ratio is not None:
            old = batch.old_logprobs[:, 1:] if batch.old_logprobs is not None else token_loss.student_logprobs
            parts.append(self.truncated_ratio.token_weights(old, batch.behaviour_logprobs[:, 1:], mask,
                                                            token_loss.student_logprobs - token_loss.teacher_logprobs))
        if self.turn_blend is not None:
            parts.append(self.turn_blend.token_weights(mask, batch.turn_index[:, 1:], token_loss.loss.dtype))
        for w in parts:
            if w is not None:
                weights = w if weights is None else weights * w
        return weights

    def off_policy_metrics(self, sums: dict[str, torch.Tensor], step_tokens: torch.Tensor, exact_kl: bool,
                           applied: int, used: int, reduce_sum: Reducer, device: torch.device | str) -> dict[str, float]:
        """The step's off-policy indicator and update counts (PROPOSED, docs/algorithms.md §7.1), over all ranks
        (collectives every rank reaches):

        * ``train/kl_k1``: mean over supervised tokens of the sampled-token estimate ``log p_S(a_t) − log p_T(a_t)``
          at learner time (nats/token; what a sampled-token loss estimates the KL with);
        * ``train/off_policy_gap``: ``train/kl − train/kl_k1`` with ``exact_kl`` (a ``FULL_VOCAB`` teacher, so
          ``sums["kl"]`` is the exact KL): about 0 on-policy, it grows with the drift between the sampling and the
          learning policy;
        * with the truncated ratio on, ``train/off_policy_gap_corrected`` (``train/kl`` − the ratio-weighted estimate
          ``Σ r_t k1_t / N``, with ``exact_kl``), ``train/ratio_mean`` and ``train/ratio_clip_frac`` (share of tokens
          at the cap C);
        * ``train/truncated_ratio`` (1 on, 0 off), ``train/uncorrected_off_policy`` (1: the explicit opt-out of
          ``model.init_args.off_policy.allow_uncorrected`` is in force);
        * ``train/applied_updates`` (optimizer updates applied this step, 0 when every update was skipped) and
          ``train/samples_per_update`` (samples with supervised tokens that reached an applied update's loss, per
          applied update; 0 when none was applied).

        Args:
            sums: this rank's ``kl`` and ``k1`` summed over the step's supervised tokens (nats; averaged over the
                step's epochs, as the ratio's sums cover all of them).
            step_tokens: supervised tokens of the step, all ranks.
            exact_kl: ``sums["kl"]`` is the exact reverse KL (``train/kl``), not its k1 estimate.
            applied: optimizer updates applied. used: samples summed over the applied updates, all ranks.
            reduce_sum: sum over data-parallel ranks. device: where the ratio's sums are reduced.
        """
        tokens = float(step_tokens.clamp(min=1))
        out = {"train/kl_k1": float(reduce_sum(sums["k1"])) / tokens,
               "train/truncated_ratio": float(self.truncated_ratio is not None),
               "train/uncorrected_off_policy": float(self.uncorrected_off_policy),
               "train/applied_updates": float(applied),
               "train/samples_per_update": used / applied if applied else 0.0}
        kl = float(reduce_sum(sums["kl"])) / tokens
        if exact_kl:
            out["train/off_policy_gap"] = kl - out["train/kl_k1"]
        if self.truncated_ratio is not None:
            total, clipped, n, weighted = (float(x) for x in reduce_sum(self.truncated_ratio.step_sums(device)))
            n_step = max(n, 1.0)
            out.update({"train/ratio_mean": total / n_step, "train/ratio_clip_frac": clipped / n_step})
            if exact_kl:
                out["train/off_policy_gap_corrected"] = kl - weighted / n_step
        return out

    def report(self) -> FreshnessReport | None:
        """What the freshness weighting measured this step (``None`` without it)."""
        return self.freshness.report() if self.freshness is not None else None


def uses_behaviour_logprobs(loss: TokenDivergence) -> bool:
    """Whether ``loss`` trains on the rollout-time log-probs (``SampledTokenReverseKL(signal="behaviour")``, the
    vanilla-async baseline, docs/algorithms.md §1.5)."""
    return bool(getattr(loss, "uses_behaviour_logprobs", False))  # getattr: only SampledTokenReverseKL declares it


def check_behaviour_signal(loss: TokenDivergence, weight_sync: WeightSync | None) -> None:
    """Refuse the stale (behaviour) signal where it has no meaning: a connected DataModule (its ``weight_sync``)
    whose every batch is sampled by the weights being trained (``mode=sync`` without ``forced_lag``), so that the
    rollout-time log-probs are the learner's own (up to the generator's numerics).

    Raises:
        ValueError: naming ``model.init_args.loss.init_args.signal`` and the ``data.init_args`` keys.
    """
    if not uses_behaviour_logprobs(loss) or weight_sync is None:
        return
    if not weight_sync.config.manages_weights:
        raise ValueError("model.init_args.loss.init_args.signal=behaviour (the vanilla-async baseline: the OPD "
                         "signal from the stale rollout-time log-probs) has no meaning with data.init_args.mode=sync "
                         "and data.init_args.forced_lag=0: every batch is sampled by the weights being trained. Set "
                         "data.init_args.forced_lag=k (k >= 1) or data.init_args.mode=async, or use "
                         "signal=recomputed")
