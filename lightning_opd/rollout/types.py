"""Trajectory: one multi-turn episode, token-exact, with everything the learner needs per token."""

from __future__ import annotations

from dataclasses import dataclass, field

NON_ASSISTANT = -1  # turn index of prompt / observation tokens
STUDENT, TEACHER = "student", "teacher"  # who played a turn (``Trajectory.turn_roles``)


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
            produced it (nats, F02); 0 where ``assistant_mask`` is 0 (teacher-played turns included: their
            log-probs are the teacher's, never the student's behaviour log-probs).
        teacher_mask: 1 for reply tokens sampled by the teacher in a teacher-played turn (teacher intervention,
            :mod:`lightning_opd.rollout.intervention`), 0 elsewhere; such tokens have ``assistant_mask`` 0 (the
            student trains on its own turns) and ``turn_index`` their turn. Empty in a trajectory from before roles
            (all zeros).
        turn_versions: policy version that generated each turn (an episode can span several); for a teacher-played
            turn, the teacher generator's version (left out of :attr:`behaviour_version`).
        turn_roles: who played each turn, ``"student"`` or ``"teacher"`` (one per turn, like ``turn_versions``;
            empty in a trajectory from before roles: all the student's).
        takeover_turn: the turn from which the teacher played the rest of the episode
            (:class:`~lightning_opd.rollout.intervention.TakeoverIntervention`); -1: no takeover.
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
    teacher_mask: list[int] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    turn_roles: list[str] = field(default_factory=list)
    takeover_turn: int = -1
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

    def append(self, ids: list[int], *, assistant: bool | list[int], turn: int, logprobs: list[float] | None = None,
               teacher: bool = False) -> None:
        """Append tokens with their mask, turn index and behaviour log-probs (``teacher``: reply tokens the teacher
        sampled, recorded in :attr:`teacher_mask`; pass ``assistant=False`` and no log-probs with it)."""
        n = len(ids)
        mask = [int(assistant)] * n if isinstance(assistant, bool) else list(assistant)
        self.token_ids.extend(ids)
        self.assistant_mask.extend(mask)
        self.turn_index.extend([turn] * n)
        self.behaviour_logprobs.extend(logprobs if logprobs is not None else [0.0] * n)
        if teacher or self.teacher_mask:
            self.teacher_mask.extend([0] * (len(self.token_ids) - n - len(self.teacher_mask)) + [int(teacher)] * n)

    def role_of(self, turn: int) -> str:
        """Who played ``turn`` (zero-based): ``"student"`` or ``"teacher"`` (a trajectory without roles: student)."""
        return self.turn_roles[turn] if turn < len(self.turn_roles) else STUDENT

    @property
    def num_turns(self) -> int:
        """Number of replies the policy produced (turns)."""
        return len(self.turn_versions)

    @property
    def num_teacher_turns(self) -> int:
        """Turns the teacher played (turns; 0 without teacher intervention)."""
        return self.turn_roles.count(TEACHER)

    @property
    def took_over(self) -> bool:
        """A takeover policy handed the rest of the episode to the teacher."""
        return self.takeover_turn >= 0

    @property
    def student_turn_versions(self) -> list[int]:
        """:attr:`turn_versions` of the turns the student played (the versions lags are measured from)."""
        return [v for k, v in enumerate(self.turn_versions) if self.role_of(k) == STUDENT]

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
        """Distinct student policy versions that produced this episode's turns, ascending (teacher turns left out)."""
        return tuple(sorted(set(self.student_turn_versions)))

    @property
    def behaviour_version(self) -> int:
        """Oldest policy version that produced a student turn (lags are measured from it); -1 if no student turn."""
        versions = self.student_turn_versions
        return min(versions) if versions else -1
