"""Training on the teacher's turns (teacher intervention, issue 64): ``model.init_args.teacher_turn_loss``.

With teacher intervention (:mod:`lightning_opd.rollout.intervention`) some turns of a training episode are played by
the teacher. Their tokens are never in ``loss_mask`` (the OPD loss, its per-turn KL curves ``kl/turn_NN``, the truncated
ratio and the on-policy checks see the student's turns only); they are marked in ``RolloutBatch.teacher_token_mask``.
By default (``kind: none``) they are not trained on at all. Otherwise the step loss gains a term over the step's
teacher tokens ``M`` (all ranks), token-mean:

* ``ce``: ``w · (1/|M|) Σ_{t∈M} −log p_S(a_t)``, cross-entropy on the teacher's sampled tokens (Guided-OPD, arXiv
  2606.15912 trains the student on its own turns; this option is PROPOSED here);
* ``forward_kl``: ``w · (1/|M|) Σ_{t∈M} Σ_v p_T(v) (log p_T(v) − log p_S(v))``, the forward KL from the teacher's full
  distribution (PivotOPD, arXiv 2609.40285, recovers with forward KL on the teacher's turns); needs a teacher that
  provides ``FULL_VOCAB`` (the in-process one), refused at construction otherwise.

Log-probs are at the batch's sampling temperature (F02), as the OPD loss's. The term is computed after each
micro-batch's OPD backward, by a second student forward on the same micro-batch (every rank and every micro-batch,
padding included, so the forwards stay collective under FSDP, F19), and backpropagated with its share
``w · Σ ℓ / |M| · world_size`` (F07: independent of micro-batching and ranks). Logged: ``train/teacher_turn_loss``
(``(1/|M|) Σ ℓ``, nats/token) and ``train/teacher_turn_tokens`` (``|M|``, tokens) per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_opd.losses.base import TeacherSignal, log_probs
from lightning_opd.losses.divergences import TokenLoss
from lightning_opd.models.fsdp import with_root_params
from lightning_opd.rollout.batch import RolloutBatch

KINDS = ("none", "ce", "forward_kl")


@dataclass
class TeacherTurnLoss:
    """What the learner does with the teacher-played turns' tokens (YAML ``model.init_args.teacher_turn_loss``).

    Attributes:
        kind: ``"none"`` (default: not trained on), ``"ce"`` (cross-entropy on the teacher's sampled tokens) or
            ``"forward_kl"`` (forward KL from the teacher's full distribution; needs an in-process teacher).
        weight: multiplier ``w`` of the term, >= 0 (the OPD loss has weight 1).
    """

    kind: str = "none"
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"model.init_args.teacher_turn_loss.kind={self.kind!r}: use one of {KINDS}")
        if self.weight < 0:
            raise ValueError(f"model.init_args.teacher_turn_loss.weight={self.weight} must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.kind != "none" and self.weight > 0


def teacher_positions(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)``, each ``(M,)``: positions whose outputs predict a teacher-sampled token (the logits at ``t``
    predict token ``t+1``); empty for a batch without teacher tokens (or built without the mask)."""
    mask = batch.teacher_token_mask
    if mask is None:
        empty = torch.zeros(0, dtype=torch.long, device=batch.input_ids.device)
        return empty, empty
    return (mask[:, 1:] > 0).nonzero(as_tuple=True)


def teacher_turn_terms(kind: str, student_logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                       teacher_logits: torch.Tensor | None = None) -> torch.Tensor:
    """``(M,)`` per-token term ``ℓ_t`` (nats): ``ce``: ``−log p_S(a_t)``; ``forward_kl``: ``Σ_v p_T (log p_T − log p_S)``.

    Args:
        kind: ``"ce"`` or ``"forward_kl"``.
        student_logits: ``(M, V)`` raw student logits (with grad).
        targets: ``(M,)`` the teacher's sampled ids.
        temperature: the batch's sampling temperature (log-probs at it, F02).
        teacher_logits: ``(M, V)`` raw teacher logits (``forward_kl`` only; detached here).
    """
    lp_s = log_probs(student_logits, temperature)
    if kind == "ce":
        return -lp_s.gather(-1, targets[:, None]).squeeze(-1)
    lp_t = log_probs(teacher_logits, temperature).detach()
    return (lp_t.exp() * (lp_t - lp_s)).sum(-1)


def check_teacher_turn_loss(config: "TeacherTurnLoss | None", teacher, module) -> TeacherTurnLoss:
    """``config`` (default ``TeacherTurnLoss()``), checked against the teacher and the module.

    Raises:
        ValueError: ``forward_kl`` with a teacher that does not provide ``FULL_VOCAB`` (a served one), or a term with a
            module whose updates are not OPD's single update (``ATODModule``).
    """
    config = config if config is not None else TeacherTurnLoss()
    if config.kind == "forward_kl" and TeacherSignal.FULL_VOCAB not in teacher.provides:
        raise ValueError(f"model.init_args.teacher_turn_loss.kind=forward_kl needs the teacher's full distribution; "
                         f"{type(teacher).__name__} does not provide it: set model.init_args.teacher to a model "
                         "directory (in-process teacher), or use kind: ce")
    if config.enabled and type(module).updates is not TeacherTurnTraining.updates:
        raise ValueError(f"model.init_args.teacher_turn_loss.kind={config.kind} is OPDModule's; {type(module).__name__} "
                         "has its own updates: use kind: none")
    return config


class TeacherTurnTraining:
    """The ``teacher_turn_loss`` term as :class:`~lightning_opd.learner.opd.OPDModule`'s ``updates``,
    ``after_micro_batch`` and ``step_extras`` hooks (a mixin: the module sets :attr:`teacher_turn_loss`)."""

    teacher_turn_loss: TeacherTurnLoss = TeacherTurnLoss()
    _teacher_turn_sums: dict[str, torch.Tensor] | None = None

    def updates(self, batch: RolloutBatch) -> list[tuple[int, RolloutBatch]]:
        """``(epoch, part)`` of every optimizer update of the step, in order. OPD: one update on the whole batch.
        With a teacher-turn term, the step's teacher tokens ``|M|`` on all ranks are counted here (one all-reduce)."""
        if self.teacher_turn_loss.enabled:
            mask = batch.teacher_token_mask
            count = mask[:, 1:].sum() if mask is not None else torch.zeros(())
            self._teacher_turn_sums = {"tokens": self.reduce_sum(count.to(self.device)),
                                       "loss": torch.zeros((), device=self.device)}
        return [(0, batch)]

    def no_teacher_turn_term(self) -> bool:
        """The step has no teacher-turn term to train on (off, or no teacher token on any rank): with no supervised
        token either, the step applies no update."""
        sums = self._teacher_turn_sums
        return not self.teacher_turn_loss.enabled or sums is None or int(sums["tokens"]) == 0

    def after_micro_batch(self, micro_batch: RolloutBatch, out: TokenLoss, keep: torch.Tensor) -> None:
        """Called after each micro-batch's backward with its per-token output and ``(b, T-1)`` supervised mask. OPD:
        the teacher-turn term's forward and backward when ``teacher_turn_loss`` is on (every micro-batch, F19)."""
        if not self.teacher_turn_loss.enabled:
            return
        sums = self._teacher_turn_sums
        terms = self.teacher_turn_forward(micro_batch)
        share = terms.sum() * self.teacher_turn_loss.weight / sums["tokens"].clamp(min=1) * self.trainer.world_size
        self.manual_backward(share)
        sums["loss"] += terms.detach().sum()

    def teacher_turn_forward(self, batch: RolloutBatch) -> torch.Tensor:
        """``(M,)`` per-token terms of ``batch``'s teacher tokens (:func:`teacher_turn_terms`), with grad: a student
        forward (and, for ``forward_kl``, the teacher's no-grad scores) at :func:`teacher_positions`."""
        rows, cols = teacher_positions(batch)
        targets = batch.input_ids[:, 1:][rows, cols]
        temperature = batch.sampling.temperature or 1.0
        teacher_logits = None
        if self.teacher_turn_loss.kind == "forward_kl":  # no teacher tokens: no teacher pass (the student's still runs)
            teacher_logits = torch.zeros(0, self.vocab_size, device=batch.input_ids.device)
            if rows.numel():
                scores = self.score_teacher(batch, rows, cols, (TeacherSignal.FULL_VOCAB,), temperature)
                teacher_logits = scores.head(scores.hidden)

        def student_side() -> torch.Tensor:
            h_s = self.hidden_states(self.student, batch)[rows, cols]  # (M, D)
            return teacher_turn_terms(self.teacher_turn_loss.kind, self.lm_head(self.student)(h_s), targets,
                                      temperature, teacher_logits)

        return with_root_params(self.student, student_side)

    def step_extras(self) -> dict[str, float]:
        """Scalars of the step beyond :mod:`~lightning_opd.learner.step_metrics`'s common set. OPD: with a teacher-turn
        term, ``train/teacher_turn_loss`` (mean term over the step's teacher tokens, all ranks; nats/token) and
        ``train/teacher_turn_tokens`` (tokens)."""
        sums = self._teacher_turn_sums
        if not self.teacher_turn_loss.enabled or sums is None:
            return {}
        tokens = float(sums["tokens"])
        return {"train/teacher_turn_loss": float(self.reduce_sum(sums["loss"])) / max(tokens, 1.0),
                "train/teacher_turn_tokens": tokens}
