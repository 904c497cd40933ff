"""f-OPD freshness: per-sample staleness diagnostics and the freshness score (the truncated importance
ratio, M3, is the learner's: :mod:`lightning_opd.losses.off_policy`). PROPOSED in docs/algorithms.md §1.4, not from the paper (its text was not
available); the decomposition into rollout drift and supervision drift follows the f-OPD abstract.

The functions are pure and batched: ``B`` samples (episodes), ``T`` token positions. Log-probs are in
nats, lags in policy versions (applied optimizer updates, docs/algorithms.md §7.2). :class:`FreshnessWeighting` is the loss-side
component ``OPDModule`` applies (first of its weightings, :mod:`lightning_opd.losses.weighting`), configured by
:class:`FreshnessConfig`; the ``StalenessMonitor`` callback builds and installs it and decides its lag bound
``lag_bound`` (Δ_max).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from lightning_opd.losses.weighting import BatchPlan, Reducer


@dataclass
class FreshnessDiagnostics:
    """Per-sample diagnostics, each ``(B,)``.

    Attributes:
        lag: version lag Δ_i = learner version − oldest behaviour version (versions); :data:`NO_LAG` (-1) for a
            sample without a reply (behaviour version -1), which has no lag.
        delta: δ_i = min(Δ_i / Δ_cap, 1) (unitless, in [0, 1]).
        rho: ρ_i = mean over supervised tokens of |log π_θ − log π_b| (nats): rollout drift.
        chi: χ_i = mean over supervised tokens of the context drift c_t accumulated over earlier
            turns (nats): supervision drift; 0 for single-turn samples.
    """

    lag: torch.Tensor
    delta: torch.Tensor
    rho: torch.Tensor
    chi: torch.Tensor


def staleness_diagnostics(lag: torch.Tensor, student_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                          mask: torch.Tensor, turns: torch.Tensor, lag_cap: int = 8) -> FreshnessDiagnostics:
    """The three diagnostics of §1.4 (PROPOSED).

    Args:
        lag: ``(B,)`` version lag per sample (versions; :data:`NO_LAG`: no reply, no lag, δ = 0).
        student_logprobs: ``(B, T)`` log π_θ(a_t|s_t) of the sampled tokens under the learner's weights.
        behaviour_logprobs: ``(B, T)`` log π_b(a_t|s_t) recorded at rollout time.
        mask: ``(B, T)`` 1 on supervised (sampled) tokens.
        turns: ``(B, T)`` zero-based turn of each token (-1 off the mask).
        lag_cap: Δ_cap, the fixed ceiling of the lag scale (versions).

    For token t in turn k: ``c_t = |Σ_{t' supervised, turn(t') < k} (log π_θ − log π_b)(t')| /
    max(1, #supervised tokens in turns < k)``; ``χ_i = mean_t c_t``.

    Raises:
        ValueError: ``lag_cap < 1``.
    """
    if lag_cap < 1:
        raise ValueError(f"lag_cap={lag_cap} must be >= 1")
    m = (mask > 0).to(torch.float64)
    d = (student_logprobs.double() - behaviour_logprobs.double()) * m  # (B, T)
    n = m.sum(dim=1).clamp(min=1.0)  # (B,)
    rho = d.abs().sum(dim=1) / n
    k_max = int(turns.max().item()) + 1 if turns.numel() else 0
    chi = torch.zeros_like(rho)
    if k_max > 1:
        t = turns.clamp(min=0).long()
        per_turn_d = torch.zeros(d.shape[0], k_max, dtype=torch.float64, device=d.device).scatter_add_(1, t, d)
        per_turn_n = torch.zeros_like(per_turn_d).scatter_add_(1, t, m)
        before_d = torch.cumsum(per_turn_d, 1) - per_turn_d  # sums over turns strictly before k
        before_n = torch.cumsum(per_turn_n, 1) - per_turn_n
        c = before_d.abs() / before_n.clamp(min=1.0)  # (B, K)
        chi = (c * per_turn_n).sum(dim=1) / n
    lag = lag.double()
    delta = (lag / lag_cap).clamp(min=0.0, max=1.0)  # a sample without lag (NO_LAG) scores δ = 0
    return FreshnessDiagnostics(lag=lag, delta=delta, rho=rho, chi=chi)


#: the lag of a sample without a reply (behaviour version -1: the context was full before the first turn). It has no
#: lag: left out of the per-sample statistics, never dropped by M2 and never deciding its group's fate (F17)
NO_LAG = -1

#: the score variants: ``full`` (lag and both drifts) and ``age_only`` (the lag alone, §1.5 ablation)
SCORES = ("full", "age_only")


def freshness_score(diag: FreshnessDiagnostics, tau_rho: float = 0.1, tau_chi: float = 0.1, alpha: float = 4.0,
                    beta: float = 1.0, lag_weight: float = 2.0, rho_weight: float = 1 / 3, chi_weight: float = 1 / 3,
                    score: str = "full") -> tuple[torch.Tensor, torch.Tensor]:
    """Staleness ``s_i = w_δ δ_i + w_ρ ρ_i/τ_ρ + w_χ χ_i/τ_χ`` (``age_only``: ``s_i = w_δ δ_i``) and freshness
    ``f_i = 1 / (1 + exp(α (s_i − β)))`` (PROPOSED, docs/algorithms.md §1.4 with the §1.5 balance; absolute
    scales, so a synchronous sample scores s = 0, f ≈ 0.98).

    Default balance (§1.5): ``w_δ = 2`` puts a driftless sample at half the lag cap on the midpoint (s = 1,
    f = 0.5) and one at the cap on s = 2, f ≈ 0.018, below the default ``min_freshness`` 0.05;
    ``w_ρ = w_χ = 1/3`` keep §1.4's drift sensitivity.

    Args:
        diag: the ``(B,)`` diagnostics of :func:`staleness_diagnostics`.
        tau_rho, tau_chi: drift tolerances (nats). alpha, beta: steepness and midpoint (score units).
        lag_weight, rho_weight, chi_weight: w_δ, w_ρ, w_χ (>= 0, unitless).
        score: ``"full"`` or ``"age_only"`` (the drifts are ignored).

    Returns:
        ``(s, f)``, each ``(B,)`` float64.

    Raises:
        ValueError: a non-positive tolerance, a negative weight, an unknown ``score``.
    """
    check_score_knobs(tau_rho, tau_chi, lag_weight, rho_weight, chi_weight, score)
    s = lag_weight * diag.delta
    if score == "full":
        s = s + rho_weight * diag.rho / tau_rho + chi_weight * diag.chi / tau_chi
    f = torch.sigmoid(-alpha * (s - beta))
    return s, f


def check_score_knobs(tau_rho: float, tau_chi: float, lag_weight: float, rho_weight: float, chi_weight: float,
                      score: str) -> None:
    """Refuse a freshness-score setting that cannot be a score (messages name the :class:`FreshnessConfig` keys,
    ``StalenessMonitor``'s ``init_args.freshness.<key>``).

    Raises:
        ValueError: ``tau_rho`` or ``tau_chi`` <= 0, a negative weight, ``score`` not in :data:`SCORES`.
    """
    if tau_rho <= 0 or tau_chi <= 0:
        raise ValueError(f"freshness.tau_rho={tau_rho} and freshness.tau_chi={tau_chi} must be > 0 (nats): "
                         "the drift at which a drift term contributes its weight")
    for name, w in (("lag_weight", lag_weight), ("rho_weight", rho_weight), ("chi_weight", chi_weight)):
        if w < 0:
            raise ValueError(f"freshness.{name}={w} must be >= 0 (0 switches that term off)")
    if score not in SCORES:
        raise ValueError(f"freshness.score={score!r}: choose one of {', '.join(SCORES)}")


@dataclass(frozen=True)
class FreshnessConfig:
    """f-OPD's freshness score and mechanisms (PROPOSED, docs/algorithms.md §1.4-§1.5): the staleness score
    ``s = w_δ δ + w_ρ ρ/τ_ρ + w_χ χ/τ_χ``, the freshness ``f = 1 / (1 + exp(α (s − β)))`` and the switches of
    M1-M3. What :class:`FreshnessWeighting` applies; ``StalenessMonitor``'s ``init_args.freshness``.

    Args:
        lag_cap: Δ_cap, fixed ceiling of the lag scale δ = min(lag / Δ_cap, 1) and of the lag bound Δ_max
            (versions, >= 1).
        tau_rho: τ_ρ, rollout-drift tolerance (nats/token, > 0; lower = stricter).
        tau_chi: τ_χ, supervision-drift tolerance (nats/token, > 0; lower = stricter).
        alpha: steepness of the freshness transform (per score unit).
        beta: staleness score at which the freshness is 0.5 (score units).
        lag_weight: w_δ, weight of the lag term (unitless, >= 0; default 2: a driftless sample at the lag cap
            scores f ≈ 0.018 < min_freshness, §1.5).
        rho_weight: w_ρ, weight of the rollout-drift term (unitless, >= 0).
        chi_weight: w_χ, weight of the supervision-drift term (unitless, >= 0).
        score: ``"full"`` (lag and drifts) or ``"age_only"`` (freshness from the lag alone, the §1.5 ablation;
            the drifts are still measured and reported).
        weighting: M1: weight every token of sample i by ``f_i / f̄`` (f̄ over the step's kept samples).
        filtering: M2: drop samples with ``f_i < min_freshness`` or lag above the lag bound Δ_max, GRPO groups
            whole.
        min_freshness: M2's threshold f_min (in [0, 1)).
        truncated_ratio: M3, the truncated ratio ``sg(min(π_old/π_b, ratio_cap))`` per token, applied by the learner
            (:mod:`lightning_opd.losses.off_policy`; the monitor hands it over with
            ``LossWeightings.configure_truncated_ratio``): ``None`` (default) leaves the learner's setting
            (``model.init_args.off_policy``: on for a sampled-token loss at lag >= 1, off for the analytic and top-k
            losses, §7.1); ``True`` turns it on for any loss; ``False`` turns it off (refused for a sampled-token loss
            at lag >= 1 unless ``model.init_args.off_policy.allow_uncorrected=true``).
        ratio_cap: M3's cap C (> 0), used when ``truncated_ratio`` is set here.

    Raises:
        ValueError: a bad value, naming its ``freshness.<key>``.
    """

    lag_cap: int = 8
    tau_rho: float = 0.1
    tau_chi: float = 0.1
    alpha: float = 4.0
    beta: float = 1.0
    lag_weight: float = 2.0
    rho_weight: float = 1 / 3
    chi_weight: float = 1 / 3
    score: str = "full"
    weighting: bool = True
    filtering: bool = True
    min_freshness: float = 0.05
    truncated_ratio: bool | None = None
    ratio_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.lag_cap < 1:
            raise ValueError(f"freshness.lag_cap={self.lag_cap} must be >= 1 (versions)")
        check_score_knobs(self.tau_rho, self.tau_chi, self.lag_weight, self.rho_weight, self.chi_weight, self.score)
        if not 0 <= self.min_freshness < 1:
            raise ValueError(f"freshness.min_freshness={self.min_freshness} must be in [0, 1)")
        if self.ratio_cap <= 0:
            raise ValueError(f"freshness.ratio_cap={self.ratio_cap} must be > 0")


@dataclass
class FreshnessReport:
    """What :class:`FreshnessWeighting` measured on one rollout batch (returned by ``training_step`` as
    ``outputs["freshness"]``).

    Attributes:
        stats: ``lag_mean``, ``lag_max`` (versions), ``delta``, ``rho``, ``chi`` (nats), ``score``,
            ``freshness_min`` (over the samples with a lag, :data:`NO_LAG`), ``dropped_samples``, ``dropped_groups``,
            ``dropped_by_lag_bound`` (dropped samples whose own lag exceeds Δ_max), ``dropped_by_freshness`` (dropped
            samples within Δ_max whose own f < f_min; the rest of ``dropped_samples`` went with a group member),
            ``would_drop_samples`` (what M2 would drop with the current bound, also when it is off) -- this rank's
            statistics, NaN without samples (``StalenessMonitor`` logs them over all ranks, F27) -- and,
            the same on every rank: ``freshness_mean`` (supervised-token-weighted mean f over **all** samples of
            the step before filtering, all ranks: what the adaptive bound reads; the plain sample mean when no
            sample has a supervised token, NaN without samples), ``freshness_kept_mean`` (M1's f̄ over the kept
            samples; NaN when none is kept), ``kept_tokens`` (supervised tokens kept, all ranks; 0: the step
            has nothing to learn from), ``lag_bound_dropped_tokens`` (supervised tokens, all ranks, that the
            freshness test alone would have kept: > 0 with ``kept_tokens`` 0 means the lag bound emptied the step);
            empty when no diagnostic was computed.
        freshness: ``(B,)`` f_i of this rank's samples (``None``: not computed).
        keep: ``(B,)`` bool, the M2 decision (all ``True`` without filtering; ``None``: not computed).
        diagnostics: this rank's ``(B,)`` diagnostics (``None``: not computed).
        score: ``(B,)`` staleness score s_i (``None``: not computed).
    """

    stats: dict[str, float] = field(default_factory=dict)
    freshness: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    diagnostics: FreshnessDiagnostics | None = None
    score: torch.Tensor | None = None


def whole_groups(group_id: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: the samples whose every group member (same ``group_id``, ``(B,)``) is ``ok`` (``(B,)`` bool):
    M2 keeps or drops a GRPO group whole, never in part (PROPOSED, "any member" rule)."""
    return ~torch.isin(group_id, torch.unique(group_id[~ok]))


class FreshnessWeighting:
    """f-OPD's token weighting (PROPOSED, docs/algorithms.md §1.4-§1.5): M1 sample weights ``f_i / f̄`` and the M2 group
    filter. M3's truncated ratio is the learner's (:mod:`lightning_opd.losses.off_policy`, §7.1): on by default for a
    sampled-token loss at lag >= 1, with or without this weighting.

    Args:
        config: the score and the mechanisms (:class:`FreshnessConfig`; default: its defaults).
        lag_bound: Δ_max, the largest lag M2 keeps (versions, in ``[1, config.lag_cap]``; ``None``: ``lag_cap``);
            a controller moves it with :meth:`set_lag_bound`. Stored here only (``StalenessMonitor`` reads and sets
            it here).
        measure: compute the diagnostics even when neither M1 nor M2 uses them (a controller reads them).

    Raises:
        ValueError: a lag bound out of range.
    """

    def __init__(self, config: FreshnessConfig | None = None, lag_bound: int | None = None,
                 measure: bool = False) -> None:
        self.config = config if config is not None else FreshnessConfig()
        self.needs_learner_logprobs = self.config.weighting or self.config.filtering or measure
        self.lag_bound: int | None = None
        self.set_lag_bound(lag_bound)
        self._report = FreshnessReport()

    def set_lag_bound(self, lag_bound: int | None) -> None:
        """Δ_max for the next rollout batches (versions; ``None``: ``lag_cap``).

        Raises:
            ValueError: ``lag_bound`` outside ``[1, lag_cap]``.
        """
        if lag_bound is not None and not 1 <= int(lag_bound) <= self.config.lag_cap:
            raise ValueError(f"lag bound {lag_bound} must be in [1, freshness.lag_cap={self.config.lag_cap}]")
        self.lag_bound = None if lag_bound is None else int(lag_bound)

    def plan(self, lag: torch.Tensor, learner_logprobs: torch.Tensor | None, behaviour_logprobs: torch.Tensor,
             mask: torch.Tensor, turns: torch.Tensor, group_id: torch.Tensor, reduce_sum: Reducer) -> BatchPlan:
        """Diagnostics, freshness and the M1/M2 decisions for one rollout batch (the whole step); starts the
        step's report (:meth:`report`).

        Args:
            lag: ``(B,)`` learner version − behaviour version per sample (versions, >= 0), :data:`NO_LAG` for a
                sample without a reply: no lag, never dropped by M2 nor deciding its group's fate, left out of the
                per-sample statistics and of the plain-mean fallback of ``freshness_mean``.
            learner_logprobs: ``(B, T-1)`` learner log-probs of the sampled tokens (nats); ``None`` when
                :attr:`needs_learner_logprobs` is false (then nothing is decided).
            behaviour_logprobs, mask, turns: ``(B, T-1)`` behaviour log-probs, loss mask, turn index of the
                target positions.
            group_id: ``(B,)`` GRPO group of each sample (M2 drops groups whole).
            reduce_sum: sums over data-parallel ranks; called exactly once (also with ``B = 0``, F19), so
                ``freshness_mean``, ``freshness_kept_mean`` and ``kept_tokens`` are the same on every rank.
        """
        # long as one sequence on purpose: the M1/M2 decisions, then the step's one collective (F19), then its report
        self._report = FreshnessReport()
        if learner_logprobs is None:  # on every rank alike: configuration
            return BatchPlan()
        c = self.config
        diag = staleness_diagnostics(lag, learner_logprobs, behaviour_logprobs, mask, turns, c.lag_cap)
        score, fresh = freshness_score(diag, c.tau_rho, c.tau_chi, c.alpha, c.beta, c.lag_weight, c.rho_weight,
                                       c.chi_weight, c.score)
        has_lag = lag != NO_LAG  # a sample without a reply has no lag: it passes both tests, whatever its group
        within_bound = (lag <= int(self.lag_bound or c.lag_cap)) | ~has_lag
        fresh_enough = (fresh >= c.min_freshness) | ~has_lag
        m2 = whole_groups(group_id, within_bound & fresh_enough)  # the M2 decision, groups whole
        keep = m2 if c.filtering else torch.ones_like(m2)
        all_tokens = mask.sum(dim=1).double()
        tokens = all_tokens * keep
        # supervised tokens the bound alone dropped: kept by the freshness test, not by M2 (0 without filtering)
        by_bound = all_tokens * (whole_groups(group_id, fresh_enough) & ~keep)
        # all ranks (float64): kept tokens and their freshness mass; all tokens and theirs; samples with a lag and
        # their freshness sum; the tokens the lag bound alone dropped
        total, mass, all_total, all_mass, samples, f_sum, bound_total = reduce_sum(torch.stack([
            tokens.sum(), (fresh * tokens).sum(), all_tokens.sum(), (fresh * all_tokens).sum(),
            has_lag.sum().to(fresh), (fresh * has_lag).sum(), by_bound.sum()]))
        f_bar = mass / total.clamp(min=1.0)
        weight = (fresh / f_bar.clamp(min=1e-12)).float() if c.weighting else None
        n_groups = len(torch.unique(group_id))
        if all_total > 0:  # before filtering: what the adaptive bound reads (§1.5)
            f_mean = float(all_mass / all_total)
        else:  # no supervised token anywhere: the plain mean over all ranks' samples (NaN: no sample anywhere)
            f_mean = float(f_sum / samples) if samples > 0 else float("nan")

        def local(x: torch.Tensor, fn=torch.mean) -> float:  # this rank's statistic over the samples with a lag
            x = x[has_lag]
            return float(fn(x.double())) if x.numel() else float("nan")

        stats = {
            "lag_mean": local(lag), "lag_max": local(lag, torch.max), "delta": local(diag.delta),
            "rho": local(diag.rho), "chi": local(diag.chi), "score": local(score), "freshness_mean": f_mean,
            "freshness_kept_mean": float(f_bar) if total > 0 else float("nan"),
            "freshness_min": local(fresh, torch.min), "kept_tokens": float(total),
            "dropped_samples": float((~keep).sum()),
            "dropped_groups": float(n_groups - len(torch.unique(group_id[keep]))),
            "dropped_by_lag_bound": float((~keep & ~within_bound).sum()),
            "dropped_by_freshness": float((~keep & within_bound & ~fresh_enough).sum()),
            "lag_bound_dropped_tokens": float(bound_total),
            "would_drop_samples": float((~m2).sum()),
        }
        self._report = FreshnessReport(stats=stats, freshness=fresh.detach().clone(), keep=keep.detach().clone(),
                                       diagnostics=diag, score=score.detach().clone())
        return BatchPlan(keep=keep if c.filtering else None, sample_weight=weight, stats=stats)

    def report(self) -> FreshnessReport:
        """What this step measured: :meth:`plan`'s diagnostics (the truncated ratio's statistics are the learner's,
        ``train/ratio_mean``, :mod:`lightning_opd.losses.off_policy`)."""
        return replace(self._report, stats=dict(self._report.stats))
