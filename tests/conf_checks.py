"""Checks of what the issue-63 overlays build (``EXPECT`` of tests/test_configs.py, which calls them with the built
``cli`` on top of conf/textworld/opd.yaml; kept here so that file does not grow)."""

from __future__ import annotations

import pytest

from lightning_opd.losses import FullVocabReverseKL, SignOnlyReverseKL
from lightning_opd.teachers import InProcessTeacher, ShuffledTeacher


def check_teacher_shuffled(cli, tmp):
    """conf/model/teacher_shuffled.yaml: the placebo teacher over the recipe's teacher path (the test's tiny teacher
    here), seed 0, the shared vocabulary set by ``bind`` (F01 checked), the base's loss and rate kept."""
    t = cli.model.teacher
    assert type(t) is ShuffledTeacher and isinstance(t, InProcessTeacher)
    assert t.seed == 0 and t.path == cli.config["model.init_args.teacher.init_args.path"]
    assert t.vocab_size == cli.model.vocab_size and t.model is None  # loaded at configure_model (fit only)
    assert type(cli.model.loss_fn) is FullVocabReverseKL and cli.model.kl_metric == "kl"
    assert cli.config["model.init_args.optimizer.init_args.lr"] == pytest.approx(5e-5)


def check_opd_sign_only(cli, tmp):
    """conf/model/opd_sign_only.yaml: the sign-only loss at opd_sampled.yaml's rate, the base's teacher directory."""
    loss = cli.model.loss_fn
    assert type(loss) is SignOnlyReverseKL and loss.signal == "recomputed" and loss.sampled_token_estimator
    assert cli.config["model.init_args.optimizer.init_args.lr"] == pytest.approx(2e-5)
    assert cli.config["model.init_args.optimizer.init_args.weight_decay"] == 0.0  # kept from the base
    assert cli.model.teacher_path is not None and cli.model.grad_clip_norm == 1.0
