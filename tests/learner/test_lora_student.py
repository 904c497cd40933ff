"""A LoRA student end to end on the tiny models (model.init_args.lora, issue 65): only the adapter trains, the
generators get the adapter alone and a sample's version is the adapter it was drawn with (async), a resume restores
adapter and optimizer exactly, the export writes the merged model and the adapter, FSDP is refused."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.losses.divergences import log_probs
from lightning_opd.models.loading import load_causal_lm, merge_adapter
from lightning_opd.models.lora import AdapterState, LoRAConfig, load_adapter_state
from tests.helpers import KeywordEnvFactory
from tests.learner.test_training import RecordingOPD

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")]


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-2)


def _dm(**kw):
    args = dict(env=KeywordEnvFactory(need=9), episodes_per_step=2, max_turns=3, max_new_tokens=4, eval_batch_size=2,
                seed=0)
    args.update(kw)
    return RolloutDataModule(**args)


def _trainer(steps, **kw):
    args = dict(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, deterministic=True)
    args.update(kw)
    return L.Trainer(**args)


def test_only_the_adapter_trains_and_the_optimizer_holds_only_its_parameters(model_dirs):
    base = load_causal_lm(model_dirs["student"])
    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"], lora=LoRAConfig(rank=4),
                         optimizer=_adamw)
    trainer = _trainer(3)
    trainer.fit(model, datamodule=_dm())
    lora = {n: p for n, p in model.student.named_parameters() if ".lora_" in n}
    opt = trainer.optimizers[0]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(lora) == 2 * 7 * 2
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in lora.values()}
    assert any(p.abs().sum() > 0 for n, p in lora.items() if ".lora_B." in n)  # B started at 0 and moved
    trained_base = {n.replace(".base_layer", ""): p for n, p in model.student.get_base_model().named_parameters()
                    if ".lora_" not in n}
    assert trained_base.keys() == dict(base.named_parameters()).keys()
    for name, p in base.named_parameters():
        assert torch.equal(trained_base[name], p), name  # bit-identical: frozen
    # lora.push auto on a CPU learner: the base with the adapter merged in, under the base's names
    assert model.lora.push == "merged" and model.policy_state_dict().keys() == base.state_dict().keys()
    model.lora = LoRAConfig(rank=4, push="adapter")
    assert isinstance(model.policy_state_dict(), AdapterState)


class AdapterRecorder(RecordingOPD):
    """Keeps every adapter it hands to the generator (by policy version) and, for every batch and every version that
    played a turn of it, the largest gap between the behaviour log-probs of those turns' tokens and the log-probs
    recomputed with that version's adapter (and, as a control, with the learner's current adapter)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.adapters, self.gaps, self.scratch = {}, [], None

    def policy_state_dict(self):
        state = super().policy_state_dict()
        self.adapters[self.policy_version] = state
        return state

    def _recompute(self, batch, state):
        if isinstance(state, AdapterState):
            load_adapter_state(self.scratch, state)
        else:  # lora.push: merged
            self.scratch.load_state_dict(state, strict=True)
        with torch.no_grad():
            logits = self.scratch(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
            lp = log_probs(logits, batch.sampling.temperature).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        return (lp - batch.behaviour_logprobs[:, 1:]).abs()

    def _check_on_policy(self, batch):
        if self.scratch is None:
            self.scratch = copy.deepcopy(self.student).eval()
            if self.lora.push == "merged":
                self.scratch = self.scratch.merge_and_unload()
        trajs = [t for t in batch.trajectories if t.turn_versions]
        assert len(trajs) == batch.input_ids.shape[0]
        turn = batch.turn_index[:, 1:]
        token_version = torch.full_like(turn, -1)  # (B, T-1): the version that sampled each reply token
        for b, t in enumerate(trajs):
            for k, v in enumerate(t.turn_versions):
                token_version[b][turn[b] == k] = v
        mask = batch.loss_mask[:, 1:] > 0
        current = self._recompute(batch, super().policy_state_dict())
        for v in sorted(set(token_version[mask].tolist())):
            sel = mask & (token_version == v)
            self.gaps.append((self.policy_version, v, self._recompute(batch, self.adapters[v])[sel].max().item(),
                              current[sel].max().item()))
        return super()._check_on_policy(batch)


@pytest.mark.parametrize("push", ["adapter", "merged"])
def test_async_samples_are_stamped_with_the_adapter_that_drew_them(model_dirs, push):
    model = AdapterRecorder(student=model_dirs["student"], teacher=model_dirs["teacher"],
                            lora=LoRAConfig(rank=4, push=push), optimizer=_adamw)
    _trainer(6).fit(model, datamodule=_dm(mode="async", producer_lead=2))
    stale = [g for g in model.gaps if g[1] < g[0]]
    assert stale, f"no batch trained at lag >= 1: {model.gaps}"
    for learner_v, v, own, current in model.gaps:
        assert own < 1e-5, (learner_v, v, own)  # the stamped version's adapter drew these tokens
    assert max(g[3] for g in stale) > 1e-3  # the control: the learner's newer adapter would not have
    want = AdapterState if push == "adapter" else dict
    assert all(type(s) is want for s in model.adapters.values())


def _fit_ckpt(model_dirs, steps, path=None, ckpt_path=None, save=False):
    L.seed_everything(0, verbose=False)
    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"], lora=LoRAConfig(rank=4),
                         optimizer=_adamw)
    ckpt = [L.pytorch.callbacks.ModelCheckpoint(dirpath=path, save_last=True, save_top_k=0)] if save else []
    trainer = _trainer(steps, enable_checkpointing=save, callbacks=ckpt)
    trainer.fit(model, datamodule=_dm(), ckpt_path=ckpt_path)
    return model, trainer


