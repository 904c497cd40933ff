"""Teacher intervention (issue 64): turn roles in the agent loop, the policies (none, annealed, takeover), which
tokens are trained, the annealed probability through AnnealingSchedule, resume, and the unchanged no-policy path."""

from __future__ import annotations

import random
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from lightning_opd.callbacks.annealing import AnnealingSchedule
from lightning_opd.data.datamodule import RolloutDataModule
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.batch import collate_trajectories, rollout_stats
from lightning_opd.rollout.chat import ChatFormat
from lightning_opd.rollout.generator import GenerationOutput, GenerationRequest, Generator, SamplingParams
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.intervention import (AnnealedIntervention, InterventionPolicy, NoIntervention,
                                                TakeoverIntervention)
from lightning_opd.rollout.sampler import EpisodeSampler
from lightning_opd.rollout.scripted import ScriptedGenerator
from lightning_opd.rollout.session import RolloutSession
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory
from tests.helpers import KeywordEnvFactory, StaticPolicy, make_model, make_tokenizer

SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=8)


class Recording(Generator):
    """Wraps a generator and records every request it is asked (which turns it played)."""

    def __init__(self, inner: Generator) -> None:
        super().__init__()
        self.inner, self.requests = inner, []
        self.stop_ids = inner.stop_ids

    def _generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationOutput]:
        self.requests.extend((r.task_id, r.turn, tuple(r.prompt_ids)) for r in requests)
        return self.inner.generate(requests, sampling)


class TeacherOnTurn(InterventionPolicy):
    """The teacher plays turn ``k`` only (a fixed role pattern for hand-worked masks)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def teacher_plays(self, traj: Trajectory, turn: int) -> bool:
        return turn == self.k


def _gens(tokenizer, student_word: str, teacher_word: str, student_version: int = 3, teacher_version: int = 7):
    student = Recording(ScriptedGenerator(tokenizer, lambda r: student_word, policy_version=student_version))
    teacher = Recording(ScriptedGenerator(tokenizer, lambda r: teacher_word, policy_version=teacher_version))
    return student, teacher


# ------------------------------------------------------------------------------------------- roles and masks


def test_three_turn_episode_trains_only_the_student_turns(tokenizer):
    """Turn 1 of 3 is the teacher's: its reply tokens are in teacher_token_mask, not in loss_mask, with turn index
    -1, behaviour log-prob 0, and the teacher's version left out of the behaviour version."""
    student, teacher = _gens(tokenizer, "apple", "apple")
    loop = AgentLoop(KeywordEnvFactory(need=3), student, tokenizer, intervention=TeacherOnTurn(1),
                     teacher_generator=teacher)
    (t,) = loop.run([EpisodeSpec("apple", seed=5)], SAMPLING)
    assert t.success and t.turn_roles == ["student", "teacher", "student"] and t.num_teacher_turns == 1
    assert [turn for _, turn, _ in student.requests] == [0, 2] and [turn for _, turn, _ in teacher.requests] == [1]
    assert t.turn_versions == [3, 7, 3] and t.behaviour_version == 3 and t.policy_versions == (3,)

    chat = ChatFormat(tokenizer, KeywordEnvFactory.system_prompt)
    p = len(chat.first_prompt(KeywordEnvFactory(need=3).make("apple").reset()))
    r = len(tokenizer.encode("apple", add_special_tokens=False)) + 1  # reply + end-of-turn id
    u = len(chat.user_turn("Again. Commands: apple, banana"))
    # hand-worked layout: prompt | reply 0 | user | reply 1 (teacher) | user | reply 2
    starts = [p, p + r + u, p + 2 * (r + u)]
    n = p + 3 * r + 2 * u
    student_pos = list(range(starts[0], starts[0] + r)) + list(range(starts[2], starts[2] + r))
    teacher_pos = list(range(starts[1], starts[1] + r))
    batch = collate_trajectories([t], SAMPLING, stop_ids=student.stop_ids)
    assert batch.input_ids.shape == (1, n)
    assert torch.nonzero(batch.loss_mask[0]).flatten().tolist() == student_pos
    assert torch.nonzero(batch.teacher_token_mask[0]).flatten().tolist() == teacher_pos
    assert batch.turn_index[0, teacher_pos].tolist() == [NON_ASSISTANT] * r
    assert batch.turn_index[0, student_pos].tolist() == [0] * r + [2] * r
    assert batch.behaviour_logprobs[0, teacher_pos].abs().sum() == 0 and batch.behaviour_version.tolist() == [3]


