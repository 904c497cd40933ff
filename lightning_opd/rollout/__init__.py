"""Rollouts: trajectory types, the token-exact chat renderer, generators, the agent loop, the buffer."""

from lightning_opd.rollout.agent_loop import AgentLoop, EnvironmentFailureError, EpisodeSpec
from lightning_opd.rollout.buffer import RolloutBuffer
from lightning_opd.rollout.chat import ChatFormat, ChatTemplateError
from lightning_opd.rollout.generator import GenerationOutput, GenerationRequest, Generator, SamplingParams
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory

__all__ = [
    "AgentLoop", "EpisodeSpec", "EnvironmentFailureError", "RolloutBuffer", "ChatFormat", "ChatTemplateError",
    "Generator", "GenerationOutput", "GenerationRequest", "SamplingParams", "HFGenerator", "Trajectory",
    "NON_ASSISTANT",
]
