"""``PolicyModule``: what every trainer of the policy shares (OPD, the SFT teacher recipe).

It owns the student (loaded in ``configure_model``, the FSDP-ready hook), its tokenizer, the policy
version counter, held-out evaluation in Lightning's validation/test loops and the export of the
student as a Hugging Face directory at the end of ``fit``.

Metric glossary (validation ``val/``, test ``test/``; means over held-out episodes):

| key | unit | reduction |
|---|---|---|
| ``{val,test}/success`` | fraction of episodes won | mean over episodes |
| ``{val,test}/turns`` | turns per episode | mean over episodes |
| ``{val,test}/invalid_actions`` | invalid actions per episode | mean over episodes |
| ``{val,test}/reward`` | points per episode | mean over episodes |
| ``{val,test}/episodes`` | episodes evaluated | sum |
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from torchmetrics import MeanMetric, SumMetric

from lightning_opd.data.collate import RolloutBatch
from lightning_opd.models.loading import load_causal_lm, load_tokenizer, save_hf_atomic

log = logging.getLogger(__name__)


class PolicyModule(L.LightningModule):
    """Base LightningModule owning the student policy.

    Args:
        student: Hugging Face causal-LM directory of the student (e.g. ``artifacts/models/smollm2-135m``).
        dtype: student parameter dtype (``float32`` on CPU).
        trust_remote_code: allow modelling code shipped with checkpoints (off by default, F15).
        export_dir: if set, the trained student is saved there as a Hugging Face directory (with
            tokenizer and chat template) when ``fit`` ends; written atomically (F16).
        gradient_checkpointing: recompute activations in the backward pass (less memory, ~30% slower).

    Raises:
        FileNotFoundError: ``student`` is not a model directory.
    """

    def __init__(self, student: str, dtype: str = "float32", trust_remote_code: bool = False,
                 export_dir: str | None = None, gradient_checkpointing: bool = False) -> None:
        super().__init__()
        self.student_path = student
        self.dtype_name = dtype
        self.trust_remote_code = trust_remote_code
        self.export_dir = export_dir
        self.gradient_checkpointing = gradient_checkpointing
        self.tokenizer = load_tokenizer(student, trust_remote_code=trust_remote_code)
        self.student = None
        #: rollout iterations trained on so far (docs/algorithms.md §3.1 note); stamped on every rollout
        self.policy_version = 0
        self.eval_metrics = torch.nn.ModuleDict({k: MeanMetric() for k in ("success", "turns", "invalid_actions", "reward")})
        self.eval_metrics["episodes"] = SumMetric()

    # ------------------------------------------------------------------------------------------ model
    @property
    def policy_model(self):
        """The student ``PreTrainedModel`` (what generators sample from)."""
        return self.student

    def configure_model(self) -> None:
        if self.student is not None:
            return
        self.student = load_causal_lm(self.student_path, self.dtype_name, self.trust_remote_code)
        self.student.train()  # from_pretrained returns eval mode; Lightning toggles modes from here on
        if self.gradient_checkpointing:
            self.student.gradient_checkpointing_enable()
            self.student.config.use_cache = False

    # ------------------------------------------------------------------------------------- evaluation
    def _eval_step(self, batch: RolloutBatch, prefix: str) -> None:
        trajs = batch.trajectories
        n = len(trajs)
        if n == 0:
            return
        values = {"success": [float(t.success) for t in trajs], "turns": [float(t.num_turns) for t in trajs],
                  "invalid_actions": [float(t.invalid_actions) for t in trajs], "reward": [t.total_reward for t in trajs],
                  "episodes": [1.0] * n}
        for key, vals in values.items():
            metric = self.eval_metrics[key]
            metric.update(torch.tensor(vals, dtype=torch.float32, device=self.device))
            self.log(f"{prefix}/{key}", metric, on_step=False, on_epoch=True, batch_size=n, prog_bar=key == "success")

    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    # ----------------------------------------------------------------------------------------- export
    def on_train_end(self) -> None:
        if self.export_dir and self.trainer.is_global_zero:
            path = save_hf_atomic(self.student, self.tokenizer, self.export_dir)
            log.info("exported the student to %s", path)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["policy_version"] = int(self.policy_version)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.policy_version = int(checkpoint.get("policy_version", 0))
