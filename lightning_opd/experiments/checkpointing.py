"""What the experiment runner adds to every fit: checkpoints that carry their training wall-clock, and the
final step's checkpoint when the fit stops between two checkpoint steps.

* Training seconds: Lightning's :class:`~lightning.pytorch.callbacks.Timer` (added by the runner's overlay,
  with the experiment's ``max_time`` as its ``duration`` or none) saves its elapsed training time in every
  checkpoint (``checkpoint["callbacks"]["Timer"]["time_elapsed"]["train"]``, seconds from ``on_train_start``
  to the save, model loading and evaluation after the fit excluded) and restores it on resume, so a resumed
  fit continues the count and does not get a fresh time budget.
  :func:`lightning_opd.models.checkpoints.train_seconds` reads it back (``evaluate`` records it).
* :class:`StepCheckpoint`: ``ModelCheckpoint`` every ``N`` optimizer steps that also writes
  ``step=M.ckpt`` for the last step ``M`` when the fit ends between two multiples of ``N`` (the Timer's
  budget ran out, or ``trainer.max_steps`` is not a multiple of ``N``), so the final weights are evaluated;
  with ``at_seconds`` (the experiment's ``evaluate_at_seconds``) also at the first step whose training seconds
  reach each mark, recorded in ``at_seconds.json`` (:mod:`.marks`).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from lightning.pytorch.callbacks import ModelCheckpoint, Timer

from lightning_opd.experiments.marks import check_at_seconds
from lightning_opd.files import write_text_atomic


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also saves the final step at the end of the fit and, optionally, the steps that
    reach given training seconds (module docstring).

    Takes ``ModelCheckpoint``'s arguments; meant with ``every_n_train_steps``, ``save_top_k=-1`` and
    ``enable_version_counter=False`` (a resumed fit that stops at once rewrites ``step=M.ckpt`` with the
    same weights instead of adding ``step=M-v1.ckpt``). Nothing is written when step ``M`` was saved already.

    Args:
        at_seconds: training-second marks (seconds, increasing; :func:`~.marks.check_at_seconds`). At the end of
            the first optimizer step whose training seconds (the fit's ``Timer``, a resumed count included) reach
            a mark, the step is saved (once: not again when the periodic or final save falls on it) and the mark
            recorded with that step and its seconds. The record is part of this callback's checkpoint state
            (written before the save, so the checkpoint holds it), so a fit resumed from that checkpoint or a
            later one does not save the mark again.
        marks_file: where the record is written as JSON (``at_seconds.json`` of :mod:`.marks`): at the start
            of training (rewritten from the restored state, dropping what a killed attempt recorded after its
            last checkpoint), after each mark's save and at the end of training; ``None``: not written.
        **kwargs: ``ModelCheckpoint``'s.

    Raises:
        ValueError: a bad ``at_seconds`` (the message names the value); at setup, ``at_seconds`` without a
            ``Timer`` among the trainer's callbacks.
    """

    def __init__(self, *args: Any, at_seconds: Sequence[float] | None = None, marks_file: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.at_seconds = check_at_seconds([] if at_seconds is None else at_seconds, "StepCheckpoint: ")
        self.marks_file = marks_file
        self.reached: dict[float, dict[str, float | int]] = {}  # mark -> {"step", "seconds"} (persisted)
        self.timer: Timer | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Find the fit's ``Timer`` when there are marks (raises ValueError without one)."""
        super().setup(trainer, pl_module, stage)
        if not self.at_seconds:
            return
        timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
        if not timers:
            raise ValueError("StepCheckpoint(at_seconds=...) needs a lightning.pytorch.callbacks.Timer among "
                             "trainer.callbacks (the experiment runner adds one): its training seconds decide the "
                             "marks")
        self.timer = timers[0]

    def on_train_start(self, trainer, pl_module) -> None:
        """Write the marks record from the (restored) state."""
        super().on_train_start(trainer, pl_module)
        self._write_marks(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """The periodic save, and the save of a step whose training seconds reach a mark (once per step)."""
        new = self._reach(trainer)  # recorded before any save at this step: its checkpoint holds them
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # every N steps
        if new:
            if not self._should_skip_saving_checkpoint(trainer):  # skipped when this step is saved already
                candidates = self._monitor_candidates(trainer)
                self._save_topk_checkpoint(trainer, candidates)
                self._save_last_checkpoint(trainer, candidates)
            self._write_marks(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        """Save the final step unless it is saved already; write the marks record."""
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)
        self._write_marks(trainer)

    def state_dict(self) -> dict[str, Any]:
        """``ModelCheckpoint``'s state and ``at_seconds_reached``: ``[{"mark", "step", "seconds"}]``."""
        return {**super().state_dict(),
                "at_seconds_reached": [{"mark": m, **r} for m, r in sorted(self.reached.items())]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; reached marks that this callback no longer asks for are dropped."""
        super().load_state_dict(state_dict)
        self.reached = {float(r["mark"]): {"step": int(r["step"]), "seconds": float(r["seconds"])}
                        for r in state_dict.get("at_seconds_reached", []) if float(r["mark"]) in self.at_seconds}

    def marks_record(self) -> list[dict]:
        """Every mark with the step (optimizer steps) and training seconds that reached it, ``None`` for both
        while not reached (the ``marks`` list of ``at_seconds.json``)."""
        return [{"mark": m, **self.reached.get(m, {"step": None, "seconds": None})} for m in self.at_seconds]

    def _reach(self, trainer) -> list[float]:
        """Record the marks the training seconds reached by the end of this step; returns the new ones."""
        if self.timer is None or len(self.reached) == len(self.at_seconds):
            return []
        # rank 0's clock decides on every rank (a save is collective under some strategies), as ModelCheckpoint's
        # train_time_interval does
        seconds = float(trainer.strategy.broadcast(float(self.timer.time_elapsed("train")), src=0))
        new = [m for m in self.at_seconds if m not in self.reached and seconds >= m]
        for m in new:
            self.reached[m] = {"step": int(trainer.global_step), "seconds": seconds}
        return new

    def _write_marks(self, trainer) -> None:
        if not self.at_seconds or self.marks_file is None or not trainer.is_global_zero:
            return
        write_text_atomic(self.marks_file, json.dumps({"marks": self.marks_record()}, indent=1))
