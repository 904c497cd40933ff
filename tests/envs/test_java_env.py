"""The shared base of the Java-engine adapters (lightning_opd/envs/java_env.py) without a JVM: an episode borrows one
engine, discards it when an engine call fails and gives it back on close; a factory's borrowed engine is discarded
when the block raises; task ids on the package's splits; the shared task-id parser. The adapters on their real
engines: tests/envs/test_scienceworld.py and tests/envs/test_textworld_express.py."""

from __future__ import annotations

import pytest

from lightning_opd.envs.base import TaskListFactory, user_message
from lightning_opd.envs.java_engines import EnginePool
from lightning_opd.envs.java_env import JavaEngineEnvFactory, JavaEngineEpisode, parse_world_id
from lightning_opd.envs.textworld_env import choose_command


class FakeEngine:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def fail(self) -> None:
        raise OSError("engine died")


@pytest.fixture(autouse=True)
def _no_jvm(monkeypatch):
    """Engines are built without a Java runtime (launch_engine would set up the JVM's environment)."""
    monkeypatch.setattr("lightning_opd.envs.java_env.launch_engine", lambda start, max_heap_mb: start())


def _pool() -> EnginePool:
    return EnginePool(FakeEngine, lambda e: e.close())


class Factory(JavaEngineEnvFactory):
    @staticmethod
    def _engine_constructor():
        return FakeEngine

    def make(self, task_id):
        raise NotImplementedError

    def expert_actions(self, task_id):
        return ["open door", "go east"]


def test_episode_borrows_one_engine_and_gives_it_back():
    pool = _pool()
    episode = JavaEngineEpisode(pool, max_observation_chars=100, repeat_goal=False)
    with pytest.raises(RuntimeError, match=r"JavaEngineEpisode.step called before reset\(\)"):
        episode._require_engine()
    engine = episode._borrow_engine()
    assert episode._borrow_engine() is engine and pool.size == 1
    episode._goal = "find the coin"
    assert episode._shown_goal is None and episode.parse_action("> Open Door.") == "open door"
    episode.close()
    assert episode._engine is None and pool.acquire() is engine  # idle again, not shut down
    assert not engine.closed


def test_episode_discards_an_engine_whose_call_failed():
    pool = _pool()
    episode = JavaEngineEpisode(pool, max_observation_chars=100, repeat_goal=True)
    engine = episode._borrow_engine()
    with pytest.raises(OSError, match="engine died"):
        episode._call(engine.fail)
    assert engine.closed and episode._engine is None and pool.size == 0


def test_factory_lists_tasks_and_discards_a_borrowed_engine_on_error():
    factory = Factory(num_train=2, num_eval=1, eval_split="dev", max_observation_chars=10, repeat_goal=True,
                      max_heap_mb=64)
    assert isinstance(factory, TaskListFactory)
    worlds = {"train": [0, 1, 2], "dev": [10, 11], "test": [20]}
    factory._add_tasks(worlds, lambda split, w: f"g-{split}-s{w}", 2, 1, "Fake g", "seeds")
    assert factory.train_tasks() == ["g-train-s0", "g-train-s1"] and factory.eval_tasks() == ["g-dev-s10"]
    with pytest.raises(ValueError, match="Fake g: train and dev seeds overlap"):
        factory._add_tasks({"train": [1], "dev": [1]}, str, None, None, "Fake g", "seeds")
    assert factory.privileged_context("x") == "A walkthrough that wins this game: open door; go east"
    with pytest.raises(OSError):
        with factory._borrowed_engine() as engine:
            engine.fail()
    assert engine.closed and factory.pool.size == 0
    with factory._borrowed_engine() as engine:
        pass
    assert factory.pool.size == 1 and not engine.closed
    factory.close()
    assert engine.closed


@pytest.mark.parametrize(("kwargs", "key"), [({"eval_split": "x"}, "eval_split"), ({"num_train": -1}, "num_train"),
                                             ({"max_observation_chars": 0}, "max_observation_chars"),
                                             ({"max_heap_mb": 0}, "max_heap_mb")])
def test_factory_names_the_bad_setting(kwargs, key):
    args = dict(num_train=None, num_eval=None, eval_split="test", max_observation_chars=10, repeat_goal=True,
                max_heap_mb=64) | kwargs
    with pytest.raises(ValueError, match=f"data.init_args.env.init_args.{key}="):
        Factory(**args)


def test_parse_world_id():
    assert parse_world_id("coin-test-s20003", "[a-z]+", "s", "X task id") == ("coin", "test", 20003)
    with pytest.raises(KeyError, match="'coin-test-v3' is not a X task id"):
        parse_world_id("coin-test-v3", "[a-z]+", "s", "X task id")


def test_user_message_and_choose_command():
    assert user_message("You see a door.", "Commands: open door", goal="  find\n the coin ") == \
        "Goal: find the coin\nObservation: You see a door.\nCommands: open door"
    assert user_message("x", "Actions: a", goal=None) == "Observation: x\nActions: a"
    assert choose_command("open door", ["Open Door", "go east"]) == ("Open Door", None)
    assert choose_command("", ["go east"]) == (None, "Empty command. Reply with one command from the list.")
    assert choose_command("fly", ["go east"]) == \
        (None, "'fly' is not a valid command here. Reply with one command from the list.")
