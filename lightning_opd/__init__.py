"""lightning_opd: on-policy distillation (OPD) of multi-turn LLM agents with PyTorch Lightning.

Run ``lightning-opd fit --config conf/textworld/opd.yaml``; see README.md and docs in the repository.
"""

__version__ = "0.1.0"
