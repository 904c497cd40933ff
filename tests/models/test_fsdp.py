"""FSDP2 on CPU with 2 gloo processes: the sharded OPD step gives the single-process loss and gradients
(F07); a full ``Trainer.fit`` under ``FSDP2Strategy`` shards games and seeds per rank without overlap,
finishes under a timeout although the ranks' episodes end at different turns (synced decoding, F10),
and exports a Hugging Face directory holding the trained (gathered) weights."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_opd.data import RolloutDataModule
from lightning_opd.envs.base import EnvFactory, StepResult
from lightning_opd.losses import FullVocabReverseKL
from lightning_opd.models.fsdp import FSDP2Strategy, decoder_layers, full_state_dict, is_sharded, shard_causal_lm
from lightning_opd.models.loading import load_causal_lm
from lightning_opd.learner import OPDModule
from tests.helpers import make_tokenizer, spawn_ranks
from tests.learner.test_module import make_batch, make_module, step_grads

pytestmark = pytest.mark.timeout(300)



# ------------------------------------------------------------------------------------------ F07 sharded
def _grad_worker(rank, port, model_dirs, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    module = make_module(model_dirs, FullVocabReverseKL, 1)
    shard_causal_lm(module.student, mesh)
    assert is_sharded(module.student) and all(is_sharded(layer) for layer in decoder_layers(module.student))
    local = make_batch(make_tokenizer()).select(slice(rank * 2, rank * 2 + 2))  # rank 0: rows 0-1, rank 1: 2-3
    sums, _ = step_grads(module, local, world_size=2)
    grads = {n: p.grad.full_tensor() for n, p in module.student.named_parameters()}  # reduce-scattered (mean)
    loss = sums["loss"].clone()
    dist.all_reduce(loss)
    logprobs = module.student_logprobs(local)  # the head under with_root_params, no grad
    torch.save({"loss": loss, "grads": grads, "logprobs": logprobs}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_sharded_step_equals_single_process(model_dirs, tokenizer, tmp_path):
    spawn_ranks(_grad_worker, (model_dirs, str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    module = make_module(model_dirs, FullVocabReverseKL, 4)
    batch = make_batch(tokenizer)
    sums, grads = step_grads(module, batch)
    torch.testing.assert_close(ranks[0]["loss"], sums["loss"])
    assert grads.keys() == ranks[0]["grads"].keys()
    for name, g in grads.items():
        torch.testing.assert_close(ranks[0]["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)
    lp = module.student_logprobs(batch)
    torch.testing.assert_close(torch.cat([ranks[0]["logprobs"], ranks[1]["logprobs"]]), lp, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- Trainer.fit, F10
class CountdownEnv:
    """Task ``tN`` ends (lost) after N turns whatever the agent says."""

    def __init__(self, turns: int) -> None:
        self.turns, self.t = turns, 0

    def reset(self) -> str:
        return "Say anything."

    def parse_action(self, reply: str) -> str:
        return reply.strip()

    def step(self, action: str) -> StepResult:
        self.t += 1
        return StepResult("Go on.", lost=self.t >= self.turns)

    def close(self) -> None:
        pass


class CountdownEnvFactory(EnvFactory):
    """Train tasks t1, t2, t5, t6: whichever two a rank gets, the rank holding t6 plays one turn more
    than the other, so ranks always finish their episodes at different turns."""

    system_prompt = "Reply with one word."

    def train_tasks(self) -> list[str]:
        return ["t1", "t2", "t5", "t6"]

    def eval_tasks(self) -> list[str]:
        return ["t1", "t6", "t2"]  # rank 0: t1, t2; rank 1: t6 and then an empty batch

    def make(self, task_id: str) -> CountdownEnv:
        return CountdownEnv(int(task_id[1:]))


class Recorder(OPDModule):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.played = []

    def _check_on_policy(self, batch):
        self.played.append([(t.task_id, t.seed, t.num_turns) for t in batch.trajectories])
        return super()._check_on_policy(batch)


def _fit_worker(rank, port, model_dirs, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    out = Path(out_dir)
    model = Recorder(student=model_dirs["student"], teacher=model_dirs["teacher"], export_dir=str(out / "export"),
                     max_logged_turns=6, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = RolloutDataModule(env=CountdownEnvFactory(), episodes_per_step=2, max_turns=6, max_new_tokens=4,
                           eval_batch_size=1, seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    state = full_state_dict(model.student)  # a collective: every rank
    torch.save({"played": model.played, "state": state if rank == 0 else {},
                "val_episodes": float(trainer.callback_metrics["val/episodes"]),
                "loss": float(trainer.callback_metrics["train/loss"]), "version": model.policy_version},
               out / f"rank{rank}.pt")


def test_fsdp_fit_shards_games_and_survives_uneven_episodes(model_dirs, tmp_path):
    spawn_ranks(_fit_worker, (model_dirs, str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [r["version"] for r in ranks] == [2, 2]
    for step in range(2):
        mine, theirs = ranks[0]["played"][step], ranks[1]["played"][step]
        assert len(mine) == len(theirs) == 2
        assert not {(t, s) for t, s, _ in mine} & {(t, s) for t, s, _ in theirs}  # no overlap
        assert sorted(t for t, _, _ in mine + theirs) == ["t1", "t2", "t5", "t6"]  # one global batch
        assert max(n for *_, n in mine) != max(n for *_, n in theirs)  # ranks stopped at different turns
    assert ranks[0]["val_episodes"] == ranks[1]["val_episodes"] == 3.0  # 3 held-out tasks over 2 ranks
    assert torch.isfinite(torch.tensor(ranks[0]["loss"]))
    exported = load_causal_lm(tmp_path / "export")  # written by rank 0 from the gathered weights
    assert exported.config.architectures == ["LlamaForCausalLM"]
    initial = load_causal_lm(model_dirs["student"]).state_dict()
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, ranks[0]["state"][name], msg=name)
    assert any((v - initial[k]).abs().max() > 1e-4 for k, v in exported.state_dict().items())


def test_fsdp_strategy_refuses_a_chosen_mesh():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        FSDP2Strategy(tensor_parallel_size=2)
