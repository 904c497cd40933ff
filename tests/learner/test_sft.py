"""The teacher recipe: SFT on expert trajectories (full and LoRA), adapter save + merge, export."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_opd.data.expert import ExpertDataModule
from lightning_opd.models.loading import load_causal_lm, merge_adapter
from lightning_opd.learner import SFTModule
from tests.helpers import KeywordEnvFactory


def _fit(module, steps=3):
    L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0).fit(
        module, datamodule=ExpertDataModule(KeywordEnvFactory(need=2), batch_size=2))


def _expert_nll(model_dir, tokenizer):
    from lightning_opd.rollout.batch import collate_trajectories
    from lightning_opd.rollout.generator import SamplingParams

    dm = ExpertDataModule(KeywordEnvFactory(need=2))
    batch = collate_trajectories(dm.expert_rollouts(tokenizer), SamplingParams(), tokenizer.pad_token_id)
    model = load_causal_lm(model_dir)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1], -1)
    nll = -lp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.loss_mask[:, 1:]
    return (nll * mask).sum() / mask.sum(), lp


def test_full_sft_lowers_expert_nll_and_exports(model_dirs, tokenizer, tmp_path):
    before, _ = _expert_nll(model_dirs["student"], tokenizer)
    module = SFTModule(student=model_dirs["student"], export_dir=str(tmp_path / "teacher"),
                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    _fit(module, steps=6)
    after, _ = _expert_nll(str(tmp_path / "teacher"), tokenizer)
    assert after < before - 0.5
    assert module.policy_version == 6


def test_lora_adapter_is_saved_small_and_merges_to_the_export(model_dirs, tokenizer, tmp_path):
    module = SFTModule(student=model_dirs["student"], lora_rank=4, adapter_dir=str(tmp_path / "adapter"),
                       export_dir=str(tmp_path / "merged"), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    _fit(module, steps=10)
    adapter = tmp_path / "adapter"
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()
    from safetensors.torch import load_file

    state = load_file(str(adapter / "adapter_model.safetensors"))
    assert state and all(v.dtype == torch.bfloat16 for v in state.values())
    assert all("lora_" in k for k in state)
    merge_adapter(model_dirs["student"], adapter, tmp_path / "rebuilt")
    nll_export, lp_export = _expert_nll(str(tmp_path / "merged"), tokenizer)
    nll_rebuilt, lp_rebuilt = _expert_nll(str(tmp_path / "rebuilt"), tokenizer)
    base, _ = _expert_nll(model_dirs["student"], tokenizer)
    assert nll_export < base - 0.3  # the adapter learned something
    torch.testing.assert_close(lp_rebuilt, lp_export, atol=5e-2, rtol=0)  # bf16 adapter: small rounding only
    assert abs(nll_rebuilt - nll_export) < 0.02


def test_lora_arguments_are_checked(model_dirs):
    with pytest.raises(ValueError, match="lora_rank=0"):
        SFTModule(student=model_dirs["student"], lora_rank=0)
    with pytest.raises(ValueError, match="adapter_dir needs model.lora_rank"):
        SFTModule(student=model_dirs["student"], adapter_dir="x")


class CountingFactory(KeywordEnvFactory):
    """KeywordEnvFactory whose environments count how many are open at once (an engine process each, F31)."""

    def __init__(self) -> None:
        super().__init__(need=2)
        self.open, self.most = 0, 0

    def make(self, task_id: str):
        env, factory = super().make(task_id), self
        factory.open += 1
        factory.most = max(factory.most, factory.open)
        close = env.close

        def counted_close() -> None:
            factory.open -= 1
            close()

        env.close = counted_close
        return env


def test_expert_rollouts_open_at_most_eval_batch_size_environments(tokenizer):
    """F31: the 4 training tasks played 3 at a time (eval_batch_size 3): at most 3 environments open at once, all
    closed at the end, and all 4 expert trajectories (won) come back in task order."""
    factory = CountingFactory()
    trajs = ExpertDataModule(factory, eval_batch_size=3).expert_rollouts(tokenizer)
    assert factory.most == 3 and factory.open == 0
    assert [t.task_id for t in trajs] == factory.train_tasks() and all(t.success for t in trajs)
