"""Text environments: the ``TextEnv`` protocol and the TextWorld adapter."""

from lightning_opd.envs.base import EnvFactory, StepResult, TextEnv

__all__ = ["TextEnv", "EnvFactory", "StepResult"]
