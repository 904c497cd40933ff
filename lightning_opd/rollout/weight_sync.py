"""How the learner's weights reach the generator: the sync configuration and :class:`WeightSync`.

Three lag quantities, three names (versions = rollout iterations, docs/algorithms.md §3.1 note):

* ``producer_lead`` (``data.init_args.producer_lead``): async only, how many versions the background producer
  may run ahead of the last pushed weights (batch ``i`` waits for the push at or before ``i - producer_lead``);
* ``max_allowed_lag`` (:attr:`SyncConfig.max_allowed_lag`): the largest lag a batch of this configuration
  can have when the learner trains on it (``producer_lead + weight_sync_interval - 1`` async, ``forced_lag``
  sync); the learner refuses a batch beyond it (``OPDModule.strict_on_policy``);
* ``lag_bound``, the f-OPD lag bound Δ_max (``FreshnessWeighting.lag_bound``; starts at ``StalenessMonitor``'s
  ``initial_lag_bound``, moved by its adaptive rule): the
  largest lag the freshness filter keeps; a loss-side decision, not a property of the data. Async, it also caps
  the producer (producer-side control, PROPOSED, docs/algorithms.md §1.5): the lead in use,
  :attr:`WeightSync.lead_in_use`, becomes :meth:`SyncConfig.producer_lead_for` ``(Δ_max)``
  ``= min(producer_lead, max(0, Δ_max - weight_sync_interval + 1))`` (:meth:`WeightSync.set_lag_bound`, through
  ``RolloutDataModule.set_lag_bound``), so batches started after the change are at most Δ_max behind;
  ``max_allowed_lag`` stays the configured ceiling (batches already buffered were made under the old lead).

``producer_lead`` always names the configured value; ``lead_in_use`` the value in force now.

Modes: ``sync`` (the generator follows the live student: every batch lag 0), ``sync`` with ``forced_lag=k``
(the generator samples with a CPU copy of version ``max(0, v - k)``: deterministic staleness), ``async`` (a
background producer, weights pushed at the start version and every ``weight_sync_interval`` versions, F18).

The one bind: ``RolloutDataModule.connect(policy)`` (called once by the module at setup) attaches the
generator to :class:`WeightSync` and returns it; the learner reports every new version to it
(:meth:`WeightSync.on_policy_update`), the DataModule calls :meth:`WeightSync.before_batch` before playing a
batch, :meth:`WeightSync.before_producer_start` before the async producer (re)starts and
:meth:`WeightSync.before_evaluation` before held-out evaluation (which plays the learner's current weights, F29).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

MODES = ("sync", "async")

#: returns the learner's full CPU ``state_dict`` (``PolicyModule.policy_state_dict``; a collective when sharded)
StateFn = Callable[[], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class SyncConfig:
    """Validated rollout/weight-sync configuration, the one place its keys are checked.

    Attributes:
        mode: ``"sync"`` or ``"async"`` (``data.init_args.mode``).
        producer_lead: async: versions the producer may run ahead of the pushed weights
            (``data.init_args.producer_lead``; >= 1 async, >= 0 and unused sync).
        weight_sync_interval: async: push every N versions (``data.init_args.weight_sync_interval``, >= 1).
        forced_lag: sync only: sample with the weights of version ``max(0, v - forced_lag)`` (0 = off).

    Raises:
        ValueError: naming the ``data.init_args`` key, its value and the fix.
    """

    mode: str = "sync"
    producer_lead: int = 1
    weight_sync_interval: int = 1
    forced_lag: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"data.init_args.mode={self.mode!r}: use 'sync' or 'async'")
        if self.producer_lead < 0:
            raise ValueError(f"data.init_args.producer_lead={self.producer_lead} must be >= 0 (versions the async "
                             "producer may run ahead of the pushed weights; >= 1 with data.init_args.mode=async)")
        if self.mode == "async" and self.producer_lead < 1:
            raise ValueError(f"data.init_args.producer_lead={self.producer_lead} must be >= 1 in async mode (use "
                             "data.init_args.mode=sync for lag 0)")
        if self.weight_sync_interval < 1:
            raise ValueError(f"data.init_args.weight_sync_interval={self.weight_sync_interval} must be >= 1")
        if self.forced_lag < 0 or (self.forced_lag and self.mode != "sync"):
            raise ValueError(f"data.init_args.forced_lag={self.forced_lag} needs data.init_args.mode=sync and must "
                             "be >= 0")

    @property
    def active_producer_lead(self) -> int:
        """The producer lead in use: ``producer_lead`` async, 0 sync (versions)."""
        return self.producer_lead if self.mode == "async" else 0

    @property
    def max_allowed_lag(self) -> int:
        """Largest lag (versions) a batch of this configuration can have when trained on."""
        if self.mode == "async":
            return self.producer_lead + self.weight_sync_interval - 1
        return self.forced_lag

    def producer_lead_for(self, lag_bound: int) -> int:
        """The producer lead that keeps every batch started from now on at most ``lag_bound`` versions behind
        the learner that trains on it (producer-side control, PROPOSED, docs/algorithms.md §1.5):
        ``min(producer_lead, max(0, lag_bound - (weight_sync_interval - 1)))`` async, 0 sync.

        A batch's lag is at most ``lead + weight_sync_interval - 1`` and reaches it when the producer keeps up,
        so this is the largest lead within the bound. The configured ``producer_lead`` is never exceeded (the
        buffer and :attr:`max_allowed_lag` are sized for it). ``lag_bound = 0`` is synchronous generation: each
        batch waits for the push of its own version (lag 0 with ``weight_sync_interval = 1``; with pushes every N
        versions the lag stays below N, and the f-OPD filter drops what exceeds its bound).

        Raises:
            ValueError: ``lag_bound < 0``.
        """
        if lag_bound < 0:
            raise ValueError(f"lag_bound={lag_bound} must be >= 0 (versions; 0 = synchronous generation)")
        if self.mode != "async":
            return 0
        return min(self.producer_lead, max(0, int(lag_bound) - (self.weight_sync_interval - 1)))

    @property
    def manages_weights(self) -> bool:
        """Weights are pushed to the generator (async, forced_lag) instead of it following the live student."""
        return self.mode == "async" or self.forced_lag > 0


class WeightSync:
    """Forced-lag snapshots and weight pushes to the generator, for one :class:`SyncConfig`.

    Args:
        config: the validated configuration.

    State: the forced-lag CPU copies of the last ``forced_lag + 1`` versions (:meth:`snapshots`, saved in the
    DataModule's checkpoint), the last version pushed since :meth:`attach`/:meth:`restore` (``None``: none,
    so the next update or producer start pushes whatever the generator claims to hold, F18) and the producer lead
    in use (:attr:`lead_in_use`).
    """

    def __init__(self, config: SyncConfig) -> None:
        self.config = config
        self.generator = None
        self._on_version: Callable[[], None] | None = None
        self._snapshots: dict[int, Mapping[str, torch.Tensor]] = {}
        self.pushed_version: int | None = None
        #: the producer lead in use (versions): ``config.producer_lead`` async until :meth:`set_lag_bound` lowers it,
        #: 0 sync
        self.lead_in_use: int = config.active_producer_lead

    @property
    def max_allowed_lag(self) -> int:
        """See :attr:`SyncConfig.max_allowed_lag`."""
        return self.config.max_allowed_lag

    @property
    def async_lead(self) -> int | None:
        """:attr:`lead_in_use` in async mode (what the learner logs as ``rollout/producer_lead``); ``None`` otherwise
        (sync, ``forced_lag``: no producer runs ahead)."""
        return self.lead_in_use if self.config.mode == "async" else None

    def set_lag_bound(self, lag_bound: int) -> int:
        """Producer-side control: :attr:`lead_in_use` becomes :meth:`SyncConfig.producer_lead_for` ``(lag_bound)``
        (versions; 0 = synchronous generation; always 0 sync). Returns it; the session hands it to its producer.

        Raises:
            ValueError: ``lag_bound < 0``.
        """
        self.lead_in_use = self.config.producer_lead_for(lag_bound)
        return self.lead_in_use

    def sampler_metrics(self) -> dict[str, float]:
        """The attached generator's running totals (:attr:`~lightning_opd.rollout.generator.Generator.stats`: a served
        sampler's requests, tokens, seconds, pushes, retries, bytes; this rank) as ``sampler/<key>``; none for the
        in-process backends or before :meth:`attach`."""
        if self.generator is None:
            return {}
        return {f"sampler/{k}": float(v) for k, v in self.generator.stats.items()}

    def attach(self, generator, on_version: Callable[[], None] | None = None) -> None:
        """Drive ``generator`` (a :class:`~lightning_opd.rollout.generator.Generator`): when this component
        manages its weights, the generator stops following the live student. ``on_version`` is called after
        every :meth:`on_policy_update` (the producer's wake-up)."""
        self.generator = generator
        self._on_version = on_version
        if self.config.manages_weights and hasattr(generator, "follow_policy"):
            generator.follow_policy = False

    def push(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``state`` into the generator as ``version``."""
        self.generator.push_weights(state, version)
        self.pushed_version = int(version)

    def on_policy_update(self, version: int, state: StateFn) -> None:
        """The learner reached ``version`` (at train start and after every rollout iteration).

        ``forced_lag``: keeps a CPU copy of ``version`` and drops those older than ``version - forced_lag``.
        Async: pushes at multiples of ``weight_sync_interval`` and at the first update after
        :meth:`attach`/:meth:`restore` (train start), so a run resumed between two pushes samples with exactly
        the restored weights (F18). ``state`` is called only then (the same decision on every rank: a
        collective when the student is sharded)."""
        cfg = self.config
        version = int(version)
        if cfg.forced_lag:
            self._snapshots[version] = state()
            for old in [v for v in self._snapshots if v < version - cfg.forced_lag]:
                del self._snapshots[old]
        elif cfg.mode == "async" and (version % cfg.weight_sync_interval == 0 or self.pushed_version is None):
            self.push(state(), version)
        if self._on_version is not None:
            self._on_version()

    def before_batch(self, learner_version: int) -> None:
        """Before a batch is played with the learner at ``learner_version``: with ``forced_lag``, make the
        generator hold version ``max(0, learner_version - forced_lag)`` (pushed from its copy unless already
        pushed since attach/restore; not the generator's stamp, which may predate a restore).

        Raises:
            RuntimeError: no copy of that version (``on_policy_update`` did not run for it).
        """
        if not self.config.forced_lag:
            return
        target = max(0, int(learner_version) - self.config.forced_lag)
        if self.pushed_version != target:
            if target not in self._snapshots:
                raise RuntimeError(f"forced_lag: no copy of version {target} (have {sorted(self._snapshots)}); "
                                   "on_policy_update must run for every version")
            self.push(self._snapshots[target], target)

    def before_evaluation(self, learner_version: int, state: StateFn) -> None:
        """Before held-out evaluation the generator must play the learner's current weights (F29), so push version
        ``learner_version`` unless it was the last push.

        ``forced_lag``: from its copy (or ``state()`` when there is none, e.g. ``validate`` before any update), not
        the lagged copy the last training batch used; the next training batch's :meth:`before_batch` pushes its
        lagged copy again. Async: ``state()`` (a collective when the student is sharded; every rank decides the
        same, as the pushes are the same on every rank), not the last interval push, which may be up to
        ``weight_sync_interval - 1`` versions old. The producer may be playing a batch meanwhile: its turns after
        the push are stamped with the new version, as at any push, and batches sampled from then on are fresher,
        never staler, than without the evaluation. Plain sync follows the live student already: no push."""
        if not self.config.manages_weights:
            return
        version = int(learner_version)
        if self.pushed_version != version:
            self.push(self._snapshots[version] if version in self._snapshots else state(), version)

    def before_producer_start(self, learner_version: int, state: StateFn, generator_version: int | None) -> None:
        """Async, before the producer (re)starts at ``learner_version``: push the learner's exact weights unless
        that version was pushed since attach/restore or the generator already holds it (its lag gate counts
        from here)."""
        version = int(learner_version)
        if self.pushed_version != version and generator_version != version:
            self.push(state(), version)

    def snapshots(self) -> dict[str, Mapping[str, torch.Tensor]]:
        """The forced-lag copies, version (as a string) -> ``state_dict`` (for a checkpoint)."""
        return {str(v): w for v, w in self._snapshots.items()}

    def restore(self, snapshots: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Restore :meth:`snapshots`; the restored weights are pushed again, whatever the generator holds."""
        self._snapshots = {int(v): w for v, w in snapshots.items()}
        self.pushed_version = None
