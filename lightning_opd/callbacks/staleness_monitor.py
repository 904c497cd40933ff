"""``StalenessMonitor``: f-OPD's control of stale samples in asynchronous OPD (arXiv 2605.17862).

PROPOSED in docs/algorithms.md §1.4, not from the paper (its text was not available to us): the three
diagnostics on absolute scales (version lag δ, rollout drift ρ, supervision drift χ), the freshness
score ``f = 1 / (1 + exp(α (s − β)))`` and three mechanisms, each switchable:

* M1 ``weighting``: every token of sample i weighted ``f_i / f̄`` (f̄: token-weighted mean over the
  kept samples of the whole step, all ranks), with the OPD signal recomputed at learner time (the
  loss always uses the learner's log-probs);
* M2 ``filtering``: drop samples with ``f_i < min_freshness`` or lag ``> Δ_max``; a group (GRPO) is
  dropped whole if any member fails, never in part (PROPOSED: "any member" rule);
* M3 ``truncated_ratio``: per-token ``sg(min(π_θ/π_b, C))`` multiplied into the loss, and
  ``adaptive_lag``: ``Δ_max ← max(1, Δ_max − 1)`` after ``patience`` consecutive steps with
  ``f̄ < low_freshness``, ``Δ_max ← min(Δ_cap, Δ_max + 1)`` when ``f̄ > high_freshness``.

Computing ρ and χ needs the learner's log-probs of every sampled token before the backward pass: the
module runs one extra no-grad student forward per step while this callback is on.

Logged (``staleness/``, per step): ``lag_mean``, ``lag_max`` (versions), ``delta``, ``rho``, ``chi``
(nats), ``score``, ``freshness_mean``, ``freshness_min``, ``dropped_samples``, ``dropped_groups``,
``max_lag_bound`` (versions), and with M3 ``ratio_mean``, ``ratio_clip_frac``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_opd.losses.freshness import freshness_score, staleness_diagnostics, truncated_importance_ratio
from lightning_opd.losses.weighting import BatchPlan


class StalenessMonitor(Callback):
    """f-OPD staleness diagnostics, freshness score and the three mechanisms (PROPOSED, §1.4).

    Args:
        lag_cap: Δ_cap, fixed ceiling of the lag scale and of the adaptive bound (versions).
        tau_rho: τ_ρ, rollout-drift tolerance (nats); tau_chi: τ_χ, supervision-drift tolerance (nats).
        alpha, beta: steepness and midpoint of the freshness transform (score units).
        weighting: M1 on/off. filtering: M2 on/off. truncated_ratio: M3 ratio on/off.
        min_freshness: M2 threshold f_min.
        max_lag: initial Δ_max (versions); default ``max(4, DataModule.max_allowed_lag)``.
        ratio_cap: M3's C.
        adaptive_lag: move Δ_max with the batch mean freshness (M3).
        low_freshness, high_freshness, patience: thresholds of the adaptive bound (patience in steps).

    Raises:
        ValueError: a bound out of range (named in the message).
    """

    def __init__(self, lag_cap: int = 8, tau_rho: float = 0.1, tau_chi: float = 0.1, alpha: float = 4.0,
                 beta: float = 1.0, weighting: bool = True, filtering: bool = True, min_freshness: float = 0.05,
                 max_lag: int | None = None, truncated_ratio: bool = False, ratio_cap: float = 2.0,
                 adaptive_lag: bool = True, low_freshness: float = 0.5, high_freshness: float = 0.8,
                 patience: int = 3) -> None:
        if lag_cap < 1:
            raise ValueError(f"lag_cap={lag_cap} must be >= 1")
        if tau_rho <= 0 or tau_chi <= 0:
            raise ValueError(f"tau_rho={tau_rho} and tau_chi={tau_chi} must be > 0 (nats)")
        if not 0 <= min_freshness < 1:
            raise ValueError(f"min_freshness={min_freshness} must be in [0, 1)")
        if max_lag is not None and not 1 <= max_lag <= lag_cap:
            raise ValueError(f"max_lag={max_lag} must be in [1, lag_cap={lag_cap}]")
        if ratio_cap <= 0:
            raise ValueError(f"ratio_cap={ratio_cap} must be > 0")
        if patience < 1:
            raise ValueError(f"patience={patience} must be >= 1")
        self.lag_cap, self.tau_rho, self.tau_chi, self.alpha, self.beta = lag_cap, tau_rho, tau_chi, alpha, beta
        self.weighting, self.filtering, self.truncated_ratio = weighting, filtering, truncated_ratio
        self.min_freshness, self.initial_max_lag, self.ratio_cap = min_freshness, max_lag, ratio_cap
        self.adaptive_lag, self.low_freshness, self.high_freshness, self.patience = (
            adaptive_lag, low_freshness, high_freshness, patience)
        self.needs_student_logprobs = weighting or filtering or adaptive_lag
        # state (plain numbers; persisted)
        self.max_lag_bound: int | None = max_lag
        self.low_streak = 0
        self._last: dict[str, float] = {}
        self._ratio_stats = [0.0, 0.0, 0.0]  # sum of ratios, clipped tokens, tokens

    @property
    def state_key(self) -> str:
        return self._generate_state_key(lag_cap=self.lag_cap, tau_rho=self.tau_rho, tau_chi=self.tau_chi,
                                        alpha=self.alpha, beta=self.beta)

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "set_weighting"):
            raise TypeError(f"StalenessMonitor needs an OPDModule-like module with set_weighting(), got {type(pl_module).__name__}")
        if self.max_lag_bound is None:
            allowed = int(getattr(trainer.datamodule, "max_allowed_lag", 0)) if trainer.datamodule is not None else 0
            self.max_lag_bound = min(self.lag_cap, max(4, allowed))
        pl_module.set_weighting("freshness", self)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._update_bound()
        self._log(pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"max_lag_bound": self.max_lag_bound, "low_streak": self.low_streak}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.max_lag_bound = state_dict.get("max_lag_bound", self.max_lag_bound)
        self.low_streak = int(state_dict.get("low_streak", 0))

    # ---------------------------------------------------------------------------------- the weighting
    def prepare(self, module, batch, student_logprobs: torch.Tensor | None) -> BatchPlan:
        """Diagnostics, freshness and the M1/M2 decisions for one rollout batch (whole step).

        Every rank reaches its one reduction, also with an empty batch (F19); ``freshness_mean`` (f̄) is
        the same on every rank, so the adaptive bound moves alike everywhere. Per-rank statistics of a rank
        without samples are NaN.
        """
        if student_logprobs is None:  # on every rank alike: needs_student_logprobs is configuration
            return BatchPlan()
        mask = batch.loss_mask[:, 1:]
        lag = (module.policy_version - batch.behaviour_version).clamp(min=0)
        diag = staleness_diagnostics(lag, student_logprobs, batch.behaviour_logprobs[:, 1:], mask,
                                     batch.turn_index[:, 1:], self.lag_cap)
        score, fresh = freshness_score(diag, self.tau_rho, self.tau_chi, self.alpha, self.beta)
        keep = torch.ones_like(fresh, dtype=torch.bool)
        if self.filtering:
            ok = (fresh >= self.min_freshness) & (lag <= int(self.max_lag_bound or self.lag_cap))
            bad_groups = torch.unique(batch.group_id[~ok])
            keep = ~torch.isin(batch.group_id, bad_groups)
        tokens = mask.sum(dim=1).double() * keep
        # all ranks: kept tokens, their freshness mass, samples, freshness sum (float64)
        total, mass, samples, f_sum = module.reduce_sum(torch.stack([
            tokens.sum(), (fresh * tokens).sum(), fresh.new_tensor(float(fresh.numel())), fresh.sum()]))
        f_bar = mass / total.clamp(min=1.0)
        weight = (fresh / f_bar.clamp(min=1e-12)).float() if self.weighting else None
        n_groups = len(torch.unique(batch.group_id))
        if total > 0:
            f_mean = float(f_bar)
        else:  # every sample dropped: the plain mean over all ranks' samples (NaN: no sample anywhere)
            f_mean = float(f_sum / samples) if samples > 0 else float("nan")

        def local(x: torch.Tensor, fn=torch.mean) -> float:  # this rank's statistic; NaN without samples
            return float(fn(x.double())) if x.numel() else float("nan")

        self._last = {
            "lag_mean": local(lag), "lag_max": local(lag, torch.max), "delta": local(diag.delta),
            "rho": local(diag.rho), "chi": local(diag.chi), "score": local(score), "freshness_mean": f_mean,
            "freshness_min": local(fresh, torch.min), "dropped_samples": float((~keep).sum()),
            "dropped_groups": float(n_groups - len(torch.unique(batch.group_id[keep]))),
        }
        self.last_freshness = fresh.detach().clone()
        self.last_keep = keep.detach().clone()
        return BatchPlan(keep=keep if self.filtering else None, sample_weight=weight)

    def token_weights(self, module, micro_batch, token_loss) -> torch.Tensor | None:
        """M3: ``(b, T-1)`` truncated importance ratios ``sg(min(π_θ/π_b, C))`` (None when off)."""
        if not self.truncated_ratio:
            return None
        ratio = truncated_importance_ratio(token_loss.student_logprobs, micro_batch.behaviour_logprobs[:, 1:],
                                           self.ratio_cap)
        m = micro_batch.loss_mask[:, 1:] > 0
        self._ratio_stats[0] += float(ratio[m].sum())
        self._ratio_stats[1] += float((ratio[m] >= self.ratio_cap).sum())
        self._ratio_stats[2] += float(m.sum())
        return ratio

    # ------------------------------------------------------------------------------------- internals
    def _update_bound(self) -> None:
        if not self.adaptive_lag or not self._last or math.isnan(self._last["freshness_mean"]):
            return  # no sample on any rank this step: nothing learned about freshness
        f_bar = self._last["freshness_mean"]
        if f_bar < self.low_freshness:
            self.low_streak += 1
            if self.low_streak >= self.patience:
                self.max_lag_bound = max(1, int(self.max_lag_bound) - 1)
                self.low_streak = 0
        else:
            self.low_streak = 0
            if f_bar > self.high_freshness:
                self.max_lag_bound = min(self.lag_cap, int(self.max_lag_bound) + 1)

    def _log(self, pl_module) -> None:
        values = dict(self._last)
        values["max_lag_bound"] = float(self.max_lag_bound or 0)
        if self.truncated_ratio and self._ratio_stats[2]:
            s, clipped, n = self._ratio_stats
            values["ratio_mean"], values["ratio_clip_frac"] = s / n, clipped / n
        self._ratio_stats = [0.0, 0.0, 0.0]
        for key, value in values.items():
            pl_module.log(f"staleness/{key}", value, batch_size=1)
