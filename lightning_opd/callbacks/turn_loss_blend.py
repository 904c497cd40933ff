"""``TurnLossBlend``: the schedule of TurnOPD's progressive turn-normalised loss budgeting (arXiv 2607.05804
§5.2; docs/algorithms.md §2.4).

The weights ``w_i = (1 - α) + α N / (T n_t)`` are computed by the loss-side component
:class:`~lightning_opd.losses.turn_blend.TurnBlendWeighting`, which this callback installs at setup with
``pl_module.configure_turn_blend(...)``. The callback only decides α over training and hands it over before
every rollout batch (``TurnBlendWeighting.set_alpha``)::

    α = clip((progress - s) / (e - s), 0, 1),  progress = k / K

From the paper (as quoted): the linear schedule with s = 0, e = 1 and progress = k / K. PROPOSED in
docs/algorithms.md, not from the paper: k = ``pl_module.policy_version`` (rollout iterations) and K =
``trainer.max_steps // pl_module.updates_per_batch`` (``max_steps`` counts optimizer updates, several per
batch with PPO epochs or mini-batches, §3.1 note) unless ``total_steps`` is given.

Logged: ``turn_blend/alpha`` (unitless, the α the step trained with).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

from lightning_opd.callbacks.step_schedule import StepSchedule
from lightning_opd.losses.turn_blend import TurnBlendWeighting


class TurnLossBlend(StepSchedule):
    """The α schedule of TurnOPD's turn-blended loss weights (§5.2); installs the module's turn-blend weighting.

    Args:
        start: s, progress at which α leaves 0 (fraction of training).
        end: e, progress at which α reaches 1 (fraction of training).
        total_steps: K (rollout iterations); default ``trainer.max_steps // pl_module.updates_per_batch``.

    Raises:
        ValueError: ``start``/``end``/``total_steps`` out of range (named in the message); at setup, no
            ``total_steps`` and ``trainer.max_steps`` unset (-1).
        TypeError: at setup, a module without ``configure_turn_blend`` (not an ``OPDModule``).
    """

    def __init__(self, start: float = 0.0, end: float = 1.0, total_steps: int | None = None) -> None:
        if not 0 <= start < end:
            raise ValueError(f"start={start}, end={end}: need 0 <= start < end")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1")
        self.start, self.end, self.total_steps = start, end, total_steps
        self.horizon: int | None = total_steps  # K in use (persisted)
        #: the loss-side component this callback installs and steers
        self.weighting = TurnBlendWeighting()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(start=self.start, end=self.end)

    def alpha_at(self, step: int) -> float:
        """α after ``step`` rollout iterations (a pure function of the step).

        Raises:
            RuntimeError: K is not known yet (before setup).
        """
        if self.horizon is None:
            raise RuntimeError("TurnLossBlend: K unknown before setup (pass total_steps or fit with max_steps)")
        progress = step / self.horizon
        return min(max((progress - self.start) / (self.end - self.start), 0.0), 1.0)

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not hasattr(pl_module, "configure_turn_blend"):
            raise TypeError(f"TurnLossBlend needs an OPDModule-like module with configure_turn_blend(), got "
                            f"{type(pl_module).__name__}")
        if self.total_steps is None:
            self.horizon = self.training_iterations(trainer, pl_module, "pass total_steps (K of progress = k / K)")
        pl_module.configure_turn_blend(self.weighting)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.weighting.set_alpha(self.alpha_at(int(pl_module.policy_version)))  # the batch about to train

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.log("turn_blend/alpha", self.alpha_at(self.trained_step(pl_module)), batch_size=1)
