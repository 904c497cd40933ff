"""The environment interface the agent loop talks to.

A ``TextEnv`` is one episode's world: ``reset`` gives the first user message, ``parse_action`` turns the
model's reply text into an action (explicitly, documented per environment), and ``step`` applies it.
An ``EnvFactory`` owns the task pool (train and held-out task ids) and makes one ``TextEnv`` per episode.
Writing a new environment means implementing these two classes; see tutorials/.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class StepResult:
    """Outcome of one environment step.

    Attributes:
        observation: the next user message shown to the agent (already formatted).
        reward: reward of this step (TextWorld: change in score, points).
        won: the task was completed (success).
        lost: the task can no longer be completed (failure).
        invalid_action: the action was empty or not allowed; the environment did not change and
            ``observation`` tells the agent so (F11). Counted by the agent loop.
    """

    observation: str
    reward: float = 0.0
    won: bool = False
    lost: bool = False
    invalid_action: bool = False

    @property
    def done(self) -> bool:
        """The episode is over on the environment's side (success or failure)."""
        return self.won or self.lost


def user_message(observation: str, options: str, goal: str | None = None) -> str:
    """One turn's user message of the game adapters: ``"Goal: <goal, whitespace collapsed>"`` (left out when
    ``goal`` is ``None``), ``"Observation: <observation>"`` and the ``options`` line, joined by newlines."""
    lines = [] if goal is None else ["Goal: " + re.sub(r"\s+", " ", goal).strip()]
    lines.append(f"Observation: {observation}")
    lines.append(options)
    return "\n".join(lines)


@runtime_checkable
class TextEnv(Protocol):
    """One episode of a text task. Implementations may raise from ``reset``/``step``: the agent loop
    catches the error, ends that episode with ``env_error=True`` and counts it (F11)."""

    def reset(self) -> str:
        """Start the episode; returns the first user message (goal + observation + options)."""

    def parse_action(self, reply: str) -> str:
        """Extract the action from the model's reply text (documented per environment)."""

    def step(self, action: str) -> StepResult:
        """Apply ``action``; an empty or invalid action must come back as an observation, not raise."""

    def close(self) -> None:
        """Release resources held by the episode."""


class EnvFactory(ABC):
    """A pool of tasks (train and held-out splits, never overlapping) and a maker of episodes."""

    #: one-line system message shown at the start of every episode (``None``: template default)
    system_prompt: str | None = None
    #: :meth:`privileged_context` gives a text for this environment's tasks (set ``True`` where it is implemented)
    provides_privileged_context: bool = False

    @abstractmethod
    def train_tasks(self) -> list[str]:
        """Task ids of the training split."""

    @abstractmethod
    def eval_tasks(self) -> list[str]:
        """Task ids of the held-out split (disjoint from ``train_tasks``)."""

    @abstractmethod
    def make(self, task_id: str) -> TextEnv:
        """A fresh episode of ``task_id``."""

    def expert_actions(self, task_id: str) -> list[str]:
        """An expert's action sequence for ``task_id`` (for the teacher recipe).

        Raises:
            NotImplementedError: the environment has no expert.
        """
        raise NotImplementedError(f"{type(self).__name__} has no expert policy")

    def privileged_context(self, task_id: str) -> str | None:
        """Privileged text about ``task_id`` that only a privileged teacher sees, never the student: e.g. a
        walkthrough that wins the game, or the gold documents and answer (PROPOSED, docs/algorithms.md §6.3; the
        self-distillation teacher of TRL's SDFT/SDPO and prime-rl's ``opsd``,
        :class:`~lightning_opd.teachers.privileged.PrivilegedTeacher`). A short plain text (a few hundred
        characters), inserted into the teacher's copy of the first prompt. An environment that implements it
        sets :attr:`provides_privileged_context` to ``True``.

        Returns:
            the text, or ``None``: this environment (or this task) has none (the default).
        """
        return None


class TaskListFactory(EnvFactory):
    """An :class:`EnvFactory` whose train and held-out task ids are two lists made at construction
    (``_train``, ``_eval``; set them, e.g. with :meth:`_keep_first`)."""

    _train: list[str]
    _eval: list[str]

    def _keep_first(self, train: list[str], evals: list[str], num_train: int | None, num_eval: int | None) -> None:
        """Keep the first ``num_train`` train and ``num_eval`` held-out task ids (``None``: all)."""
        self._train = train[:num_train] if num_train is not None else train
        self._eval = evals[:num_eval] if num_eval is not None else evals

    def train_tasks(self) -> list[str]:
        return list(self._train)

    def eval_tasks(self) -> list[str]:
        return list(self._eval)
