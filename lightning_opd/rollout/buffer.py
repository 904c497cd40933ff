"""A bounded buffer of rollout batches (lists of :class:`~lightning_opd.rollout.types.Trajectory`, whose turns
carry the policy versions that produced them).

The asynchronous :class:`~lightning_opd.rollout.producer.RolloutProducer` fills it from its background thread
and the learner takes batches from it (``data.init_args.mode=async``); the bound (the producer lead, at least
one batch) gives back-pressure. Synchronous generation does not use it: each batch is generated inside the
training step. ``get`` re-raises an error put by the producer, so a crash surfaces in the trainer instead of
hanging it.
"""

from __future__ import annotations

import threading
from collections import deque

from lightning_opd.rollout.types import Trajectory


class RolloutBuffer:
    """Thread-safe bounded FIFO of rollout batches (lists of :class:`Trajectory`).

    Args:
        capacity: maximum number of batches held; ``put`` blocks when full (back-pressure).

    Raises:
        ValueError: ``capacity < 1``.
    """

    def __init__(self, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity = capacity
        self._items: deque[list[Trajectory]] = deque()
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, batch: list[Trajectory], timeout: float | None = None) -> None:
        """Append a batch, waiting while the buffer is full.

        Raises:
            TimeoutError: still full after ``timeout`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._items) < self.capacity, timeout):
                raise TimeoutError(f"rollout buffer still full ({self.capacity} batches) after {timeout} s")
            self._items.append(batch)
            self._cond.notify_all()

    def put_error(self, error: BaseException) -> None:
        """Record a producer failure; the next ``get`` raises it."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> list[Trajectory]:
        """Pop the oldest batch, waiting until one is there.

        Raises:
            RuntimeError: the producer failed (chained to its exception).
            TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self._error is not None, timeout):
                raise TimeoutError(f"no rollout batch arrived within {timeout} s")
            if self._error is not None and not self._items:
                raise RuntimeError("the rollout producer failed") from self._error
            batch = self._items.popleft()
            self._cond.notify_all()
            return batch

    def snapshot(self) -> list[list[Trajectory]]:
        """The buffered batches, oldest first (a shallow copy; the buffer is unchanged)."""
        with self._cond:
            return list(self._items)
