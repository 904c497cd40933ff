"""The rollout producer: plays episodes beside training and fills the :class:`RolloutBuffer`.

Modes:

* ``sync``: no background work; the learner asks for a batch inside its training step and the
  batch is generated then, by exactly the weights being trained (lag 0).
* ``async``: a background thread generates batch ``i`` (the batch the learner will consume at
  version ``i``) as soon as the weights it samples with have reached :meth:`RolloutProducer.required_version`
  ``(i)``: the version of the last weight push at or before learner version ``i - producer_lead``
  (:attr:`~lightning_opd.rollout.weight_sync.SyncConfig.producer_lead`, ``data.init_args.producer_lead``). Pushes land
  at the start version (train start, resume) and at every multiple of ``weight_sync_interval``, so that is
  ``max(start, (i - producer_lead) // weight_sync_interval * weight_sync_interval)``. Every batch is then at most
  ``producer_lead + weight_sync_interval - 1`` (``max_allowed_lag``) versions behind the learner that trains on
  it (``producer_lead`` when weights are pushed every version; measured on the weights actually used, not on
  the learner's counter, which moves before the push lands), and no pair of knobs deadlocks (F18): the learner
  waiting for batch ``v`` holds weights of version ``max(start, v // interval * interval)``, which is never below
  what batch ``v`` waits for, for any lead >= 0. The bounded buffer gives back-pressure. A controller may lower
  the lead (down to 0, synchronous generation) and raise it again up to the configured one while running
  (:meth:`RolloutProducer.set_lead_in_use`; ``RolloutDataModule.set_lag_bound``): ``producer_lead`` is the configured
  lead, ``lead_in_use`` the one in force (the gate above uses it).

Checkpoints: :meth:`RolloutProducer.quiesce` parks the thread between batches and returns every finished
batch not yet taken by the learner (the buffer, plus a batch waiting for room), so a checkpoint holds
them with their policy versions; :meth:`RolloutProducer.resume` lets the thread go on.

Errors: anything the producer raises (an engine crash, too many environment errors) is put into the
buffer and re-raised by the learner's next ``get`` with the original traceback chained; a producer
thread that died without a word is detected within ``poll_seconds``. ``stop`` ends the thread and
never hangs (the thread is a daemon, joined with a timeout).
"""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Callable

from lightning_opd.rollout.buffer import RolloutBuffer
from lightning_opd.rollout.types import Trajectory
from lightning_opd.rollout.weight_sync import SyncConfig

log = logging.getLogger(__name__)


class ProducerError(RuntimeError):
    """The background rollout producer failed; the cause is chained and its traceback quoted."""


