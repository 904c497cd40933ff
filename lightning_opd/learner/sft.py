"""``SFTModule``: the teacher recipe, supervised fine-tuning on expert trajectories.

A task-specialised teacher is the student's base model fine-tuned on expert walkthroughs rendered by
the *same* agent loop and chat template the student will later play with
(:class:`lightning_opd.data.expert.ExpertDataModule`). The loss is token-mean cross-entropy on the
expert's reply tokens (observation tokens masked, F04), with the common aggregation (§0.5).
Run: ``lightning-opd fit --config conf/textworld/teacher_sft.yaml`` (exports to ``model.export_dir``).

With ``lora_rank`` set, only a LoRA adapter (peft) is trained; at the end it is saved on its own to
``adapter_dir`` (small enough to commit) and merged into the exported model. ``lightning-opd
merge-adapter`` rebuilds the merged teacher from a committed adapter.

F28 (docs/faults.md): an optimizer update whose loss or gradient is not finite on any rank is skipped (weights, the
optimizer state and the LR scheduler untouched) and counted (``train/nonfinite_steps_skipped``);
``max_nonfinite_steps`` of them in a row stop the run (:meth:`SFTModule.optimizer_step`).

Metrics (``train/``, logged every step): ``loss`` (nats/token, over all ranks' reply tokens), ``supervised_tokens``
(reply tokens of the step, all ranks), ``nonfinite_steps_skipped`` (optimizer updates skipped so far in this fit,
resumed runs included, F28).
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.losses.aggregation import aggregate_token_loss
from lightning_opd.losses.divergences import log_probs
from lightning_opd.metrics.rank_stats import Mean, Sum, all_ranks
from lightning_opd.models.loading import save_adapter_atomic
from lightning_opd.models.lora import LoRAConfig
from lightning_opd.learner.policy import PolicyModule


class SFTModule(PolicyModule):
    """Supervised fine-tuning of a policy on (expert) trajectories.

    Args:
        student: model directory to fine-tune.
        optimizer: optimizer factory (default AdamW, lr 3e-5).
        lr_scheduler: optional scheduler factory, stepped per optimizer step.
        lora_rank: train a LoRA adapter of this rank on every linear layer instead of all weights
            (``None``: full fine-tuning).
        lora_alpha: LoRA scaling numerator (default ``2 * lora_rank``).
        adapter_dir: where the LoRA adapter alone is saved at the end of fit (bf16 safetensors).
        dtype, trust_remote_code, export_dir, gradient_checkpointing, max_nonfinite_steps: see :class:`PolicyModule`
            (``max_nonfinite_steps``: F28, :meth:`optimizer_step`).

    Raises:
        ValueError: ``lora_rank < 1``, ``adapter_dir`` without ``lora_rank``, or ``max_nonfinite_steps < 1``.
        NonFiniteUpdateError: in fit, ``max_nonfinite_steps`` optimizer updates in a row with a non-finite loss or
            gradient (:class:`~lightning_opd.learner.nonfinite.NonFiniteUpdateError`).
    """

    default_lr = 3e-5  # the teacher recipe's rate (PolicyModule.default_lr: the default AdamW's)

    def __init__(self, student: str, optimizer: OptimizerCallable | None = None,
                 lr_scheduler: LRSchedulerCallable | None = None, lora_rank: int | None = None,
                 lora_alpha: float | None = None, adapter_dir: str | None = None, dtype: str = "float32",
                 trust_remote_code: bool = False, export_dir: str | None = None,
                 gradient_checkpointing: bool = False, max_nonfinite_steps: int = 3) -> None:
        if lora_rank is not None and lora_rank < 1:
            raise ValueError(f"model.lora_rank={lora_rank} must be >= 1 (or null for full fine-tuning)")
        if adapter_dir and lora_rank is None:
            raise ValueError("model.adapter_dir needs model.lora_rank (there is no adapter in full fine-tuning)")
        lora = LoRAConfig(rank=lora_rank, alpha=lora_alpha) if lora_rank is not None else None
        super().__init__(student=student, dtype=dtype, trust_remote_code=trust_remote_code, export_dir=export_dir,
                         gradient_checkpointing=gradient_checkpointing, optimizer=optimizer, lr_scheduler=lr_scheduler,
                         max_nonfinite_steps=max_nonfinite_steps, lora=lora)
        self.lora_rank = lora_rank
        self.lora_alpha = lora.scaling_alpha if lora is not None else None
        self.adapter_dir = adapter_dir
        #: whether the last optimizer update was skipped (F28), read by :meth:`lr_scheduler_step`
        self.update_skipped = False

    @property
    def policy_model(self):
        return self.student

    def on_train_end(self) -> None:
        if not self.trainer.is_global_zero:
            return
        if self.lora_rank is None:
            super().on_train_end()
            return
        if self.adapter_dir:
            save_adapter_atomic(self.student, self.adapter_dir)
        if self.export_dir:
            self.export(self.export_dir)

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        """Token-mean cross-entropy (nats/token) on the batch's reply tokens."""
        mask = batch.loss_mask[:, 1:]
        cols = (mask > 0).any(dim=0).nonzero().squeeze(1)  # positions predicting a reply token
        cols = cols if cols.numel() else torch.zeros(1, dtype=torch.long, device=mask.device)
        logits = self.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                              logits_to_keep=cols).logits  # (B, K, V)
        lp = log_probs(logits)
        nll = -lp.gather(-1, batch.input_ids[:, 1:].index_select(1, cols).unsqueeze(-1)).squeeze(-1)  # (B, K)
        loss = aggregate_token_loss(nll, mask.index_select(1, cols), mask.sum())
        self._log_step(loss, mask.sum(), batch.size)
        return loss

    def _log_step(self, loss: torch.Tensor, tokens: torch.Tensor, episodes: int) -> None:
        """Log ``train/loss`` (nats/token) and ``train/supervised_tokens`` over all data-parallel ranks' reply tokens
        (F27): each rank's loss sum and token count are summed over ranks, then divided
        (:func:`~lightning_opd.metrics.rank_stats.all_ranks`: one all-reduce, every rank; float64)."""
        n = float(tokens)
        stats = all_ranks({"loss": Mean(float(loss.detach()) * n, n, empty=0.0), "tokens": Sum(n)},
                          self.reduce_sum, self.reduce_max, self.device)
        self.log("train/loss", stats["loss"], prog_bar=True, batch_size=episodes)
        self.log("train/supervised_tokens", stats["tokens"], batch_size=episodes)

    # ------------------------------------------------------------------------- F28: non-finite updates
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """Apply the update only when its loss and gradient are finite on every rank (F28, PROPOSED).

        Lightning's public hook for automatic optimization: the closure (``training_step``, ``zero_grad``,
        ``backward``) runs here first; then :meth:`NonFiniteGuard.check
        <lightning_opd.learner.nonfinite.NonFiniteGuard.check>` looks at the closure's loss and the global gradient
        L2 norm before clipping, with one all-reduce, so every rank decides alike.

        * Applied: ``optimizer.step(closure=...)`` with a closure that returns the loss already computed, so
          Lightning's precision plugin still calls the ``on_before_optimizer_step`` hooks and clips the gradients
          (``trainer.gradient_clip_val``) before the step, as without this override.
        * Skipped: no ``optimizer.step()`` at all and the gradients are dropped (``zero_grad(set_to_none=True)``):
          weights, AdamW's moments and step count stay as they are; :meth:`lr_scheduler_step` holds back the
          per-step LR scheduler of that update; ``on_before_optimizer_step`` hooks do not run. Lightning still counts
          the update (``trainer.global_step``, so ``max_steps`` ends the run), as in ``OPDModule``. Counted by
          :attr:`nonfinite`, which warns and, at ``max_nonfinite_steps`` in a row, raises.

        Logs ``train/nonfinite_steps_skipped`` (updates skipped so far, resumed runs included) after each decision.

        With a GradScaler (``trainer.precision: 16-mixed``) only the loss is checked: an inf gradient is then the
        scaler's overflow, which it skips and handles itself. Optimizers that evaluate the closure more than once
        (LBFGS) get the same loss each time.

        Raises:
            NonFiniteUpdateError: the ``max_nonfinite_steps``-th skipped update in a row, naming the step
                (``trainer.global_step``) and the first non-finite quantity.
        """
        loss = optimizer_closure()
        loss_now = loss.detach() if loss is not None else torch.zeros((), device=self.device)
        grad_norm = torch.zeros((), device=self.device)
        if getattr(self.trainer.precision_plugin, "scaler", None) is None:  # getattr: only 16-mixed has a GradScaler
            params, _, full = self.grad_norm()
            grad_norm = full if params else grad_norm
        bad = self.check_update(loss_now, grad_norm)
        self.update_skipped = bad is not None
        if bad is not None:
            self.nonfinite.skip(self.trainer.global_step, bad)  # may raise NonFiniteUpdateError (every rank alike)
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.step(closure=lambda: loss)
            self.nonfinite.applied()
        self.log("train/nonfinite_steps_skipped", float(self.nonfinite.skipped))  # the same on every rank

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """Step ``scheduler`` as Lightning does, except a per-step (``interval: step``) scheduler after a skipped
        update (F28, :meth:`optimizer_step`): its LR stays where it was."""
        if self.update_skipped and any(cfg.scheduler is scheduler and cfg.interval == "step"
                                       for cfg in self.trainer.lr_scheduler_configs):
            return
        super().lr_scheduler_step(scheduler, metric)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.policy_version += 1
