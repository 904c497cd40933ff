"""``InProcessTeacher``: a frozen Hugging Face causal LM in the learner's process, on the student's device.

It provides every :class:`~lightning_opd.losses.base.TeacherSignal`. It runs the transformer once on the whole
``(B, T)`` batch and keeps the final hidden states of the ``N`` scored positions only; the LM head turns them
into logits ``chunk_size`` positions at a time, so no ``(B, T, V)`` (or ``(N, V)``) tensor is built:

* ``FULL_VOCAB``: the ``(N, D_T)`` hidden states and the head, which the loss applies chunk by chunk
  (:func:`~lightning_opd.losses.chunked.chunked_token_terms`);
* ``SAMPLED_TOKEN``: :func:`~lightning_opd.losses.chunked.chunked_sampled_logprobs` on them;
* ``TOP_K``: the top-k of each chunk's fp32 log-probs at the temperature.

The model is kept out of the LightningModule's module tree: frozen (eval mode, no grad), never checkpointed,
never sharded. Deliberate simplification: every data-parallel rank holds a full copy.
"""

from __future__ import annotations

from typing import Collection

import torch

from lightning_opd.losses.base import TeacherSignal, log_probs
from lightning_opd.losses.chunked import chunked_sampled_logprobs
from lightning_opd.models.fsdp import with_root_params
from lightning_opd.models.loading import load_causal_lm, resolve_dtype
from lightning_opd.models.logits import check_head_path, output_head, trunk_hidden_states
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.teachers.base import Teacher, TeacherScores