def test_collate_without_teachers_has_an_all_zero_teacher_mask(tokenizer):
    student, _ = _gens(tokenizer, "apple", "apple")
    trajs = AgentLoop(KeywordEnvFactory(need=2), student, tokenizer).run([EpisodeSpec("apple")], SAMPLING)
    assert trajs[0].teacher_mask == [] and trajs[0].turn_roles == ["student", "student"]
    batch = collate_trajectories(trajs, SAMPLING)
    assert batch.teacher_token_mask.shape == batch.loss_mask.shape and batch.teacher_token_mask.sum() == 0
    assert batch.masked_rows(2).teacher_token_mask.sum() == 0 and batch.select(slice(0, 1)).teacher_token_mask.shape[0] == 1


# ------------------------------------------------------------------------------------------------ takeover


@pytest.mark.parametrize("k", [1, 2])
def test_takeover_fires_right_after_the_kth_invalid_action(tokenizer, k):
    """The student says 'xyz' (invalid, no state change): after its k-th invalid action the teacher says 'apple'
    three times and wins (need 3); turns 0..k-1 are the student's, k.. the teacher's."""
    student, teacher = _gens(tokenizer, "xyz", "apple")
    loop = AgentLoop(KeywordEnvFactory(need=3), student, tokenizer, max_turns=8,
                     intervention=TakeoverIntervention(after_invalid_actions=k), teacher_generator=teacher)
    (t,) = loop.run([EpisodeSpec("apple")], SAMPLING)
    assert t.turn_roles == ["student"] * k + ["teacher"] * 3 and t.success
    assert t.invalid_actions == k and t.takeover_turn == k and t.took_over
    stats = rollout_stats([t, Trajectory(task_id="empty")])
    assert stats["takeovers"] == 0.5 and stats["teacher_turns"] == 1.5  # 1 of 2 episodes; 3 teacher turns / 2


def test_takeover_on_a_stall(tokenizer):
    """stall_turns=2: the student's 'apple' earns reward 0 until the win (need 4); after two such turns the teacher
    plays turns 2 and 3 and wins."""
    student, teacher = _gens(tokenizer, "apple", "apple")
    loop = AgentLoop(KeywordEnvFactory(need=4), student, tokenizer,
                     intervention=TakeoverIntervention(after_invalid_actions=None, stall_turns=2),
                     teacher_generator=teacher)
    (t,) = loop.run([EpisodeSpec("apple")], SAMPLING)
    assert t.turn_roles == ["student", "student", "teacher", "teacher"] and t.takeover_turn == 2 and t.success


def test_no_takeover_without_a_trigger(tokenizer):
    student, teacher = _gens(tokenizer, "apple", "apple")
    loop = AgentLoop(KeywordEnvFactory(need=2), student, tokenizer, intervention=TakeoverIntervention(2),
                     teacher_generator=teacher)
    (t,) = loop.run([EpisodeSpec("apple")], SAMPLING)
    assert t.turn_roles == ["student", "student"] and not t.took_over and teacher.requests == []


@pytest.mark.parametrize("kwargs, match", [({"after_invalid_actions": None}, "needs after_invalid_actions"),
                                           ({"after_invalid_actions": 0}, "after_invalid_actions=0"),
                                           ({"stall_turns": 0}, "stall_turns=0")])
def test_takeover_refuses_bad_knobs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TakeoverIntervention(**kwargs)


# ------------------------------------------------------------------------------------------------ annealed


