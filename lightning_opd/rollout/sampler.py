"""``EpisodeSampler``: which episodes a rollout batch plays.

Task order, episode seeds, GRPO groups, this rank's slice, the turn cap and the TurnOPD probe schedule, with
their counters as plain numbers (``state_dict``), so a resumed run plays exactly the episodes an uninterrupted
one would. It plays nothing itself: :class:`~lightning_opd.rollout.session.RolloutSession` asks it for the
:class:`~lightning_opd.rollout.agent_loop.EpisodeSpec` list of each batch.

Training batch ``k`` (``k`` = the learner version it is meant for = training batches started before it) is a
full-depth probe batch when a probe schedule is set and ``k < warmup or k % interval == 0`` (TurnOPD,
docs/algorithms.md §2.5); its cap and probe flag are fixed when the batch starts and travel with every sample
(``Trajectory.rollout_cap``/``is_probe``), so a later change applies to later batches only.
"""

from __future__ import annotations

import random
from typing import Iterator

from lightning_opd.envs.base import EnvFactory
from lightning_opd.rollout.agent_loop import EpisodeSpec


class EpisodeSampler:
    """The episodes of every training batch and of the held-out pass, for one data-parallel rank.

    Args:
        env: task pool (``train_tasks()``, ``eval_tasks()``).
        episodes_per_step: this rank's episodes per training batch (a multiple of ``group_size``).
        max_turns: turn cap of non-probe training episodes (turns); controllers move it (:meth:`set_max_turns`).
        group_size: episodes per task sharing a ``group_id`` (GRPO groups; 1 = every episode its own group).
        seed: seeds the task order and every episode's sampling seed.

    Raises:
        ValueError: ``episodes_per_step``, ``max_turns`` or ``group_size`` below 1, or ``episodes_per_step`` not a
            multiple of ``group_size`` (named as ``data.init_args`` keys).
    """

    def __init__(self, env: EnvFactory, episodes_per_step: int, max_turns: int, group_size: int = 1,
                 seed: int = 0) -> None:
        for name, value in (("episodes_per_step", episodes_per_step), ("max_turns", max_turns),
                            ("group_size", group_size)):
            if value < 1:
                raise ValueError(f"data.init_args.{name}={value} must be >= 1")
        if episodes_per_step % group_size:
            raise ValueError(f"data.init_args.episodes_per_step={episodes_per_step} must be a multiple of "
                             f"data.init_args.group_size={group_size}")
        self.env = env
        self.episodes_per_step, self.max_turns, self.group_size, self.seed = (
            episodes_per_step, max_turns, group_size, seed)
        self.probe_schedule: tuple[int, int, int] | None = None  # (warmup, interval, full_depth)
        self.rank, self.world_size = 0, 1
        # counters (plain numbers: resumable)
        self.epoch = 0  # passes over the training tasks
        self.cursor = 0  # next task of this pass
        self.episodes_started = 0  # global episodes laid out (every rank counts the same)
        self.batches_started = 0  # training batches started (index of the next one)

    # ------------------------------------------------------------------------------------------ knobs
    def set_rank(self, rank: int, world_size: int) -> None:
        """Play this data-parallel rank's share: of every global batch of ``world_size * episodes_per_step``
        episodes (the same task order, seeds and group ids on every rank) rank ``r`` plays slice ``r``, and
        of the held-out tasks every ``world_size``-th from ``r``. Shards never overlap.

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.rank, self.world_size = int(rank), int(world_size)

    def set_max_turns(self, max_turns: int) -> None:
        """Turn cap for training batches started from now on (turns).

        Raises:
            ValueError: ``max_turns < 1``.
        """
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns} must be >= 1")
        self.max_turns = int(max_turns)

    def set_probe_schedule(self, warmup: int, interval: int, full_depth: int) -> None:
        """Make training batch ``k`` a probe batch when ``k < warmup or k % interval == 0``: played at
        ``full_depth`` turns with ``EpisodeSpec(is_probe=True)``; other batches use ``max_turns``.

        ``k`` counts training batches from 0 (= the learner version the batch is meant for, also in
        async mode, where the producer plays ahead). Applies to batches started from now on.

        Args:
            warmup: batches ``0 .. warmup-1`` are all probes (batches).
            interval: then every ``interval``-th batch is a probe (batches).
            full_depth: turn cap of probe batches (turns).

        Raises:
            ValueError: ``warmup < 0``, ``interval < 1`` or ``full_depth < 1``.
        """
        if warmup < 0:
            raise ValueError(f"warmup={warmup} must be >= 0")
        if interval < 1:
            raise ValueError(f"interval={interval} must be >= 1")
        if full_depth < 1:
            raise ValueError(f"full_depth={full_depth} must be >= 1")
        self.probe_schedule = (int(warmup), int(interval), int(full_depth))

    def clear_probe_schedule(self) -> None:
        """No more probe batches: every training batch runs at ``max_turns``."""
        self.probe_schedule = None

    def is_probe_batch(self, k: int) -> bool:
        """Whether training batch ``k`` is a probe batch under the current schedule."""
        if self.probe_schedule is None:
            return False
        warmup, interval, _ = self.probe_schedule
        return k < warmup or k % interval == 0

    # --------------------------------------------------------------------------------------- episodes
    def _task_order(self, epoch: int) -> list[str]:
        tasks = self.env.train_tasks()
        if not tasks:
            raise ValueError("the environment has no training tasks")
        random.Random(self.seed * 7919 + epoch).shuffle(tasks)
        return tasks

    def next_episodes(self, n: int, max_turns: int | None = None, is_probe: bool = False) -> list[EpisodeSpec]:
        """This rank's next ``n`` training episodes: tasks in a seeded order, reshuffled every pass; each
        task played ``group_size`` times with distinct episode seeds and one shared ``group_id``; capped
        at ``max_turns`` (default: the current ``self.max_turns``) and flagged ``is_probe``. With several
        ranks, the global batch of ``world_size * n`` episodes is laid out identically on every rank and
        rank ``r`` keeps slice ``r`` (whole groups: ``n`` is a multiple of ``group_size``)."""
        cap = self.max_turns if max_turns is None else int(max_turns)
        specs = []
        order = self._task_order(self.epoch)
        for _ in range(n * self.world_size // self.group_size):
            if self.cursor >= len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
                order = self._task_order(self.epoch)
            group = self.episodes_started // self.group_size
            for _ in range(self.group_size):
                seed = self.seed * 1_000_003 + self.episodes_started
                specs.append(EpisodeSpec(task_id=order[self.cursor], seed=seed, max_turns=cap,
                                         is_probe=is_probe, group_id=group))
                self.episodes_started += 1
            self.cursor += 1
        return specs[self.rank * n:(self.rank + 1) * n]

    def next_batch(self) -> list[EpisodeSpec]:
        """The episodes of the next training batch ``k`` (``batches_started``, then counted): a probe batch at the
        schedule's full depth, else at ``max_turns``, both read once so the whole batch shares them."""
        k = self.batches_started
        self.batches_started += 1
        schedule, cap = self.probe_schedule, self.max_turns  # read once: fixed for the whole batch
        probe = schedule is not None and self.is_probe_batch(k)
        return self.next_episodes(self.episodes_per_step, max_turns=schedule[2] if probe else cap, is_probe=probe)

    def eval_batches(self, max_turns: int, batch_size: int) -> Iterator[list[EpisodeSpec]]:
        """Every held-out task once (this rank's share: every ``world_size``-th task from ``rank``), ``batch_size``
        episodes at a time, episode seed ``rank + index * world_size``, capped at ``max_turns`` (turns). Every rank
        yields the same number of batches (a rank with fewer tasks gets an empty last batch), as collective
        generation needs."""
        every = self.env.eval_tasks()
        tasks = every[self.rank::self.world_size]
        most = -(-len(every) // self.world_size)  # the largest share
        for start in range(0, most, batch_size):
            yield [EpisodeSpec(task_id=t, seed=self.rank + (start + i) * self.world_size, max_turns=max_turns)
                   for i, t in enumerate(tasks[start:start + batch_size])]

    # ----------------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, int]:
        """``epoch``, ``cursor``, ``episodes_started`` (the task order and seeds; plain ints). ``batches_started``
        is saved by the session, which knows how many of them the learner took. The turn cap and probe schedule
        are not saved: they are configuration, or a controller's decision that its own state restores."""
        return {"epoch": self.epoch, "cursor": self.cursor, "episodes_started": self.episodes_started}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (missing keys: 0)."""
        self.epoch = int(state.get("epoch", 0))
        self.cursor = int(state.get("cursor", 0))
        self.episodes_started = int(state.get("episodes_started", 0))
