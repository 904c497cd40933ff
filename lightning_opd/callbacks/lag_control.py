"""When asynchronous generation falls back to synchronous generation: f-OPD's producer-side control
(PROPOSED, docs/algorithms.md §1.5 "Producer-side control"; not from the paper).

The staleness monitor hands the producer its lag bound Δ_max (``RolloutDataModule.set_lag_bound``); this rule
decides when the producer's lag bound is 0 instead (:meth:`SyncFallback.producer_lag_bound`): after ``patience``
consecutive steps whose mean freshness f̄ (all samples of the step, before filtering; unitless in [0, 1]) is
below ``floor``, and until ``patience`` consecutive steps reach ``recover`` again. A step without samples
(f̄ ``None`` or NaN) says nothing and changes nothing.

Not a callback itself: the rule :class:`~lightning_opd.callbacks.staleness_monitor.StalenessMonitor` applies
(kept apart so it is tested on hand-made sequences of f̄).
"""

from __future__ import annotations

import math
from typing import Any


class SyncFallback:
    """The fallback rule (PROPOSED, docs/algorithms.md §1.5): a two-state machine over the step's f̄.

    Args:
        floor: f_floor; ``patience`` consecutive steps with ``f̄ < floor`` switch to synchronous generation.
        recover: ``patience`` consecutive steps with ``f̄ >= recover`` switch back (``recover >= floor``).
        patience: consecutive steps (>= 1).

    State (:meth:`state_dict`): ``active`` (synchronous now) and ``streak`` (consecutive steps towards a switch).

    Raises:
        ValueError: ``floor`` or ``recover`` outside [0, 1], ``recover < floor`` or ``patience < 1``, naming the
            ``StalenessMonitor`` key (``init_args.fallback_freshness``, ``init_args.low_freshness``,
            ``init_args.patience``).
    """

    def __init__(self, floor: float, recover: float, patience: int) -> None:
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"init_args.fallback_freshness={floor} must be in [0, 1] (a mean freshness)")
        if not floor <= recover <= 1.0:
            raise ValueError(f"init_args.low_freshness={recover} must be in [fallback_freshness={floor}, 1]: the "
                             "fallback ends when the mean freshness is back at it")
        if patience < 1:
            raise ValueError(f"init_args.patience={patience} must be >= 1")
        self.floor, self.recover, self.patience = float(floor), float(recover), int(patience)
        self.active = False
        self.streak = 0

    def update(self, freshness_mean: float | None) -> bool:
        """One step's f̄; returns whether generation is synchronous from now on."""
        if freshness_mean is None or math.isnan(freshness_mean):
            return self.active
        towards_switch = freshness_mean >= self.recover if self.active else freshness_mean < self.floor
        self.streak = self.streak + 1 if towards_switch else 0
        if self.streak >= self.patience:
            self.active, self.streak = not self.active, 0
        return self.active

    def producer_lag_bound(self, lag_bound: int) -> int:
        """The lag bound handed to the producer (versions, ``RolloutDataModule.set_lag_bound``): 0 while
        synchronous, else ``lag_bound`` (Δ_max)."""
        return 0 if self.active else int(lag_bound)

    def state_dict(self) -> dict[str, Any]:
        return {"active": self.active, "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.active = bool(state.get("active", False))
        self.streak = int(state.get("streak", 0))
