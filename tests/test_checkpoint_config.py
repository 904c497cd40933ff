"""The shipped checkpoint overlay (``conf/trainer/checkpoint.yaml``) writes a ``last.ckpt`` that the README's
``--ckpt_path`` line resumes from: a tiny fit of ``conf/textworld/opd.yaml`` + the overlay through the CLI,
then a second fit resumed from the written file continues at the saved step instead of starting over."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_opd.cli import OPDCLI
from tests.test_configs import BASE, CONF

OVERLAY = CONF / "trainer" / "checkpoint.yaml"
pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:No seed found"),
              pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")]


@pytest.fixture(autouse=True)
def _isolate(isolate):
    yield


def _fit(model_dirs, logs: Path, max_steps: int, *extra: str) -> OPDCLI:
    """``lightning-opd fit`` on opd.yaml + the overlay, with the tiny models and a keyword environment."""
    return OPDCLI(args=["fit", "--config", str(BASE), "--config", str(OVERLAY),
                        f"--model.init_args.student={model_dirs['student']}",
                        f"--model.init_args.teacher={model_dirs['teacher']}",
                        f"--model.init_args.export_dir={logs / 'export'}",
                        '--data.init_args.env={"class_path": "tests.helpers.KeywordEnvFactory"}',
                        "--data.init_args.episodes_per_step=2", "--data.init_args.max_turns=2",
                        "--data.init_args.max_new_tokens=4", "--data.init_args.max_context_tokens=256",
                        f"--trainer.logger.init_args.save_dir={logs}", f"--trainer.max_steps={max_steps}",
                        "--trainer.limit_val_batches=0", "--trainer.enable_model_summary=false", *extra])


def _logged_steps(run: Path, tag: str = "train/loss") -> list[int]:
    events = EventAccumulator(str(run)).Reload()
    return [e.step for e in events.Scalars(tag)]


def test_overlay_writes_a_last_ckpt_every_n_steps():
    import yaml

    (ckpt,) = yaml.safe_load(OVERLAY.read_text())["trainer"]["callbacks+"]
    assert ckpt["class_path"] == "lightning.pytorch.callbacks.ModelCheckpoint"
    assert ckpt["init_args"]["save_last"] is True and ckpt["init_args"]["every_n_train_steps"] == 5


def test_fit_from_the_shipped_overlay_resumes_from_its_last_ckpt(model_dirs, tmp_path):
    first = _fit(model_dirs, tmp_path / "runs", 5)
    assert any(isinstance(c, ModelCheckpoint) and c.save_last for c in first.trainer.callbacks)
    last = tmp_path / "runs" / "opd" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    state = torch.load(last, weights_only=True)
    assert state["global_step"] == 5 and state["policy_version"] == 5
    tag = next(t for t in EventAccumulator(str(last.parents[1])).Reload().Tags()["scalars"] if t.startswith("train/"))
    assert _logged_steps(last.parents[1], tag) == [0, 1, 2, 3, 4]

    second = _fit(model_dirs, tmp_path / "runs", 7, f"--ckpt_path={last}")
    assert second.trainer.global_step == 7 and second.model.policy_version == 7
    assert _logged_steps(tmp_path / "runs" / "opd" / "version_1", tag) == [5, 6]  # steps 0-4 are not redone
