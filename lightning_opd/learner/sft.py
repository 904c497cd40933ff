"""``SFTModule``: the teacher recipe, supervised fine-tuning on expert trajectories.

A task-specialised teacher is the student's base model fine-tuned on expert walkthroughs rendered by
the *same* agent loop and chat template the student will later play with
(:class:`lightning_opd.data.expert.ExpertDataModule`). The loss is token-mean cross-entropy on the
expert's reply tokens (observation tokens masked, F04), with the common aggregation (§0.5).
Run: ``lightning-opd fit --config conf/textworld/teacher_sft.yaml`` (exports to ``model.export_dir``).

With ``lora_rank`` set, only a LoRA adapter (peft) is trained; at the end it is saved on its own to
``adapter_dir`` (small enough to commit) and merged into the exported model. ``lightning-opd
merge-adapter`` rebuilds the merged teacher from a committed adapter.
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.losses.aggregation import aggregate_token_loss
from lightning_opd.losses.divergences import log_probs
from lightning_opd.models.loading import save_adapter_atomic, save_hf_atomic
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
        dtype, trust_remote_code, export_dir, gradient_checkpointing: see :class:`PolicyModule`.

    Raises:
        ValueError: ``lora_rank < 1``, or ``adapter_dir`` without ``lora_rank``.
    """

    default_lr = 3e-5  # the teacher recipe's rate (PolicyModule.default_lr: the default AdamW's)

    def __init__(self, student: str, optimizer: OptimizerCallable | None = None,
                 lr_scheduler: LRSchedulerCallable | None = None, lora_rank: int | None = None,
                 lora_alpha: float | None = None, adapter_dir: str | None = None, dtype: str = "float32",
                 trust_remote_code: bool = False, export_dir: str | None = None,
                 gradient_checkpointing: bool = False) -> None:
        super().__init__(student=student, dtype=dtype, trust_remote_code=trust_remote_code, export_dir=export_dir,
                         gradient_checkpointing=gradient_checkpointing, optimizer=optimizer, lr_scheduler=lr_scheduler)
        if lora_rank is not None and lora_rank < 1:
            raise ValueError(f"model.lora_rank={lora_rank} must be >= 1 (or null for full fine-tuning)")
        if adapter_dir and lora_rank is None:
            raise ValueError("model.adapter_dir needs model.lora_rank (there is no adapter in full fine-tuning)")
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else (2 * lora_rank if lora_rank else None)
        self.adapter_dir = adapter_dir

    def configure_model(self) -> None:
        if self.student is not None:
            return
        super().configure_model()
        if self.lora_rank is not None:
            from peft import LoraConfig, get_peft_model

            cfg = LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha, lora_dropout=0.0,
                             target_modules="all-linear", bias="none", task_type="CAUSAL_LM")
            self.student = get_peft_model(self.student, cfg)

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
            save_hf_atomic(self.student.merge_and_unload(), self.tokenizer, self.export_dir)

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
        (F27): each rank's loss sum and token count are summed over ranks, then divided (one all-reduce, every rank)."""
        if self.trainer.world_size > 1:
            total = self.trainer.strategy.reduce(torch.stack([loss.detach().float() * tokens, tokens.float()]),
                                                 reduce_op="sum")
            loss, tokens = total[0] / total[1].clamp(min=1), total[1]
        self.log("train/loss", loss, prog_bar=True, batch_size=episodes)
        self.log("train/supervised_tokens", tokens, batch_size=episodes)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.policy_version += 1
