"""``trainer.precision: auto`` for ``lightning-opd fit|validate|test`` (issue 61).

Lightning's ``Trainer(precision=...)`` takes ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ... but not
``"auto"``; :func:`allow_auto_precision` widens the type LightningCLI's parser checks ``trainer.precision`` against
by ``"auto"`` (the one argument; every Lightning value is still accepted), and :func:`resolve_config_precision`
resolves ``auto`` by :func:`~lightning_opd.models.precision.resolve_precision` before the Trainer is built;
:class:`~lightning_opd.cli.fit.OPDCLI` builds the Trainer with the pick. The parsed (and saved) config keeps
``auto``, the value as written (a rerun probes its machine again); the pick itself is logged (a log line, and the
run's hyper-parameters ``precision_choice/...``). The probe runs at the student's ``nn.Linear`` shapes, read from its
``config.json`` (no weights are loaded).
"""

from __future__ import annotations

import os
import sys
from typing import Literal, Optional, Union

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_opd.models.precision import (PrecisionChoice, normalize_precision, resolve_student_precision,
                                            weights_dtype_for)

KEY = "trainer.precision"
#: the pick of ``auto``, set in the environment of the process that resolved it, so the data-parallel ranks Lightning
#: launches from it (subprocesses re-running the command line, ``LOCAL_RANK`` >= 1) take the same precision instead of
#: probing again (a second probe could pick differently)
PICK_ENV = "LIGHTNING_OPD_PRECISION_PICK"


def allow_auto_precision(parser) -> None:
    """Accept ``--trainer.precision=auto`` (and ``precision: auto`` under ``trainer`` in a config file).

    LightningCLI adds ``trainer.precision`` from ``Trainer.__init__``'s signature (a ``Literal`` of Lightning's
    values); jsonargparse keeps that type hint on the argument's action, which this widens by ``Literal["auto"]``.
    The default (``None``: Lightning's ``32-true``) is unchanged.

    Raises:
        RuntimeError: the parser has no typed ``--trainer.precision`` (a jsonargparse or Lightning change).
    """
    action = parser._option_string_actions.get(f"--{KEY}")
    hint = getattr(action, "_typehint", None)
    if hint is None:
        raise RuntimeError(f"cannot add 'auto' to --{KEY}: the parser's argument has no type hint (jsonargparse "
                           "changed?); lightning_opd/cli/precision.py needs updating")
    action._typehint = Optional[Union[Literal["auto"], hint]]


def student_path(config) -> str | None:
    """``model.init_args.student`` of a parsed config (``None`` when the module has none)."""
    model = config.get("model") or {}
    init = model.get("init_args") if hasattr(model, "get") else None
    path = init.get("student") if hasattr(init, "get") else None
    return str(path) if path else None


def training_device(config) -> str:
    """``"cuda"`` where ``trainer.accelerator`` is ``gpu``/``cuda`` (or ``auto`` with a CUDA device), else ``"cpu"``."""
    import torch

    accelerator = str((config.get("trainer") or {}).get("accelerator") or "auto").lower()
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def auto_precision(config) -> PrecisionChoice:
    """:func:`~lightning_opd.models.precision.resolve_precision` of ``"auto"`` at the student's shapes (from
    ``model.init_args.student``'s ``config.json``) on the run's device (:func:`training_device`).
    tests/conftest.py replaces this function (a fixed ``32-true``) unless a test requests ``real_auto_precision``.

    Raises:
        ValueError: no ``model.init_args.student``, or its config cannot be read (names the path and the fix).
    """
    device = training_device(config)
    path = student_path(config)
    if device != "cuda" and path is None:
        raise ValueError(f"{KEY}=auto probes the student's matmul shapes, but model.init_args.student is not set; set "
                         f"--{KEY}=32-true or bf16-mixed")
    trust = bool(((config.get("model") or {}).get("init_args") or {}).get("trust_remote_code", False))
    try:
        return resolve_student_precision("auto", path, device, trust)
    except ValueError as err:
        raise ValueError(f"{KEY}=auto at model.init_args.student: {err}") from None


def resolve_config_precision(config) -> PrecisionChoice | None:
    """The pick for ``trainer.precision: auto`` in ``config`` (one subcommand's parsed config, left unchanged), after
    logging one line (``rank_zero_info``, like ``generator: auto``) saying what was picked and why; ``None`` for any
    other value.

    Raises:
        ValueError: from :func:`auto_precision`.
    """
    trainer = config.get("trainer")
    if trainer is None or trainer.get("precision") != "auto":
        return None
    inherited = os.environ.get(PICK_ENV) if os.environ.get("LOCAL_RANK", "0") != "0" else None
    if inherited:  # a rank Lightning's launcher started (LOCAL_RANK >= 1): rank 0's pick, not a probe of its own
        choice = PrecisionChoice(inherited, _weights(inherited), {}, f"{PICK_ENV}={inherited}: the pick of the process "
                                 "that launched this rank")
    else:
        choice = sys.modules[__name__].auto_precision(config)  # looked up here: tests/conftest.py replaces it
        os.environ[PICK_ENV] = choice.trainer_precision  # ranks launched from here (ddp subprocesses) inherit it
    rank_zero_info(f"trainer.precision=auto: {choice.trainer_precision} (frozen weights "
                   f"{choice.as_dict()['weights_dtype']}): {choice.reason}")
    return choice


def _weights(trainer_precision: str):
    import torch

    return weights_dtype_for(normalize_precision(trainer_precision)) or torch.float32
