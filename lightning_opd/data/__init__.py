"""Data: ``RolloutDataModule`` (streams rollouts of the current policy) and the collate step."""

from lightning_opd.data.collate import RolloutBatch, collate_trajectories, rollout_stats
from lightning_opd.data.datamodule import RolloutDataModule

__all__ = ["RolloutDataModule", "RolloutBatch", "collate_trajectories", "rollout_stats"]
