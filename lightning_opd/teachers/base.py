"""The teacher seam: what scores the student's tokens, whatever holds the teacher's weights.

A teacher gets a batch of token sequences (a :class:`~lightning_opd.rollout.batch.RolloutBatch`, the student's
own ids, no re-tokenisation) and the ``N`` positions to score, ``(rows, cols)``: position ``(rows[i], cols[i])``
predicts the token ``input_ids[rows[i], cols[i] + 1]``, the sampled token ``a_i``. It returns
:class:`TeacherScores`: per position, the signals a loss asked for (:class:`~lightning_opd.losses.base.TeacherSignal`:
the sampled token's log-prob, the teacher's top-k, or the full vocabulary). Each loss class names the one it
needs (``teacher_signal``), each teacher the ones it ``provides``; :func:`check_teacher_fits` refuses a pair that
does not fit, naming both and the losses that would work.

Implementations: :class:`~lightning_opd.teachers.in_process.InProcessTeacher` (a Hugging Face model in the
learner's process: all three signals), :class:`~lightning_opd.teachers.privileged.PrivilegedTeacher` (the
student's own weights shown the environment's privileged context: other token positions, the same sampled tokens),
:class:`~lightning_opd.teachers.placebo.ShuffledTeacher` (a placebo control: the in-process teacher's scores permuted
across the scored positions of each episode, PROPOSED). A teacher that scores elsewhere (a ``vllm serve`` endpoint) or on its own view of the episode subclasses
:class:`Teacher`: it owns how it gets the numbers, and returns them at the student's positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Collection

import torch

from lightning_opd.losses.base import TeacherSignal
from lightning_opd.rollout.batch import RolloutBatch


@dataclass
class TeacherScores:
    """The teacher's signals at ``N`` scored positions (fields not asked for, or not provided, are ``None``).

    Log-probs are fp32 nats at the temperature the teacher was asked to score at (F02: the batch's sampling
    temperature), the same as the loss assumes.

    Attributes:
        sampled_logprobs: ``(N,)`` ``log p_T(a_i)`` of the sampled tokens (``SAMPLED_TOKEN``).
        topk_ids: ``(N, K)`` long, the teacher's ``K`` most likely ids, most likely first (``TOP_K``).
        topk_logprobs: ``(N, K)`` their log-probs (``TOP_K``).
        hidden: ``(N, D_T)`` teacher final hidden states, no grad (``FULL_VOCAB``, with ``head``).
        head: ``(c, D_T) -> (c, V)`` the teacher's logits over the shared vocabulary (F01b), raw: the loss upcasts
            to fp32 and applies the temperature (F05), ``c`` positions at a time, so no ``(N, V)`` tensor is built
            beyond one chunk (``FULL_VOCAB``, with ``hidden``).
    """

    sampled_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def signals(self) -> frozenset[TeacherSignal]:
        """The signals these scores hold."""
        present = {TeacherSignal.SAMPLED_TOKEN: self.sampled_logprobs is not None,
                   TeacherSignal.TOP_K: self.topk_ids is not None and self.topk_logprobs is not None,
                   TeacherSignal.FULL_VOCAB: self.hidden is not None and self.head is not None}
        return frozenset(s for s, ok in present.items() if ok)


class Teacher:
    """Base class of the teachers: scores token sequences at the positions a loss supervises.

    Attributes:
        provides: the :class:`~lightning_opd.losses.base.TeacherSignal` values :meth:`score` can return
            (class attribute; every teacher should provide ``SAMPLED_TOKEN``, what ``TokenLoss.teacher_logprobs``
            and ATOD's T-DUR read).
    """

    provides: ClassVar[frozenset[TeacherSignal]] = frozenset()

    @property
    def name(self) -> str:
        """How messages name this teacher (its class and what it scores with)."""
        return type(self).__name__

    def bind(self, tokenizer, vocab_size: int) -> None:
        """The student's tokenizer and the shared vocabulary size ``V``, given by the module before :meth:`load`
        (a teacher that checks the student's tokenizer against its own at :meth:`load` keeps them). Default:
        nothing."""

    def load(self) -> None:
        """Get ready to score (load weights, connect), once before fit. Default: nothing."""

    def to(self, device: torch.device | str) -> "Teacher":
        """Move what scores in this process to ``device`` (the student's). Default: nothing."""
        return self

    def attach_student(self, student) -> None:
        """The student ``PreTrainedModel`` the module trains, given by ``OPDModule.configure_model`` after it is
        loaded (a teacher scoring with the student's own weights keeps it or copies it). Default: nothing."""

    def attach_envs(self, envs) -> None:
        """The :class:`~lightning_opd.envs.base.EnvFactory` the rollouts come from, given by ``OPDModule`` at
        setup (a teacher that reads what the environment gives, e.g. privileged context, keeps it and may refuse
        an environment). Default: nothing."""

    def on_optimizer_step(self) -> None:
        """Called by ``OPDModule`` right after each optimizer step that changed the student's weights (not after a
        skipped update), e.g. to update an EMA copy. Default: nothing."""

    def close(self) -> None:
        """Stop what this teacher runs beside the fit (heartbeats, request threads, weight pushers); called by
        ``OPDModule.teardown``. Default: nothing."""

    @property
    def stats(self) -> dict[str, float]:
        """Running totals this teacher keeps on this rank (e.g. a served teacher's requests, tokens, seconds), logged
        every step as ``teacher/<key>``; a teacher may start a new window when it is read (read once per step).
        Default: none (``{}``)."""
        return {}

    def observe_kl(self, batch: RolloutBatch, kl: torch.Tensor, keep: torch.Tensor) -> None:
        """The per-token KL of one (real, not padding) micro-batch of the step, after its backward: ``kl`` ``(b, T-1)``
        (nats) and ``keep`` ``(b, T-1)`` bool, the supervised positions of ``batch``'s rows (a teacher that routes rows
        to several teachers keeps per-teacher sums for :meth:`step_metrics`). Default: nothing."""

    def step_metrics(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor], kl_name: str,
                     device: torch.device | str) -> dict[str, float]:
        """The teacher's scalars of the step, called once per step on every rank (a collective where a teacher
        reduces its sums with ``reduce_sum``, the sum over data-parallel ranks): by default :attr:`stats` as
        ``teacher/<key>`` (this rank's). ``kl_name`` is the KL's metric name (``kl`` or ``kl_sampled``); ``device``
        the one of the tensors to reduce."""
        return {f"teacher/{k}": float(v) for k, v in self.stats.items()}

    def state_dict(self) -> dict:
        """What a resumed run needs to continue this teacher exactly (saved in the checkpoint by ``OPDModule``, e.g.
        an EMA copy's weights). Default: nothing (``{}``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (at checkpoint load, after :meth:`attach_student`). Default: nothing."""

    def score(self, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor, signals: Collection[TeacherSignal],
              temperature: float = 1.0, top_k: int | None = None, chunk_size: int = 256) -> TeacherScores:
        """The teacher's ``signals`` at the positions ``(rows, cols)`` of ``batch``; no gradient.

        Args:
            batch: ``(B, T)`` token sequences (``input_ids``, ``attention_mask``) and what the episodes carry.
            rows, cols: ``(N,)`` long each: position ``(rows[i], cols[i])`` predicts ``input_ids[rows[i], cols[i]
                + 1]``.
            signals: what to return (each in :attr:`provides`).
            temperature: scoring temperature (> 0), the batch's sampling temperature.
            top_k: ``K`` of ``TOP_K`` (>= 1; required with it).
            chunk_size: positions per LM-head chunk, for a teacher that applies a head here.

        Returns:
            :class:`TeacherScores` holding at least ``signals``.

        Raises:
            ValueError: a signal not in :attr:`provides`, or ``TOP_K`` without ``top_k >= 1``.
        """
        raise NotImplementedError

    def check_request(self, signals: Collection[TeacherSignal], top_k: int | None) -> None:
        """Refuse a :meth:`score` request this teacher cannot answer (for implementations).

        Raises:
            ValueError: a signal not in :attr:`provides`, or ``TOP_K`` without ``top_k >= 1``.
        """
        missing = sorted(s.value for s in set(signals) - self.provides)
        if missing:
            raise ValueError(f"teacher {self.name} was asked for {missing} but provides only "
                             f"{sorted(s.value for s in self.provides)}")
        if TeacherSignal.TOP_K in signals and (top_k is None or top_k < 1):
            raise ValueError(f"teacher {self.name}: top_k={top_k} must be >= 1 to score the teacher's top-k")


def losses_for(provides: Collection[TeacherSignal]) -> list[str]:
    """Names of the loss classes of :mod:`lightning_opd.losses` whose ``teacher_signal`` is in ``provides``."""
    from lightning_opd import losses

    classes = [getattr(losses, n) for n in losses.__all__]
    return [c.__name__ for c in classes if isinstance(c, type) and issubclass(c, losses.TokenDivergence)
            and c is not losses.TokenDivergence and c.teacher_signal in provides]


def check_teacher_fits(loss, teacher: Teacher) -> None:
    """Refuse a loss that needs more of the teacher than the teacher provides (at construction of the module).

    Args:
        loss: a :class:`~lightning_opd.losses.divergences.TokenDivergence` (its ``teacher_signal``).
        teacher: the :class:`Teacher` (its ``provides``).

    Raises:
        ValueError: naming the loss class, what it needs, the teacher and what it provides, and the losses that
            work with that teacher.
    """
    need = loss.teacher_signal
    if need in teacher.provides:
        return
    raise ValueError(
        f"model.init_args.loss={type(loss).__name__} needs the teacher's {need.value} log-probs, but teacher "
        f"{teacher.name} provides only {sorted(s.value for s in teacher.provides)}: use one of "
        f"{', '.join(losses_for(teacher.provides)) or '(no loss)'} with this teacher, or a teacher that provides "
        f"{need.value} (the in-process teacher provides all)")


def check_teacher_serves(loss, teacher: Teacher) -> None:
    """Refuse a loss/teacher pair the learner cannot train with (at construction of the module, when both are known):
    :func:`check_teacher_fits`, and a teacher that provides ``SAMPLED_TOKEN`` when it lacks ``FULL_VOCAB`` (every loss
    then reads ``log p_T(a_t)`` for ``teacher_logprobs`` and its ``kl``).

    Raises:
        ValueError: see :func:`check_teacher_fits`; a teacher without ``full_vocab`` nor ``sampled_token``, naming it,
            what it provides and the loss.
    """
    check_teacher_fits(loss, teacher)
    if TeacherSignal.FULL_VOCAB not in teacher.provides and TeacherSignal.SAMPLED_TOKEN not in teacher.provides:
        raise ValueError(
            f"teacher {teacher.name} provides only {sorted(s.value for s in teacher.provides)}: a teacher without "
            f"full_vocab must also provide sampled_token (the log-prob of the sampled token, which "
            f"{type(loss).__name__} logs and estimates the KL with)")
