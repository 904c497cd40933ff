"""``NonFiniteGuard``: an optimizer update whose loss or gradient is not finite is skipped, counted, and after
``max_in_a_row`` such updates in a row the run stops (F28, docs/faults.md; PROPOSED, not from a paper).

Without it a NaN or inf loss (e.g. a teacher that overflows in bf16) or gradient reaches ``optimizer.step()``
and turns every weight and AdamW's moments into NaN, and the run goes on producing garbage. The decision
is taken after the backward pass and before clipping and the step, identically on every data-parallel rank
(one all-reduce of each rank's flags): a rank whose loss is NaN makes every rank skip, so the ranks' weights
never diverge. A skipped update leaves the weights, the optimizer state (moments, step count) and the LR
scheduler untouched; Lightning still counts it as an optimizer step (``global_step``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from lightning.pytorch.utilities import rank_zero_warn


class NonFiniteUpdateError(RuntimeError):
    """``max_nonfinite_steps`` optimizer updates in a row had a non-finite loss or gradient."""


def first_nonfinite_grad(named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> str | None:
    """Name of the first parameter (in ``named_parameters`` order) whose gradient holds a NaN or inf, looking at
    this rank's shard of a sharded (DTensor) gradient; ``None`` when there is none here."""
    for name, p in named_parameters:
        grad = p.grad
        if grad is None:
            continue
        grad = grad.to_local() if isinstance(grad, DTensor) else grad  # FSDP2: this rank's shard, no collective
        if not bool(torch.isfinite(grad).all()):
            return name
    return None


class NonFiniteGuard:
    """Decides whether an optimizer update may be applied and stops the run after too many non-finite ones.

    Args:
        max_in_a_row: stop after this many consecutive skipped updates (``model.init_args.max_nonfinite_steps``,
            optimizer updates, >= 1; 1 = stop at the first).

    Attributes:
        skipped: updates skipped so far in this fit (saved in checkpoints).
        in_a_row: consecutive skipped updates up to now (0 after an applied update).

    Raises:
        ValueError: ``max_in_a_row < 1``, naming ``model.init_args.max_nonfinite_steps``.
    """

    def __init__(self, max_in_a_row: int = 3) -> None:
        if int(max_in_a_row) < 1:
            raise ValueError(f"model.init_args.max_nonfinite_steps={max_in_a_row} must be >= 1 (optimizer updates in "
                             "a row with a non-finite loss or gradient before the run stops; 1: stop at the first)")
        self.max_in_a_row = int(max_in_a_row)
        self.skipped = 0
        self.in_a_row = 0
        self._streak_start: str | None = None  # where the current streak began (for the error)

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, named_parameters: Callable[[], Iterable],
              reduce_sum: Callable[[torch.Tensor], torch.Tensor], rank: int = 0, world_size: int = 1) -> str | None:
        """The first non-finite quantity of this update on any rank, or ``None`` when it may be applied.

        One all-reduce, reached by every rank: each rank sets its row of a ``(world_size, 2)`` flag tensor
        (loss not finite, gradient norm not finite), so the answer is ``None`` on every rank or on none.

        Args:
            loss: this rank's loss of the update (0-d, detached; nats).
            grad_norm: the global gradient L2 norm before clipping (0-d; the same on every rank after the
                data-parallel gradient reduction).
            named_parameters: called only when the gradient is not finite, to name the first bad parameter.
            reduce_sum: sum over data-parallel ranks.
            rank, world_size: this rank and the number of ranks.

        Returns:
            ``None``, or ``"the loss (rank(s) [..])"``, or ``"the gradient of <parameter name>"`` (on this
            rank's shard), or ``"the gradient norm (<value>)"`` when no gradient here holds a NaN/inf (another
            rank's shard, or an overflow of the norm itself).
        """
        flags = torch.zeros(world_size, 2, dtype=torch.float64, device=loss.device)
        flags[rank, 0] = float(not bool(torch.isfinite(loss)))
        flags[rank, 1] = float(not bool(torch.isfinite(grad_norm)))
        flags = reduce_sum(flags)
        if not bool(flags.any()):
            return None
        bad_loss = flags[:, 0].nonzero().flatten().tolist()
        if bad_loss:
            return f"the loss (rank(s) {bad_loss})"
        name = first_nonfinite_grad(named_parameters())
        return f"the gradient of {name}" if name is not None else f"the gradient norm ({float(grad_norm)})"

    def applied(self) -> None:
        """An update was applied: the streak of skipped ones ends."""
        self.in_a_row, self._streak_start = 0, None

    def skip(self, step: int, quantity: str) -> None:
        """Count a skipped update (``step``: ``trainer.global_step`` at it; ``quantity``: what :meth:`check` found)
        and stop the run when it is the ``max_in_a_row``-th in a row.

        Raises:
            NonFiniteUpdateError: naming the step, the quantity, where the streak began and what to check.
        """
        self.skipped += 1
        self.in_a_row += 1
        where = f"optimizer step {step} (trainer.global_step={step})"
        if self._streak_start is None:
            self._streak_start = f"{where}: {quantity}"
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteUpdateError(
                f"{where}: {quantity} is not finite; {self.in_a_row} optimizer updates in a row had a non-finite "
                f"loss or gradient (model.init_args.max_nonfinite_steps={self.max_in_a_row}), the first at "
                f"{self._streak_start}. "
                "The weights and optimizer state are those from before that update. Check the teacher's and the "
                "student's outputs at that step (dtype overflow, e.g. bf16; a checkpoint with NaN weights), lower "
                "the learning rate or set model.init_args.grad_clip_norm")
        rank_zero_warn(f"{where}: {quantity} is not finite; update skipped (weights and optimizer state unchanged), "
                       f"{self.in_a_row} in a row, {self.skipped} in this fit (model.init_args.max_nonfinite_steps="
                       f"{self.max_in_a_row} in a row stop the run)")

    def state_dict(self) -> dict[str, int]:
        """``skipped`` and ``in_a_row`` (plain integers)."""
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (missing keys: 0, a checkpoint from before F28)."""
        self.skipped = int(state.get("skipped", 0))
        self.in_a_row = int(state.get("in_a_row", 0))
