"""Teacher-trajectory reverse KL (lightning_opd.evaluation.teacher_kl): 0 when student == teacher, equal to
a hand computation from the models' own logits (token-weighted mean, per turn, per task, assistant tokens
only), and the teacher's trajectories cached by teacher, environment, tasks and limits."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_opd.evaluation.evaluate import Backends, EvalSettings, PolicyHandle
from lightning_opd.evaluation.teacher_kl import teacher_trajectories, trajectory_kl, zero_kl
from lightning_opd.models.loading import load_causal_lm
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory
from tests.helpers import KeywordEnvFactory

pytestmark = pytest.mark.timeout(300)


def _loop(model, tokenizer, path, max_turns=3):
    """The loop ``evaluate`` plays with (built by ``RolloutDataModule.connect``), HF backend."""
    settings = EvalSettings(backend="hf", max_turns=max_turns, max_new_tokens=4, max_context_tokens=512, device="cpu")
    return Backends(settings).loop(KeywordEnvFactory(need=2), PolicyHandle(tokenizer, model, path), path)


def _handmade() -> list[Trajectory]:
    """Two episodes: prompt tokens, replies of turns 0 and 1, and (episode b) a cut reply's appended
    end-of-turn token (assistant_mask 0: never scored, F04)."""
    a = Trajectory(task_id="north")
    a.append([5, 17, 9], assistant=False, turn=NON_ASSISTANT)
    a.append([40, 41, 2], assistant=True, turn=0)
    a.append([7, 8], assistant=False, turn=NON_ASSISTANT)
    a.append([60, 2], assistant=True, turn=1)
    b = Trajectory(task_id="south")
    b.append([5, 30], assistant=False, turn=NON_ASSISTANT)
    b.append([90, 91, 92, 93], assistant=True, turn=0)
    b.append([2], assistant=False, turn=0)  # cut reply closed by the loop
    return [a, b]


def _reference(student, teacher, trajs):
    """Per (task, turn): [sum of KL, tokens], from the models' full forward in float64."""
    out = {}
    for traj in trajs:
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            ls = torch.log_softmax(student(input_ids=ids).logits[0].double(), -1)  # (T, V)
            lt = torch.log_softmax(teacher(input_ids=ids).logits[0].double(), -1)
        for t in range(1, len(traj.token_ids)):
            if traj.assistant_mask[t]:
                kl = float((ls[t - 1].exp() * (ls[t - 1] - lt[t - 1])).sum())
                cell = out.setdefault((traj.task_id, traj.turn_index[t]), [0.0, 0])
                cell[0] += kl
                cell[1] += 1
    return out


def test_kl_matches_a_hand_computation(model_dirs, tokenizer):
    student = load_causal_lm(model_dirs["student"]).eval()
    teacher = load_causal_lm(model_dirs["teacher"]).eval()
    trajs = _handmade()
    ref = _reference(student, teacher, trajs)
    res = trajectory_kl(student, teacher, trajs, vocab_size=len(tokenizer), micro_batch_size=2, chunk_size=3)
    assert res.tokens == 3 + 2 + 4 and res.tokens_per_turn == [7, 2]
    total = sum(v[0] for v in ref.values())
    assert res.mean == pytest.approx(total / 9, rel=1e-5)
    turn0 = ref[("north", 0)][0] + ref[("south", 0)][0]
    assert res.per_turn == pytest.approx([turn0 / 7, ref[("north", 1)][0] / 2], rel=1e-5)
    assert res.per_task["south"]["tokens"] == 4
    assert res.per_task["north"]["kl_sum"] == pytest.approx(ref[("north", 0)][0] + ref[("north", 1)][0], rel=1e-5)
    assert res.mean > 0.01  # different random models
    # one trajectory per forward gives the same numbers (padding never reaches the scores)
    single = trajectory_kl(student, teacher, trajs, vocab_size=len(tokenizer), micro_batch_size=1)
    assert single.per_turn == pytest.approx(res.per_turn, rel=1e-5)


def test_kl_is_exactly_zero_when_student_is_teacher(model_dirs, tokenizer):
    teacher = load_causal_lm(model_dirs["teacher"]).eval()
    same = load_causal_lm(model_dirs["teacher"]).eval()
    trajs, _ = teacher_trajectories(lambda: _loop(teacher, tokenizer, model_dirs["teacher"]), model_dirs["teacher"], {"env": "kw"},
                                    ["north", "south"], max_turns=3, max_new_tokens=4, max_context_tokens=512,
                                    cache_dir=None)
    res = trajectory_kl(same, teacher, trajs, vocab_size=len(tokenizer))
    assert res.tokens > 0 and res.mean == 0.0 and all(v == 0.0 for v in res.per_turn)


