"""Rollouts: trajectory types, the token-exact chat renderer, generators, the agent loop, the buffer."""

from lightning_opd.rollout.agent_loop import AgentLoop, EnvironmentFailureError, EpisodeSpec
from lightning_opd.rollout.buffer import RolloutBuffer
from lightning_opd.rollout.chat import ChatFormat, ChatTemplateError, stop_token_ids
from lightning_opd.rollout.generator import (ContextLimit, GenerationOutput, GenerationRequest, Generator, SamplingParams,
                                             policy_configs)
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory

__all__ = [
    "AgentLoop", "EpisodeSpec", "EnvironmentFailureError", "RolloutBuffer", "ChatFormat", "ChatTemplateError",
    "Generator", "GenerationOutput", "GenerationRequest", "SamplingParams", "HFGenerator", "Trajectory",
    "NON_ASSISTANT", "stop_token_ids", "policy_configs", "ContextLimit",
]