class RolloutProducer:
    """Generates rollout batches with ``make_batch`` and hands them to the learner.

    Args:
        make_batch: plays one rollout batch with the generator's current weights.
        weights_version: returns the policy version of the weights ``make_batch`` samples with.
        config: mode, producer lead and push interval (:class:`~lightning_opd.rollout.weight_sync.SyncConfig`,
            validated there): async, the producer runs up to ``config.producer_lead`` versions ahead of the
            pushed weights, which move at the start version and at multiples of ``config.weight_sync_interval``.
        capacity: buffered batches (async; default the producer lead).
        poll_seconds: how often a waiting side re-checks stop flags and liveness (seconds).
    """

    def __init__(self, make_batch: Callable[[], list[Trajectory]], weights_version: Callable[[], int],
                 config: SyncConfig | None = None, capacity: int | None = None, poll_seconds: float = 0.2) -> None:
        config = config if config is not None else SyncConfig()
        self.make_batch = make_batch
        self.weights_version = weights_version
        self.mode = config.mode
        self.producer_lead = config.active_producer_lead  # configured (0 sync): the buffer, max_allowed_lag sized for it
        self.lead_in_use = config.active_producer_lead  # versions; lowered by set_lead_in_use: producer-side control
        self.weight_sync_interval = config.weight_sync_interval
        self.start_version = 0  # the learner's version when the thread started (pushed then)
        self.buffer = RolloutBuffer(capacity or max(1, self.producer_lead))
        self.poll_seconds = poll_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._produced = 0  # batches handed to the buffer (async)
        self._version_changed = threading.Condition()
        self._paused = threading.Event()
        self._pause_cond = threading.Condition()
        self._idle = False  # the thread is parked (paused between batches)
        self._pending: list[Trajectory] | None = None  # a finished batch waiting for room in the buffer

    # ------------------------------------------------------------------------------------- lifecycle
    def start(self, first_batch_index: int = 0, start_version: int = 0) -> None:
        """Start the background thread (async mode; no-op in sync mode or if running).

        Args:
            first_batch_index: index (= learner version it is for) of the first batch the thread makes.
            start_version: the learner's version now; the caller has pushed those weights (see
                :meth:`required_version`).
        """
        if self.mode != "async" or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._produced = first_batch_index
        self.start_version = int(start_version)
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread; waits at most ``timeout`` seconds (it is a daemon: it cannot outlive the process)."""
        self._stop.set()
        self.notify_version()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("rollout producer still finishing a batch after %.0f s; left as a daemon", timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def quiesce(self, timeout: float | None = None) -> list[list[Trajectory]]:
        """Park the background thread between batches (a batch being played is finished first) and return
        the finished batches the learner has not taken, oldest first. The thread stays parked until
        :meth:`resume`. Sync mode, or no thread: the buffer's batches.

        Raises:
            TimeoutError: the thread did not park within ``timeout`` seconds.
        """
        if self.running:
            self._paused.set()
            self.notify_version()
            with self._pause_cond:
                if not self._pause_cond.wait_for(lambda: self._idle or not self.running, timeout):
                    raise TimeoutError(f"the rollout producer did not pause within {timeout} s")
        pending = [self._pending] if self._pending is not None else []
        return self.buffer.snapshot() + pending

    def resume(self) -> None:
        """Let a quiesced producer go on."""
        with self._pause_cond:
            self._paused.clear()
            self._pause_cond.notify_all()

    def _park(self) -> None:
        """At a safe point of the thread: while paused, report idle and wait."""
        if not self._paused.is_set():
            return
        with self._pause_cond:
            self._idle = True
            self._pause_cond.notify_all()
            while self._paused.is_set() and not self._stop.is_set():
                self._pause_cond.wait(self.poll_seconds)
            self._idle = False

    def required_version(self, index: int) -> int:
        """Weights version batch ``index`` waits for: the last push at or before learner version
        ``index - lead_in_use``, i.e. ``max(start_version, (index - lead_in_use) // weight_sync_interval *
        weight_sync_interval)``."""
        interval = self.weight_sync_interval
        return max(self.start_version, (index - self.lead_in_use) // interval * interval)

    def set_lead_in_use(self, lead: int) -> None:
        """Run at most ``lead`` versions ahead of the pushed weights from now on (``0 <= lead <=`` the configured
        :attr:`producer_lead`; 0 = synchronous generation). The gate of the batch not yet started is re-read at once:
        a lower lead holds it back, a higher one lets it go (waking the thread); batches already made keep their lag.

        Raises:
            ValueError: ``lead`` outside ``[0, data.init_args.producer_lead]`` (0 sync).
        """
        if not 0 <= lead <= self.producer_lead:
            raise ValueError(f"producer lead {lead} must be in [0, data.init_args.producer_lead="
                             f"{self.producer_lead}]")
        self.lead_in_use = int(lead)
        self.notify_version()

    def notify_version(self) -> None:
        """Wake the producer: the weights' version moved."""
        with self._version_changed:
            self._version_changed.notify_all()

    # -------------------------------------------------------------------------------------- producing
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._park()
                index = self._produced
                with self._version_changed:  # at most lead_in_use + interval - 1 versions behind when consumed
                    while (not self._stop.is_set() and not self._paused.is_set()
                           and self.weights_version() < self.required_version(index)):
                        self._version_changed.wait(self.poll_seconds)
                if self._stop.is_set():
                    return
                if self._paused.is_set():
                    continue  # park before starting a batch
                batch = self._pending = self.make_batch()
                while not self._stop.is_set():
                    try:
                        self.buffer.put(batch, timeout=self.poll_seconds)
                        self._pending = None
                        break
                    except TimeoutError:
                        self._park()  # paused with a full buffer: quiesce reports the batch as pending
                self._produced += 1
        except BaseException as err:  # noqa: BLE001 - everything goes to the learner
            err.add_note("traceback in the rollout producer thread:\n" + traceback.format_exc())
            self.buffer.put_error(err)

    def next_batch(self, timeout: float | None = None) -> list[Trajectory]:
        """The next batch for the learner: generated now (sync) or taken from the buffer (async).

        Raises:
            ProducerError: the producer failed (cause chained) or died silently.
            TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        if self.mode == "sync":
            return self.make_batch()
        self.start()
        waited = 0.0
        while True:
            try:
                return self.buffer.get(timeout=self.poll_seconds)
            except TimeoutError:
                waited += self.poll_seconds
                if not self.running and len(self.buffer) == 0:
                    raise ProducerError("the rollout producer thread stopped without producing a batch") from None
                if timeout is not None and waited >= timeout:
                    raise
            except RuntimeError as err:
                cause = err.__cause__ or err
                notes = "\n".join(getattr(cause, "__notes__", []))
                raise ProducerError(f"rollout producer failed: {type(cause).__name__}: {cause}\n{notes}") from cause
