"""The privileged teacher's views (:mod:`lightning_opd.teachers.privileged_views`) on the tiny tokenizer and models.

* ``next_action`` (PROPOSED after PivotOPD arXiv 2609.40285): on a hand-built 2-turn episode the view is the chat
  template's render of the conversation with the hint in each user message, and every reply token sits at its own
  position plus the hint tokens before it (22 after the first prompt, 44 after the second user turn); a turn without
  an expert action gets no hint; a user turn that is not ``ChatFormat.user_turn`` of its message is refused.
* ``PrivilegedTeacher(view="next_action")`` scores at the mapped positions exactly what the model's forward over the
  view gives there, counts hint use, and refuses a view that does not hold a scored token (naming the position).
* ``walkthrough`` (the default) is the old constant offset, as a position map.
"""

from __future__ import annotations

import pytest
import torch

from lightning_opd.losses import TeacherSignal
from lightning_opd.rollout.batch import collate_trajectories
from lightning_opd.rollout.chat import ChatFormat
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory
from lightning_opd.teachers import PrivilegedTeacher
from lightning_opd.teachers.privileged_views import (HINT_FORMAT, TeacherView, TeacherViewError, expert_next_actions,
                                                     hinted_user_text, next_action_view, teacher_view,
                                                     walkthrough_view)
from tests.helpers import KeywordEnvFactory, make_model, make_tokenizer
from tests.teachers.test_privileged_teacher import SYSTEM, _hint, episode
from tests.test_configs import CONF, build, games_dir, search_qa_dir  # noqa: F401 (fixtures)

S, K, F = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K, TeacherSignal.FULL_VOCAB
FIRST, OBS = "Goal: say key", "Again."


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def two_turns(tok, replies=("banana", "key")) -> Trajectory:
    """Two turns rendered like the agent loop: text replies ending on EOS, one user turn between them."""
    chat = ChatFormat(tok, SYSTEM)
    traj = Trajectory(task_id="key", seed=0)
    traj.messages.append({"role": "user", "content": FIRST})
    traj.append(chat.first_prompt(FIRST), assistant=False, turn=NON_ASSISTANT)
    for turn, reply in enumerate(replies):
        ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        traj.append(ids, assistant=True, turn=turn, logprobs=[-1.0] * len(ids))
        traj.turn_versions.append(0)
        traj.messages.append({"role": "assistant", "content": reply})
        if turn == 0:
            traj.append(chat.user_turn(OBS), assistant=False, turn=NON_ASSISTANT)
            traj.messages.append({"role": "user", "content": OBS})
    return traj


def test_hint_text_is_one_format():
    assert HINT_FORMAT == "Hint: the next command is: {action}"
    assert hinted_user_text("obs", "open door") == "obs\n\nHint: the next command is: open door"
    assert hinted_user_text("obs", None) == "obs"


def test_next_action_view_and_position_map_by_hand(tok):
    traj = two_turns(tok)
    chat = ChatFormat(tok, SYSTEM)
    view = next_action_view(traj, {0: "key", 1: "key"}, chat)
    # by hand: first prompt 49 tokens (71 hinted), user turn 23 (45 hinted): each hint adds 22 tokens
    assert [len(chat.first_prompt(FIRST)), len(chat.first_prompt(hinted_user_text(FIRST, "key")))] == [49, 71]
    assert [len(chat.user_turn(OBS)), len(chat.user_turn(hinted_user_text(OBS, "key")))] == [23, 45]
    reply0 = [j for j, k in enumerate(traj.turn_index) if k == 0]
    reply1 = [j for j, k in enumerate(traj.turn_index) if k == 1]
    assert reply0 == [49, 50, 51, 52, 53] and reply1 == [77, 78]
    assert [view.positions[j] for j in reply0] == [71, 72, 73, 74, 75]  # + 22
    assert [view.positions[j] for j in reply1] == [121, 122]  # + 44
    assert [j for j, k in enumerate(view.kept) if k] == reply0 + reply1
    assert all(view.ids[view.positions[j]] == traj.token_ids[j] for j in reply0 + reply1)
    assert len(view.ids) == traj.num_tokens + 44 and len(view.positions) == traj.num_tokens
    # the view is the template's render of the hinted conversation (text replies re-tokenise exactly here)
    full = tok.apply_chat_template([
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": hinted_user_text(FIRST, "key")},
        {"role": "assistant", "content": "banana"}, {"role": "user", "content": hinted_user_text(OBS, "key")},
        {"role": "assistant", "content": "key"}], tokenize=True, return_dict=False)
    assert list(full)[:len(view.ids)] == view.ids and tok.decode(list(full)[len(view.ids):]) == "\n"
    assert tok.decode(view.ids).count("Hint: the next command is: key") == 2
    assert "Hint" not in tok.decode(traj.token_ids)  # the student never sees it
    # prompt and user-turn tokens map into their replacements, aligned at the end (the generation prompt's last token)
    assert view.positions[48] == 70 and view.positions[76] == 120 and view.positions[0] == 22


