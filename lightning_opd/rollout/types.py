"""Trajectory: one multi-turn episode, token-exact, with everything the learner needs per token."""

from __future__ import annotations

from dataclasses import dataclass, field

NON_ASSISTANT = -1  # turn index of prompt / observation tokens


@dataclass
class Trajectory:
    """One episode as the learner sees it. Token-level lists all have length ``T`` (tokens).

    Attributes:
        task_id: environment task (TextWorld game id).
        seed: per-episode sampling seed.
        token_ids: the whole conversation, ids exactly as rendered and sampled (F08).
        assistant_mask: 1 for tokens sampled by the policy (trained on), 0 for prompt/observation
            tokens and for an end-of-turn token appended to a reply cut by ``max_new_tokens`` (F04).
        turn_index: zero-based turn of each reply token (the appended end-of-turn token included),
            ``-1`` (``NON_ASSISTANT``) for prompt/observation tokens.
        behaviour_logprobs: log-prob of each sampled token under the sampling distribution that
            produced it (nats, F02); 0 where ``assistant_mask`` is 0.
        turn_versions: policy version that generated each turn (an episode can span several).
        turn_prefill_tokens: per turn, the prompt tokens the generator prefilled (computed) for it.
        turn_cached_tokens: per turn, the prompt tokens it served from a cache instead (KV cache kept
            between turns, prefix cache); each turn's two add up to its whole prompt.
        rewards: environment reward per turn (points).
        success / failure: the environment reported a win / a loss.
        truncated: stopped by the turn limit (``"max_turns"``) or the context limit
            (``"max_context"``), see ``truncation_reason``.
        env_error: the environment raised; the episode ended there (F11).
        invalid_actions: turns whose action was empty or not allowed (F11).
        cut_replies: replies cut by ``max_new_tokens`` (closed with the end-of-turn token).
        rollout_cap: max turns this episode was allowed (the rollout-depth cap it ran under).
        is_probe: a full-depth probe rollout (TurnOPD).
        group_id: GRPO group (episodes of the same task sampled together).
        messages: the conversation as text, for logging only (never re-tokenised).
    """

    task_id: str
    seed: int = 0
    token_ids: list[int] = field(default_factory=list)
    assistant_mask: list[int] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    turn_prefill_tokens: list[int] = field(default_factory=list)
    turn_cached_tokens: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    success: bool = False
    failure: bool = False
    truncated: bool = False
    truncation_reason: str = ""
    env_error: bool = False
    error_message: str = ""
    invalid_actions: int = 0
    cut_replies: int = 0
    rollout_cap: int = 0
    is_probe: bool = False
    group_id: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)

    def append(self, ids: list[int], *, assistant: bool | list[int], turn: int, logprobs: list[float] | None = None) -> None:
        """Append tokens with their mask, turn index and behaviour log-probs."""
        n = len(ids)
        mask = [int(assistant)] * n if isinstance(assistant, bool) else list(assistant)
        self.token_ids.extend(ids)
        self.assistant_mask.extend(mask)
        self.turn_index.extend([turn] * n)
        self.behaviour_logprobs.extend(logprobs if logprobs is not None else [0.0] * n)

    @property
    def num_turns(self) -> int:
        """Number of replies the policy produced (turns)."""
        return len(self.turn_versions)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_assistant_tokens(self) -> int:
        return sum(self.assistant_mask)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens prefilled over all turns (tokens computed, not served from a cache)."""
        return sum(self.turn_prefill_tokens)

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens served from a cache over all turns."""
        return sum(self.turn_cached_tokens)

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def policy_versions(self) -> tuple[int, ...]:
        """Distinct policy versions that produced this episode, ascending."""
        return tuple(sorted(set(self.turn_versions)))

    @property
    def behaviour_version(self) -> int:
        """Oldest policy version that produced a turn (lags are measured from it); -1 if no turn."""
        return min(self.turn_versions) if self.turn_versions else -1