def test_teacher_states_are_computed_once_for_several_students(model_dirs, tokenizer):
    """With a ``teacher_states`` dict, the teacher's forward runs on the first call only (3 micro-batches of the
    handmade episodes at 1 per forward, then none), and every student's KL is what it is without the dict."""
    student = load_causal_lm(model_dirs["student"]).eval()
    teacher = load_causal_lm(model_dirs["teacher"]).eval()
    trajs = _handmade() + [_handmade()[0]]
    forwards = []
    hook = teacher.model.register_forward_hook(lambda *_: forwards.append(1))  # the trunk (trunk_hidden_states)
    try:
        states: dict = {}
        kw = dict(vocab_size=len(tokenizer), micro_batch_size=1)
        first = trajectory_kl(student, teacher, trajs, teacher_states=states, **kw)
        assert len(forwards) == 3 and len(states) == 3
        second = trajectory_kl(teacher, teacher, trajs, teacher_states=states, **kw)  # another "student"
        assert len(forwards) == 3 + 3  # the student side only: this student is the teacher model
        plain = trajectory_kl(student, teacher, trajs, **kw)
        assert len(forwards) == 6 + 3
    finally:
        hook.remove()
    assert first.per_turn == plain.per_turn and first.per_task == plain.per_task and first.mean > 0.01
    assert second.mean == 0.0  # the cached states are the teacher's own


def test_zero_kl_counts_the_tokens_trajectory_kl_scores(model_dirs, tokenizer):
    """The teacher scoring itself, counted without a forward: the same token counts per turn and per task as
    :func:`trajectory_kl` (handmade: 7 turn-0 and 2 turn-1 tokens; a cut reply's appended token not scored)."""
    teacher = load_causal_lm(model_dirs["teacher"]).eval()
    trajs = _handmade() + [Trajectory(task_id="empty")]
    zero, full = zero_kl(trajs), trajectory_kl(teacher, teacher, trajs, vocab_size=len(tokenizer))
    assert zero.tokens_per_turn == full.tokens_per_turn == [7, 2] and zero.tokens == full.tokens == 9
    assert zero.per_task == full.per_task == {"north": {"kl_sum": 0.0, "tokens": 5}, "south": {"kl_sum": 0.0, "tokens": 4}}
    assert zero.mean == full.mean == 0.0 and zero.per_turn == full.per_turn == [0.0, 0.0]


def test_teacher_trajectories_are_cached_by_teacher_env_tasks_and_limits(model_dirs, tokenizer, tmp_path):
    teacher = load_causal_lm(model_dirs["teacher"]).eval()
    plays = []

    def factory():
        plays.append(1)
        return _loop(teacher, tokenizer, model_dirs["teacher"])

    kw = dict(max_turns=3, max_new_tokens=4, max_context_tokens=512, cache_dir=tmp_path)
    first, path = teacher_trajectories(factory, model_dirs["teacher"], {"env": "kw"}, ["north", "south"], **kw)
    again, path2 = teacher_trajectories(factory, model_dirs["teacher"], {"env": "kw"}, ["north", "south"], **kw)
    assert len(plays) == 1 and path2 == path and path.is_file()
    assert [t.token_ids for t in again] == [t.token_ids for t in first]
    assert [t.assistant_mask for t in again] == [t.assistant_mask for t in first]
    teacher_trajectories(factory, model_dirs["teacher"], {"env": "kw"}, ["north"], **kw)  # other tasks
    teacher_trajectories(factory, model_dirs["teacher"], {"env": "kw2"}, ["north", "south"], **kw)  # other env
    teacher_trajectories(factory, model_dirs["teacher"], {"env": "kw"}, ["north", "south"], **{**kw, "max_turns": 2})
    assert len(plays) == 4
    path.write_text("{ truncated")  # a damaged cache file is replayed, not trusted
    teacher_trajectories(factory, model_dirs["teacher"], {"env": "kw"}, ["north", "south"], **kw)
    assert len(plays) == 5 and json.loads(path.read_text())["key"]["tasks"] == ["north", "south"]
