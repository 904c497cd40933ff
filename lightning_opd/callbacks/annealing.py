"""``AnnealingSchedule``: anneal one module coefficient over training (ATOD Eq. 10-12; docs/algorithms.md §3.2).

ATOD moves the hybrid advantage from imitation to reward over the first ``T_anneal`` steps::

    p(s) = min(s / T_anneal, 1)
    κ(s) = max(κ_min, κ_init − (κ_init − κ_min) p(s))      1.0 -> 0.1
    ρ(s) = ρ_init + (ρ_max − ρ_init) p(s)                   1.0 -> 2.0,   T_anneal = 80 (of 150 steps)

Both are ``start + (end − start) · p(s)`` (the ``max`` is inactive for κ_min < κ_init), so one schedule
per attribute does it: ``AnnealingSchedule("kappa", 1.0, 0.1, steps=80)`` and
``AnnealingSchedule("rho", 1.0, 2.0, steps=80)``. The value is a pure function of the step, set on the
module in ``on_train_batch_start`` before every rollout batch (nothing to restore on resume but the
horizon), through the module's named setter ``set_<attribute>`` (``ATODModule.set_kappa`` /
``set_rho``, which check the value when it is set), or the DataModule's where the module has none
(``RolloutDataModule.set_intervention_prob``: the teacher-intervention probability, Guided-OPD arXiv 2606.15912). At fit setup the schedule also hands itself to the module's
``set_<attribute>_schedule`` where it has one (``ATODModule.set_kappa_schedule`` / ``set_rho_schedule``), so the
module's F22 check sees the coefficient at every iteration (Lightning runs the callbacks' setup before the module's).
The step ``s`` is ``pl_module.policy_version``: rollout iterations trained on, however many optimizer updates each
batch gets (§3.1 note), never ``trainer.global_step``.

PROPOSED (not from the paper): the horizon may be given as a fraction of training (the paper's 80 of
150 steps is longer than a CPU run), where training = ``trainer.max_steps // updates_per_batch`` rollout
iterations (``max_steps`` counts optimizer updates); the ``"cosine"`` shape
``start + (end − start)(1 − cos(π p)) / 2``.

Logged: ``schedule/<attribute>`` (the value the step just trained with).
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from typing_extensions import override

from lightning_opd.callbacks.step_schedule import StepSchedule

SHAPES = ("linear", "cosine")


class AnnealingSchedule(StepSchedule):
    """Hand ``start + (end − start) · shape(min(s / horizon, 1))`` to ``pl_module.set_<attribute>(...)`` before
    each rollout batch ``s`` (ATOD §3.2).

    Args:
        attribute: the coefficient to anneal, e.g. ``"kappa"`` or ``"rho"`` (``ATODModule``): the module must
            have a setter ``set_<attribute>`` and a numeric attribute ``<attribute>``; else the DataModule
            (``"intervention_prob"``: ``RolloutDataModule.set_intervention_prob``).
        start: value at step 0.
        end: value from the end of the horizon on.
        steps: horizon T_anneal in rollout iterations (>= 1).
        fraction: horizon as a fraction of training in (0, 1] (rollout iterations =
            ``trainer.max_steps // pl_module.updates_per_batch``); give ``steps`` or ``fraction``, not both.
        shape: ``"linear"`` (ATOD) or ``"cosine"``.

    Raises:
        ValueError: neither or both of ``steps``/``fraction``, a value out of range or an unknown shape
            (named in the message); at setup, neither the module nor the DataModule has ``set_<attribute>``, its
            ``<attribute>`` is not a number, or ``fraction`` with ``trainer.max_steps`` unset.
    """

    def __init__(self, attribute: str, start: float, end: float, steps: int | None = None,
                 fraction: float | None = None, shape: str = "linear") -> None:
        if not attribute.isidentifier():
            raise ValueError(f"attribute={attribute!r} must be the name of a module coefficient with a setter "
                             "set_<attribute>, e.g. 'kappa' or 'rho' (ATODModule)")
        self.check_horizon("steps", steps, fraction)
        if shape not in SHAPES:
            raise ValueError(f"shape={shape!r}: use one of {SHAPES}")
        self.attribute, self.start, self.end = attribute, float(start), float(end)
        self.steps, self.fraction, self.shape = steps, fraction, shape
        self.horizon: int | None = steps  # T_anneal in use (persisted)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(attribute=self.attribute)

    @property
    def setter_name(self) -> str:
        """The module's setter this schedule calls: ``set_<attribute>``."""
        return f"set_{self.attribute}"

    @property
    def schedule_name(self) -> str:
        return f"AnnealingSchedule({self.attribute!r})"

    def value_at(self, step: int) -> float:
        """The attribute's value for rollout batch ``step`` (a pure function of the step).

        Raises:
            RuntimeError: the horizon is a fraction and setup has not run yet.
        """
        if self.horizon is None:
            raise RuntimeError(f"AnnealingSchedule({self.attribute!r}): horizon unknown before setup "
                               "(fraction of trainer.max_steps)")
        p = min(max(step, 0) / self.horizon, 1.0)
        if self.shape == "cosine":
            p = (1.0 - math.cos(math.pi * p)) / 2.0
        if p == 1.0:
            return self.end  # exactly the end value after the horizon
        return self.start + (self.end - self.start) * p

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_attribute(self._owner(trainer, pl_module))
        if self.fraction is not None:
            iterations = self.training_iterations(trainer, pl_module, "give the horizon in steps")
            self.horizon = max(1, round(self.fraction * iterations))
        hand_over = getattr(pl_module, f"{self.setter_name}_schedule", None)  # e.g. ATODModule.set_kappa_schedule
        if callable(hand_over):
            hand_over(self)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        getattr(self._owner(trainer, pl_module), self.setter_name)(self.value_at(int(pl_module.policy_version)))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.log(f"schedule/{self.attribute}", self.value_at(self.trained_step(pl_module)), batch_size=1)

    # ------------------------------------------------------------------------------------- internals
    def _owner(self, trainer: L.Trainer, pl_module: L.LightningModule):
        """Whose ``set_<attribute>`` this schedule calls: the module's, else the DataModule's where it has one."""
        if callable(getattr(pl_module, self.setter_name, None)):
            return pl_module
        datamodule = getattr(trainer, "datamodule", None)
        return datamodule if callable(getattr(datamodule, self.setter_name, None)) else pl_module

    def _check_attribute(self, pl_module) -> None:
        module = type(pl_module).__name__
        if not callable(getattr(pl_module, self.setter_name, None)):
            raise ValueError(f"AnnealingSchedule: {module} has no setter {self.setter_name}() for {self.attribute!r} "
                             "to anneal (ATODModule anneals 'kappa' and 'rho': model.class_path="
                             "lightning_opd.learner.ATODModule; the DataModule anneals 'intervention_prob' with "
                             "data.init_args.intervention an AnnealedIntervention)")
        current = getattr(pl_module, self.attribute, None)
        if isinstance(current, bool) or not isinstance(current, (int, float)):
            raise ValueError(f"AnnealingSchedule: {module}.{self.attribute} is {type(current).__name__}, not a number")
