"""Lightning checkpoints of a policy run, read by the tools that consume them (``evaluate``, the experiment
runner, ``validate``/``test``; F30).

A checkpoint path (``checkpoints/last.ckpt``, ``checkpoints/step=N.ckpt``) is one of two things:

* a **file**: ``torch.save`` of the whole checkpoint dict (one process, DDP, or FSDP with a full state dict);
* a **folder of shards**, what an FSDP run writes (``conf/trainer/fsdp.yaml``: ``FSDP2Strategy`` /
  ``ModelParallelStrategy`` with ``save_distributed_checkpoint: true``, or ``FSDPStrategy(state_dict_type=
  "sharded")``): every rank's ``torch.distributed.checkpoint`` shards (``.metadata``, ``__<rank>_0.distcp``)
  holding the module's ``state_dict`` (under the key ``state_dict``, ``model`` for ``FSDPStrategy``) and the
  optimizer states, and ``meta.pt``, the rest of the dict (``global_step``, ``callbacks``, ``policy_version``,
  ``rollout_totals``, ...).

:func:`read_policy_checkpoint` reads both: the shards are consolidated in one process, without a process group
(``torch.distributed.checkpoint.load`` into full CPU tensors, only the policy's weights, never the optimizer
states). Everything is loaded with ``weights_only=True`` (F15). One command turns a folder into a file for tools
outside this package: :data:`CONSOLIDATE_COMMAND`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # torch is imported where checkpoints are read: the experiment runner checks paths without it
    import torch

#: Lightning's extra file in a folder of shards (``lightning.fabric.utilities.load._METADATA_FILENAME``)
META_FILE = "meta.pt"
#: the shards' index written by ``torch.distributed.checkpoint``
SHARD_INDEX = ".metadata"
#: the module's ``state_dict`` inside the shards: ``ModelParallelStrategy`` (FSDP2), then ``FSDPStrategy``
STATE_KEYS = ("state_dict", "model")
#: Lightning's converter from a folder of shards to one ``torch.load``-able file (``{path}``: the folder)
CONSOLIDATE_COMMAND = ("python -m lightning.fabric.utilities.consolidate_checkpoint {path} "
                       "--output_file {path}.consolidated")


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder of checkpoint shards written by Lightning (``meta.pt`` and the
    ``torch.distributed.checkpoint`` index ``.metadata`` in it)."""
    p = Path(path)
    return p.is_dir() and (p / META_FILE).is_file() and (p / SHARD_INDEX).is_file()


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Lightning checkpoint: a file, or a folder of shards (:func:`is_sharded_checkpoint`)."""
    return Path(path).is_file() or is_sharded_checkpoint(path)


def sharded_checkpoint_note(path: str | os.PathLike) -> str:
    """What a folder of shards is and how to use it, for error messages of tools that need a file or a model
    directory (names :func:`read_policy_checkpoint`'s command and :data:`CONSOLIDATE_COMMAND`)."""
    return (f"{str(path)!r} is a sharded Lightning checkpoint (a folder of torch.distributed.checkpoint shards "
            "written by an FSDP run), not a Hugging Face model directory or a checkpoint file. Evaluate it with "
            f"`lightning-opd evaluate --students {path} --base <the run's model.init_args.student>` (the shards "
            "are consolidated on load), or turn it into one checkpoint file with "
            f"`{CONSOLIDATE_COMMAND.format(path=path)}`")


def train_seconds(checkpoint: Mapping[str, Any]) -> float | None:
    """Training seconds recorded in a loaded Lightning checkpoint dict by a
    :class:`~lightning.pytorch.callbacks.Timer` (``checkpoint["callbacks"]["Timer"]["time_elapsed"]["train"]``,
    seconds from ``on_train_start`` to the save; the experiment runner adds the Timer to every fit,
    :mod:`lightning_opd.experiments.checkpointing`), or ``None`` when the fit ran without one."""
    timer = (checkpoint.get("callbacks") or {}).get("Timer")
    if not isinstance(timer, Mapping):
        return None
    value = (timer.get("time_elapsed") or {}).get("train")
    return None if value is None else float(value)


def read_policy_checkpoint(path: str | os.PathLike, prefix: str = "student.") -> tuple[dict[str, torch.Tensor],
                                                                                      dict[str, Any]]:
    """Read a policy run's checkpoint, a file or a folder of shards (module docstring).

    Args:
        path: the checkpoint (``.../checkpoints/last.ckpt``).
        prefix: the module attribute holding the policy (``student.`` for ``PolicyModule``).

    Returns:
        ``(weights, rest)``: the ``prefix``-ed entries of the module's ``state_dict`` with ``prefix`` removed
        (full CPU tensors, consolidated from the shards), and the rest of the checkpoint dict without
        ``state_dict`` and optimizer states (``policy_version``, ``global_step``, ``callbacks``, ...).

    Raises:
        FileNotFoundError: ``path`` is neither a file nor a folder of shards.
        ValueError: no ``prefix``-ed weights in it (naming the keys it has).
        pickle.UnpicklingError: the file (or ``meta.pt``) holds pickled objects other than tensors and
            containers (F15).
    """
    import torch

    p = Path(path)
    if p.is_file():
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
        module_state = ckpt.pop("state_dict", {}) or {}
        weights = {k[len(prefix):]: v for k, v in module_state.items() if k.startswith(prefix)}
        rest = {k: v for k, v in ckpt.items() if not k.startswith("optimizer_")}  # _states, or _0 consolidated
        found = sorted(module_state)[:5]
    elif is_sharded_checkpoint(p):
        rest = torch.load(p / META_FILE, map_location="cpu", weights_only=True)
        weights, found = _consolidate(p, prefix)
    else:
        raise FileNotFoundError(f"{str(p)!r} is neither a checkpoint file nor a folder of checkpoint shards "
                                f"(with {META_FILE} and {SHARD_INDEX})")
    if not weights:
        raise ValueError(f"{str(p)!r} holds no {prefix}* weights (first keys: {found}); not a checkpoint of an "
                         "OPDModule/PolicyModule run?")
    return weights, rest


def _consolidate(folder: Path, prefix: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The ``prefix``-ed module weights of a folder of shards as full CPU tensors (one process, no process
    group), and the first keys of the shards' index (for messages)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    index = reader.read_metadata().state_dict_metadata
    for container in STATE_KEYS:
        head = f"{container}.{prefix}"
        found = {k[len(head):]: m for k, m in index.items()
                 if k.startswith(head) and isinstance(m, TensorStorageMetadata)}
        if found:
            break
    if not found:
        return {}, sorted(index)[:5]
    weights = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in found.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process")
        dcp.load({container: {prefix + k: v for k, v in weights.items()}}, storage_reader=reader, no_dist=True)
    return weights, []
