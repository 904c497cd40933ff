"""Evaluation you can trust: ``lightning-opd evaluate`` (greedy success, Avg@k, teacher-trajectory KL of
students or checkpoints, one JSON per run keyed by task and seed), ``lightning-opd compare`` (paired
bootstrap confidence intervals) and the statistics over runs (:mod:`~lightning_opd.evaluation.curves`). The
experiment runner that launches fits and evaluations is :mod:`lightning_opd.experiments`."""

from lightning_opd.evaluation.compare import Comparison, paired_bootstrap

__all__ = ["Comparison", "paired_bootstrap"]
