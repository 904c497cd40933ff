"""State that differs per data-parallel rank, in checkpoints (F21).

Lightning asks every rank for its checkpoint state (``LightningDataModule.state_dict``,
``LightningModule.on_save_checkpoint``) but writes rank 0's dict only. State that differs per rank
(buffered rollouts, sampler counters, random states) is therefore gathered into the saved dict as a list
indexed by rank (:func:`gather_per_rank`, a collective that every rank reaches because Lightning calls
those hooks on every rank), and on resume every rank takes its own entry.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_per_rank(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, indexed by rank (``torch.distributed.all_gather_object``; picklable objects).
    Call it on every rank. On one process: ``[obj]``.

    Raises:
        RuntimeError: ``world_size > 1`` without an initialized process group of that size.
    """
    if world_size == 1:
        return [obj]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        raise RuntimeError(f"gathering per-rank state of {world_size} ranks needs an initialized process group of "
                           f"{world_size} processes (every rank saves the checkpoint, as Lightning's does)")
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out
