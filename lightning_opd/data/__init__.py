"""Data: ``RolloutDataModule`` (streams rollouts of the current policy) and ``ExpertDataModule`` (SFT).

The batch type and the collate step live in :mod:`lightning_opd.rollout.batch`."""

from lightning_opd.data.datamodule import RolloutDataModule

__all__ = ["RolloutDataModule"]
