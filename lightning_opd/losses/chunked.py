"""Chunked, recomputing evaluation of a divergence from hidden states (memory: no ``(B, T, V)`` tensor).

:func:`chunked_token_terms` applies both heads (a teacher that gives ``FULL_VOCAB``); :func:`chunked_signal_terms`
the student's only, beside the per-position signals a teacher reported (``SAMPLED_TOKEN``, ``TOP_K``).

For each chunk of ``c`` supervised positions the LM heads turn hidden states into ``(c, V)`` logits and
the divergence kernel reduces them to per-token values. The chunk runs under
``torch.utils.checkpoint`` (non-reentrant): autograd keeps only the chunk's ``(c, D)`` hidden states
and recomputes logits and softmax in the backward pass. Peak memory is a few ``c x V`` fp32 tensors
plus the ``(V, D)`` head gradient, independent of the number of tokens; the price is one more head
forward per chunk (benchmarks/loss_memory.py measures both).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch.utils.checkpoint import checkpoint

from lightning_opd.losses.base import TokenLoss, log_probs


class TokenKernel(Protocol):
    """What :func:`chunked_token_terms` needs of a loss: its per-token kernel on logits
    (:meth:`lightning_opd.losses.divergences.TokenDivergence.token_terms`)."""

    def token_terms(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                    temperature: float, **extras: torch.Tensor) -> TokenLoss:
        """``(c, V)`` logits and ``(c,)`` targets -> :class:`TokenLoss` with ``(c,)`` fields."""


def chunked_token_terms(divergence: TokenKernel, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                        targets: torch.Tensor, student_head: Callable[[torch.Tensor], torch.Tensor],
                        teacher_head: Callable[[torch.Tensor], torch.Tensor], temperature: float,
                        chunk_size: int, extras: dict[str, torch.Tensor | None] | None = None) -> TokenLoss:
    """Evaluate ``divergence.token_terms`` on ``chunk_size`` tokens at a time, recomputing in backward.

    Args:
        divergence: the per-token kernel.
        student_hidden: ``(N, D)`` student hidden states (differentiable).
        teacher_hidden: ``(N, D_T)`` teacher hidden states (not differentiated).
        targets: ``(N,)`` target ids.
        student_head, teacher_head: ``(c, D) -> (c, V)`` heads, cut to the shared vocabulary.
        temperature: scoring temperature (> 0).
        chunk_size: tokens per chunk (>= 1).
        extras: further ``(N,)`` per-token inputs of the kernel (e.g. the hybrid loss's advantages),
            sliced like ``targets`` and passed to ``token_terms`` as keyword arguments; ``None`` values
            are passed as ``None``.

    Returns:
        :class:`~lightning_opd.losses.base.TokenLoss` with ``(N,)`` fields.

    Raises:
        ValueError: the inputs disagree on ``N``.
    """
    n = targets.shape[0]
    if student_hidden.shape[0] != n or teacher_hidden.shape[0] != n or targets.dim() != 1:
        raise ValueError(f"expected (N, D), (N, D_T), (N,): got student {tuple(student_hidden.shape)}, "
                         f"teacher {tuple(teacher_hidden.shape)}, targets {tuple(targets.shape)}")
    extras = {k: v for k, v in (extras or {}).items() if v is not None}
    for key, value in extras.items():
        if value.shape != targets.shape:
            raise ValueError(f"extra input {key!r} has shape {tuple(value.shape)}, expected {tuple(targets.shape)}")
    keys = list(extras)
    teacher_hidden = teacher_hidden.detach()

    def chunk(h_s: torch.Tensor, h_t: torch.Tensor, tgt: torch.Tensor, *more: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            t_logits = teacher_head(h_t)
        out = divergence.token_terms(student_head(h_s), t_logits, tgt, temperature, **dict(zip(keys, more)))
        return tuple(getattr(out, f) for f in TokenLoss.FIELDS)

    needs_grad = torch.is_grad_enabled()
    parts = []
    for start in range(0, n, chunk_size):
        sl = slice(start, start + chunk_size)
        args = (student_hidden[sl], teacher_hidden[sl], targets[sl], *(extras[k][sl].detach() for k in keys))
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if needs_grad else chunk(*args))
    if not parts:  # N = 0
        empty = student_hidden.new_zeros(0, dtype=torch.float32)
        return TokenLoss(*(empty for _ in TokenLoss.FIELDS))
    return TokenLoss(*(torch.cat([p[i] for p in parts]) for i in range(len(TokenLoss.FIELDS))))


@torch.no_grad()
def chunked_sampled_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                             temperature: float, chunk_size: int) -> torch.Tensor:
    """``(N,)`` log-probs (nats, fp32) of the sampled ``targets`` under ``head`` at ``temperature``, the head
    applied ``chunk_size`` positions at a time (no ``(N, V)`` tensor beyond one chunk), without gradient.

    The same head pass as :func:`chunked_token_terms`'s student side, for the no-grad passes of the learner
    (π_old, the staleness diagnostics, T-DUR's teacher log-probs).

    Args:
        hidden: ``(N, D)`` final hidden states at the positions predicting ``targets``.
        targets: ``(N,)`` the sampled token ids.
        head: ``(c, D) -> (c, V)`` LM head (cut to the shared vocabulary).
        temperature: scoring temperature (> 0).
        chunk_size: positions per chunk (>= 1).

    Raises:
        ValueError: ``temperature <= 0``.
    """
    return torch.cat([log_probs(head(hidden[i:i + chunk_size]), temperature).gather(-1, targets[i:i + chunk_size, None])[:, 0]
                      for i in range(0, targets.shape[0], chunk_size)])


class SignalKernel(Protocol):
    """What :func:`chunked_signal_terms` needs of a loss: its per-token kernel on the student's logits and the
    teacher's reported signals (:meth:`lightning_opd.losses.divergences.TokenDivergence.signal_terms`)."""

    def signal_terms(self, student_logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                     **inputs: torch.Tensor) -> TokenLoss:
        """``(c, V)`` student logits, ``(c,)`` targets and ``(c, ...)`` teacher signals -> ``(c,)`` fields."""


def chunked_signal_terms(kernel: SignalKernel, student_hidden: torch.Tensor, targets: torch.Tensor,
                         student_head: Callable[[torch.Tensor], torch.Tensor], temperature: float, chunk_size: int,
                         inputs: dict[str, torch.Tensor | None]) -> TokenLoss:
    """Evaluate ``kernel.signal_terms`` on ``chunk_size`` tokens at a time, recomputing the student's logits in
    backward: the student side of :func:`chunked_token_terms` for a teacher that reports per-position signals (the
    sampled token's log-prob, its top-k ids and log-probs) instead of hidden states and a head. No ``(N, V)``
    tensor beyond one chunk's student logits.

    Args:
        kernel: the per-token kernel.
        student_hidden: ``(N, D)`` student hidden states (differentiable).
        targets: ``(N,)`` target ids.
        student_head: ``(c, D) -> (c, V)`` head, cut to the shared vocabulary.
        temperature: scoring temperature (> 0).
        chunk_size: tokens per chunk (>= 1).
        inputs: per-position inputs of the kernel, each ``(N, ...)`` (teacher signals: ``(N,)`` log-probs,
            ``(N, K)`` ids and log-probs; loss extras: ``(N,)``), sliced on dim 0 and passed detached as keyword
            arguments; ``None`` values are left out.

    Returns:
        :class:`~lightning_opd.losses.base.TokenLoss` with ``(N,)`` fields.

    Raises:
        ValueError: the inputs disagree on ``N``.
    """
    n = targets.shape[0]
    inputs = {k: v for k, v in inputs.items() if v is not None}
    bad = {k: tuple(v.shape) for k, v in inputs.items() if v.dim() < 1 or v.shape[0] != n}
    if student_hidden.shape[0] != n or targets.dim() != 1 or bad:
        raise ValueError(f"expected (N, D), (N,) and (N, ...) inputs: got student {tuple(student_hidden.shape)}, "
                         f"targets {tuple(targets.shape)}, inputs with another N: {bad}")
    keys = list(inputs)

    def chunk(h_s: torch.Tensor, tgt: torch.Tensor, *more: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = kernel.signal_terms(student_head(h_s), tgt, temperature, **dict(zip(keys, more)))
        return tuple(getattr(out, f) for f in TokenLoss.FIELDS)

    needs_grad = torch.is_grad_enabled()
    parts = []
    for start in range(0, n, chunk_size):
        sl = slice(start, start + chunk_size)
        args = (student_hidden[sl], targets[sl], *(inputs[k][sl].detach() for k in keys))
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if needs_grad else chunk(*args))
    if not parts:  # N = 0
        empty = student_hidden.new_zeros(0, dtype=torch.float32)
        return TokenLoss(*(empty for _ in TokenLoss.FIELDS))
    return TokenLoss(*(torch.cat([p[i] for p in parts]) for i in range(len(TokenLoss.FIELDS))))
