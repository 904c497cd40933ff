"""The resumable experiment runner (arms x seeds of ``lightning-opd fit``, each in its own process, the checkpoints
evaluated afterwards by ``lightning-opd evaluate``; :mod:`lightning_opd.experiments.runner`, run by
``python -m benchmarks.experiment``) and what it adds to every fit (:mod:`lightning_opd.experiments.checkpointing`).

It orchestrates processes and selects checkpoints; the evaluation and the statistics it calls live in
:mod:`lightning_opd.evaluation`."""
