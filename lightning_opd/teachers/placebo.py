"""``ShuffledTeacher``: a placebo control for OPD, the real teacher's scores moved to other positions of the episode.

Source: issue 63, design 3 ("a placebo control for OPD itself"; the claim tested is that of "Does OPD really
distill?", arXiv 2608.31046). PROPOSED, docs/algorithms.md §8.1: not from a paper.

The placebo has the real teacher's weights and gives the same kind of signal, but not at the right places: for the
``N`` scored positions ``(rows, cols)`` of a request, it runs the real teacher (one transformer pass, as
:class:`~lightning_opd.teachers.in_process.InProcessTeacher`), then draws one permutation ``π_r`` of the scored
positions of each batch row ``r`` (one row = one episode) and hands position ``i`` of row ``r`` the teacher's
distribution at position ``π_r(i)`` of the same row::

    p_placebo(· | s_i) := p_T(· | s_{π_r(i)})

The permutation is applied to the teacher's final hidden states *before* any signal is computed, so every signal is
the one of that moved distribution: ``FULL_VOCAB`` (hidden states + head), ``TOP_K`` (its top-k) and
``SAMPLED_TOKEN``, which is ``log p_T(a_i | s_{π_r(i)})``, the log-prob of the token sampled AT position ``i`` under
the moved distribution (not the already-gathered ``log p_T(a_{π_r(i)} | s_{π_r(i)})``), so the full-vocabulary and the
sampled-token losses see one and the same placebo distribution.

What it keeps: the marginal distribution of the teacher's per-position distributions within each episode (the same
multiset of distributions: their entropies, how peaked they are, which tokens they favour), so the loss starts away
from 0 and stays on the scale of the real teacher's (the untrained student would not: it equals the student). What it
removes: their alignment with the states (a distribution answers another prefix of the episode), i.e. the task
knowledge the teacher's scores carry about *this* state.

Deliberate simplifications:

1. A uniformly random permutation, not a derangement: a row with ``n`` scored positions keeps on average one position
   in place (a share ``1/n`` of its tokens; the demo's episodes have tens of supervised tokens). A row with one scored
   position is left as is.
2. Each :meth:`ShuffledTeacher.score` call draws new permutations (one generator, seeded, advanced by ``N`` uniform
   draws per call): a module that scores the same positions twice in a step (``ATODModule``'s T-DUR weights, then its
   loss; the teacher-turn term of ``teacher_turn_loss``) sees two different placebos there. ``OPDModule`` scores each
   micro-batch once per step.
3. Several data-parallel ranks each hold their own generator, seeded alike; a checkpoint keeps rank 0's
   (``OPDModule.on_save_checkpoint``), so a resumed one-rank run continues exactly and a multi-rank one continues rank
   0's stream on every rank (still a placebo, not bit-identical to the uninterrupted run on the other ranks).
"""

from __future__ import annotations

from typing import Collection

import torch

from lightning_opd.losses.base import TeacherSignal
from lightning_opd.models.loading import load_tokenizer
from lightning_opd.models.logits import output_head
from lightning_opd.models.tokenizers import check_tokenizers_compatible
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.teachers.base import TeacherScores
from lightning_opd.teachers.in_process import InProcessTeacher, scores_from_hidden


