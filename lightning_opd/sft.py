"""``SFTModule``: the teacher recipe, supervised fine-tuning on expert trajectories.

A task-specialised teacher is the student's base model fine-tuned on expert walkthroughs rendered by
the *same* agent loop and chat template the student will later play with
(:class:`lightning_opd.data.expert.ExpertDataModule`). The loss is token-mean cross-entropy on the
expert's reply tokens (observation tokens masked, F04), with the common aggregation (§0.5).
Run: ``lightning-opd fit --config conf/textworld/teacher_sft.yaml`` (exports to ``model.export_dir``).
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_opd.data.collate import RolloutBatch
from lightning_opd.losses.aggregation import aggregate_token_loss
from lightning_opd.losses.divergences import log_probs
from lightning_opd.policy import PolicyModule


def _default_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-5, weight_decay=0.0)


class SFTModule(PolicyModule):
    """Supervised fine-tuning of a policy on (expert) trajectories.

    Args:
        student: model directory to fine-tune.
        optimizer: optimizer factory (default AdamW, lr 3e-5).
        lr_scheduler: optional scheduler factory, stepped per optimizer step.
        dtype, trust_remote_code, export_dir, gradient_checkpointing: see :class:`PolicyModule`.
    """

    def __init__(self, student: str, optimizer: OptimizerCallable | None = None,
                 lr_scheduler: LRSchedulerCallable | None = None, dtype: str = "float32",
                 trust_remote_code: bool = False, export_dir: str | None = None,
                 gradient_checkpointing: bool = False) -> None:
        super().__init__(student=student, dtype=dtype, trust_remote_code=trust_remote_code, export_dir=export_dir,
                         gradient_checkpointing=gradient_checkpointing)
        self.optimizer_factory = optimizer if optimizer is not None else _default_optimizer
        self.lr_scheduler_factory = lr_scheduler

    def configure_optimizers(self):
        opt = self.optimizer_factory(self.student.parameters())
        if self.lr_scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.lr_scheduler_factory(opt), "interval": "step"}}

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        """Token-mean cross-entropy (nats/token) on the batch's reply tokens."""
        logits = self.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        lp = log_probs(logits[:, :-1])  # (B, T-1, V)
        nll = -lp.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)
        mask = batch.loss_mask[:, 1:]
        loss = aggregate_token_loss(nll, mask, mask.sum())
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.size)
        self.log("train/supervised_tokens", mask.sum(), batch_size=batch.size)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.policy_version += 1
