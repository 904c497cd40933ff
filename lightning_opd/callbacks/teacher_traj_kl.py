"""``TeacherTrajectoryKL``: the student's teacher-forced reverse KL on the teacher's own greedy trajectories
of the held-out tasks, logged at every validation.

A low-variance companion of ``val/success`` (issue: "evaluation you can trust"): the teacher plays every
held-out task of the DataModule once, greedily (cached on disk by
:func:`~lightning_opd.evaluation.teacher_kl.teacher_trajectories`, and in memory for the run), and at the
end of each validation epoch the current student is scored teacher-forced on those fixed token
sequences with :func:`~lightning_opd.evaluation.teacher_kl.trajectory_kl` (exact full-vocabulary
``KL(student || teacher)`` through ``FullVocabReverseKL``, temperature 1).

Metric glossary:

| key | unit | reduction |
|---|---|---|
| ``val/teacher_traj_kl`` | nats/token | mean over every assistant token of the teacher's trajectories |
| ``val/teacher_traj_kl/turn_NN`` | nats/token | mean over the tokens of zero-based turn NN (turns the teacher's episodes reach) |

Needs a module with ``student``, ``tokenizer``, ``teacher_path`` (and ``teacher`` when loaded) and
``vocab_size`` (``OPDModule``), and a DataModule with ``env``, ``eval_max_turns``, ``eval_sampling`` and
``max_context_tokens`` (``RolloutDataModule``). Every rank scores the same trajectories (a sharded
student's forward is a collective, so all ranks take part); the teacher is played by an HF generator
in this process, once per run.

Use: ``lightning-opd fit --config conf/textworld/opd.yaml --config conf/callbacks/teacher_traj_kl.yaml``
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_opd.evaluation.teacher_kl import TrajectoryKL, teacher_trajectories, trajectory_kl
from lightning_opd.rollout.types import Trajectory


def env_identity(env) -> dict:
    """Class path and plain-valued attributes of an environment factory (part of the cache key)."""
    init = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(env).items())
            if not k.startswith("_") and isinstance(v, (str, int, float, bool, type(None), Path))}
    return {"class_path": f"{type(env).__module__}.{type(env).__qualname__}", "init_args": init}


class TeacherTrajectoryKL(Callback):
    """Log the student's reverse KL on the teacher's greedy held-out trajectories at every validation.

    Args:
        cache_dir: directory of the trajectory cache (``None``: play the teacher once per run, no file).
        max_tasks: score only the first N held-out tasks (``None``: all).
        micro_batch_size: trajectories per forward pass.
        chunk_size: tokens per LM-head chunk.

    Raises:
        ValueError: ``max_tasks`` or ``micro_batch_size`` below 1.
    """

    def __init__(self, cache_dir: str | None = "artifacts/cache/teacher_trajectories", max_tasks: int | None = None,
                 micro_batch_size: int = 1, chunk_size: int = 256) -> None:
        if max_tasks is not None and max_tasks < 1:
            raise ValueError(f"TeacherTrajectoryKL max_tasks={max_tasks} must be >= 1 (or null: every task)")
        if micro_batch_size < 1:
            raise ValueError(f"TeacherTrajectoryKL micro_batch_size={micro_batch_size} must be >= 1")
        self.cache_dir = cache_dir
        self.max_tasks = max_tasks
        self.micro_batch_size = micro_batch_size
        self.chunk_size = chunk_size
        self._trajectories: list[Trajectory] | None = None
        self._teacher = None  # a teacher loaded here when the module has none (validate/test)
        self.last: TrajectoryKL | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a module whose teacher is not a model directory in this process (a served teacher).

        Raises:
            ValueError: ``pl_module.teacher_path`` is ``None`` (``model.init_args.teacher`` is a served teacher).
        """
        if getattr(pl_module, "teacher_path", "") is None:
            raise ValueError(
                "TeacherTrajectoryKL plays the teacher's greedy episodes and scores the full-vocabulary KL on them, "
                f"which needs the teacher's weights in this process, but model.init_args.teacher is "
                f"{pl_module.teacher.name}: remove the callback from trainer.callbacks and measure it after the "
                "fit with `lightning-opd evaluate --teacher DIR` (docs/usage.md)")

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.last = self._score(trainer, pl_module)
        self._log(pl_module, self.last)

    # ----------------------------------------------------------------------------------------- helpers
    def _teacher_model(self, pl_module):
        teacher = getattr(pl_module, "teacher_model", None)  # getattr: an SFT learner has no teacher
        if teacher is not None:
            return teacher
        if self._teacher is None:
            from lightning_opd.models.loading import load_causal_lm

            dtype = getattr(pl_module, "teacher_dtype", "float32")
            self._teacher = load_causal_lm(pl_module.teacher_path, dtype).to(pl_module.device).eval()
            self._teacher.requires_grad_(False)
        return self._teacher

    def _teacher_trajectories(self, trainer, pl_module, teacher) -> list[Trajectory]:
        if self._trajectories is None:
            from lightning_opd.evaluation.evaluate import Backends, EvalSettings, PolicyHandle

            dm = trainer.datamodule
            for attr in ("env", "eval_max_turns", "eval_sampling", "max_context_tokens"):
                if not hasattr(dm, attr):
                    raise TypeError(f"TeacherTrajectoryKL needs a RolloutDataModule-like DataModule ({attr!r} missing "
                                    f"on {type(dm).__name__})")
            tasks = dm.env.eval_tasks()[:self.max_tasks]
            settings = EvalSettings(backend="hf", avg_k=0, max_turns=dm.eval_max_turns,
                                    max_new_tokens=dm.eval_sampling.max_new_tokens,
                                    max_context_tokens=dm.max_context_tokens, device=str(pl_module.device))
            path = pl_module.teacher_path
            handle = PolicyHandle(pl_module.tokenizer, teacher, str(path))
            self._trajectories, _ = teacher_trajectories(
                lambda: Backends(settings).loop(dm.env, handle, str(path)), path, env_identity(dm.env), tasks,
                max_turns=settings.max_turns, max_new_tokens=settings.max_new_tokens,
                max_context_tokens=settings.max_context_tokens, cache_dir=self.cache_dir)
        return self._trajectories

    def _score(self, trainer, pl_module) -> TrajectoryKL:
        teacher = self._teacher_model(pl_module)
        trajs = self._teacher_trajectories(trainer, pl_module, teacher)
        tok = pl_module.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return trajectory_kl(pl_module.student, teacher, trajs, int(pl_module.vocab_size), int(pad),
                             micro_batch_size=self.micro_batch_size, chunk_size=self.chunk_size)

    @staticmethod
    def _log(pl_module, kl: TrajectoryKL) -> None:
        pl_module.log("val/teacher_traj_kl", kl.mean, batch_size=max(1, kl.tokens))
        for n, (value, tokens) in enumerate(zip(kl.per_turn, kl.tokens_per_turn)):
            pl_module.log(f"val/teacher_traj_kl/turn_{n:02d}", value, batch_size=max(1, tokens))