def within_row_permutation(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random permutation of the ``N`` scored positions that maps each position to one of the same row.

    One uniform key per position (``N`` draws from ``generator``, a CPU generator); within each row the positions,
    taken in their order, receive the row's positions sorted by key.

    Args:
        rows: ``(N,)`` long, the batch row (episode) of each scored position, any order.
        generator: the CPU ``torch.Generator`` drawn from (advanced by ``N`` draws; none for ``N = 0``).

    Returns:
        ``(N,)`` long on ``rows``' device, ``perm``: position ``i`` takes the values of position ``perm[i]``;
        ``rows[perm] == rows``, and ``perm`` restricted to a row is a permutation of that row's positions.
    """
    r = rows.detach().to("cpu", torch.long)
    keys = torch.rand(r.shape[0], generator=generator)  # (N,)
    by_row = torch.sort(r, stable=True).indices  # (N,) positions grouped by row, each row in its own order
    by_key = torch.argsort(keys, stable=True)  # (N,)
    by_row_then_key = by_key[torch.sort(r[by_key], stable=True).indices]  # grouped by row, each row by key
    perm = torch.empty_like(r)
    perm[by_row] = by_row_then_key  # groups of equal size in the same row order: a row maps onto itself
    return perm.to(rows.device)


class ShuffledTeacher(InProcessTeacher):
    """The placebo teacher: the in-process teacher's scores, permuted across the scored positions of each episode.

    PROPOSED, docs/algorithms.md §8.1 (issue 63, design 3; "Does OPD really distill?", arXiv 2608.31046); see the
    module docstring for what it keeps and removes. A subclass of
    :class:`~lightning_opd.teachers.in_process.InProcessTeacher`: loaded, frozen, precision-following and packed like it
    (``OPDModule``'s checks on the in-process teacher apply), and it provides every signal.

    Configured as a class (``model.init_args.teacher: {class_path: lightning_opd.teachers.ShuffledTeacher, init_args:
    {path: DIR}}``, conf/model/teacher_shuffled.yaml); the module then calls :meth:`bind`, which checks the teacher's
    tokenizer against the student's (F01) and sets ``V``.

    Args:
        path: the real teacher's model directory (Hugging Face causal LM sharing the student's tokenizer, F01).
        seed: seed of the permutations' generator (one stream for the whole fit; saved in checkpoints).
        vocab_size: the shared vocabulary ``V``; ``None`` (default): set by :meth:`bind` from the student's tokenizer.
        dtype, trust_remote_code: see :class:`~lightning_opd.teachers.in_process.InProcessTeacher` (``model.init_args.
            teacher_dtype`` is not handed to a teacher given as a class: set ``dtype`` here).

    Raises:
        ValueError: ``seed`` negative or ``vocab_size < 1``.
    """

    def __init__(self, path: str, seed: int = 0, vocab_size: int | None = None, dtype: str = "auto",
                 trust_remote_code: bool = False) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"ShuffledTeacher seed={seed!r} must be an integer >= 0 (model.init_args.teacher."
                             "init_args.seed)")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"ShuffledTeacher vocab_size={vocab_size} must be >= 1, or null (set from the student's "
                             "tokenizer)")
        super().__init__(path, 0 if vocab_size is None else vocab_size, dtype, trust_remote_code)
        self.vocab_size: int | None = vocab_size  # type: ignore[assignment]  # None until bind()
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)  #: CPU; advanced by N draws per score() call
        self.calls = 0  #: score() calls so far (saved with the generator)
        #: ``(N,)`` the permutation of the last :meth:`score` call (position ``i`` got the scores of ``perm[i]``)
        self.last_permutation: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return f"{type(self).__name__}({self.path}, seed={self.seed})"

    def bind(self, tokenizer, vocab_size: int) -> None:
        """Check the teacher's tokenizer against the student's (F01, as ``OPDModule`` does for a teacher directory) and
        take ``V`` from it.

        Raises:
            TokenizerMismatchError: the two tokenizers differ (naming both).
            ValueError: a ``vocab_size`` given at construction that is not the shared vocabulary's.
        """
        shared = check_tokenizers_compatible(tokenizer, load_tokenizer(self.path, self.trust_remote_code),
                                             str(getattr(tokenizer, "name_or_path", "") or "student"), self.path)
        if self.vocab_size is not None and self.vocab_size != shared:
            raise ValueError(f"ShuffledTeacher vocab_size={self.vocab_size}, but the student's and the teacher's "
                             f"shared vocabulary has {shared} ids: leave vocab_size unset")
        self.vocab_size = shared

    def load(self) -> None:
        """:meth:`InProcessTeacher.load`, once ``V`` is known.

        Raises:
            RuntimeError: ``V`` unknown (no ``vocab_size`` given and :meth:`bind` not called).
        """
        if self.vocab_size is None:
            raise RuntimeError(f"teacher {self.name}: the shared vocabulary size is unknown; give vocab_size or call "
                               "bind(tokenizer, V) first (OPDModule does at construction)")
        super().load()

    @torch.no_grad()
    def score(self, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor, signals: Collection[TeacherSignal],
              temperature: float = 1.0, top_k: int | None = None, chunk_size: int = 256) -> TeacherScores:
        """See :meth:`~lightning_opd.teachers.base.Teacher.score`: the real teacher's ``(N, D_T)`` hidden states at
        ``(rows, cols)``, permuted within rows (:func:`within_row_permutation`, one draw per call, kept in
        :attr:`last_permutation`), then every signal from them at the unpermuted targets ``a_i``.

        Raises:
            RuntimeError: called before :meth:`load`.
            ValueError: ``TOP_K`` without ``top_k >= 1``; ``temperature <= 0`` with ``SAMPLED_TOKEN`` or ``TOP_K``.
        """
        self.check_request(signals, top_k)
        hidden = self.hidden_at(batch, rows, cols)  # (N, D_T)
        perm = within_row_permutation(rows, self.generator).to(hidden.device)  # (N,)
        self.calls += 1
        self.last_permutation = perm
        targets = batch.input_ids[:, 1:][rows, cols]  # (N,) the tokens sampled at each position, not moved
        return scores_from_hidden(hidden[perm], targets, output_head(self.model, self.vocab_size), signals,
                                  temperature, top_k, chunk_size, self.vocab_size)

    def state_dict(self) -> dict:
        """``{"seed", "calls", "generator"}``: the seed, the calls so far and the generator's state (a uint8 tensor),
        so that a resumed run draws the permutations the uninterrupted one would have drawn."""
        return {"seed": self.seed, "calls": self.calls, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: the checkpoint's seed is not this teacher's (``model.init_args.teacher.init_args.seed``).
        """
        if int(state["seed"]) != self.seed:
            raise ValueError(f"the checkpoint's ShuffledTeacher ran with seed={state['seed']}, this one has "
                             f"seed={self.seed}: resume with model.init_args.teacher.init_args.seed={state['seed']}, "
                             "or start a new run")
        self.generator.set_state(state["generator"].to("cpu", torch.uint8))
        self.calls = int(state["calls"])
