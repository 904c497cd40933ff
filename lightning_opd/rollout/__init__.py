"""Rollouts: trajectory types, the token-exact chat renderer, generators, the agent loop, the buffer, the
learner's batch type and the collate step (:mod:`lightning_opd.rollout.batch`)."""

from lightning_opd.rollout.agent_loop import AgentLoop, EnvironmentFailureError, EpisodeSpec
from lightning_opd.rollout.batch import RolloutBatch, collate_trajectories, rollout_stats
from lightning_opd.rollout.buffer import RolloutBuffer
from lightning_opd.rollout.chat import ChatFormat, ChatTemplateError, stop_token_ids
from lightning_opd.rollout.generator import (ContextLimit, GenerationOutput, GenerationRequest, Generator, SamplingParams,
                                             policy_configs)
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory

__all__ = [
    "AgentLoop", "EpisodeSpec", "EnvironmentFailureError", "RolloutBuffer", "ChatFormat", "ChatTemplateError",
    "Generator", "GenerationOutput", "GenerationRequest", "SamplingParams", "HFGenerator", "Trajectory",
    "NON_ASSISTANT", "stop_token_ids", "policy_configs", "ContextLimit", "RolloutBatch", "collate_trajectories",
    "rollout_stats",
]
