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
  budget ran out, or ``trainer.max_steps`` is not a multiple of ``N``), so the final weights are evaluated.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also saves the final step at the end of the fit (module docstring).

    Takes ``ModelCheckpoint``'s arguments; meant with ``every_n_train_steps``, ``save_top_k=-1`` and
    ``enable_version_counter=False`` (a resumed fit that stops at once rewrites ``step=M.ckpt`` with the
    same weights instead of adding ``step=M-v1.ckpt``). Nothing is written when step ``M`` was saved already.
    """

    def on_train_end(self, trainer, pl_module) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)
