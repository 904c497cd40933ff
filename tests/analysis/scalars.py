"""A TensorBoard event file written from a dict of scalar series, for the tests that read logs back."""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter


def write_scalars(run: str | Path, points: dict[str, list[tuple[int, float]]]) -> Path:
    """Write ``{tag: [(step, value), ...]}`` as one event file under ``run``; returns ``run`` as a Path."""
    w = SummaryWriter(str(run))
    for tag, values in points.items():
        for step, v in values:
            w.add_scalar(tag, v, step)
    w.close()
    return Path(run)
