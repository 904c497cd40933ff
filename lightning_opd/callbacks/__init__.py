"""Controllers as Lightning callbacks, one per file (``lightning_opd.callbacks.<file>.<Class>`` in configs).

They decide values (a rollout cap, a staleness bound, an annealed coefficient) and hand them to the module
or the DataModule through named public setters; the module and the DataModule work without them. A rule a
callback applies may have its own file (:mod:`~lightning_opd.callbacks.lag_control`, ``StalenessMonitor``'s).
"""