def test_annealed_draws_are_keyed_on_seed_episode_and_turn(tokenizer):
    """Turn k of the episode with seed s is the teacher's iff Random(f"{salt}:{s}:{k}").random() < prob."""
    policy = AnnealedIntervention(prob=0.5, seed=1)
    expected = [random.Random(f"1:11:{k}").random() < 0.5 for k in range(6)]
    assert [policy.teacher_plays(Trajectory("apple", seed=11), k) for k in range(6)] == expected
    student, teacher = _gens(tokenizer, "apple", "apple")
    loop = AgentLoop(KeywordEnvFactory(need=6), student, tokenizer, intervention=policy, teacher_generator=teacher)
    first = loop.run([EpisodeSpec("apple", seed=11)], SAMPLING)[0]
    assert first.turn_roles == ["teacher" if e else "student" for e in expected]
    assert asdict(loop.run([EpisodeSpec("apple", seed=11)], SAMPLING)[0]) == asdict(first)  # replays exactly
    assert not AnnealedIntervention(prob=0.0).teacher_plays(Trajectory("apple"), 0)
    assert all(AnnealedIntervention(prob=1.0).teacher_plays(Trajectory("apple", seed=s), 0) for s in range(20))
    with pytest.raises(ValueError, match="prob=1.5"):
        policy.set_intervention_prob(1.5)


def _datamodule(tokenizer, **kwargs) -> RolloutDataModule:
    gen = ScriptedGenerator(tokenizer, lambda r: r.task_id)
    return RolloutDataModule(KeywordEnvFactory(need=2), generator=gen, episodes_per_step=2, max_turns=4,
                             max_new_tokens=8, max_context_tokens=512, **kwargs)


def test_annealing_schedule_sets_the_probability_at_given_steps(tokenizer):
    """AnnealingSchedule('intervention_prob', 0.8, 0.0, steps=4) reaches the DataModule's policy (the module has
    no such setter): 0.8, 0.6, 0.4, 0.2 at steps 0..3, then 0.0."""
    dm = _datamodule(tokenizer, intervention=AnnealedIntervention(prob=0.3),
                     teacher_generator=ScriptedGenerator(tokenizer, lambda r: r.task_id))
    schedule = AnnealingSchedule("intervention_prob", 0.8, 0.0, steps=4)
    trainer, module = SimpleNamespace(datamodule=dm, max_steps=10), SimpleNamespace(policy_version=0)
    schedule.setup(trainer, module, "fit")
    seen = []
    for step in range(6):
        module.policy_version = step
        schedule.on_train_batch_start(trainer, module, None, step)
        seen.append(dm.intervention_prob)
    assert seen == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0, 0.0])


def test_resume_restores_the_policy_state(tokenizer):
    dm = _datamodule(tokenizer, intervention=AnnealedIntervention(prob=0.9),
                     teacher_generator=ScriptedGenerator(tokenizer, lambda r: r.task_id))
    dm.set_intervention_prob(0.35)
    state = dm.state_dict()
    assert state["intervention"] == {"prob": 0.35}
    resumed = _datamodule(tokenizer, intervention=AnnealedIntervention(prob=0.9),
                          teacher_generator=ScriptedGenerator(tokenizer, lambda r: r.task_id))
    resumed.load_state_dict(state)
    assert resumed.intervention_prob == 0.35
    assert "intervention" not in _datamodule(tokenizer).state_dict()  # default: the checkpoint is as before


def test_intervention_without_a_teacher_generator_is_refused(tokenizer):
    with pytest.raises(ValueError, match="data.init_args.intervention=AnnealedIntervention needs "
                                         "data.init_args.teacher_generator"):
        _datamodule(tokenizer, intervention=AnnealedIntervention())
    with pytest.raises(ValueError, match="teacher_generator='vllm'"):
        _datamodule(tokenizer, intervention=AnnealedIntervention(), teacher_generator="vllm")
    with pytest.raises(ValueError, match="has no per-turn probability"):
        _datamodule(tokenizer).set_intervention_prob(0.5)
    assert _datamodule(tokenizer, intervention=NoIntervention()).session.intervention is None  # no teacher needed


