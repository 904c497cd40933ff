"""Real SmolLM2-135M-Instruct + TextWorld (needs `make prepare`: the converted model and the games).

Slow: a teacher made by a short SFT run on expert walkthroughs, then one real OPD step."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.data.expert import ExpertDataModule
from lightning_opd.envs.textworld_env import TextWorldEnvFactory
from lightning_opd.models import load_tokenizer
from lightning_opd.learner import OPDModule
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.chat import ChatFormat
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies
from lightning_opd.learner import SFTModule

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "artifacts/models/smollm2-135m"
GAMES = ROOT / "artifacts/games/quest3"

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Game .* is not fully supported")]


@pytest.fixture(scope="module")
def artifacts():
    missing = [str(p) for p in (MODEL / "config.json", GAMES / "manifest.json") if not p.exists()]
    if missing:
        pytest.fail(f"missing {missing}: run `make prepare` (prepare-model and make-games) first")
    return {"model": str(MODEL), "games": str(GAMES)}


def test_f08_expert_episodes_equal_full_render_with_smollm2_template(artifacts):
    tok = load_tokenizer(artifacts["model"])
    env = TextWorldEnvFactory(artifacts["games"], num_train=6)
    tasks = env.train_tasks()
    gen = ScriptedGenerator(tok, walkthrough_replies({t: env.expert_actions(t) for t in tasks}))
    trajs = AgentLoop(env, gen, tok, max_turns=8).run([EpisodeSpec(t) for t in tasks], SamplingParams())
    chat = ChatFormat(tok, env.system_prompt)
    for t in trajs:
        assert t.success
        full = chat.render([{"role": "system", "content": env.system_prompt}] + t.messages, add_generation_prompt=False)
        cut = len(full) - full[::-1].index(tok.eos_token_id)
        assert t.token_ids == full[:cut]


@pytest.mark.timeout(1200)
def test_real_smollm2_textworld_sft_then_opd_step(artifacts, tmp_path):
    env = TextWorldEnvFactory(artifacts["games"], num_train=8, num_eval=2)
    teacher_dir = tmp_path / "teacher"
    sft = SFTModule(student=artifacts["model"], export_dir=str(teacher_dir))
    L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              limit_val_batches=0, num_sanity_val_steps=0).fit(sft, datamodule=ExpertDataModule(env, batch_size=4))
    assert (teacher_dir / "model.safetensors").exists() and (teacher_dir / "chat_template.jinja").exists()

    model = OPDModule(student=artifacts["model"], teacher=str(teacher_dir))
    dm = RolloutDataModule(env, episodes_per_step=2, max_turns=3, max_new_tokens=16, seed=0)
    model.configure_model()
    before = model.student.model.layers[0].mlp.down_proj.weight.detach().clone()
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    metrics = trainer.callback_metrics
    assert model.policy_version == 1
    assert torch.isfinite(metrics["train/loss"]) and metrics["train/kl"] > 0
    assert "kl/turn_00" in metrics and metrics["rollout/turns"] >= 1
    assert not torch.equal(before, model.student.model.layers[0].mlp.down_proj.weight)