def test_a_turn_without_an_expert_action_gets_no_hint(tok):
    traj = two_turns(tok)
    view = next_action_view(traj, {0: "key"}, ChatFormat(tok, SYSTEM))
    assert [view.positions[j] for j in (77, 78)] == [99, 100]  # + 22: the user turn is the student's
    assert view.ids[71 + 5:] == traj.token_ids[49 + 5:]
    # expert_next_actions gives the hints: "banana" is not the expert's "key", so both turns are hinted "key"
    assert expert_next_actions(traj, ["key"]) == {0: "key", 1: "key"}
    assert expert_next_actions(two_turns(tok, ("key", "key")), ["key"]) == {0: "key"}  # taken at turn 0: none left


def test_a_user_turn_that_is_not_its_render_is_refused(tok):
    traj = two_turns(tok)
    traj.token_ids[60] = (traj.token_ids[60] + 1) % 250
    with pytest.raises(TeacherViewError, match=r"task 'key'.*position 60"):
        next_action_view(traj, {0: "key", 1: "key"}, ChatFormat(tok, SYSTEM))
    traj = two_turns(tok)
    traj.messages = traj.messages[:2]  # the second user message lost
    with pytest.raises(TeacherViewError, match="user turn at position 54 has no user message"):
        next_action_view(traj, {0: "key"}, ChatFormat(tok, SYSTEM))


def test_next_action_view_of_an_agent_loop_episode(tok):
    """An episode the agent loop played (3 turns: the expert's word, a word it does not know, the word again; cut
    replies get an end-of-turn id): the view keeps every reply token and hints each turn."""
    from lightning_opd.rollout import AgentLoop, EpisodeSpec
    from lightning_opd.rollout.scripted import ScriptedGenerator

    replies = iter(["key", "pear", "key"])
    env = KeywordEnvFactory(need=2)
    traj = AgentLoop(env, ScriptedGenerator(tok, lambda r: next(replies)), tok, max_turns=3).run(
        [EpisodeSpec("key")], SamplingParams())[0]
    assert traj.num_turns == 3 and traj.success
    hints = expert_next_actions(traj, env.expert_actions("key"))
    assert hints == {0: "key", 1: "key", 2: "key"}  # "key" taken at turn 0; "pear" is not the next one
    view = next_action_view(traj, hints, ChatFormat(tok, env.system_prompt))
    replies_at = [j for j, k in enumerate(traj.turn_index) if k >= 0]
    assert [j for j, k in enumerate(view.kept) if k] == replies_at
    assert all(view.ids[view.positions[j]] == traj.token_ids[j] for j in replies_at)
    assert tok.decode(view.ids).count("Hint: the next command is: key") == 3


def test_walkthrough_view_is_the_constant_offset(tok):
    traj = episode(tok)
    chat = ChatFormat(tok, SYSTEM)
    ids, offset = teacher_view(traj, _hint("key"), chat)
    view = walkthrough_view(traj, _hint("key"), chat)
    n = len(chat.first_prompt(traj.messages[0]["content"]))
    assert view.ids == ids and view.positions == list(range(n)) + [j + offset for j in range(n, traj.num_tokens)]
    assert view.kept == [j >= n for j in range(traj.num_tokens)]


# ---------------------------------------------------------------------------------------------- the scores
def _teacher(tok, model, cls=PrivilegedTeacher) -> PrivilegedTeacher:
    t = cls("frozen", view="next_action")
    t.bind(tok, len(tok))
    t.attach_envs(KeywordEnvFactory())  # no privileged text: the next_action view needs only the expert
    t.attach_student(model)
    return t