class InProcessTeacher(Teacher):
    """A Hugging Face teacher loaded into this process (``model.init_args.teacher``: its directory).

    Args:
        path: teacher model directory (Hugging Face causal LM sharing the student's tokenizer, F01).
        vocab_size: the shared vocabulary ``V`` (logits are cut to ``[:V]``, F01b).
        dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ...), or ``"auto"`` (default): the run's precision
            pick, handed over by :meth:`set_weights_dtype` before :meth:`load` (``OPDModule.configure_model`` does
            under ``trainer.precision: bf16-*``), ``"float32"`` when nothing was handed over.
        trust_remote_code: run modelling code shipped with the checkpoint (F15).
    """

    provides = frozenset(TeacherSignal)

    def __init__(self, path: str, vocab_size: int, dtype: str = "auto", trust_remote_code: bool = False) -> None:
        self.path = path
        self.vocab_size = int(vocab_size)
        self.dtype = dtype
        #: ``dtype`` was ``"auto"``: :meth:`set_weights_dtype` decides it
        self.follows_precision = dtype == "auto"
        self.trust_remote_code = trust_remote_code
        self.model = None  #: the frozen ``PreTrainedModel``; ``None`` until :meth:`load`
        #: ``(model, ids, mask) -> (B, T, D)`` hidden states (the learner's packed trunk when it attaches one)
        self.trunk = trunk_hidden_states

    @property
    def name(self) -> str:
        return f"{type(self).__name__}({self.path})"

    def set_weights_dtype(self, dtype: str | torch.dtype) -> None:
        """Follow the run's precision pick: the dtype to load with when ``dtype`` was left at ``"auto"`` (an explicit
        dtype stays as given). Call before :meth:`load`.

        Raises:
            RuntimeError: the model is already loaded in another dtype than the one an ``"auto"`` teacher is given.
        """
        name = str(dtype).removeprefix("torch.")
        if not self.follows_precision:
            return
        if self.model is not None and self.model.dtype != resolve_dtype(name):
            raise RuntimeError(f"teacher {self.name} is already loaded in {self.model.dtype}; set its dtype ({name}) "
                               "before load()")
        self.dtype = name

    def load(self) -> None:
        """Load the model (once), frozen, and check its head path (F20). ``dtype: auto`` never handed a dtype
        (:meth:`set_weights_dtype`) loads in float32.

        Raises:
            UnsupportedArchitectureError: a model whose log-probs the chunked head path cannot reproduce
                (:func:`~lightning_opd.models.logits.check_head_path`, naming ``model.init_args.teacher``).
        """
        if self.model is not None:
            return
        if self.dtype == "auto":
            self.dtype = "float32"
        model = load_causal_lm(self.path, self.dtype, self.trust_remote_code)
        model.eval().requires_grad_(False)
        check_head_path(model, self.vocab_size, "model.init_args.teacher")  # F20
        self.model = model

    def to(self, device: torch.device | str) -> "InProcessTeacher":
        if self.model is not None:
            self.model.to(device)
        return self

    @torch.no_grad()
    def score(self, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor, signals: Collection[TeacherSignal],
              temperature: float = 1.0, top_k: int | None = None, chunk_size: int = 256) -> TeacherScores:
        """See :meth:`Teacher.score`. One transformer pass over ``batch``; ``SAMPLED_TOKEN`` and ``TOP_K`` apply the
        head ``chunk_size`` positions at a time. ``K`` is ``min(top_k, V)``.

        Raises:
            RuntimeError: called before :meth:`load`.
            ValueError: ``TOP_K`` without ``top_k >= 1``; ``temperature <= 0`` with ``SAMPLED_TOKEN`` or ``TOP_K``.
        """
        self.check_request(signals, top_k)
        hidden = self.hidden_at(batch, rows, cols)
        return scores_from_hidden(hidden, batch.input_ids[:, 1:][rows, cols], output_head(self.model, self.vocab_size),
                                  signals, temperature, top_k, chunk_size, self.vocab_size)

    @torch.no_grad()
    def hidden_at(self, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``(N, D_T)`` final hidden states (after the last norm) at the ``N`` positions ``(rows, cols)`` of ``batch``:
        one transformer pass over the ``(B, T)`` batch (:attr:`trunk`), no gradient.

        Raises:
            RuntimeError: called before :meth:`load`.
        """
        if self.model is None:
            raise RuntimeError(f"teacher {self.name} is not loaded: call load() (OPDModule.configure_model does, "
                               "for fit) before scoring")
        model = self.model

        def hidden_states() -> torch.Tensor:  # (N, D_T)
            return self.trunk(model, batch.input_ids, batch.attention_mask)[rows, cols]

        return with_root_params(model, hidden_states)


def scores_from_hidden(hidden: torch.Tensor, targets: torch.Tensor, head, signals: Collection[TeacherSignal],
                       temperature: float, top_k: int | None, chunk_size: int, vocab_size: int) -> TeacherScores:
    """The teacher's ``signals`` from its final hidden states at the ``N`` scored positions (no gradient is built
    when ``hidden`` and ``head`` carry none; shared by the in-process and the privileged teacher).

    Args:
        hidden: ``(N, D_T)`` final hidden states (after the last norm) at the scored positions.
        targets: ``(N,)`` long, the sampled token each position predicts.
        head: ``(c, D_T) -> (c, V)`` the teacher's head cut to the shared vocabulary (F01b).
        signals, temperature, top_k, chunk_size: see :meth:`~lightning_opd.teachers.base.Teacher.score`.
        vocab_size: the shared vocabulary ``V`` (``K`` is ``min(top_k, V)``).

    Returns:
        :class:`TeacherScores` with ``signals`` (``FULL_VOCAB``: ``hidden`` and ``head`` as given).
    """
    out = TeacherScores()
    if TeacherSignal.FULL_VOCAB in signals:
        out.hidden, out.head = hidden, head
    if TeacherSignal.SAMPLED_TOKEN in signals:
        out.sampled_logprobs = chunked_sampled_logprobs(hidden, targets, head, temperature, chunk_size)
    if TeacherSignal.TOP_K in signals:
        k = min(int(top_k), vocab_size)
        parts = [log_probs(head(hidden[i:i + chunk_size]), temperature).topk(k, dim=-1)
                 for i in range(0, hidden.shape[0], chunk_size)]
        out.topk_ids = torch.cat([p.indices for p in parts]) if parts else hidden.new_zeros(0, k, dtype=torch.long)
        out.topk_logprobs = torch.cat([p.values for p in parts]) if parts else hidden.new_zeros(0, k)
    return out
