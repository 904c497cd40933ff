"""``StalenessMonitor``: f-OPD's control of stale samples in asynchronous OPD (arXiv 2605.17862).

PROPOSED in docs/algorithms.md §1.4-§1.5, not from the paper (its text was not available to us): the three
diagnostics on absolute scales (version lag δ, rollout drift ρ, supervision drift χ), the staleness score
``s = w_δ δ + w_ρ ρ/τ_ρ + w_χ χ/τ_χ`` (``score="age_only"``: ``s = w_δ δ``), the freshness
``f = 1 / (1 + exp(α (s − β)))`` and three mechanisms, each switchable:

* M1 ``weighting``: every token of sample i weighted ``f_i / f̄`` (f̄: token-weighted mean over the
  kept samples of the whole step, all ranks), with the OPD signal recomputed at learner time (the
  loss always uses the learner's log-probs);
* M2 ``filtering``: drop samples with ``f_i < min_freshness`` or lag ``> Δ_max``; a group (GRPO) is
  dropped whole if any member fails, never in part (PROPOSED: "any member" rule);
* M3 ``truncated_ratio``: per-token ``sg(min(π_old/π_b, C))`` multiplied into the loss (π_old: the learner before
  the step's first update, §6.2). The learner applies it (``model.init_args.off_policy``, on by default for a
  sampled-token loss at lag >= 1, off for the analytic and top-k losses, §7.1); ``freshness.truncated_ratio``
  ``true``/``false`` replaces that setting (``OPDModule.configure_freshness`` hands it over; ``false`` with a sampled-token
  loss is refused unless ``model.init_args.off_policy.allow_uncorrected=true``), ``null`` (default) leaves it; and
  ``adaptive_lag``: ``Δ_max ← max(Δ_min, Δ_max − 1)`` after ``patience`` consecutive steps with
  ``f̄ < low_freshness``, ``Δ_max ← min(Δ_cap, Δ_max + 1)`` when ``f̄ > high_freshness``, where f̄ is the
  token-weighted mean freshness of **all** the step's samples before filtering, all ranks (§1.5), and the floor
  ``Δ_min`` is 1, or the DataModule's ``forced_lag`` when set (§6.2: under a forced lag every sample has that lag by
  construction, so a bound below it would drop every sample).

A step whose samples are all filtered makes no update (``OPDModule``: no optimizer step; it still counts as a
rollout iteration); the monitor counts them (``skipped_steps``) and, separately, those that the lag bound emptied
(the freshness test alone would have kept a supervised token: ``skipped_steps_by_lag_bound``). ``mode="measure"`` logs every diagnostic
and applies nothing (no weighting, filtering, ratio or bound change: the update is that of a run without the
monitor) and writes one JSON line per sample (``staleness_samples.jsonl`` in the run's log directory: step,
rank, lag, delta, rho, chi, score, freshness, kept), which ``lightning-opd calibrate-freshness`` reads to set
τ_ρ, τ_χ (§1.5).

The computation lives in the loss-side component
:class:`~lightning_opd.losses.freshness.FreshnessWeighting`, which this callback builds from its ``freshness``
argument (:class:`~lightning_opd.losses.freshness.FreshnessConfig`) and installs at setup with
``pl_module.configure_freshness(...)``; the module applies it (first of its weightings, so collectives run in the
same order on every rank). This callback only decides the lag bound Δ_max (held by the weighting alone,
``FreshnessWeighting.lag_bound``, set with ``FreshnessWeighting.set_lag_bound``) from the diagnostics
``training_step`` returns (``outputs["freshness"]``, a :class:`~lightning_opd.losses.freshness.FreshnessReport`),
and logs them.

Computing ρ and χ needs the learner's log-probs of every sampled token before the backward pass: the
module runs one extra no-grad student forward per step while this callback is on.

Logged (``staleness/``, per step): ``lag_mean``, ``lag_max`` (versions), ``delta``, ``rho``, ``chi``
(nats), ``score``, ``freshness_mean``, ``freshness_kept_mean``, ``freshness_min``, ``kept_tokens``,
``dropped_samples``, ``dropped_groups``, ``dropped_by_lag_bound``, ``dropped_by_freshness`` (samples, see
:class:`~lightning_opd.losses.freshness.FreshnessReport`), ``lag_bound_dropped_tokens``, ``would_drop_samples``,
``lag_bound`` (Δ_max, versions), ``skipped_steps`` and ``skipped_steps_by_lag_bound`` (cumulative) (M3's
statistics are the learner's ``train/ratio_mean``, ``train/ratio_clip_frac``), and async with producer-side control (§1.5.1: Δ_max caps the producer's
lead; synchronous fallback) ``producer_lead`` (versions: the lead in use), ``sync_fallback`` (1 while generating
synchronously from the next step on), ``sync_fallback_step`` (1 when this step ran in the fallback: the producer
was held at lead 0 while the step waited for its batch) and ``sync_fallback_steps`` (cumulative count of such
steps). Every mean over samples or tokens and every count is over
all data-parallel ranks' samples and tokens (sums and counts reduced, then divided: :func:`all_rank_stats`, F27).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_opd.callbacks.lag_control import SyncFallback
from lightning_opd.losses.freshness import FreshnessConfig, FreshnessReport, FreshnessWeighting
from lightning_opd.metrics.rank_stats import Max, Mean, Min, RankStat, Sum, all_ranks

#: per-sample means of :class:`FreshnessReport` ``stats`` that are this rank's, and the (B,) values they average
_SAMPLE_MEANS = {"lag_mean": lambda r: r.diagnostics.lag, "delta": lambda r: r.diagnostics.delta,
                 "rho": lambda r: r.diagnostics.rho, "chi": lambda r: r.diagnostics.chi, "score": lambda r: r.score}
#: counts of :class:`FreshnessReport` ``stats`` that are this rank's (samples, groups): summed over ranks
_RANK_COUNTS = ("dropped_samples", "dropped_groups", "dropped_by_lag_bound", "dropped_by_freshness",
                "would_drop_samples")


def all_rank_stats(report: FreshnessReport, reduce_sum, reduce_max, device) -> dict[str, float]:
    """``report.stats`` with this rank's statistics replaced by their values over all ranks' samples and tokens
    (F27; collectives every rank reaches): the per-sample means (``lag_mean``, ``delta``, ``rho``, ``chi``,
    ``score``) as reduced sums over reduced counts, ``lag_max`` and ``freshness_min`` as the extremes, the sample and
    group counts summed; the statistics that are already over all ranks (``freshness_mean``, ...) as reported.
    The samples are those with a lag (``lag >= 0``; a row without a reply has none).

    Args:
        report: this rank's report of the step (the same keys on every rank).
        reduce_sum, reduce_max, device: see :func:`~lightning_opd.metrics.rank_stats.all_ranks`.
    """
    stats = dict(report.stats)
    ranked: dict[str, RankStat] = {}
    if report.diagnostics is not None and stats:
        has = report.diagnostics.lag >= 0
        for key, values in _SAMPLE_MEANS.items():
            ranked[key] = Mean(float(values(report).double()[has].sum()), float(has.sum()))
        lags, fresh = report.diagnostics.lag.double()[has], report.freshness.double()[has]
        ranked["lag_max"] = Max(float(lags.max()) if lags.numel() else float("-inf"))
        ranked["freshness_min"] = Min(float(fresh.min()) if fresh.numel() else float("inf"))
        ranked.update({k: Sum(stats[k]) for k in _RANK_COUNTS if k in stats})
    stats.update(all_ranks(ranked, reduce_sum, reduce_max, device))
    return stats


class StalenessMonitor(Callback):
    """f-OPD staleness diagnostics, freshness score and the three mechanisms (PROPOSED, §1.4-§1.5).

    Args:
        freshness: the freshness score and the mechanisms M1-M3 (``FreshnessConfig``; YAML
            ``init_args.freshness: {tau_rho: 0.15, ...}``), applied by the ``FreshnessWeighting`` this callback
            installs (:attr:`freshness`).
        initial_lag_bound: the lag bound Δ_max at the start (versions, in ``[1, freshness.lag_cap]``); default
            ``min(lag_cap, max(1, DataModule.max_allowed_lag))``: the configured producer lead async (with weights
            pushed every version), so the producer-side control acts from the first step (docs/algorithms.md §7.2). Not the DataModule's ``producer_lead`` (how far
            the async producer runs ahead) nor its ``max_allowed_lag`` (the largest lag a batch can have).
        adaptive_lag: move Δ_max with the step's mean freshness f̄ (M3), never below :attr:`lag_bound_floor` (the
            DataModule's ``forced_lag``, or 1).
        low_freshness: the adaptive rule lowers Δ_max by one after ``patience`` consecutive steps with f̄ below
            it (unitless, in [0, 1]); also where the synchronous fallback ends.
        high_freshness: the adaptive rule raises Δ_max by one (up to ``freshness.lag_cap``) at every step with f̄
            above it (unitless, in [0, 1]).
        patience: consecutive steps (>= 1) of the adaptive rule and of the synchronous fallback.
        mode: ``"control"`` (the mechanisms as configured) or ``"measure"`` (every diagnostic logged and
            per-sample records written, nothing applied: ``freshness.weighting``, ``freshness.filtering``,
            ``freshness.truncated_ratio`` and ``adaptive_lag`` are ignored: the learner's own ratio setting stays).
        sample_records: write the per-sample JSON lines also in ``control`` mode (``None``: only in ``measure``).
        producer_control: async (``data.init_args.mode=async``): hand Δ_max to the producer's lag gate after
            every step (``RolloutDataModule.set_lag_bound``: lead ``min(producer_lead, max(0, Δ_max -
            weight_sync_interval + 1))``, §1.5.1); no effect in sync mode or with ``forced_lag``.
        fallback_freshness: async with ``producer_control``: after ``patience`` consecutive steps with f̄ below
            it, generate synchronously (producer lag bound 0) until ``patience`` consecutive steps
            reach ``low_freshness`` (:class:`~lightning_opd.callbacks.lag_control.SyncFallback`, §1.5.1); ``None``:
            never. While it lasts, the batches already buffered are weighed by their freshness (M1/M2) like any
            others: the lag bound Δ_max is held at ``max(Δ_max, DataModule.max_allowed_lag)`` so that no buffered
            batch is dropped for its lag alone, and set to 1 when the fallback ends (docs/algorithms.md §7.2).

    Raises:
        ValueError: ``initial_lag_bound`` outside ``[1, freshness.lag_cap]``, ``patience < 1``, an unknown ``mode``
            (named in the message). At setup, with filtering applied and ``data.init_args.forced_lag`` k > 0: an
            explicit ``initial_lag_bound`` below k, or ``freshness.lag_cap`` below k (the bound could not reach the
            forced lag, so M2 would drop every sample; naming both keys).
        TypeError: at setup, a module without ``configure_freshness`` (not an ``OPDModule``).
    """

    def __init__(self, freshness: FreshnessConfig = FreshnessConfig(),  # frozen: one shared default is safe
                 initial_lag_bound: int | None = None, adaptive_lag: bool = True, low_freshness: float = 0.5,
                 high_freshness: float = 0.8, patience: int = 3, mode: str = "control",
                 sample_records: bool | None = None, producer_control: bool = True,
                 fallback_freshness: float | None = 0.2) -> None:
        if initial_lag_bound is not None and not 1 <= initial_lag_bound <= freshness.lag_cap:
            raise ValueError(f"initial_lag_bound={initial_lag_bound} must be in [1, freshness.lag_cap="
                             f"{freshness.lag_cap}]")
        if patience < 1:
            raise ValueError(f"patience={patience} must be >= 1")
        if mode not in ("control", "measure"):
            raise ValueError(f"StalenessMonitor init_args.mode={mode!r}: choose control (apply the mechanisms) or "
                             "measure (log the diagnostics, change nothing)")
        measure = mode == "measure"
        if measure:
            freshness = replace(freshness, weighting=False, filtering=False, truncated_ratio=None)
        #: the loss-side component this callback installs and steers; it holds the lag bound Δ_max (``lag_bound``)
        self.freshness = FreshnessWeighting(freshness, lag_bound=initial_lag_bound, measure=adaptive_lag or measure)
        self.initial_lag_bound, self.mode = initial_lag_bound, mode
        self.adaptive_lag, self.low_freshness, self.high_freshness, self.patience = (
            adaptive_lag and not measure, low_freshness, high_freshness, patience)
        self.sample_records = measure if sample_records is None else sample_records
        self.records_path: Path | None = None
        # state (plain numbers; persisted with the lag bound)
        self.low_streak = 0
        self.skipped_steps = 0
        self.skipped_steps_by_lag_bound = 0
        #: Δ_min, the adaptive bound's floor (versions): the DataModule's forced_lag when set (setup), else 1
        self.lag_bound_floor = 1
        self.data_max_lag = 1  # set at setup: the DataModule's max_allowed_lag within [1, lag_cap]
        #: producer-side control (§1.5.1); acts only when setup finds an async DataModule with set_lag_bound
        self.producer_control = producer_control and not measure
        self.sync_fallback = (SyncFallback(fallback_freshness, low_freshness, patience)
                              if self.producer_control and fallback_freshness is not None else None)
        self.controls_producer = False
        #: the producer lead in use after the last hand-over (versions; logged as ``staleness/producer_lead``)
        self.lead_in_use: int | None = None
        #: steps (rollout iterations) so far that ran in the synchronous fallback (persisted)
        self.sync_fallback_steps = 0
        #: whether the last step ran in the synchronous fallback
        self.in_sync_fallback = False

    @property
    def lag_bound(self) -> int | None:
        """Δ_max (versions), held by :attr:`freshness` (``FreshnessWeighting.lag_bound``); ``None`` before setup
        without ``initial_lag_bound``."""
        return self.freshness.lag_bound

    @property
    def state_key(self) -> str:
        c = self.freshness.config
        return self._generate_state_key(lag_cap=c.lag_cap, tau_rho=c.tau_rho, tau_chi=c.tau_chi, alpha=c.alpha,
                                        beta=c.beta)

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "configure_freshness"):
            raise TypeError(f"StalenessMonitor needs an OPDModule-like module with configure_freshness(), got "
                            f"{type(pl_module).__name__}")
        bound = self.lag_bound
        allowed = int(getattr(trainer.datamodule, "max_allowed_lag", 0)) if trainer.datamodule is not None else 0
        #: the largest lag a batch of the data configuration can have, within the lag cap (versions)
        self.data_max_lag = min(self.freshness.config.lag_cap, max(1, allowed))
        if bound is None:  # §7.2: the configured lead (async, pushes every version), not max(4, lead)
            bound = self.data_max_lag
        self.lag_bound_floor = self.lag_bound_floor_for(int(getattr(trainer.datamodule, "forced_lag", 0) or 0))
        self.freshness.set_lag_bound(max(self.lag_bound_floor, int(bound)))
        pl_module.configure_freshness(self.freshness)
        dm = trainer.datamodule
        self.controls_producer = (self.producer_control and getattr(dm, "mode", None) == "async"
                                  and hasattr(dm, "set_lag_bound"))
        log_dir = getattr(trainer, "log_dir", None)
        if self.sample_records and log_dir is not None:
            world, rank = int(getattr(trainer, "world_size", 1)), int(getattr(trainer, "global_rank", 0))
            self.records_path = Path(log_dir) / (f"staleness_samples.rank{rank}.jsonl" if world > 1
                                                 else "staleness_samples.jsonl")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        outputs = outputs if isinstance(outputs, dict) else {}
        report = outputs.get("freshness")
        report = report if report is not None else FreshnessReport()
        if outputs.get("skipped_update"):
            self.skipped_steps += 1
            if report.stats.get("lag_bound_dropped_tokens", 0.0) > 0:  # all ranks: the bound emptied the step
                self.skipped_steps_by_lag_bound += 1
        freshness_mean = report.stats.get("freshness_mean")
        fallback = self.sync_fallback if self.controls_producer else None
        was_synchronous = fallback is not None and fallback.active  # the state the whole step ran in
        self.in_sync_fallback = was_synchronous
        self.sync_fallback_steps += int(was_synchronous)
        if fallback is not None and (fallback.update(freshness_mean) or was_synchronous):
            self.low_streak = 0
            if fallback.active:  # entering and during (§7.2): the producer waits (lead 0); the batches already
                # buffered are weighed by their freshness (M1/M2), never dropped for their lag alone
                self.freshness.set_lag_bound(max(int(self.lag_bound), self.data_max_lag))
            else:  # leaving (§1.5.1): from 1, lag-0 batches say nothing about lag >= 1; the adaptive rule moves it next
                self.freshness.set_lag_bound(1)
        else:
            self.update_bound(freshness_mean)
        self.hand_over_lag_bound(trainer)
        self._log(pl_module, self._all_rank_report(trainer, pl_module, report))
        if self.records_path is not None and report.freshness is not None:
            self.write_records(self.records_path, report, int(getattr(trainer, "global_step", batch_idx)),
                               int(getattr(trainer, "global_rank", 0)))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.hand_over_lag_bound(trainer)  # also after a resume, before the producer starts

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"lag_bound": self.lag_bound, "low_streak": self.low_streak,
                 "skipped_steps": self.skipped_steps, "skipped_steps_by_lag_bound": self.skipped_steps_by_lag_bound}
        if self.sync_fallback is not None:
            state["sync_fallback"] = self.sync_fallback.state_dict()
            state["sync_fallback_steps"] = self.sync_fallback_steps
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # "max_lag_bound": the key before issue 40 (older checkpoints)
        bound = state_dict.get("lag_bound", state_dict.get("max_lag_bound", self.lag_bound))
        if bound is not None:  # restored after setup: a bound saved below the forced lag is raised
            bound = max(self.lag_bound_floor, int(bound))
        self.low_streak = int(state_dict.get("low_streak", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.skipped_steps_by_lag_bound = int(state_dict.get("skipped_steps_by_lag_bound", 0))
        if self.sync_fallback is not None:
            self.sync_fallback.load_state_dict(state_dict.get("sync_fallback", {}))
            self.sync_fallback_steps = int(state_dict.get("sync_fallback_steps", 0))
        self.freshness.set_lag_bound(bound)

    # ------------------------------------------------------------------------------------- the decision
    def update_bound(self, freshness_mean: float | None) -> None:
        """One step of the adaptive bound from the step's f̄ (the mean over all samples before filtering, §1.5;
        ``None`` or NaN: no sample on any rank, nothing learned about freshness): ``Δ_max ← max(Δ_min, Δ_max − 1)``
        (Δ_min: :attr:`lag_bound_floor`, the forced lag or 1, §6.2)
        after ``patience`` consecutive steps below ``low_freshness``, ``Δ_max ← min(Δ_cap, Δ_max + 1)`` above
        ``high_freshness``; set on the weighting, which holds it. Nothing moves in ``measure`` mode."""
        if not self.adaptive_lag or freshness_mean is None or math.isnan(freshness_mean):
            return
        bound = self.lag_bound
        if freshness_mean < self.low_freshness:
            self.low_streak += 1
            if self.low_streak >= self.patience:
                bound = max(self.lag_bound_floor, int(bound) - 1)
                self.low_streak = 0
        else:
            self.low_streak = 0
            if freshness_mean > self.high_freshness:
                bound = min(self.freshness.config.lag_cap, int(bound) + 1)
        self.freshness.set_lag_bound(bound)

    def lag_bound_floor_for(self, forced_lag: int) -> int:
        """Δ_min for a DataModule with ``data.init_args.forced_lag`` = ``forced_lag`` (versions; 0: off): every
        sample then has lag ``min(version, forced_lag)`` by construction, so the bound must not fall below it
        (docs/algorithms.md §6.2: floored, not refused, so that the adaptive rule's default stays usable with a
        forced lag; the bound then never drops a sample for its lag and is only reported).

        Raises:
            ValueError: with filtering applied, ``forced_lag`` above ``freshness.lag_cap`` or above an explicit
                ``initial_lag_bound`` (both keys named): M2 would drop every sample from then on.
        """
        if forced_lag <= 0:
            return 1
        lag_cap = self.freshness.config.lag_cap
        if self.freshness.config.filtering:
            if forced_lag > lag_cap:
                raise ValueError(f"data.init_args.forced_lag={forced_lag} exceeds StalenessMonitor init_args.freshness."
                                 f"lag_cap={lag_cap}: the lag bound lives in [1, lag_cap], so every sample of lag "
                                 f"{forced_lag} would be dropped; set freshness.lag_cap >= {forced_lag} or "
                                 "freshness.filtering=false")
            if self.initial_lag_bound is not None and self.initial_lag_bound < forced_lag:
                raise ValueError(f"StalenessMonitor init_args.initial_lag_bound={self.initial_lag_bound} is below "
                                 f"data.init_args.forced_lag={forced_lag}: every sample of lag {forced_lag} would "
                                 f"be dropped; set initial_lag_bound >= {forced_lag} or leave it unset")
        return min(forced_lag, lag_cap)

    def hand_over_lag_bound(self, trainer: L.Trainer) -> None:
        """Async with producer control: the producer's lag bound, Δ_max or 0 while generating synchronously,
        handed to ``trainer.datamodule.set_lag_bound`` (§1.5.1), which returns the producer lead now in use."""
        if not self.controls_producer or self.lag_bound is None:
            return
        fallback = self.sync_fallback
        bound = fallback.producer_lag_bound(self.lag_bound) if fallback is not None else int(self.lag_bound)
        self.lead_in_use = int(trainer.datamodule.set_lag_bound(bound))

    def _all_rank_report(self, trainer, pl_module, report: FreshnessReport) -> FreshnessReport:
        """``report`` with the statistics over all data-parallel ranks (:func:`all_rank_stats`, F27); one process:
        ``report`` itself."""
        if trainer is None or int(getattr(trainer, "world_size", 1)) <= 1:
            return report
        return replace(report, stats=all_rank_stats(report, pl_module.reduce_sum, pl_module.reduce_max,
                                                    pl_module.device))

    def _log(self, pl_module, report: FreshnessReport) -> None:
        values = dict(report.stats)
        values["lag_bound"] = float(self.lag_bound or 0)
        values["skipped_steps"] = float(self.skipped_steps)
        values["skipped_steps_by_lag_bound"] = float(self.skipped_steps_by_lag_bound)
        if self.controls_producer:
            values["producer_lead"] = float(self.lead_in_use if self.lead_in_use is not None else -1)
            values["sync_fallback"] = float(self.sync_fallback is not None and self.sync_fallback.active)
            values["sync_fallback_step"] = float(self.in_sync_fallback)
            values["sync_fallback_steps"] = float(self.sync_fallback_steps)
        for key, value in values.items():
            pl_module.log(f"staleness/{key}", value, batch_size=1)

    @staticmethod
    def write_records(path: Path, report: FreshnessReport, step: int, rank: int) -> None:
        """Append one JSON line per sample of ``report`` to ``path``: ``step``, ``rank``, ``lag`` (versions),
        ``delta``, ``rho``, ``chi`` (nats), ``score``, ``freshness``, ``kept`` (what
        ``lightning-opd calibrate-freshness`` reads)."""
        d = report.diagnostics
        rows = zip(d.lag.tolist(), d.delta.tolist(), d.rho.tolist(), d.chi.tolist(), report.score.tolist(),
                   report.freshness.tolist(), report.keep.tolist())
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            for lag, delta, rho, chi, score, fresh, kept in rows:
                fh.write(json.dumps({"step": step, "rank": rank, "lag": lag, "delta": delta, "rho": rho, "chi": chi,
                                     "score": score, "freshness": fresh, "kept": bool(kept)}) + "\n")
