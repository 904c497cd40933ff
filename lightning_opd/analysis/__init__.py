"""Post-training analysis: what is computed from evaluation JSON files and TensorBoard logs, never by playing episodes.

- :mod:`~lightning_opd.analysis.bootstrap`: the paired bootstrap over runs and tasks (:func:`paired_bootstrap`,
  :class:`Comparison`), verdicts and t-intervals;
- :mod:`~lightning_opd.analysis.compare`: ``lightning-opd compare``, arms read from ``evaluate`` outputs;
- :mod:`~lightning_opd.analysis.curves`: learning curves and checkpoint selection (Same-Step, Least-Time, final,
  best, per-turn KL by outcome); :mod:`~lightning_opd.analysis.summary`: the experiment summary's tables;
- :mod:`~lightning_opd.analysis.rollout_validity`: the probe-rollout validity checks of a run's logs;
- :mod:`~lightning_opd.analysis.freshness_calibration`: ``lightning-opd calibrate-freshness`` (f-OPD tau_rho, tau_chi);
- :mod:`~lightning_opd.analysis.report`: ``lightning-opd report`` (report.png + report.html of one run) and the
  TensorBoard reader; :mod:`~lightning_opd.analysis.results`: ``lightning-opd results`` (last value per run).
"""

from lightning_opd.analysis.bootstrap import Comparison, paired_bootstrap

__all__ = ["Comparison", "paired_bootstrap"]