def test_training_batches_intervene_and_held_out_episodes_never(tokenizer):
    tok = make_tokenizer(extra_words=("apple", "cherry", "door", "key", "banana"))
    policy = StaticPolicy(make_model(tok), tok, version=2)
    sampler = EpisodeSampler(KeywordEnvFactory(), episodes_per_step=2, max_turns=4, seed=0)
    teacher = Recording(ScriptedGenerator(tok, lambda r: r.task_id))
    s = RolloutSession(KeywordEnvFactory(need=2), ScriptedGenerator(tok, lambda r: r.task_id), max_context_tokens=512,
                       sampler=sampler, sampling=SamplingParams(max_new_tokens=8),
                       intervention=AnnealedIntervention(prob=1.0), teacher_generator=teacher)
    s.connect(policy)
    batch = s.next_batch()
    assert all(t.turn_roles == ["teacher", "teacher"] for t in batch.trajectories)
    assert batch.loss_mask.sum() == 0 and batch.teacher_token_mask.sum() > 0
    assert batch.behaviour_version.tolist() == [-1, -1]  # no student turn: no lag to measure
    n = len(teacher.requests)
    held_out = list(s.eval_batches(SamplingParams(temperature=0.0, max_new_tokens=8), max_turns=2, batch_size=2))
    assert all(t.turn_roles == ["student"] * t.num_turns for b in held_out for t in b.trajectories)
    assert len(teacher.requests) == n  # the teacher played no held-out turn


# ------------------------------------------------------------------------------------------ the default path


def test_no_policy_path_is_unchanged(tokenizer):
    """A loop with NoIntervention makes the same student requests as a loop without a policy, gives equal
    trajectories and never asks the teacher; with the HF generator at temperature 1 the sampled tokens (RNG) match."""
    envs = KeywordEnvFactory(need=2)
    specs = [EpisodeSpec(t, seed=i) for i, t in enumerate(["apple", "cherry", "door"])]
    plain, _ = _gens(tokenizer, "apple", "x")
    with_policy, teacher = _gens(tokenizer, "apple", "x")
    a = AgentLoop(envs, plain, tokenizer).run(specs, SAMPLING)
    b = AgentLoop(envs, with_policy, tokenizer, intervention=NoIntervention(), teacher_generator=teacher).run(
        specs, SAMPLING)
    assert plain.requests == with_policy.requests and teacher.requests == []
    assert [asdict(t) for t in a] == [asdict(t) for t in b]

    tok = make_tokenizer(extra_words=("apple", "cherry", "door", "key", "banana"))
    policy = StaticPolicy(make_model(tok), tok)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    runs = []
    for intervention in (None, NoIntervention()):
        gen = HFGenerator()
        gen.attach(policy, [tok.eos_token_id])
        torch.manual_seed(0)
        teacher_gen = ScriptedGenerator(tok, lambda r: "x") if intervention is not None else None
        runs.append(AgentLoop(envs, gen, tok, max_turns=3, intervention=intervention,
                              teacher_generator=teacher_gen).run(specs, sampling))
    assert [t.token_ids for t in runs[0]] == [t.token_ids for t in runs[1]]
    assert [t.behaviour_logprobs for t in runs[0]] == [t.behaviour_logprobs for t in runs[1]]


# ------------------------------------------------------------------------------------------ the tutorial's policy


def test_the_tutorials_own_policy_runs_as_written(tokenizer):
    """tutorials/03_compose_controllers.py's FirstTurnsTeacher, taken from its docstring and run in the loop."""
    import textwrap
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "tutorials" / "03_compose_controllers.py").read_text()
    start = text.index("    from lightning_opd.rollout.intervention import InterventionPolicy")
    end = text.index("return turn < self.turns", start) + len("return turn < self.turns")
    namespace: dict = {}
    exec(textwrap.dedent(text[start:end]), namespace)  # noqa: S102 - the tutorial's code, as a user copies it
    policy = namespace["FirstTurnsTeacher"](turns=2)
    student, teacher = _gens(tokenizer, "apple", "apple")
    loop = AgentLoop(KeywordEnvFactory(need=3), student, tokenizer, intervention=policy, teacher_generator=teacher)
    (t,) = loop.run([EpisodeSpec("apple")], SAMPLING)
    assert t.turn_roles == ["teacher", "teacher", "student"] and t.success
    with pytest.raises(ValueError, match="turns=-1"):
        namespace["FirstTurnsTeacher"](turns=-1)
