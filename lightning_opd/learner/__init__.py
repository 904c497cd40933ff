"""The learner: LightningModules that train the policy.

* :class:`PolicyModule` (``policy.py``): the shared base (student loading, policy version, held-out
  evaluation, export, per-rank random states);
* :class:`OPDModule` (``opd.py``): plain on-policy distillation;
* :class:`ATODModule` (``atod.py``): ``OPDModule`` with ATOD's hybrid objective (κ, ρ, PPO updates, T-DUR);
* :class:`SFTModule` (``sft.py``): the teacher recipe;
* :class:`StepMetrics` (``step_metrics.py``): the per-step logging component of ``OPDModule`` and its glossary.
"""

from lightning_opd.learner.atod import ATODModule, PPOUpdates
from lightning_opd.learner.opd import OffPolicyBatchError, OPDModule
from lightning_opd.learner.policy import PolicyModule
from lightning_opd.learner.sft import SFTModule
from lightning_opd.learner.step_metrics import StepMetrics, StepRecord

__all__ = ["ATODModule", "OPDModule", "OffPolicyBatchError", "PolicyModule", "PPOUpdates", "SFTModule", "StepMetrics",
           "StepRecord"]