def test_scores_at_mapped_positions_equal_the_forward_over_the_view(tok):
    model = make_model(tok, seed=3)
    trajs = [episode(tok, task="key", seed=1), episode(tok, task="apple", seed=2)]
    batch = collate_trajectories(trajs, SamplingParams(temperature=0.7), pad_id=tok.pad_token_id)
    t = _teacher(tok, model)
    assert "view=next_action" in t.name
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    got = t.score(batch, rows, cols, (S, K, F), temperature=0.7, top_k=5, chunk_size=4)
    chat = ChatFormat(tok, SYSTEM)
    for r, traj in enumerate(trajs):
        view = next_action_view(traj, {0: traj.task_id, 1: traj.task_id, 2: traj.task_id}, chat)  # random replies
        assert tok.decode(view.ids).count(f"Hint: the next command is: {traj.task_id}") == 3
        sel = rows == r
        at = torch.tensor([view.positions[c + 1] - 1 for c in cols[sel].tolist()])
        with torch.no_grad():
            out = model(input_ids=torch.tensor([view.ids]), output_hidden_states=True)
        lp = torch.log_softmax(out.logits[0, at].float() / 0.7, -1)
        targets = batch.input_ids[r, 1:][cols[sel]]
        assert torch.equal(torch.tensor(view.ids)[at + 1], targets)  # the student's tokens at their ids
        torch.testing.assert_close(got.sampled_logprobs[sel], lp.gather(-1, targets[:, None])[:, 0], atol=1e-5, rtol=0)
        top = lp.topk(5, -1)
        assert torch.equal(got.topk_ids[sel], top.indices)
        torch.testing.assert_close(got.hidden[sel], out.hidden_states[-1][0, at], atol=1e-5, rtol=0)
    # the hint-use metric counts the hinted turns (3 turns per episode, each with an expert action)
    assert t.hint_totals["turns"] == 6 and t.stats["hint_turns"] == 6


class BrokenView(PrivilegedTeacher):
    """A view that drops one reply token's id: the check must catch it."""

    def episode_view(self, traj):
        view = super().episode_view(traj)
        j = traj.assistant_mask.index(1) + 1  # the second token of the first reply
        ids = list(view.ids)
        ids[view.positions[j]] = (ids[view.positions[j]] + 1) % 250
        return TeacherView(ids, view.positions, view.kept)


def test_a_view_that_does_not_hold_a_scored_token_is_refused(tok):
    traj = episode(tok, task="key", seed=1)
    batch = collate_trajectories([traj], SamplingParams(), pad_id=tok.pad_token_id)
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    j = traj.assistant_mask.index(1) + 1
    with pytest.raises(TeacherViewError, match=rf"row 0: the student's token at position {j} .* next_action view"):
        _teacher(tok, make_model(tok, seed=3), BrokenView).score(batch, rows, cols, (S,))


def test_next_action_needs_an_expert_and_a_known_view(tok):
    class NoExpert(KeywordEnvFactory):
        def expert_actions(self, task_id):
            raise NotImplementedError("no expert")

    t = PrivilegedTeacher("frozen", view="next_action")
    t.bind(tok, len(tok))
    t.attach_envs(NoExpert())
    t.attach_student(make_model(tok, seed=3))
    batch = collate_trajectories([episode(tok)], SamplingParams(), pad_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="NoExpert has no expert actions for task 'key'"):
        t.view_batch(batch)
    with pytest.raises(ValueError, match="view='whole'"):
        PrivilegedTeacher(view="whole")


# ------------------------------------------------------------------------------------------------ YAML
@pytest.mark.filterwarnings("ignore:No seed found")
def test_hint_overlay_composes_on_the_self_distillation_recipe(model_dirs, games_dir, search_qa_dir, tmp_path, isolate):
    """The overlay's ``Use:`` line: self_distill.yaml's teacher with the next_action view, the rest kept."""
    files = [CONF / "textworld/self_distill.yaml", CONF / "textworld/self_distill_hint.yaml"]
    cli, _, _ = build(files, model_dirs, {"games_dir": games_dir, "data_dir": search_qa_dir}, tmp_path)
    t = cli.model.teacher
    assert isinstance(t, PrivilegedTeacher) and (t.view, t.weights, t.ema_decay, t.placement) == (
        "next_action", "frozen", 0.99, "before_observation")
    assert cli.trainer.logger.name == "self_distill_hint"
