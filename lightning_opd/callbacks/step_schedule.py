"""Shared base of the callbacks whose value is a pure function of the training step (TurnLossBlend's α,
AnnealingSchedule's κ/ρ/...): the horizon in rollout iterations and its persistence.

The step is ``pl_module.policy_version``: rollout iterations trained on, however many optimizer
updates each batch gets (docs/algorithms.md §3.1 note). ``trainer.max_steps`` counts optimizer updates
in manual optimisation, so a horizon derived from it is divided by the module's ``updates_per_batch``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override


class StepSchedule(Callback):
    """A callback with a ``horizon`` (rollout iterations) that a resumed run keeps.

    Subclasses set ``self.horizon`` (``None`` until known) and name themselves in ``schedule_name``.
    """

    horizon: int | None = None

    @staticmethod
    def check_horizon(name: str, steps: int | None, fraction: float | None) -> None:
        """Refuse a horizon given as neither or both of ``<name>=steps`` (rollout iterations, >= 1) and ``fraction``
        (of training, in (0, 1]), or out of range; the messages name the values.

        Raises:
            ValueError: as above.
        """
        if (steps is None) == (fraction is None):
            raise ValueError(f"give exactly one of {name}={steps} and fraction={fraction}: the horizon in rollout "
                             "iterations or as a fraction of training")
        if steps is not None and steps < 1:
            raise ValueError(f"{name}={steps} must be >= 1 (rollout iterations)")
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"fraction={fraction} must be in (0, 1]")

    @property
    def schedule_name(self) -> str:
        """How messages name this schedule."""
        return type(self).__name__

    def training_iterations(self, trainer: L.Trainer, pl_module: L.LightningModule, fix: str) -> int:
        """Rollout iterations of the whole fit: ``trainer.max_steps // updates_per_batch`` (>= 1).

        Raises:
            ValueError: ``trainer.max_steps`` is unset (-1); ``fix`` says what to do instead.
        """
        max_steps = trainer.max_steps
        if max_steps is None or max_steps < 1:
            raise ValueError(f"{self.schedule_name}: trainer.max_steps={max_steps} is unset; set trainer.max_steps "
                             f"or {fix}")
        return max(1, int(max_steps) // int(getattr(pl_module, "updates_per_batch", 1)))

    @staticmethod
    def trained_step(pl_module: L.LightningModule) -> int:
        """The rollout iteration that just trained, in ``on_train_batch_end`` (``policy_version`` has moved
        past it): ``max(0, policy_version - 1)``."""
        return max(0, int(pl_module.policy_version) - 1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"horizon": self.horizon}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("horizon")
        if saved is not None and self.horizon is not None and saved != self.horizon:
            rank_zero_warn(f"{self.schedule_name}: resuming with the checkpoint's horizon {saved} (this run "
                           f"configures {self.horizon}) so the schedule continues unchanged")
        self.horizon = saved if saved is not None else self.horizon
