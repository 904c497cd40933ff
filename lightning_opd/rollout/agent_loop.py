"""The agent loop: batched multi-turn episodes, token in, token out.

Per turn, every running episode sends its whole conversation (ids) to the generator, gets the
sampled reply ids back unchanged, decodes them only to parse the action, steps its environment and
appends the next user turn as the chat template's token difference (:class:`ChatFormat`). Episodes end
on success/failure, on the turn limit (``truncated``, ``"max_turns"``), when the next turn would not
fit in the context limit (``truncated``, ``"max_context"``) or when the environment raises
(``env_error``, counted, F11). Training and evaluation use this same loop.

A reply is finished when it ends on one of the generator's stop ids (F23); only a reply cut by
``max_new_tokens`` gets the template's end-of-turn token appended (outside the loss). The context
limit is the smaller of ``max_context_tokens`` and the generator's own limit (F24), so an over-long
episode ends as truncated on every backend instead of failing the batch in the engine.

Teacher intervention (issue 64, :mod:`lightning_opd.rollout.intervention`): with a policy and a teacher generator,
each round the policy says per running training episode whether this turn is the teacher's; student turns go through
the student generator in one call as before, teacher turns through the teacher generator, and each reply is recorded
with its role (``Trajectory.turn_roles``; the teacher's tokens in ``teacher_mask``, not in ``assistant_mask``).
Without a policy (the default) the loop makes exactly the same requests in the same order as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lightning.pytorch.utilities import rank_zero_warn
from transformers import PreTrainedTokenizerBase

from lightning_opd.envs.base import EnvFactory, StepResult, TextEnv
from lightning_opd.rollout.chat import ChatFormat
from lightning_opd.rollout.generator import GenerationRequest, Generator, SamplingParams
from lightning_opd.rollout.intervention import InterventionPolicy
from lightning_opd.rollout.types import NON_ASSISTANT, STUDENT, TEACHER, Trajectory

log = logging.getLogger(__name__)


class EnvironmentFailureError(RuntimeError):
    """Too many episodes of one batch ended with an environment error."""


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to play: which task, with which seed, under which cap, in which GRPO group."""

    task_id: str
    seed: int = 0
    max_turns: int | None = None  # None: the loop's default
    is_probe: bool = False
    group_id: int = 0


