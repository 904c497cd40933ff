"""``RolloutSession``: one policy playing episodes in one environment, however the episodes are used.

The one place that wires "policy -> stop ids -> generator -> agent loop" (F23, F24), and for training the
producer (sync or async, :mod:`lightning_opd.rollout.producer`) and the weight sync
(:class:`~lightning_opd.rollout.weight_sync.WeightSync`). ``RolloutDataModule`` (training and validation),
``lightning-opd evaluate`` and the teacher-trajectory KL callback all build their loops through it.

Modes (``SyncConfig``):

* ``sync``: the batch is generated when the learner asks, by exactly the weights being trained (lag 0);
* ``async``: a background producer runs up to ``producer_lead`` versions ahead of the pushed weights; the
  learner's weights are pushed to the generator at every multiple of ``weight_sync_interval`` and whenever the
  producer (re)starts (train start, resume), so batch ``k`` is sampled with weights no older than the last push
  at or before version ``k - producer_lead`` (lag at most ``max_allowed_lag = producer_lead +
  weight_sync_interval - 1``; every pair of the two knobs finishes, F18);
* ``forced_lag=k`` (with ``sync``): the generator samples with the weights of version ``max(0, v-k)`` while the
  learner is at ``v`` (deterministic staleness studies; keeps ``k+1`` CPU copies).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Iterator

from lightning.pytorch.utilities import rank_zero_info

from lightning_opd.envs.base import EnvFactory
from lightning_opd.rollout import vllm as vllm_backend
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.batch import RolloutBatch, collate_trajectories
from lightning_opd.rollout.chat import stop_token_ids
from lightning_opd.rollout.generator import Generator, SamplingParams, policy_configs
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.intervention import InterventionPolicy
from lightning_opd.rollout.producer import RolloutProducer
from lightning_opd.rollout.sampler import EpisodeSampler
from lightning_opd.rollout.types import Trajectory
from lightning_opd.rollout.weight_sync import SyncConfig, WeightSync


class RolloutSession:
    """A policy, a generator and an environment, wired once; plays episodes and training batches.

    Args:
        env: task pool and episode maker (:class:`~lightning_opd.envs.base.EnvFactory`).
        generator: the sampling backend (:func:`choose_generator` turns a config choice into one).
        max_context_tokens: context limit per episode (tokens); the loop plays under the smaller of it and the
            generator's own limit, with a warning naming both when they disagree (F24).
        max_turns: turn limit of an episode whose :class:`EpisodeSpec` sets none (turns).
        max_env_error_rate: fraction of a batch's episodes that may hit an environment error before the run
            stops (F11; 1.0: count errors, never raise).
        sync: mode, producer lead, push interval, forced lag (default: synchronous, lag 0).
        sampler: the training episodes (:class:`~lightning_opd.rollout.sampler.EpisodeSampler`); ``None`` for a
            session that only plays given episodes (evaluation).
        sampling: sampling parameters of training batches (default ``SamplingParams()``).
        intervention: who plays each turn of a training episode (teacher intervention,
            :mod:`~lightning_opd.rollout.intervention`); ``None``: the student, always. Held-out episodes never.
        teacher_generator: samples the teacher's turns; attached at :meth:`connect` to the teacher's frozen weights
            (:class:`TeacherWeights`, never pushed) with the student's stop ids. Needed with ``intervention``.

    Raises:
        ValueError: ``intervention`` without ``teacher_generator``.
    """

    def __init__(self, env: EnvFactory, generator: Generator, *, max_context_tokens: int, max_turns: int = 8,
                 max_env_error_rate: float = 0.5, sync: SyncConfig | None = None,
                 sampler: EpisodeSampler | None = None, sampling: SamplingParams | None = None,
                 intervention: InterventionPolicy | None = None, teacher_generator: Generator | None = None) -> None:
        if intervention is not None and teacher_generator is None:
            raise ValueError(f"data.init_args.intervention={type(intervention).__name__} needs "
                             "data.init_args.teacher_generator (hf: the in-process teacher's weights, or a Generator "
                             "class_path such as lightning_opd.rollout.remote.RemoteGenerator on the served teacher)")
        self.intervention, self.teacher_generator = intervention, teacher_generator
        self.env, self.generator, self.sampler = env, generator, sampler
        self.max_context_tokens, self.max_turns, self.max_env_error_rate = (
            max_context_tokens, max_turns, max_env_error_rate)
        self.sync = sync if sync is not None else SyncConfig()
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.weight_sync = WeightSync(self.sync)
        self.policy = None
        self.loop: AgentLoop | None = None
        self.producer: RolloutProducer | None = None
        self.pad_id = 0
        self.batches_taken = 0  # training batches handed to the learner
        self.restored: list[list[Trajectory]] = []  # async: batches buffered at the checkpoint, served first

    # --------------------------------------------------------------------------------------- binding
    def connect(self, policy) -> WeightSync:
        """Bind to ``policy`` (an object with ``tokenizer``, ``policy_model``, ``policy_version`` and, when weights
        are pushed (async, ``forced_lag``), ``policy_state_dict()``). Once: a second call with the same policy
        changes nothing.

        The generator stops on every EOS of the tokenizer and the policy's generation config (F23); the agent loop
        plays under the smaller of ``max_context_tokens`` and the generator's own limit (F24).

        Returns:
            the :class:`~lightning_opd.rollout.weight_sync.WeightSync` the learner reports new versions to.
        """
        if policy is self.policy and self.loop is not None:
            return self.weight_sync
        tok = policy.tokenizer
        self.policy = policy
        stop_ids = stop_token_ids(tok, policy_configs(policy)[1])
        self.generator.attach(policy, stop_ids)
        if self.teacher_generator is not None:  # frozen teacher weights, the student's stop ids (F23)
            teacher = TeacherWeights(policy)
            if isinstance(self.teacher_generator, HFGenerator) and teacher.student_path is None:
                raise ValueError("data.init_args.teacher_generator=hf samples from the in-process teacher: set "
                                 "model.init_args.teacher to a model directory, or give a Generator class_path for a "
                                 "served teacher (lightning_opd.rollout.remote.RemoteGenerator)")
            self.teacher_generator.attach(teacher, stop_ids)
        self.loop = AgentLoop(self.env, self.generator, tok, max_turns=self.max_turns,
                              max_context_tokens=self.max_context_tokens, max_env_error_rate=self.max_env_error_rate,
                              intervention=self.intervention, teacher_generator=self.teacher_generator)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.producer = RolloutProducer(self.play_batch, lambda: int(self.generator.policy_version), self.sync)
        self.producer.set_lead_in_use(self.weight_sync.lead_in_use)  # a bound set before connect
        self.weight_sync.attach(self.generator, on_version=self.producer.notify_version)
        return self.weight_sync

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the background producer, if any (never hangs: joined with ``timeout`` seconds)."""
        if self.producer is not None:
            self.producer.stop(timeout=timeout)

    def close(self, timeout: float = 30.0) -> None:
        """End the session: stop the producer (:meth:`stop`), then close the generator (:meth:`Generator.close
        <lightning_opd.rollout.generator.Generator.close>`: e.g. a served sampler's temporary weights folder is
        removed). A later batch reconnects the generator."""
        self.stop(timeout=timeout)
        self.generator.close()
        if self.teacher_generator is not None:
            self.teacher_generator.close()

    def _connected(self) -> AgentLoop:
        if self.loop is None or self.producer is None:
            raise RuntimeError("RolloutSession is not connected to a policy (RolloutDataModule.connect, called by "
                               "the module's setup in trainer.fit, binds it)")
        return self.loop

    @property
    def generator_version(self) -> int | None:
        """The policy version of the weights the generator holds (``None`` before :meth:`connect` or before the
        backend has weights)."""
        try:
            return self.generator.policy_version if self.policy is not None else None
        except Exception:  # noqa: BLE001 - a backend without weights yet
            return None

    # ---------------------------------------------------------------------------------------- playing
    def play(self, specs: list[EpisodeSpec], sampling: SamplingParams, intervene: bool = False) -> list[Trajectory]:
        """Play ``specs`` together with the generator's current weights; trajectories in order (``intervene``: the
        intervention policy may hand turns to the teacher; training batches only)."""
        return self._connected().run(specs, sampling, intervene=intervene)

    def collate(self, trajs: list[Trajectory], sampling: SamplingParams) -> RolloutBatch:
        """``trajs`` as one padded :class:`~lightning_opd.rollout.batch.RolloutBatch` (the loop's stop ids)."""
        return collate_trajectories(trajs, sampling, self.pad_id, self._connected().stop_ids)

    def play_batch(self) -> list[Trajectory]:
        """Play the sampler's next training batch with the generator's weights (runs in the producer in async
        mode; ``forced_lag``: the lagged copy is pushed first).

        Raises:
            RuntimeError: a session without a sampler, or not connected.
        """
        if self.sampler is None:
            raise RuntimeError("RolloutSession.play_batch needs an EpisodeSampler (sampler=...)")
        self.weight_sync.before_batch(int(self.policy.policy_version))
        return self.play(self.sampler.next_batch(), self.sampling, intervene=True)

    def next_batch(self) -> RolloutBatch:
        """The next training batch, collated: generated now (sync) or from the background producer (async;
        batches restored from a checkpoint first).

        Raises:
            RuntimeError: not connected to a policy.
            ProducerError: the background producer failed (cause chained).
        """
        self._connected()
        if self.sync.mode == "async" and not self.producer.running:  # after a resume: the lag gate counts from here
            version = int(self.policy.policy_version)
            self.weight_sync.before_producer_start(version, lambda: self.policy.policy_state_dict(),
                                                  self.generator_version)
            self.producer.start(first_batch_index=self.sampler.batches_started, start_version=version)
        trajs = self.restored.pop(0) if self.restored else self.producer.next_batch()
        self.batches_taken += 1
        return self.collate(trajs, self.sampling)

    def eval_batches(self, sampling: SamplingParams, max_turns: int, batch_size: int) -> Iterator[RolloutBatch]:
        """The held-out pass (:meth:`EpisodeSampler.eval_batches`), collated, played by the learner's current
        weights (pushed first in async and ``forced_lag`` modes, F29)."""
        self._connected()
        self.weight_sync.before_evaluation(int(self.policy.policy_version), lambda: self.policy.policy_state_dict())
        for specs in self.sampler.eval_batches(max_turns, batch_size):
            yield self.collate(self.play(specs, sampling), sampling)

    # ------------------------------------------------------------------------------------ controllers
    def set_lag_bound(self, lag_bound: int) -> int:
        """Producer-side control (PROPOSED, docs/algorithms.md §1.5): batches started from now on are at most
        ``lag_bound`` versions behind the learner that trains on them. Async: the producer lead becomes
        :meth:`~lightning_opd.rollout.weight_sync.SyncConfig.producer_lead_for` ``(lag_bound)``; 0 = synchronous
        generation. Sync (``forced_lag`` included) it changes nothing. ``max_allowed_lag`` is unchanged.

        Returns:
            the producer lead now in use (versions).

        Raises:
            ValueError: ``lag_bound < 0``.
        """
        lead = self.weight_sync.set_lag_bound(lag_bound)
        if self.producer is not None:
            self.producer.set_lead_in_use(lead)
        return lead

    @property
    def lead_in_use(self) -> int:
        """The producer lead in use (versions): the configured one async unless :meth:`set_lag_bound` lowered it,
        0 sync."""
        return self.weight_sync.lead_in_use

    # ----------------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """This rank's training state (plain numbers, lists, strings): the sampler's counters,
        ``train_batches`` (batches the learner took = its version), ``batches_started`` and, async,
        ``buffered_batches`` (finished batches the learner has not taken, trajectories as plain dicts with their
        policy versions), read while the producer is parked, so they agree."""
        buffered: list[list[Trajectory]] = list(self.restored)
        producer = self.producer if self.sync.mode == "async" else None
        if producer is not None:
            buffered += producer.quiesce()
        try:  # counters read while the producer is parked: consistent with the buffered batches
            own = {**self.sampler.state_dict(), "train_batches": self.batches_taken,
                   "batches_started": self.batches_taken + len(buffered)}
        finally:
            if producer is not None:
                producer.resume()
        if self.sync.mode == "async":
            own["buffered_batches"] = [[asdict(t) for t in batch] for batch in buffered]
        return own

    def load_state_dict(self, own: dict) -> None:
        """Restore :meth:`state_dict` (missing keys: 0); buffered batches are served first by :meth:`next_batch`."""
        self.sampler.load_state_dict(own)
        self.batches_taken = int(own.get("train_batches", 0))
        self.sampler.batches_started = int(own.get("batches_started", self.batches_taken))
        self.restored = [[Trajectory(**t) for t in batch] for batch in own.get("buffered_batches", [])]


class TeacherWeights:
    """The teacher's frozen weights as the policy a teacher generator is attached to (teacher intervention).

    ``policy_model`` is ``policy.teacher_model`` (the in-process teacher, once loaded), ``student_path`` the teacher's
    model directory ``policy.teacher_path`` (where a backend that starts from a directory, vLLM, reads it); the version
    is always 0 and no weights are ever pushed to it (the weight sync only knows the student's generator).
    """

    policy_version = 0
    lora = None  # a served teacher gets full-model requests (RemoteGenerator reads it)

    def __init__(self, policy) -> None:
        self._policy = policy
        self.tokenizer = policy.tokenizer
        self.trust_remote_code = bool(getattr(policy, "trust_remote_code", False))

    @property
    def policy_model(self):
        """The teacher's ``PreTrainedModel`` (``None`` until loaded, or for a teacher held elsewhere)."""
        return getattr(self._policy, "teacher_model", None)  # getattr: any policy (tests use StaticPolicy)

    @property
    def student_path(self) -> str | None:
        """The teacher's model directory (``None`` for a teacher given as a ``Teacher`` object)."""
        return getattr(self._policy, "teacher_path", None)


def choose_teacher_generator(choice: Generator | str | None) -> Generator | None:
    """The teacher's sampling backend for ``data.init_args.teacher_generator`` (teacher intervention): a ``Generator``
    (e.g. ``RemoteGenerator`` on the served teacher's ``vllm serve`` endpoints) is itself; ``"hf"`` is an
    ``HFGenerator`` on the in-process teacher's weights (``model.init_args.teacher`` a model directory); ``None``: none.

    Raises:
        ValueError: a string other than ``hf``.
    """
    if choice is None or isinstance(choice, Generator):
        return choice
    if choice != "hf":
        raise ValueError(f"data.init_args.teacher_generator={choice!r}: use hf (the in-process teacher's weights) or a "
                         "Generator class_path (e.g. lightning_opd.rollout.remote.RemoteGenerator on the served teacher)")
    return HFGenerator()


def choose_generator(choice: Generator | str | None, max_context_tokens: int) -> Generator:
    """The sampling backend for ``data.init_args.generator``.

    * a ``Generator``: itself (an explicit ``class_path`` in YAML wins), e.g. the sampler on ``vllm serve`` endpoints,
      ``{class_path: lightning_opd.rollout.remote.RemoteGenerator, init_args: {urls: [http://HOST:8002]}}``
      (:class:`~lightning_opd.rollout.remote.RemoteGenerator`: weights pushed to the servers by disk + reload);
    * ``None`` or ``"hf"``: ``HFGenerator()`` (samples from the live student; KV cache kept between turns);
    * ``"vllm"``: ``VLLMGenerator`` with the policy's dtype and ``max_model_len = max_context_tokens`` (the same
      context limit as HF's for any model with at least that many positions, F24; the engine starts at the
      first rollout; in sync mode the student's weights are pushed before every step's first reply);
    * ``"auto"``: ``"vllm"`` when vLLM imports here (:func:`~lightning_opd.rollout.vllm.vllm_importable`), else
      ``"hf"``; logs one line saying which and why.

    Both backends sample with the same :class:`~lightning_opd.rollout.generator.SamplingParams`, stop on the same
    stop ids (F23), play under the same context limit and return the sampled ids as sampled (F08).

    Raises:
        ValueError: a string other than ``auto``, ``vllm`` or ``hf``.
    """
    if choice is None or isinstance(choice, Generator):
        return choice if choice is not None else HFGenerator()
    if choice not in ("auto", "vllm", "hf"):
        raise ValueError(f"data.init_args.generator={choice!r}: use auto, vllm, hf or a Generator class_path")
    if choice == "auto":
        ok, why = vllm_backend.vllm_importable()
        choice = "vllm" if ok else "hf"
        rank_zero_info(f"data.init_args.generator=auto: sampling with {'vLLM' if ok else 'HF generate'} ({why})")
    if choice == "hf":
        return HFGenerator()
    return vllm_backend.VLLMGenerator(dtype=None, max_model_len=max_context_tokens)
