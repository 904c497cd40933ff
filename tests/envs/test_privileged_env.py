"""``WithPrivilegedContext`` and ``lightning-opd evaluate --privileged-context``: the policy sees each task's
privileged text before its first observation (exactly the privileged teacher's ``before_observation`` view), an
environment without it is refused naming it."""

from __future__ import annotations

import json

import pytest

from lightning_opd.cli import main
from lightning_opd.envs.privileged import WithPrivilegedContext
from lightning_opd.rollout import AgentLoop, EpisodeSpec, SamplingParams
from lightning_opd.rollout.chat import ChatFormat
from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies
from lightning_opd.teachers.privileged_views import privileged_messages
from tests.helpers import KeywordEnvFactory
from tests.teachers.test_privileged_teacher import HintedKeywordEnvFactory, _hint


def test_the_first_message_starts_with_the_privileged_text_as_in_the_teachers_view(tokenizer):
    inner = HintedKeywordEnvFactory()
    env = WithPrivilegedContext(inner)
    assert env.train_tasks() == inner.train_tasks() and env.eval_tasks() == inner.eval_tasks()
    assert env.system_prompt == inner.system_prompt
    plain, hinted = inner.make("key").reset(), env.make("key").reset()
    assert hinted == f"{_hint('key')}\n\n{plain}"
    # the policy's first prompt = the teacher's before_observation view of the plain episode's first prompt
    chat = ChatFormat(tokenizer, inner.system_prompt)
    view = chat.render(privileged_messages(inner.system_prompt, plain, _hint("key"), "before_observation"),
                       add_generation_prompt=True)
    assert chat.first_prompt(hinted) == view
    # and the episode plays on: the expert's actions win it
    expert = ScriptedGenerator(tokenizer, walkthrough_replies({"key": inner.expert_actions("key")}))
    (traj,) = AgentLoop(env, expert, tokenizer, max_turns=4).run([EpisodeSpec("key")], SamplingParams())
    assert traj.success and traj.messages[0]["content"] == hinted


def test_an_environment_without_privileged_context_is_refused():
    with pytest.raises(ValueError, match="KeywordEnvFactory provides no privileged context"):
        WithPrivilegedContext(KeywordEnvFactory())


def test_evaluate_with_privileged_context(model_dirs, tmp_path):
    out = tmp_path / "r.json"
    main(["evaluate", "--env", "tests.teachers.test_privileged_teacher.HintedKeywordEnvFactory", "--backend", "hf",
          "--device", "cpu", "--max-turns", "2", "--max-new-tokens", "4", "--max-context-tokens", "512", "--avg-k", "0",
          "--students", model_dirs["student"], "--privileged-context", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["config"]["env"]["privileged_context"] is True
    assert len(res["students"][0]["greedy"]) == len(HintedKeywordEnvFactory().eval_tasks())
    with pytest.raises(ValueError, match="KeywordEnvFactory provides no privileged context"):
        main(["evaluate", "--env", "tests.helpers.KeywordEnvFactory", "--backend", "hf", "--device", "cpu",
              "--avg-k", "0", "--students", model_dirs["student"], "--privileged-context", "--out",
              str(tmp_path / "x.json")])
