"""Progress display for runs that are watched through a log file, and held-out bars that count episodes.

Two Lightning progress bars (``ProgressBar`` subclasses; ``lightning-opd`` picks one when the config names
none, see :class:`lightning_opd.cli.OPDCLI`):

* :class:`StepLinePrinter`, when standard output is not a terminal (a log file, ``nohup``, SLURM): one
  plain line per optimizer step, flushed at once, e.g.::

      step 3/20 | kl 0.412 | success 0.25 | turns 5.5 | 41.2 s/step | ETA 11m54s

  (``train/kl`` in nats/token, or ``train/loss`` for SFT; ``rollout/success`` as a fraction;
  ``rollout/turns`` mean turns per episode; seconds per step averaged since the start of this fit), and
  one line per held-out evaluation: ``validation: 50/50 episodes in 63.0 s | val/success 0.92``.
* :class:`EpisodeProgressBar`, on a terminal: Lightning's tqdm bar whose validation and test bars count
  held-out episodes out of the split's size (``25/50``) instead of batches of a stream of unknown length
  (``2/--``).

Floats are printed with 3 significant digits.
"""

from __future__ import annotations

import math
from time import monotonic
from typing import Any

from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from typing_extensions import override

# (logged key, short name) shown on a step line, in order; a key the run does not log is left out
STEP_KEYS = (("train/kl", "kl"), ("rollout/success", "success"), ("rollout/turns", "turns"))
LOSS_KEY = ("train/loss", "loss")  # shown instead of train/kl when the module logs no KL (SFT)


def held_out_episodes(trainer, stage: str = "validate") -> int | None:
    """Held-out episodes this rank plays in one evaluation, or None when unknown.

    Read from a DataModule with ``env.eval_tasks()`` and ``eval_batch_size`` (``RolloutDataModule``):
    this rank's share of the tasks (``ceil(tasks / world_size)``, the largest share), capped by an integer
    ``limit_val_batches`` / ``limit_test_batches`` (batches of ``eval_batch_size`` episodes) and, in the
    sanity check, by ``num_sanity_val_steps``."""
    dm = getattr(trainer, "datamodule", None)
    env, size = getattr(dm, "env", None), getattr(dm, "eval_batch_size", None)
    if env is None or not hasattr(env, "eval_tasks") or not size:
        return None
    share = -(-len(env.eval_tasks()) // max(1, trainer.world_size))
    limit = trainer.limit_test_batches if stage == "test" else trainer.limit_val_batches
    if getattr(trainer, "sanity_checking", False):
        limit = trainer.num_sanity_val_steps
    if isinstance(limit, int):
        return min(share, limit * size)
    return share if limit == 1.0 else None


def _episodes_in(batch: Any) -> int:
    trajs = getattr(batch, "trajectories", None)
    return len(trajs) if trajs is not None else 1


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class StepLinePrinter(ProgressBar):
    """One plain line per optimizer step and per held-out evaluation (module docstring), on global rank 0.

    For logs that are not a terminal: nothing is redrawn, every line is flushed. Seconds per step are the
    wall time since the first step of this fit started (resumed fits count from the resume) divided by the
    optimizer steps done since; ETA = that times the steps left to ``max_steps``."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._t0: float | None = None
        self._first_step = 0
        self._eval_t0 = 0.0
        self._episodes = 0

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    def _out(self, text: str) -> None:
        if self._enabled and self.trainer.is_global_zero:
            print(text, flush=True)

    # ------------------------------------------------------------------------------------------ train
    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._t0, self._first_step = monotonic(), trainer.global_step

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._out(self.step_line(trainer))

    def step_line(self, trainer) -> str:
        """The line for the step just finished (module docstring)."""
        metrics = trainer.callback_metrics
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        step = trainer.global_step
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        if "train/kl" in metrics:
            keys = STEP_KEYS
        elif "train/kl_sampled" in metrics:  # a served teacher: the k1 estimate (docs/algorithms.md §6.5)
            keys = (("train/kl_sampled", "kl_sampled"), *STEP_KEYS[1:])
        else:
            keys = (LOSS_KEY, *STEP_KEYS[1:])
        parts += [f"{name} {_fmt(float(metrics[key]))}" for key, name in keys if key in metrics]
        done = step - self._first_step
        if self._t0 is not None and done > 0:
            per_step = (monotonic() - self._t0) / done
            parts.append(f"{_fmt(per_step)} s/step")
            if total:
                parts.append(f"ETA {_duration(per_step * max(0, total - step))}")
        return " | ".join(parts)

    # ------------------------------------------------------------------------------------- evaluation
    def _eval_start(self) -> None:
        self._eval_t0, self._episodes = monotonic(), 0

    def _eval_end(self, trainer, stage: str, prefix: str) -> None:
        if trainer.sanity_checking:
            return
        total = held_out_episodes(trainer, stage)
        count = f"{self._episodes}/{total}" if total is not None else str(self._episodes)
        parts = [f"{'test' if stage == 'test' else 'validation'}: {count} episodes in {monotonic() - self._eval_t0:.1f} s"]
        metrics = trainer.callback_metrics
        parts += [f"{k} {_fmt(float(metrics[k]))}" for k in (f"{prefix}/success", f"{prefix}/turns") if k in metrics]
        self._out(" | ".join(parts))

    @override
    def on_validation_start(self, trainer, pl_module) -> None:
        self._eval_start()

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._episodes += _episodes_in(batch)

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        self._eval_end(trainer, "validate", "val")

    @override
    def on_test_start(self, trainer, pl_module) -> None:
        self._eval_start()

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._episodes += _episodes_in(batch)

    @override
    def on_test_end(self, trainer, pl_module) -> None:
        self._eval_end(trainer, "test", "test")


class EpisodeProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar with held-out bars in episodes: ``25/50 episodes`` instead of ``2/--`` batches
    (the held-out dataloader is a stream whose length Lightning cannot know; the total comes from
    :func:`held_out_episodes`)."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self._episodes = 0

    def _reset_bar(self, bar, trainer, stage: str, description: str) -> None:
        total = held_out_episodes(trainer, stage)
        bar.reset(total=total if total is not None else math.inf)
        bar.unit = " episodes"
        bar.set_description(description)
        self._episodes = 0

    def _advance(self, bar, batch) -> None:
        self._episodes += _episodes_in(batch)
        bar.n = self._episodes
        bar.refresh()

    @override
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.has_dataloader_changed(dataloader_idx):
            desc = self.sanity_check_description if trainer.sanity_checking else self.validation_description
            self._reset_bar(self.val_progress_bar, trainer, "validate", desc)

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._val_progress_bar is not None:
            self._advance(self.val_progress_bar, batch)

    @override
    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.has_dataloader_changed(dataloader_idx):
            self._reset_bar(self.test_progress_bar, trainer, "test", self.test_description)

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._test_progress_bar is not None:
            self._advance(self.test_progress_bar, batch)
