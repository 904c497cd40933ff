"""``TurnLossBlend``: TurnOPD's progressive turn-normalised loss budgeting (arXiv 2607.05804 §5.2;
docs/algorithms.md §2.4).

Vanilla OPD spends the loss budget by tokens, so the long, early turns dominate. This callback moves
each trajectory's budget from token-level (``q_t = n_t / N``) towards turn-balanced (``q_t = 1 / T``)
over training::

    α = clip((progress - s) / (e - s), 0, 1),  progress = k / K
    w_i = N q_t^blend / n_t = (1 - α) + α N / (T n_t)      for token i of turn t

per sample: ``N`` its supervised tokens, ``T`` its observed turns (turns with at least one supervised
token), ``n_t`` the supervised tokens of turn t. ``Σ_i w_i = N`` per sample, so the step's
normalisation (§0.5) is unchanged and α = 0 is exactly vanilla OPD. A micro-batch holds whole samples,
so the weights do not depend on the micro-batch size.

From the paper (as quoted): the linear schedule with s = 0, e = 1 and progress = k / K. PROPOSED in
docs/algorithms.md, not from the paper: the per-token rescaling ``w_i = N q_t / n_t`` (follows a public
re-implementation; the paper's batch aggregation is unknown), composing with other weights by
multiplication (§0.5), k = ``pl_module.policy_version`` (rollout iterations) and K = ``trainer.max_steps //
pl_module.updates_per_batch`` (``max_steps`` counts optimizer updates, several per batch with PPO epochs or
mini-batches, §3.1 note) unless ``total_steps`` is given.

Logged: ``turn_blend/alpha`` (unitless, the α the step trained with).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_opd.callbacks.step_schedule import StepSchedule
from lightning_opd.losses.weighting import BatchPlan


def blend_weights(loss_mask: torch.Tensor, turn_index: torch.Tensor, alpha: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token turn-blend weights ``(1 - α) + α N / (T n_t)``.

    Args:
        loss_mask: ``(b, L)`` 1 on supervised tokens (e.g. ``loss_mask[:, 1:]``, the target positions).
        turn_index: ``(b, L)`` zero-based turn of each token, aligned with ``loss_mask``; -1 elsewhere.
        alpha: α in [0, 1].

    Returns:
        ``(b, L)`` weights; 1 at positions that are not supervised; exactly 1 everywhere when α = 0.
    """
    sup = (loss_mask > 0) & (turn_index >= 0)
    if alpha == 0 or not bool(sup.any()):
        return torch.ones(loss_mask.shape, dtype=dtype, device=loss_mask.device)
    idx = torch.where(sup, turn_index, torch.zeros_like(turn_index)).long()  # (b, L)
    h = int(idx.max()) + 1
    counts = torch.zeros(loss_mask.shape[0], h, dtype=torch.float64, device=loss_mask.device)
    counts.scatter_add_(1, idx, sup.double())  # (b, H): n_t per sample
    n_total = counts.sum(1, keepdim=True)  # (b, 1): N
    observed = (counts > 0).sum(1, keepdim=True).double()  # (b, 1): T
    n_t = counts.gather(1, idx).clamp(min=1)  # (b, L): n_t of each token's turn
    w = (1 - alpha) + alpha * n_total / (observed.clamp(min=1) * n_t)
    return torch.where(sup, w, torch.ones_like(w)).to(dtype)


class TurnLossBlend(StepSchedule):
    """Turn-blended per-token loss weights (TurnOPD §5.2), registered as the module's ``"turn_blend"``
    weighting.

    Args:
        start: s, progress at which α leaves 0 (fraction of training).
        end: e, progress at which α reaches 1 (fraction of training).
        total_steps: K (rollout iterations); default ``trainer.max_steps // pl_module.updates_per_batch``.

    Raises:
        ValueError: ``start``/``end``/``total_steps`` out of range (named in the message); at setup, no
            ``total_steps`` and ``trainer.max_steps`` unset (-1).
        TypeError: at setup, a module without ``set_weighting``.
    """

    needs_student_logprobs = False

    def __init__(self, start: float = 0.0, end: float = 1.0, total_steps: int | None = None) -> None:
        if not 0 <= start < end:
            raise ValueError(f"start={start}, end={end}: need 0 <= start < end")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1")
        self.start, self.end, self.total_steps = start, end, total_steps
        self.horizon: int | None = total_steps  # K in use (persisted)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(start=self.start, end=self.end)

    def alpha_at(self, step: int) -> float:
        """α after ``step`` rollout iterations (a pure function of the step).

        Raises:
            RuntimeError: K is not known yet (before setup).
        """
        if self.horizon is None:
            raise RuntimeError("TurnLossBlend: K unknown before setup (pass total_steps or fit with max_steps)")
        progress = step / self.horizon
        return min(max((progress - self.start) / (self.end - self.start), 0.0), 1.0)

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not hasattr(pl_module, "set_weighting"):
            raise TypeError(f"TurnLossBlend needs an OPDModule-like module with set_weighting(), got {type(pl_module).__name__}")
        if self.total_steps is None:
            self.horizon = self.training_iterations(trainer, pl_module, "pass total_steps (K of progress = k / K)")
        pl_module.set_weighting("turn_blend", self)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.log("turn_blend/alpha", self.alpha_at(self.trained_step(pl_module)), batch_size=1)

    # ---------------------------------------------------------------------------------- the weighting
    def prepare(self, module, batch, student_logprobs: torch.Tensor | None) -> BatchPlan:
        """No per-sample decisions."""
        return BatchPlan()

    def token_weights(self, module, micro_batch, token_loss) -> torch.Tensor | None:
        """``(b, T-1)`` weights of the target positions (``loss_mask[:, 1:]``, ``turn_index[:, 1:]``) at
        α = ``alpha_at(module.policy_version)``; ``None`` (all 1, vanilla OPD) when α = 0."""
        alpha = self.alpha_at(int(module.policy_version))
        if alpha == 0:
            return None
        return blend_weights(micro_batch.loss_mask[:, 1:], micro_batch.turn_index[:, 1:], alpha, token_loss.loss.dtype)