def test_resume_restores_adapter_and_optimizer_exactly(model_dirs, tmp_path):
    full, full_trainer = _fit_ckpt(model_dirs, 4)
    _fit_ckpt(model_dirs, 2, path=tmp_path / "half", save=True)
    state = torch.load(tmp_path / "half" / "last.ckpt", weights_only=True)
    assert len(state["optimizer_states"][0]["state"]) == 2 * 7 * 2  # AdamW moments of the adapter only
    resumed, trainer = _fit_ckpt(model_dirs, 4, ckpt_path=str(tmp_path / "half" / "last.ckpt"))
    assert resumed.seen == full.seen[2:]
    want, got = full.policy_state_dict(), resumed.policy_state_dict()
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    a, b = full_trainer.optimizers[0].state_dict()["state"], trainer.optimizers[0].state_dict()["state"]
    assert a.keys() == b.keys()
    for k in a:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(b[k][key], a[k][key], rtol=1e-5, atol=1e-7)


def test_export_writes_the_merged_model_and_the_adapter(model_dirs, tmp_path):
    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"], lora=LoRAConfig(rank=4),
                         optimizer=_adamw, export_dir=str(tmp_path / "export"))
    _trainer(2).fit(model, datamodule=_dm())
    ids = torch.tensor([[1, 4, 9, 16, 25, 36]])
    with torch.no_grad():
        want = model.student.eval()(input_ids=ids).logits
        merged = load_causal_lm(tmp_path / "export")(input_ids=ids).logits
    torch.testing.assert_close(merged, want, atol=1e-5, rtol=0)
    assert (tmp_path / "export" / "adapter" / "adapter_config.json").is_file()
    assert hasattr(model.student, "peft_config")  # the live student keeps its adapter
    # the committed adapter (bf16) rebuilds the merge within bf16 rounding of the adapter
    rebuilt = merge_adapter(model_dirs["student"], tmp_path / "export" / "adapter", tmp_path / "rebuilt")
    with torch.no_grad():
        again = load_causal_lm(rebuilt)(input_ids=ids).logits
    torch.testing.assert_close(again, want, atol=1e-2, rtol=0)


def test_a_lora_student_under_fsdp_is_refused(model_dirs):
    model = RecordingOPD(student=model_dirs["student"], teacher=model_dirs["teacher"], lora=LoRAConfig(rank=4))
    model.data_parallel_mesh = lambda: object()
    with pytest.raises(ValueError, match="model.init_args.lora with an FSDP strategy"):
        model.configure_model()


def test_a_lora_checkpoint_is_evaluated_as_base_plus_its_adapter_merged(model_dirs, tmp_path):
    from lightning_opd.evaluation.evaluate import load_student

    model, _ = _fit_ckpt(model_dirs, 2, path=tmp_path / "ckpt", save=True)
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["lora"]["rank"] == 4
    loaded = load_student("lora", str(tmp_path / "ckpt" / "last.ckpt"), model_dirs["student"], "float32", "cpu")
    ids = torch.tensor([[1, 4, 9, 16, 25, 36]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, model.student.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)
