"""F30: the ``last.ckpt`` of a 2-rank FSDP fit (CPU, gloo) is a folder of ``torch.distributed.checkpoint`` shards;
``evaluate`` loads it (the shards consolidated in one process) with exactly the fitted weights, and the tools that
need a model directory or a checkpoint file say what it is and name the commands that read it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_opd.cli import OPDCLI, main
from lightning_opd.data import RolloutDataModule
from lightning_opd.evaluation.evaluate import load_student
from lightning_opd.learner import OPDModule
from lightning_opd.models.fsdp import FSDP2Strategy, full_state_dict
from lightning_opd.models.loading import load_causal_lm, load_tokenizer
from tests.helpers import KeywordEnvFactory, spawn_ranks

pytestmark = pytest.mark.timeout(400)


def _fit_worker(rank, port, model_dirs, out_dir):
    """2 steps under ``FSDP2Strategy`` (``conf/trainer/fsdp.yaml``: shards saved per rank) with the
    ``conf/trainer/checkpoint.yaml`` callback; rank 0 saves the gathered fitted weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    out = Path(out_dir)
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"],
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    ckpt = ModelCheckpoint(dirpath=str(out / "run" / "checkpoints"), save_last=True, save_top_k=0,
                           every_n_train_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(save_distributed_checkpoint=True),
                        max_steps=2, logger=False, callbacks=[ckpt], enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    state = full_state_dict(model.student)  # a collective: every rank
    if rank == 0:
        torch.save(state, out / "fitted.pt")


@pytest.fixture(scope="module")
def fsdp_run(model_dirs, tmp_path_factory):
    """``(last.ckpt folder, fitted weights)`` of one 2-rank FSDP fit."""
    out = tmp_path_factory.mktemp("fsdp_ckpt")
    spawn_ranks(_fit_worker, (model_dirs, str(out)), timeout=300)
    return out / "run" / "checkpoints" / "last.ckpt", torch.load(out / "fitted.pt", weights_only=True)


def test_fsdp_last_ckpt_is_a_folder_of_shards(fsdp_run):
    last, _ = fsdp_run
    assert last.is_dir()
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


def test_evaluate_loads_the_fitted_weights_of_an_fsdp_checkpoint(fsdp_run, model_dirs):
    """On main: FileNotFoundError "no config.json ... Run `lightning-opd prepare-model`"."""
    last, fitted = fsdp_run
    student = load_student("run/last", str(last), model_dirs["student"], "float32", torch.device("cpu"))
    assert (student.kind, student.policy_version, student.global_step) == ("ckpt", 2, 2)
    assert student.rollouts == {"generated": 8, "used": 8}  # 2 steps x 2 ranks x 2 episodes (meta.pt)
    state = student.model.state_dict()
    assert sorted(state) == sorted(fitted)
    for name, value in fitted.items():
        assert torch.equal(state[name], value), name
    initial = load_causal_lm(model_dirs["student"]).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in fitted.items())  # the fit moved the weights


def test_evaluate_command_plays_an_fsdp_checkpoint(fsdp_run, model_dirs, tmp_path):
    last, _ = fsdp_run
    out = tmp_path / "results.json"
    main(["evaluate", "--env", "tests.helpers.KeywordEnvFactory", "--env-args", '{"need": 2}', "--backend", "hf",
          "--device", "cpu", "--max-turns", "2", "--max-new-tokens", "4", "--avg-k", "0", "--out", str(out),
          "--students", str(last), "--base", model_dirs["student"]])
    (entry,) = json.loads(out.read_text())["students"]
    assert (entry["name"], entry["kind"], entry["policy_version"], entry["global_step"]) == ("run/last", "ckpt", 2, 2)
    assert entry["summary"]["greedy"]["episodes"] == 2  # both held-out tasks of the keyword environment


def test_model_loaders_name_a_folder_of_shards_and_the_commands(fsdp_run, model_dirs):
    """A folder of shards given where a Hugging Face directory is expected (``--model.init_args.student``,
    ``--teacher``, ``--base``): the message says what it is and names ``evaluate`` and the consolidation command;
    a checkpoint file likewise, instead of "run prepare-model"."""
    last, _ = fsdp_run
    for load in (load_causal_lm, load_tokenizer):
        with pytest.raises(FileNotFoundError) as err:
            load(last)
        text = str(err.value)
        assert "is a sharded Lightning checkpoint" in text and "prepare-model" not in text
        assert f"lightning-opd evaluate --students {last} --base" in text
        assert f"python -m lightning.fabric.utilities.consolidate_checkpoint {last}" in text


def test_the_named_consolidation_command_gives_the_fitted_weights(fsdp_run, tmp_path):
    """The command the messages name writes one file that ``evaluate`` reads (``weights_only``) with the same
    weights as the folder."""
    from lightning_opd.models.checkpoints import CONSOLIDATE_COMMAND, is_checkpoint, read_policy_checkpoint

    last, fitted = fsdp_run
    folder = tmp_path / "last.ckpt"
    folder.symlink_to(last, target_is_directory=True)  # the output goes next to it: not in the shared run
    cmd = CONSOLIDATE_COMMAND.format(path=folder).split()
    assert cmd[:3] == ["python", "-m", "lightning.fabric.utilities.consolidate_checkpoint"]
    subprocess.run([sys.executable, *cmd[1:]], check=True, timeout=120, capture_output=True)
    single = tmp_path / "last.ckpt.consolidated"
    assert single.is_file() and is_checkpoint(single) and is_checkpoint(last)
    weights, rest = read_policy_checkpoint(single)
    assert rest["policy_version"] == 2 and all(torch.equal(weights[k], v) for k, v in fitted.items())
    with pytest.raises(FileNotFoundError, match="neither a checkpoint file nor a folder of checkpoint shards"):
        read_policy_checkpoint(tmp_path)


def test_validate_under_one_process_names_a_folder_of_shards(fsdp_run, capsys):
    """``lightning-opd validate --ckpt_path <folder>`` without a sharding strategy: Lightning would fail with
    "Is a directory"; the CLI says what it is and how to read it."""
    last, _ = fsdp_run
    cli = SimpleNamespace(subcommand="validate", trainer=SimpleNamespace(strategy=SingleDeviceStrategy("cpu")),
                          _parser=lambda _: argparse.ArgumentParser(prog="lightning-opd validate"))
    with pytest.raises(SystemExit):
        OPDCLI._check_ckpt_path(cli, str(last))
    err = capsys.readouterr().err
    assert "--ckpt_path" in err and "sharded Lightning checkpoint" in err and "consolidate_checkpoint" in err
    assert "conf/trainer/fsdp.yaml" in err
    under_fsdp = SimpleNamespace(subcommand="validate", trainer=SimpleNamespace(strategy=FSDP2Strategy()))
    OPDCLI._check_ckpt_path(under_fsdp, str(last))  # the sharding strategy reads the folder itself
