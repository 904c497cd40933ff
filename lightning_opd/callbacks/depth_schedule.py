"""``DepthSchedule``: a fixed rollout-depth schedule, the probe-free baseline of TurnOPD's adaptive cap
(TCOD arXiv 2604.24005 grows the cap over training; "the same idea as TurnOPD's cap" with no probes).

The turn cap of training batch ``s`` grows linearly from ``start`` to ``end`` over ``horizon`` rollout
iterations, rounded half up to whole turns, then stays at ``end``::

    cap(s) = start + floor((end − start) · min(s, horizon) / horizon + 1/2)        (turns)

computed in integers (``start + ((end − start) · 2 · min(s, H) + H) // (2 H)``), so no float rounding
can move a half. E.g. start 2, end 8, horizon 6: steps 0..7 -> 2, 3, 4, 5, 6, 7, 8, 8. With
``rounding="floor"`` the cap is ``start + floor((end − start) · min(s, H) / H)``, TCOD-f2b's staircase
``min(1 + ⌊s / checkpoint_steps⌋, max_env_steps)`` exactly when start = 1, end = max_env_steps and
H = (max_env_steps − 1) · checkpoint_steps (docs/algorithms.md §4, TCOD).

The step ``s`` is ``pl_module.policy_version`` (rollout iterations trained on, as in
:mod:`~lightning_opd.callbacks.annealing`); ``fraction`` gives the horizon as a fraction of
``trainer.max_steps // updates_per_batch`` (PROPOSED, as there). ``end`` defaults to the DataModule's
``max_turns``, read once at setup and kept in the checkpoint. The cap is handed to the DataModule with
``set_max_turns`` in ``on_train_batch_start``: synchronous OPD pulls its batch inside the training step, so
batch ``s`` is played at ``cap(s)``; with an async producer the cap applies to batches started from then on
(up to ``producer_lead`` batches later). The cap a batch was played at is logged with the batch
(``rollout/cap``). It is a pure function of the step: the checkpoint keeps the horizon and ``end``, and a
resumed run continues exactly.

It sets the same cap as :class:`~lightning_opd.callbacks.rollout_depth.RolloutDepthController`; the two
are refused together in one fit.

PROPOSED (docs/algorithms.md §4, TCOD): the linear shape with round half up (the default), ``end`` =
``max_turns`` by default, the horizon as a fraction of training.

Logged: ``controller/cap`` (turns; the cap of the next batch, the key the TurnOPD controller logs its cap
under, so the two runs' curves compare in TensorBoard).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

from lightning_opd.callbacks.rollout_depth import RolloutDepthController
from lightning_opd.callbacks.step_schedule import StepSchedule

ROUNDINGS = ("half_up", "floor")


class DepthSchedule(StepSchedule):
    """Cap training rollouts at ``start + floor((end − start) · min(s, H) / H + 1/2)`` turns at rollout
    iteration ``s`` (TCOD arXiv 2604.24005; round half up and the defaults PROPOSED; ``rounding="floor"``
    drops the ``+ 1/2``: TCOD-f2b's staircase).

    Args:
        start: cap at step 0 (turns, >= 1).
        horizon: H, rollout iterations over which the cap grows (>= 1); give ``horizon`` or ``fraction``.
        fraction: H as a fraction of training in (0, 1]: ``max(1, round(fraction · max_steps //
            updates_per_batch))`` rollout iterations, fixed at setup.
        end: cap from step H on (turns, >= ``start``); default: the DataModule's ``max_turns`` at setup.
        rounding: ``"half_up"`` (default) or ``"floor"`` (TCOD-f2b).

    Raises:
        ValueError: ``start < 1``, ``start > end``, ``horizon < 1``, ``fraction`` outside (0, 1], an unknown
            ``rounding``, or both or neither of ``horizon``/``fraction`` (named in the message); at setup, ``start``
            above the DataModule's ``max_turns`` when ``end`` is not given, ``fraction`` with ``trainer.max_steps``
            unset, or a ``RolloutDepthController`` among the trainer's callbacks.
        TypeError: at setup, a DataModule without ``set_max_turns``.
    """

    def __init__(self, start: int, horizon: int | None = None, fraction: float | None = None,
                 end: int | None = None, rounding: str = "half_up") -> None:
        self.check_horizon("horizon", horizon, fraction)
        if start < 1:
            raise ValueError(f"start={start} must be >= 1 (turns)")
        if end is not None and start > end:
            raise ValueError(f"start={start} is above end={end}: the cap grows from start to end (turns)")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding!r}: use one of {ROUNDINGS}")
        self.start, self.end, self.fraction, self.rounding = int(start), end, fraction, rounding
        self.horizon: int | None = horizon  # H in use (persisted)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(start=self.start)

    def cap_at(self, step: int) -> int:
        """The turn cap of rollout batch ``step`` (turns; a pure function of the step).

        Raises:
            RuntimeError: ``horizon`` (from ``fraction``) or ``end`` (from the DataModule) unknown before setup.
        """
        if self.horizon is None or self.end is None:
            raise RuntimeError("DepthSchedule: horizon or end unknown before setup (fraction of trainer.max_steps, "
                               "end = the DataModule's max_turns)")
        h, grown = self.horizon, (self.end - self.start) * min(max(step, 0), self.horizon)  # turns · H
        if self.rounding == "floor":
            return self.start + grown // h
        return self.start + (2 * grown + h) // (2 * h)

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if any(isinstance(c, RolloutDepthController) for c in trainer.callbacks):
            raise ValueError("DepthSchedule and RolloutDepthController both set the rollout cap: use one of them "
                             "per fit (remove conf/callbacks/rollout_depth.yaml or conf/callbacks/depth_schedule.yaml)")
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "set_max_turns"):
            raise TypeError(f"DepthSchedule needs a RolloutDataModule-like DataModule, got {type(dm).__name__}")
        if self.end is None:
            self.end = int(dm.max_turns)
            if self.start > self.end:
                raise ValueError(f"start={self.start} is above the DataModule's max_turns={self.end} (the default "
                                 "end): lower start or raise data.init_args.max_turns")
        if self.fraction is not None:
            self.horizon = max(1, round(self.fraction * self.training_iterations(trainer, pl_module,
                                                                                 "give the horizon in steps")))

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        trainer.datamodule.set_max_turns(self.cap_at(int(pl_module.policy_version)))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.log("controller/cap", float(self.cap_at(int(pl_module.policy_version))), batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "end": self.end}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.end = state_dict.get("end", self.end)
