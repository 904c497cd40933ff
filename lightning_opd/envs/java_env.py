"""The shared base of the adapters whose engine runs in a JVM (TextWorldExpress, ScienceWorld).

An episode (:class:`JavaEngineEpisode`) borrows one engine from its factory's
:class:`~lightning_opd.envs.java_engines.EnginePool` on its first ``reset`` and gives it back on ``close``; an error
inside an engine call discards that engine (its state is unknown). A factory (:class:`JavaEngineEnvFactory`) checks
the settings both adapters share, imports the benchmark package, owns the pool (shut down by :meth:`close`, on
garbage collection or at exit) and lists the train / held-out task ids from the package's own splits. Each adapter
keeps what differs: the world a task id names, the engine calls of an episode, what the agent sees, the reward.
"""

from __future__ import annotations

import re
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_opd.envs.base import TaskListFactory
from lightning_opd.envs.java_engines import EnginePool, check_count, check_eval_split, check_positive, launch_engine
from lightning_opd.envs.textworld_env import parse_action


def _close_engine(engine: Any) -> None:
    engine.close()


def parse_world_id(tid: str, name_pattern: str, marker: str, what: str) -> tuple[str, str, int]:
    """``(name, split, number)`` of a task id ``"<name>-<split>-<marker><number>"`` (split: train, dev or test).

    Args:
        name_pattern: regular expression of the name part (a game, a task type).
        marker: the letter before the world number (``"s"``: seed, ``"v"``: variation).
        what: ``"<benchmark> task id (<the form>)"``, for the error.

    Raises:
        KeyError: ``tid`` is not of that form.
    """
    m = re.fullmatch(rf"({name_pattern})-(train|dev|test)-{marker}(\d+)", tid)
    if m is None:
        raise KeyError(f"{tid!r} is not a {what}")
    return m.group(1), m.group(2), int(m.group(3))


class JavaEngineEpisode:
    """One episode on an engine borrowed from a pool (the :class:`~lightning_opd.envs.base.TextEnv` protocol's
    ``parse_action`` and ``close``; subclasses write ``reset`` and ``step``).

    Args:
        pool: engines to borrow one from (for the episode; given back by :meth:`close`).
        max_observation_chars: characters of observation text kept per turn.
        repeat_goal: show the goal in every user message (``False``: first message only).
    """

    def __init__(self, pool: EnginePool, max_observation_chars: int, repeat_goal: bool) -> None:
        self.pool, self.max_observation_chars, self.repeat_goal = pool, max_observation_chars, repeat_goal
        self._engine = None
        #: the task description the engine gave at reset
        self._goal = ""

    def _borrow_engine(self) -> Any:
        """The episode's engine, borrowed from the pool on the first call."""
        if self._engine is None:
            self._engine = self.pool.acquire()
        return self._engine

    def _require_engine(self) -> None:
        """Raises RuntimeError when ``step`` comes before ``reset``."""
        if self._engine is None:
            raise RuntimeError(f"{type(self).__name__}.step called before reset()")

    def _call(self, fn, *args, **kwargs):
        """Run an engine call; an error discards the engine (its state is unknown) and propagates."""
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.pool.discard(self._engine)
            self._engine = None
            raise

    @property
    def _shown_goal(self) -> str | None:
        """The goal to put in a later user message (``None`` with ``repeat_goal=False``)."""
        return self._goal if self.repeat_goal else None

    def parse_action(self, reply: str) -> str:
        """:func:`lightning_opd.envs.textworld_env.parse_action`."""
        return parse_action(reply)

    def close(self) -> None:
        """Give the engine back to the pool."""
        if self._engine is not None:
            self.pool.release(self._engine)
            self._engine = None


class JavaEngineEnvFactory(TaskListFactory):
    """Tasks of a JVM benchmark on the package's own splits, and a pool of its engines.

    Args:
        num_train: use only the first ``num_train`` train worlds (of each task type; ``None``: all).
        num_eval: use only the first ``num_eval`` held-out worlds (of each task type; ``None``: all).
        eval_split: the held-out split, ``"test"`` or ``"dev"``.
        max_observation_chars: characters of observation text kept per turn.
        repeat_goal: show the goal in every user message.
        max_heap_mb: each engine JVM's maximum heap, MiB.

    Raises:
        ValueError: an unknown ``eval_split``, a negative count, ``max_observation_chars < 1`` or
            ``max_heap_mb < 1`` (the message names the config key).
        ImportError: the benchmark package is not installed (from :meth:`_engine_constructor`).
    """

    provides_privileged_context = True

    def __init__(self, num_train: int | None, num_eval: int | None, eval_split: str, max_observation_chars: int,
                 repeat_goal: bool, max_heap_mb: int) -> None:
        check_eval_split(eval_split)
        check_count("num_train", num_train)
        check_count("num_eval", num_eval)
        check_positive("max_observation_chars", max_observation_chars, "characters of observation text per turn")
        check_positive("max_heap_mb", max_heap_mb, "MiB of JVM heap per engine")
        construct = self._engine_constructor()
        self.eval_split, self.max_observation_chars, self.repeat_goal = eval_split, max_observation_chars, repeat_goal
        self.max_heap_mb = max_heap_mb
        # the pool's callables hold no reference to the factory, so the finalizer does not keep it alive
        self.pool = EnginePool(lambda: launch_engine(construct, max_heap_mb), _close_engine)
        self._finalizer = weakref.finalize(self, self.pool.close)
        self._train: list[str] = []
        self._eval: list[str] = []

    @staticmethod
    @abstractmethod
    def _engine_constructor() -> Callable[[], Any]:
        """Import the benchmark package and return a constructor of one engine (it launches a JVM).

        Raises:
            ImportError: the package is not installed (the message says how to install it).
        """

    @contextmanager
    def _borrowed_engine(self) -> Iterator[Any]:
        """An engine from the pool for the block: given back after it, discarded when it raises."""
        engine = self.pool.acquire()
        try:
            yield engine
        except Exception:
            self.pool.discard(engine)
            raise
        self.pool.release(engine)

    def _add_tasks(self, worlds: dict[str, list[int]], task_id: Callable[[str, int], str], num_train: int | None,
                   num_eval: int | None, label: str, noun: str) -> None:
        """Append the task ids of the first ``num_train`` train and ``num_eval`` held-out worlds.

        Args:
            worlds: the package's world numbers (seeds, variations) by split name.
            task_id: ``(split, world) -> task id``.
            label, noun: name the worlds in the error, e.g. ``"TextWorldExpress coin"`` and ``"seeds"``.

        Raises:
            ValueError: train and held-out worlds overlap.
        """
        train, held_out = worlds["train"], worlds[self.eval_split]
        if set(train) & set(held_out):
            raise ValueError(f"{label}: train and {self.eval_split} {noun} overlap")
        self._train += [task_id("train", w) for w in train[:num_train]]
        self._eval += [task_id(self.eval_split, w) for w in held_out[:num_eval]]

    def privileged_context(self, task_id: str) -> str | None:
        """``"A walkthrough that wins this game: act1; act2; ..."`` (the :meth:`expert_actions`). PROPOSED,
        docs/algorithms.md §6.3.

        Raises:
            KeyError: unknown task id.
        """
        return f"A walkthrough that wins this game: {'; '.join(self.expert_actions(task_id))}"

    def close(self) -> None:
        """Shut down the factory's engine JVMs (also done when the factory is garbage-collected or Python exits)."""
        self.pool.close()