class AgentLoop:
    """Plays batches of episodes with a :class:`Generator` in :class:`TextEnv` environments.

    Args:
        envs: task pool and episode maker.
        generator: sampling backend (must be attached to a policy).
        tokenizer: the policy's tokenizer (with chat template).
        max_turns: default turn limit per episode (turns).
        max_context_tokens: an episode stops (``truncated``, ``"max_context"``) when its next prompt
            plus ``max_new_tokens`` would exceed this many tokens, or the generator's own
            :attr:`~lightning_opd.rollout.generator.Generator.context_limit` if that is smaller (a
            warning at construction names both; :attr:`max_context_tokens` is the effective limit).
        max_env_error_rate: raise :class:`EnvironmentFailureError` when more than this fraction of a
            batch's episodes hit an environment exception (1.0: never raise, only count).
        intervention: who plays each turn of a training episode
            (:class:`~lightning_opd.rollout.intervention.InterventionPolicy`); ``None``: the student, always.
        teacher_generator: samples the teacher's turns (attached to the teacher's weights, with the same stop ids);
            needed with ``intervention``.

    Raises:
        ValueError: a limit is not positive, a generator's stop ids do not include the chat
            template's end-of-turn id (attach it with ``stop_token_ids(tokenizer, ...)``), or ``intervention``
            without ``teacher_generator``.
    """

    def __init__(self, envs: EnvFactory, generator: Generator, tokenizer: PreTrainedTokenizerBase,
                 max_turns: int = 8, max_context_tokens: int = 4096, max_env_error_rate: float = 0.5,
                 intervention: InterventionPolicy | None = None, teacher_generator: Generator | None = None) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns} must be >= 1")
        if max_context_tokens < 1:
            raise ValueError(f"max_context_tokens={max_context_tokens} must be >= 1")
        if not 0.0 <= max_env_error_rate <= 1.0:
            raise ValueError(f"max_env_error_rate={max_env_error_rate} must be in [0, 1]")
        self.envs = envs
        self.generator = generator
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer, envs.system_prompt)
        if intervention is not None and teacher_generator is None:
            raise ValueError(f"intervention={type(intervention).__name__} needs a teacher_generator to play the "
                             "teacher's turns (data.init_args.teacher_generator)")
        self.intervention, self.teacher_generator = intervention, teacher_generator
        generators = [g for g in (generator, teacher_generator) if g is not None]
        for gen in generators:
            if self.chat.end_of_turn_id not in gen.stop_ids:
                raise ValueError(
                    f"{type(gen).__name__} stops on ids {sorted(gen.stop_ids)}, which lack the chat template's "
                    f"end-of-turn id {self.chat.end_of_turn_id}; attach it with "
                    "lightning_opd.rollout.chat.stop_token_ids(tokenizer, generation_config)")
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        for gen in generators:  # the teacher generator's own limit too, when there is one
            limit = gen.context_limit
            if limit is not None and limit.tokens < self.max_context_tokens:
                rank_zero_warn(
                    f"max_context_tokens={max_context_tokens} (data.init_args.max_context_tokens) is above the "
                    f"generator's limit {limit.tokens} ({limit.source}); episodes are truncated at {limit.tokens} "
                    f"tokens. Set data.init_args.max_context_tokens <= {limit.tokens} or raise {limit.source} to "
                    "silence this.")
                self.max_context_tokens = limit.tokens
        self.max_env_error_rate = max_env_error_rate

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a reply: the generator's (F23); collate stops training a reply at them too."""
        return self.generator.stop_ids

    def _start(self, spec: EpisodeSpec, sampling: SamplingParams) -> tuple[Trajectory, TextEnv | None]:
        cap = spec.max_turns if spec.max_turns is not None else self.max_turns
        traj = Trajectory(task_id=spec.task_id, seed=spec.seed, rollout_cap=cap, is_probe=spec.is_probe,
                          group_id=spec.group_id)
        env = None
        try:
            env = self.envs.make(spec.task_id)
            first = env.reset()
        except Exception as err:  # noqa: BLE001 - any environment failure is counted, not fatal (F11)
            self._fail(traj, env, err)
            return traj, None
        traj.messages.append({"role": "user", "content": first})
        traj.append(self.chat.first_prompt(first), assistant=False, turn=NON_ASSISTANT)
        if traj.num_tokens + sampling.max_new_tokens > self.max_context_tokens:
            traj.truncated, traj.truncation_reason = True, "max_context"  # not even one turn fits
            env.close()
            return traj, None
        return traj, env

    @staticmethod
    def _fail(traj: Trajectory, env: TextEnv | None, err: BaseException) -> None:
        traj.env_error = True
        traj.error_message = f"{type(err).__name__}: {err}"
        log.warning("episode %s (task %s) ended by an environment error: %s", traj.seed, traj.task_id, traj.error_message)
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001
                pass

    def run(self, episodes: list[EpisodeSpec], sampling: SamplingParams, intervene: bool = True) -> list[Trajectory]:
        """Play ``episodes`` to the end, all turns batched through the generator (``intervene``: let the intervention
        policy, if any, hand turns to the teacher generator; ``False`` for held-out evaluation).

        Returns:
            One :class:`Trajectory` per episode, in order.

        Raises:
            EnvironmentFailureError: more than ``max_env_error_rate`` of the episodes hit an
                environment exception.
        """
        started = [self._start(spec, sampling) for spec in episodes]
        trajs = [t for t, _ in started]
        envs: dict[int, TextEnv] = {i: e for i, (_, e) in enumerate(started) if e is not None}
        turn = 0
        collective = self.generator.collective  # sharded sampling model: lock-step turns across ranks (F10)
        try:
            while True:  # one any_rank_active collective per round on every rank
                if not (self.generator.any_rank_active(bool(envs)) if collective else envs):
                    break
                if not envs:  # this rank is done, others play on: join their collective forwards
                    self.generator.idle_step(sampling)
                    turn += 1
                    continue
                active = sorted(envs)
                policy = self.intervention if intervene else None
                teacher = [i for i in active if policy is not None and policy.teacher_plays(trajs[i], turn)]
                student = [i for i in active if i not in teacher] if teacher else active
                outs = dict(zip(student, self._generate(self.generator, trajs, student, turn, sampling)))
                outs.update(zip(teacher, self._generate(self.teacher_generator, trajs, teacher, turn, sampling)))
                for i in active:
                    if self._advance(trajs[i], envs[i], outs[i], turn, sampling, TEACHER if i in teacher else STUDENT):
                        envs.pop(i).close()
                turn += 1
        finally:
            for env in envs.values():
                env.close()
            self.generator.release()
            if self.teacher_generator is not None:
                self.teacher_generator.release()
        errors = sum(t.env_error for t in trajs)
        if trajs and errors / len(trajs) > self.max_env_error_rate:
            msgs = "; ".join(sorted({t.error_message for t in trajs if t.env_error})[:3])
            raise EnvironmentFailureError(
                f"{errors}/{len(trajs)} episodes ended with an environment error (max_env_error_rate="
                f"{self.max_env_error_rate}); first errors: {msgs}"
            )
        return trajs

    def _generate(self, generator: Generator, trajs: list[Trajectory], rows: list[int], turn: int,
                  sampling: SamplingParams) -> list:
        """``generator``'s replies for episodes ``rows`` (none asked for no rows; a collective student generator
        then joins the round with :meth:`Generator.idle_step`, F10)."""
        if not rows:
            if generator is self.generator and generator.collective:
                generator.idle_step(sampling)
            return []
        reqs = [GenerationRequest(key=(id(self), i), prompt_ids=trajs[i].token_ids, turn=turn,
                                  seed=trajs[i].seed, task_id=trajs[i].task_id) for i in rows]
        return generator.generate(reqs, sampling)

    def _advance(self, traj: Trajectory, env: TextEnv, out, turn: int, sampling: SamplingParams,
                 role: str = STUDENT) -> bool:
        """Record one reply (played by ``role``) and step the environment; returns True when the episode is over.
        A teacher's reply is recorded outside ``assistant_mask``, with no behaviour log-probs (``teacher_mask``)."""
        if role == TEACHER:
            traj.append(out.token_ids, assistant=False, turn=turn, teacher=True)
        else:
            traj.append(out.token_ids, assistant=True, turn=turn, logprobs=out.logprobs)
        traj.turn_versions.append(out.policy_version)
        traj.turn_roles.append(role)
        traj.turn_prefill_tokens.append(int(out.prompt_tokens_computed))
        traj.turn_cached_tokens.append(int(out.prompt_tokens_cached))
        if not out.finished:  # cut by max_new_tokens (no stop id): close the turn, not trained on
            traj.append([self.chat.end_of_turn_id], assistant=False, turn=turn)
            traj.cut_replies += 1
        reply_ids = out.token_ids[:-1] if out.finished else out.token_ids
        reply = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
        traj.messages.append({"role": "assistant", "content": reply})
        try:
            result: StepResult = env.step(env.parse_action(reply))
        except Exception as err:  # noqa: BLE001 - counted, the batch goes on (F11)
            traj.rewards.append(0.0)
            self._fail(traj, None, err)
            return True
        traj.rewards.append(float(result.reward))
        traj.invalid_actions += int(result.invalid_action)
        if result.done:
            traj.success, traj.failure = bool(result.won), bool(result.lost)
            return True
        if turn + 1 >= traj.rollout_cap:
            traj.truncated, traj.truncation_reason = True, "max_turns"
            return True
        user_ids = self.chat.user_turn(result.observation)
        if traj.num_tokens + len(user_ids) + sampling.max_new_tokens > self.max_context_tokens:
            traj.truncated, traj.truncation_reason = True, "max_context"
            return True
        traj.messages.append({"role": "user", "content": result.observation})
        traj.append(user_ids, assistant=False, turn=NON_ASSISTANT)
        return False
