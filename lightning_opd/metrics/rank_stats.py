"""Step statistics reduced over data-parallel ranks before they are logged (F27, docs/style.md lesson 6).

A mean over episodes or tokens is logged as the run's value, so it must be the mean over **every** rank's
episodes or tokens: each rank contributes its sum and its count, both are summed over ranks, and only then
divided (never a mean of the ranks' means, which weights a rank with 1 episode like a rank with 30). Extremes
are reduced with ``max`` (a minimum as the maximum of its negation). Lightning's ``self.log`` does none of
this: without ``sync_dist`` each rank logs its own value and the logger writes rank 0's.

Every rank must pass the same keys in the same order (a collective per reduction op): give a rank without
episodes or tokens ``Mean(0, 0)``, ``Max(-inf)`` or ``Min(inf)``, never leave the key out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Union

import torch

#: sums (``"sum"``) or maxima (``"max"``) of a tensor over data-parallel ranks, e.g. ``OPDModule.reduce_sum``
Reducer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Mean:
    """A mean over items (episodes, tokens, groups) from this rank's ``total`` (the sum of the values) and
    ``count`` (the items, or the weights); all ranks: ``sum(total) / sum(count)``, ``empty`` when no rank has
    any item (``sum(count) == 0``)."""

    total: float
    count: float
    empty: float = math.nan

    @property
    def local(self) -> float:
        """This rank's mean (``empty`` without items)."""
        return self.total / self.count if self.count > 0 else float(self.empty)


@dataclass(frozen=True)
class Sum:
    """A count or sum (episodes, groups, errors) on this rank; all ranks: the sum."""

    value: float

    @property
    def local(self) -> float:
        """This rank's value."""
        return float(self.value)


@dataclass(frozen=True)
class Max:
    """The largest value on this rank (``-inf`` without any); all ranks: the maximum (NaN when no rank has one)."""

    value: float

    @property
    def local(self) -> float:
        """This rank's value (``-inf`` without any)."""
        return float(self.value)


@dataclass(frozen=True)
class Min:
    """The smallest value on this rank (``inf`` without any); all ranks: the minimum (NaN when no rank has one)."""

    value: float

    @property
    def local(self) -> float:
        """This rank's value (``inf`` without any)."""
        return float(self.value)


RankStat = Union[Mean, Sum, Max, Min]


def all_ranks(stats: Mapping[str, RankStat], reduce_sum: Reducer, reduce_max: Reducer,
              device: torch.device | str = "cpu") -> dict[str, float]:
    """The values over all ranks of this rank's ``stats``: one ``sum`` all-reduce (totals, counts, sums) and,
    when there is a :class:`Max` or :class:`Min`, one ``max`` all-reduce; float64 throughout.

    Args:
        stats: ``{key: Mean | Sum | Max | Min}``, the same keys in the same order on every rank.
        reduce_sum, reduce_max: sum / maximum over data-parallel ranks (identity on one process).
        device: where the reduced tensors live (the module's device: NCCL reduces CUDA tensors only).

    Returns:
        ``{key: value}`` in the order of ``stats``, the same on every rank.

    Raises:
        TypeError: a value that is not a :class:`Mean`, :class:`Sum`, :class:`Max` or :class:`Min`.
    """
    sums, extremes = [], []
    for key, stat in stats.items():
        if isinstance(stat, Mean):
            sums += [float(stat.total), float(stat.count)]
        elif isinstance(stat, Sum):
            sums.append(float(stat.value))
        elif isinstance(stat, (Max, Min)):
            extremes.append(float(stat.value) if isinstance(stat, Max) else -float(stat.value))
        else:
            raise TypeError(f"all_ranks: {key!r} is a {type(stat).__name__}; use Mean, Sum, Max or Min")
    summed = _reduced(sums, reduce_sum, device)
    maxed = _reduced(extremes, reduce_max, device)
    out, i, j = {}, 0, 0
    for key, stat in stats.items():
        if isinstance(stat, Mean):
            total, count = summed[i], summed[i + 1]
            out[key] = total / count if count > 0 else float(stat.empty)
            i += 2
        elif isinstance(stat, Sum):
            out[key] = summed[i]
            i += 1
        else:
            out[key] = math.nan if maxed[j] == -math.inf else (maxed[j] if isinstance(stat, Max) else -maxed[j])
            j += 1
    return out


def _reduced(values: list[float], reduce: Reducer, device: torch.device | str) -> list[float]:
    """``values`` reduced over ranks (one collective; none for an empty list, on every rank alike)."""
    if not values:
        return []
    return reduce(torch.tensor(values, dtype=torch.float64, device=device)).tolist()
