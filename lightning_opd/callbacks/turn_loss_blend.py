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
from lightning.pytorch.callbacks import Timer
from typing_extensions import override

from lightning_opd.callbacks.step_schedule import StepSchedule
from lightning_opd.losses.turn_blend import TurnBlendWeighting


class TurnLossBlend(StepSchedule):
    """The α schedule of TurnOPD's turn-blended loss weights (§5.2); installs the module's turn-blend weighting.

    Args:
        start: s, progress at which α leaves 0 (fraction of training).
        end: e, progress at which α reaches 1 (fraction of training).
        total_steps: K (rollout iterations); default ``trainer.max_steps // pl_module.updates_per_batch``.
        horizon: ``"steps"`` (progress = k / K) or ``"time"`` (progress = training seconds / the ``Timer``'s
            budget; module docstring).

    Raises:
        ValueError: ``start``/``end``/``total_steps`` out of range, an unknown ``horizon`` or ``total_steps``
            with ``horizon="time"`` (named in the message); at setup, no ``total_steps`` and
            ``trainer.max_steps`` unset (-1) with the step horizon, or no ``Timer`` with a ``duration`` among
            the trainer's callbacks with the time horizon.
        TypeError: at setup, a module without ``configure_turn_blend`` (not an ``OPDModule``).
    """

    def __init__(self, start: float = 0.0, end: float = 1.0, total_steps: int | None = None,
                 horizon: str = "steps") -> None:
        if not 0 <= start < end:
            raise ValueError(f"start={start}, end={end}: need 0 <= start < end")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1")
        if horizon not in ("steps", "time"):
            raise ValueError(f"horizon={horizon!r}: use 'steps' (progress k / K) or 'time' (training seconds / the "
                             "Timer's budget)")
        if horizon == "time" and total_steps is not None:
            raise ValueError(f"total_steps={total_steps} with horizon='time': the Timer's budget is the horizon; "
                             "drop total_steps")
        self.start, self.end, self.total_steps, self.time_horizon = start, end, total_steps, horizon == "time"
        self.horizon: int | None = total_steps  # K in use (persisted; None with the time horizon)
        self.timer: Timer | None = None  # the fit's Timer (time horizon)
        self.alpha: float | None = None  # α of the batch being trained (time horizon; logged)
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
        return self.alpha_from_progress(step / self.horizon)

    def alpha_from_progress(self, progress: float) -> float:
        """α at ``progress`` (fraction of training, k / K or seconds / budget): ``clip((progress - s) / (e - s),
        0, 1)``."""
        return min(max((progress - self.start) / (self.end - self.start), 0.0), 1.0)

    def time_progress(self) -> float:
        """Training seconds spent / the Timer's budget (time horizon), in [0, 1]."""
        elapsed, remaining = self.timer.time_elapsed("train"), self.timer.time_remaining("train")
        return min(max(elapsed / max(elapsed + remaining, 1e-9), 0.0), 1.0)

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not hasattr(pl_module, "configure_turn_blend"):
            raise TypeError(f"TurnLossBlend needs an OPDModule-like module with configure_turn_blend(), got "
                            f"{type(pl_module).__name__}")
        if self.time_horizon:
            timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer) and cb.time_remaining("train") is not None]
            if not timers:
                raise ValueError("TurnLossBlend(horizon='time') needs a lightning.pytorch.callbacks.Timer with a "
                                 "duration among trainer.callbacks (the experiment runner adds one with max_time); "
                                 "or use horizon='steps'")
            self.timer = timers[0]
        elif self.total_steps is None:
            self.horizon = self.training_iterations(trainer, pl_module, "pass total_steps (K of progress = k / K)")
        pl_module.configure_turn_blend(self.weighting)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.time_horizon:
            self.alpha = self.alpha_from_progress(self.time_progress())
            self.weighting.set_alpha(self.alpha)
        else:
            self.weighting.set_alpha(self.alpha_at(int(pl_module.policy_version)))  # the batch about to train

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        alpha = self.alpha if self.time_horizon else self.alpha_at(self.trained_step(pl_module))
        pl_module.log("turn_blend/alpha", alpha, batch_size=1)
