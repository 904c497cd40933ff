"""The learner: LightningModules that train the policy.

* :class:`PolicyModule` (``policy.py``): the shared base (student loading, policy version, held-out
  evaluation, export, per-rank random states);
* :class:`OPDModule` (``opd.py``): plain on-policy distillation;
* :class:`ATODModule` (``atod.py``): ``OPDModule`` with ATOD's hybrid objective (κ, ρ, PPO updates, T-DUR);
* :class:`SFTModule` (``sft.py``): the teacher recipe;
* :class:`StepMetrics` (``step_metrics.py``): the per-step logging component of ``OPDModule`` and its glossary;
* :class:`LossWeightings` (``weightings.py``): ``OPDModule``'s token weightings (freshness, truncated ratio, turn blend);
* :class:`AppliedLags` (``lags.py``): lags in applied updates and the on-policy check; ``positions.py``: supervised
  positions, per-position scores and the micro-batch layout;
* ``nonfinite.py``: the F28 guard the shared base (``PolicyModule``) applies.
"""

from lightning_opd.learner.atod import ATODModule, PPOUpdates
from lightning_opd.learner.lags import AppliedLags, OffPolicyBatchError
from lightning_opd.learner.opd import OPDModule
from lightning_opd.learner.policy import PolicyModule
from lightning_opd.learner.sft import SFTModule
from lightning_opd.learner.step_metrics import StepMetrics, StepRecord
from lightning_opd.learner.weightings import LossWeightings

__all__ = ["ATODModule", "AppliedLags", "LossWeightings", "OPDModule", "OffPolicyBatchError", "PolicyModule", "PPOUpdates",
           "SFTModule", "StepMetrics", "StepRecord"]
