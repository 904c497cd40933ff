"""Playing and scoring episodes after training: ``lightning-opd evaluate`` (:mod:`~lightning_opd.evaluation.evaluate`:
greedy success, Avg@k, teacher-trajectory KL of students or checkpoints, one JSON per run keyed by task and seed) and
the teacher-trajectory KL it and the in-training callback share (:mod:`~lightning_opd.evaluation.teacher_kl`).

The statistics over what it writes (paired bootstrap ``compare``, learning curves, validity checks, the run report)
live in :mod:`lightning_opd.analysis`; the experiment runner that launches fits and evaluations is
:mod:`lightning_opd.experiments`."""
