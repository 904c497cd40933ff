"""The supervised positions of a rollout batch, per-position scores over its micro-batches (no grad) and the
micro-batch layout (:func:`micro_batch_layout`).

A position ``(row, col)`` of a ``(B, T)`` batch is supervised when ``loss_mask[row, col + 1] > 0``: the logits at
``col`` predict the sampled token ``input_ids[row, col + 1]``. ``OPDModule`` scores the student and the teacher
there, in the micro-batches every data-parallel rank agrees on (F19).
"""

from __future__ import annotations

from typing import Callable

import torch

from lightning_opd.losses.chunked import chunked_sampled_logprobs
from lightning_opd.models.fsdp import with_root_params
from lightning_opd.rollout.batch import RolloutBatch

#: ``score(micro_batch, rows, cols, temperature) -> (N,)``: a value at each of the ``N`` positions ``(rows, cols)``
PositionScore = Callable[[RolloutBatch, torch.Tensor, torch.Tensor, float], torch.Tensor]


def supervised_positions(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)``, each ``(N,)``: the positions whose outputs predict a supervised token (the
    logits at position t predict token t+1). Never empty: an all-masked micro-batch keeps position
    (0, 0), whose mask is 0, so every rank still runs a forward and backward (its loss is exactly 0, F06)."""
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    if rows.numel() == 0:
        zero = torch.zeros(1, dtype=torch.long, device=rows.device)
        return zero, zero
    return rows, cols


@torch.no_grad()
def per_position(batch: RolloutBatch, micro: list[RolloutBatch], n_real: int, score: PositionScore) -> torch.Tensor:
    """``(B, T-1)`` values of ``score`` at the supervised positions of ``batch`` (0 elsewhere), no grad.

    Args:
        batch: the ``(B, T)`` rollout batch.
        micro: its micro-batches followed by padding ones (``OPDModule.agreed_micro_batches``: the same number on
            every rank, F19); every one is scored, so collectives inside ``score`` run on every rank alike.
        n_real: how many of ``micro`` hold ``batch``'s rows (the padding ones' values are discarded).
        score: the value at each supervised position of a micro-batch, at its sampling temperature.

    Returns:
        the ``(B, T-1)`` float values; ``batch.behaviour_logprobs[:, 1:]`` (a copy) when there is no micro-batch.
    """
    parts = []
    for mb in micro:
        rows, cols = supervised_positions(mb)
        lp = score(mb, rows, cols, mb.sampling.temperature or 1.0)
        if len(parts) < n_real:  # padding rows: run for the collectives, discarded
            dense = torch.zeros(mb.size, batch.input_ids.shape[1] - 1, device=lp.device)
            parts.append(dense.index_put((rows, cols), lp.float()))
    return torch.cat(parts) if parts else batch.behaviour_logprobs[:, 1:].clone()


def sampled_token_score(model, make_head: Callable[[], Callable[[torch.Tensor], torch.Tensor]],
                        hidden_states: Callable[[object, RolloutBatch], torch.Tensor], chunk_size: int) -> PositionScore:
    """A :data:`PositionScore` giving ``model``'s log-probs of the sampled tokens (nats, at the temperature): its
    ``(B, T, D)`` ``hidden_states`` at the positions, then the head ``make_head()`` (built per micro-batch)
    ``chunk_size`` positions at a time (:func:`~lightning_opd.losses.chunked.chunked_sampled_logprobs`), with a
    sharded model's root parameters gathered (:func:`~lightning_opd.models.fsdp.with_root_params`)."""
    def score(mb: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor, temp: float) -> torch.Tensor:
        targets = mb.input_ids[:, 1:][rows, cols]
        head = make_head()

        def run() -> torch.Tensor:
            hidden = hidden_states(model, mb)[rows, cols]  # (N, D)
            return chunked_sampled_logprobs(hidden, targets, head, temp, chunk_size)

        return with_root_params(model, run)

    return score


def micro_batch_layout(micro_batch_size: int | None, micro_batch_tokens: int | None) -> tuple[int | None, int | None]:
    """``(micro_batch_size, micro_batch_tokens)`` in use: one of the two knobs (episodes per micro-batch, or a
    token budget per micro-batch), the other ``None``; neither set means 1 episode per micro-batch.

    Raises:
        ValueError: both set, or a value below 1 (naming ``model.init_args.<key>``).
    """
    if micro_batch_size is not None and micro_batch_tokens is not None:
        raise ValueError(f"model.init_args.micro_batch_size={micro_batch_size} and model.init_args.micro_batch_tokens="
                         f"{micro_batch_tokens} are both set: micro-batches are sized by episodes or by tokens; set "
                         "one and the other to null (e.g. --model.init_args.micro_batch_size=null)")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"model.init_args.micro_batch_size={micro_batch_size} must be >= 1 (episodes per micro-batch)")
    if micro_batch_tokens is not None and micro_batch_tokens < 1:
        raise ValueError(f"model.init_args.micro_batch_tokens={micro_batch_tokens} must be >= 1 (tokens per "
                         "micro-batch)")
    if micro_batch_tokens is None and micro_batch_size is None:
        micro_batch_size = 1
    return micro_batch_size, micro_batch_tokens
