"""TextWorld adapter: action parsing, prompt formatting, game generation with disjoint splits, the
environment itself (walkthrough wins; F11 invalid actions change nothing) and the agent loop on it.

Five tiny games (quest length 2, two rooms) are generated once per session (about 10 s)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from lightning_opd.envs.textworld_env import (
    SYSTEM_PROMPT,
    TextWorldEnv,
    TextWorldEnvFactory,
    clean_feedback,
    format_observation,
    parse_action,
    visible_commands,
)
from lightning_opd.cli import main as cli_main
from lightning_opd.envs import textworld_games
from lightning_opd.envs.textworld_games import GameSpec, _game_hash, in_eval_split, make_games, seed_budget
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies

NUM_TRAIN, NUM_EVAL, SEED = 3, 2, 123
SPEC = GameSpec(quest_length=2, world_size=2, nb_objects=3)
# jericho warns that generated games lack its score/move detection; TextWorld tracks the score itself
pytestmark = pytest.mark.filterwarnings("ignore:Game .* is not fully supported")

SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=16)
INVALID_TAIL = " is not a valid command here. Reply with one command from the list."

# ---------------------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize(("reply", "action"), [
    ("take key", "take key"),
    ("\n\n   Take Key  \ngo north", "take key"),  # first non-empty line only
    ("go north\ntake key", "go north"),
    ("> go north", "go north"),
    (">>> go north", "go north"),
    ("- open box", "open box"),
    ("* open box", "open box"),
    ("Command: take key", "take key"),
    ("action:take key", "take key"),
    ("ACTION :   take key", "take key"),
    ('"take key"', "take key"),
    ("`take key`", "take key"),
    ("'go west'", "go west"),
    ("take key.", "take key"),
    ("> `Take   the\tKEY.`", "take the key"),
    ("Command: open chest.\nI think this is right.", "open chest"),
    ("```\ntake key\n```", "take key"),  # a line of only backticks is empty
    ('"take key".', "take key"),  # quote and period in either order
    ("...\ntake key", "take key"),  # a line of only dots is empty
    ("- Action: take key", "take key"),  # stacked prefixes
    ("> Go North!", "go north"),
    ("", ""),
    ("   \n \t\n", ""),
])
def test_parse_action(reply, action):
    assert parse_action(reply) == action


@pytest.mark.parametrize(("text", "max_chars", "out"), [
    ("You see a key.\n\n> ", 600, "You see a key."),  # the prompt line is cut
    ("a\n> b\n> c", 600, "a > b"),  # at the *last* "\n>"
    ("  a   b \n c\t", 600, "a b c"),  # no prompt: whitespace collapsed only
    ("> look", 600, "> look"),  # a ">" not after a newline is kept
    ("0123456789", 3, "789"),  # the last max_chars characters
    ("a    b\n\n> prompt", 3, "a b"),  # collapsed before counting
    ("0123456789\n>", 0, "0123456789"),  # 0: keep everything
])
def test_clean_feedback(text, max_chars, out):
    assert clean_feedback(text, max_chars) == out


def test_clean_feedback_default_keeps_600_chars():
    assert clean_feedback("x" * 700 + "yz") == "x" * 598 + "yz"


def test_visible_commands_hide_examine_look_inventory():
    cmds = ["examine box", "look", "inventory", "open box", "lock door", "go east", "take lookout map"]
    assert visible_commands(cmds) == ["open box", "lock door", "go east", "take lookout map"]


def test_format_observation():
    cmds = ["take key", "examine key", "look", "inventory", "go north"]
    assert format_observation("You see a key.", cmds) == "Observation: You see a key.\nCommands: take key, go north"
    assert format_observation("You see a key.", cmds, goal="Find  the\nkey.") == (
        "Goal: Find the key.\nObservation: You see a key.\nCommands: take key, go north")
    assert format_observation("Dark.", []) == "Observation: Dark.\nCommands: "


@pytest.mark.parametrize(("prefix", "fraction", "held_out"), [
    ("00000000", 0.1, True),
    ("00000000", 0.0, False),  # nothing is held out at fraction 0
    ("7fffffff", 0.5, True),
    ("80000000", 0.5, False),  # exactly 0.5 is not below 0.5
    ("3fffffff", 0.25, True),
    ("40000000", 0.25, False),
    ("ffffffff", 1.0, True),  # everything is held out at fraction 1
])
def test_in_eval_split(prefix, fraction, held_out):
    # only the first 8 hex digits count
    assert in_eval_split(prefix + "0" * 56, fraction) is held_out
    assert in_eval_split(prefix + "f" * 56, fraction) is held_out


def test_game_hash_covers_content_only():
    game = {"world": [1], "quests": [2], "infos": {"a": 3}, "objective": "eat"}
    assert _game_hash(game) == _game_hash({**game, "metadata": {"seed": 9}})  # seeds etc. do not count
    assert _game_hash(game) != _game_hash({**game, "objective": "drink"})
    assert len(_game_hash(game)) == 64


# ------------------------------------------------------------------------------------------ generated games


@pytest.fixture(scope="session")
def games_dir(tmp_path_factory):
    return make_games(tmp_path_factory.mktemp("tw") / "games", num_train=NUM_TRAIN, num_eval=NUM_EVAL, spec=SPEC,
                      seed=SEED, workers=2)


@pytest.fixture(scope="session")
def manifest(games_dir):
    return json.loads((games_dir / "manifest.json").read_text())


@pytest.fixture(scope="session")
def factory(games_dir):
    """Goal on the first message only, so later observations are exactly comparable."""
    return TextWorldEnvFactory(str(games_dir), repeat_goal=False)


def test_manifest(games_dir, manifest):
    assert manifest["spec"] == {"quest_length": 2, "world_size": 2, "nb_objects": 3}
    assert (manifest["seed"], manifest["num_train"], manifest["num_eval"]) == (SEED, NUM_TRAIN, NUM_EVAL)
    games = manifest["games"]
    assert [g["split"] for g in games] == ["train"] * NUM_TRAIN + ["eval"] * NUM_EVAL
    for g in games:
        assert g["task_id"] == f"{g['split']}-s{g['seed']:05d}"
        assert g["file"] == f"{g['split']}/{g['task_id']}.z8"
        assert g["seed"] >= SEED
        assert (games_dir / g["file"]).is_file()
        assert (games_dir / g["file"]).with_suffix(".json").is_file()  # the game logic, next to the .z8
        assert in_eval_split(g["hash"], 0.2) is (g["split"] == "eval")
        assert 1 <= len(g["walkthrough"]) <= SPEC.quest_length and g["objective"]
    assert len({g["seed"] for g in games}) == len({g["hash"] for g in games}) == NUM_TRAIN + NUM_EVAL
    train = {g["hash"] for g in games if g["split"] == "train"}
    held_out = {g["hash"] for g in games if g["split"] == "eval"}
    assert not train & held_out
    # nothing else is left in the output folder (the generator's seed*.z8 files are moved or removed)
    assert sorted(p.name for p in games_dir.iterdir()) == ["eval", "manifest.json", "train"]
    assert len(list((games_dir / "train").iterdir())) == 2 * NUM_TRAIN
    assert len(list((games_dir / "eval").iterdir())) == 2 * NUM_EVAL


def test_factory(games_dir, manifest, factory):
    games = manifest["games"]
    assert factory.train_tasks() == [g["task_id"] for g in games if g["split"] == "train"]
    assert factory.eval_tasks() == [g["task_id"] for g in games if g["split"] == "eval"]
    assert factory.system_prompt == SYSTEM_PROMPT
    for g in games:
        assert factory.expert_actions(g["task_id"]) == g["walkthrough"]
        assert factory.game_file(g["task_id"]) == games_dir / g["file"]
    with pytest.raises(KeyError, match="nope"):
        factory.game_file("nope")
    small = TextWorldEnvFactory(str(games_dir), num_train=2, num_eval=1)
    assert small.train_tasks() == factory.train_tasks()[:2] and small.eval_tasks() == factory.eval_tasks()[:1]


def _write_manifest(path, manifest):
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps(manifest))
    return str(path)


def test_factory_refuses_overlapping_splits(tmp_path, manifest):
    edited = json.loads(json.dumps(manifest))
    train0 = next(g for g in edited["games"] if g["split"] == "train")
    next(g for g in edited["games"] if g["split"] == "eval")["hash"] = train0["hash"]
    with pytest.raises(ValueError, match=r"overlap \(1 shared hashes\)"):
        TextWorldEnvFactory(_write_manifest(tmp_path / "overlap", edited))


def test_factory_refuses_empty_manifest(tmp_path, manifest):
    with pytest.raises(ValueError, match="no games listed"):
        TextWorldEnvFactory(_write_manifest(tmp_path / "empty", {**manifest, "games": []}))


def test_factory_without_manifest_names_make_games(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing manifest\.json.*lightning-opd make-games --out .*nogames"):
        TextWorldEnvFactory(str(tmp_path / "nogames"))


def test_make_games_gives_up_with_a_clear_error(tmp_path):
    out = tmp_path / "few"
    with pytest.raises(RuntimeError, match=r"after 1 seeds .*increase quest_length"):
        make_games(out, num_train=1, num_eval=1, spec=SPEC, seed=SEED, workers=1, max_attempts=1)
    assert not out.exists()
    # the one game made is kept next to it, the staging folder is gone
    assert [p.name for p in tmp_path.iterdir()] == ["few.incomplete"]
    manifest = json.loads((tmp_path / "few.incomplete" / "manifest.json").read_text())
    assert manifest["complete"] is False and len(manifest["games"]) == 1
    assert (tmp_path / "few.incomplete" / manifest["games"][0]["file"]).is_file()


# -------------------------------------------------------------------------------------- the environment


def _commands_line(message: str) -> str:
    last = message.splitlines()[-1]
    assert last.startswith("Commands: ")
    return last


def _play(env: TextWorldEnv, actions: list[str]):
    return [env.step(a) for a in actions]


def test_reset_message(factory, manifest):
    g = manifest["games"][0]
    env = factory.make(g["task_id"])
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("look")
    try:
        lines = env.reset().splitlines()
    finally:
        env.close()
    assert len(lines) == 3
    assert lines[0] == "Goal: " + " ".join(g["objective"].split())
    assert lines[1].startswith("Observation: ") and len(lines[1]) <= len("Observation: ") + 600
    commands = lines[2][len("Commands: "):].split(", ")
    assert lines[2].startswith("Commands: ") and g["walkthrough"][0] in commands
    assert not [c for c in commands if c.startswith(("examine", "look", "inventory"))]


@pytest.mark.parametrize("index", range(NUM_TRAIN + NUM_EVAL))
def test_walkthrough_wins(factory, manifest, index):
    g = manifest["games"][index]
    env = factory.make(g["task_id"])
    try:
        env.reset()
        results = _play(env, g["walkthrough"])
    finally:
        env.close()
    assert [r.invalid_action for r in results] == [False] * len(results)
    assert [r.done for r in results] == [False] * (len(results) - 1) + [True]
    assert (results[-1].won, results[-1].lost) == (True, False)
    # one quest worth one point: the score goes 0 -> 1, so the score changes sum to 1
    assert sum(r.reward for r in results) == 1.0 and results[-1].reward == 1.0
    assert "You scored 1 out of a possible 1" in results[-1].observation
    assert "Goal:" not in results[0].observation  # the goal is shown on the first turn only


@pytest.mark.parametrize("index", range(NUM_TRAIN + NUM_EVAL))
def test_progress_reward_is_the_share_of_the_quest_done(games_dir, manifest, index):
    """reward="progress": each walkthrough step shortens the game's remaining walkthrough by one of its L
    commands, so it earns exactly 1/L; "look" and an invalid action earn 0; the episode's rewards add up to 1
    (the whole quest) where the score reward gives 0, ..., 0, 1."""
    g = manifest["games"][index]
    walkthrough = g["walkthrough"]
    length = len(walkthrough)
    env = TextWorldEnvFactory(str(games_dir), reward="progress").make(g["task_id"])
    try:
        env.reset()
        assert env.step("xyzzy plugh").reward == 0.0
        assert env.step("look").reward == 0.0  # a valid command that changes nothing
        results = _play(env, walkthrough)
    finally:
        env.close()
    assert [r.reward for r in results] == [1 / length] * length
    assert results[-1].won and sum(r.reward for r in results) == pytest.approx(1.0)


def test_unknown_reward_names_the_key(games_dir):
    with pytest.raises(ValueError, match=r"env.init_args.reward='points'"):
        TextWorldEnvFactory(str(games_dir), reward="points")


def test_invalid_actions_are_observations_and_change_nothing(factory, manifest):
    """F11: empty, garbage and over-long actions come back as the adapter's own observation (not the
    game's reply), flagged invalid_action, with no reward and the same commands; the walkthrough then
    plays out exactly as in a clean episode, observations included."""
    g = manifest["games"][0]
    walkthrough = g["walkthrough"]
    clean = factory.make(g["task_id"])
    try:
        clean.reset()
        expected = _play(clean, walkthrough)
    finally:
        clean.close()

    env = factory.make(g["task_id"])
    try:
        commands = _commands_line(env.reset())
        long = "x" * 2000
        bad = [("", "Empty command. Reply with one command from the list."),
               ("xyzzy plugh", "'xyzzy plugh'" + INVALID_TAIL),
               (long, "'" + "x" * 80 + "'" + INVALID_TAIL)]
        for action, message in bad:
            r = env.step(action)
            assert r == type(r)(observation=f"Observation: {message}\n{commands}", reward=0.0, won=False,
                                lost=False, invalid_action=True)
        first = env.step(walkthrough[0])
        assert first == expected[0]
        if len(walkthrough) > 1:  # invalid actions mid-game too, with the current commands repeated
            r = env.step("xyzzy plugh")
            assert (r.invalid_action, r.reward, r.done) == (True, 0.0, False)
            assert r.observation == f"Observation: 'xyzzy plugh'{INVALID_TAIL}\n{_commands_line(first.observation)}"
        assert _play(env, walkthrough[1:]) == expected[1:]
    finally:
        env.close()


def test_hidden_commands_are_still_valid(factory, manifest):
    g = manifest["games"][0]
    env = factory.make(g["task_id"])
    try:
        env.reset()
        for action in ("look", "inventory"):
            r = env.step(action)
            assert (r.invalid_action, r.reward, r.done) == (False, 0.0, False)
        assert _play(env, g["walkthrough"])[-1].won
    finally:
        env.close()


# -------------------------------------------------------------------------------- the agent loop on TextWorld


def _loop(factory, tokenizer, reply_fn, max_turns=8):
    # the tiny test tokenizer is nearly byte-level, so TextWorld prompts are long in tokens
    return AgentLoop(factory, ScriptedGenerator(tokenizer, reply_fn), tokenizer, max_turns=max_turns,
                     max_context_tokens=200_000)


def test_expert_wins_every_episode(factory, tokenizer):
    tasks = factory.train_tasks() + factory.eval_tasks()
    walkthroughs = {t: factory.expert_actions(t) for t in tasks}
    trajs = _loop(factory, tokenizer, walkthrough_replies(walkthroughs)).run([EpisodeSpec(t) for t in tasks], SAMPLING)
    for task, t in zip(tasks, trajs):
        assert t.task_id == task
        assert (t.success, t.failure, t.truncated, t.env_error, t.invalid_actions) == (True, False, False, False, 0)
        assert t.num_turns == len(walkthroughs[task])
        assert t.total_reward == 1.0
        assert [m["content"] for m in t.messages if m["role"] == "assistant"] == walkthroughs[task]
        assert t.messages[0]["content"].startswith("Goal: ")


@pytest.mark.parametrize(("reply", "expected"), [
    ("dance wildly", "'dance wildly'" + INVALID_TAIL),
    ("", "Empty command. Reply with one command from the list."),
    ("Take " * 400, "'" + "take " * 16 + "'" + INVALID_TAIL),  # over-long: the first 80 characters are echoed
], ids=["garbage", "empty", "over-long"])
def test_garbage_policy_is_counted_and_truncated(factory, tokenizer, reply, expected):
    """F11 through the loop: every turn is an invalid action; the episode runs to the turn limit."""
    tasks = factory.train_tasks()[:2]
    trajs = _loop(factory, tokenizer, lambda r: reply, max_turns=3).run([EpisodeSpec(t) for t in tasks], SAMPLING)
    for t in trajs:
        assert (t.invalid_actions, t.num_turns) == (3, 3)
        assert (t.truncated, t.truncation_reason) == (True, "max_turns")
        assert (t.success, t.failure, t.env_error, t.total_reward) == (False, False, False, 0.0)
        observations = [m["content"] for m in t.messages if m["role"] == "user"][1:]
        assert len(observations) == 2
        assert [o.splitlines()[0] for o in observations] == [f"Observation: {expected}"] * 2


def test_commands_with_capitals_are_matched_ignoring_case():
    """Object names can carry capitals ('type X latchkey'); parse_action lower-cases, so matching must not care."""
    from lightning_opd.envs.textworld_env import TextWorldEnv

    env = TextWorldEnv("unused.z8")
    env._env = type("Fake", (), {"step": lambda self, c: (f"did {c}\n>", 1, False,
                                                          {"admissible_commands": ["look"], "won": True, "lost": False})})()
    env._admissible = ["take type X latchkey", "go east"]
    res = env.step(parse_action("Take type x LATCHKEY."))
    assert not res.invalid_action and res.won and res.reward == 1.0
    assert res.observation.startswith("Observation: did take type X latchkey")


def test_goal_repeated_every_turn_by_default(games_dir, manifest):
    g = manifest["games"][0]
    env = TextWorldEnvFactory(str(games_dir)).make(g["task_id"])
    try:
        first = env.reset()
        goal_line = first.splitlines()[0]
        assert goal_line.startswith("Goal: ")
        results = _play(env, g["walkthrough"][:-1])
        results.append(env.step("xyzzy"))
        assert all(r.observation.splitlines()[0] == goal_line for r in results)
        assert results[-1].invalid_action and results[-1].observation.splitlines()[1].startswith("Observation: ")
    finally:
        env.close()


def test_corrupt_manifest_names_the_file(tmp_path):
    (tmp_path / "manifest.json").write_text('{"games": [')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'manifest.json'} is not valid JSON .*--force"):
        TextWorldEnvFactory(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"spec": {}}))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'manifest.json'} has no 'games' list"):
        TextWorldEnvFactory(str(tmp_path))


def test_seed_budget_is_sized_from_the_split():
    """4 x the seeds the slower split needs on average (a game is held out with probability 0.2) + 20."""
    assert seed_budget(0, 20) == 4 * 100 + 20  # held-out only: 5 seeds per held-out game
    assert seed_budget(200, 50) == 4 * 250 + 20
    assert seed_budget(100, 0) == 4 * 125 + 20  # 100 / 0.8
    assert seed_budget(0, 20, eval_fraction=0.5) == 4 * 40 + 20


def _fake_generate(args):
    """A stand-in for TextWorld: seed s makes game number s // repeat (files written like the real one)."""
    seed, spec, tmp_dir = args
    number = seed // int(os.environ["FAKE_GAME_REPEAT"])
    path = Path(tmp_dir) / f"seed{seed}.z8"
    path.write_text("z8")
    path.with_suffix(".json").write_text("{}")
    return {"seed": seed, "path": str(path), "hash": hashlib.sha256(str(number).encode()).hexdigest(),
            "walkthrough": ["go east"], "objective": f"game {number}"}


def test_held_out_only_games_fit_the_budget(tmp_path, monkeypatch):
    """20 held-out games alone need about 100 distinct games; the old budget (4 x 20 + 20 = 100 seeds) failed
    about half the time, the split-sized one (420) does not."""
    monkeypatch.setenv("FAKE_GAME_REPEAT", "1")
    monkeypatch.setattr(textworld_games, "_generate_one", _fake_generate)
    out = make_games(tmp_path / "g", num_train=0, num_eval=20, workers=1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [g["split"] for g in manifest["games"]] == ["eval"] * 20
    last = max(g["seed"] for g in manifest["games"])
    assert 20 <= last < seed_budget(0, 20)
    held_out = sum(in_eval_split(hashlib.sha256(str(s).encode()).hexdigest(), 0.2) for s in range(last + 1))
    assert held_out == 20  # the 20th held-out game is the last seed used


def test_make_games_says_what_ran_out(tmp_path, monkeypatch):
    monkeypatch.setattr(textworld_games, "_generate_one", _fake_generate)
    monkeypatch.setenv("FAKE_GAME_REPEAT", "1")  # every seed a new game: the seed budget runs out
    with pytest.raises(RuntimeError, match=r"only 0/0 train and \d+/20 held-out games after 30 seeds .*: the seed "
                                           r"budget ran out \(0 repeated games; .*raise max_attempts"):
        make_games(tmp_path / "a", num_train=0, num_eval=20, workers=1, max_attempts=30)
    monkeypatch.setenv("FAKE_GAME_REPEAT", "10")  # ten seeds per game: the game space runs out
    with pytest.raises(RuntimeError, match=r"after 30 seeds .*: the game space ran out: 27 of the 30 seeds repeated "
                                           r"an earlier game; increase quest_length"):
        make_games(tmp_path / "b", num_train=3, num_eval=3, workers=1, max_attempts=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.incomplete", "b.incomplete"]  # no staging folder


def test_make_games_keeps_the_games_it_made_when_the_budget_runs_out(tmp_path, monkeypatch, capsys):
    """Seeds 0-29 are 30 distinct games; the held-out split takes those whose hash falls in the first fifth:
    they are kept in ``<out>.incomplete`` with a manifest marked incomplete, and an existing ``out`` stays."""
    monkeypatch.setattr(textworld_games, "_generate_one", _fake_generate)
    monkeypatch.setenv("FAKE_GAME_REPEAT", "1")
    held_out = [s for s in range(30) if in_eval_split(hashlib.sha256(str(s).encode()).hexdigest(), 0.2)]
    assert 0 < len(held_out) < 20
    out = tmp_path / "games"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    with pytest.raises(SystemExit) as exc:
        cli_main(["make-games", "--out", str(out), "--train", "0", "--eval", "20", "--workers", "1",
                  "--max-attempts", "30", "--force"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert (f"only 0/0 train and {len(held_out)}/20 held-out games after 30 seeds (seeds 0-29) with" in err
            and "the seed budget ran out (0 repeated games;" in err and "--max-attempts, 30 here" in err)
    partial = tmp_path / "games.incomplete"
    assert f"the {len(held_out)} games made are kept in {partial}" in err and "Traceback" not in err
    manifest = json.loads((partial / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["seeds_tried"] == 30 and manifest["num_eval"] == 20
    assert [g["seed"] for g in manifest["games"]] == held_out
    assert all((partial / g["file"]).is_file() and g["split"] == "eval" for g in manifest["games"])
    assert (out / "mine.txt").read_text() == "kept"  # --force replaces out only with a complete set
    assert TextWorldEnvFactory(str(partial)).eval_tasks() == [f"eval-s{s:05d}" for s in held_out]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_observation_chars": -5}, r"data.init_args.env.init_args.max_observation_chars=-5 must be >= 1"),
    ({"max_observation_chars": 0}, r"max_observation_chars=0 must be >= 1"),
    ({"num_train": -1}, r"data.init_args.env.init_args.num_train=-1 must be >= 0"),
    ({"num_eval": -2}, r"data.init_args.env.init_args.num_eval=-2 must be >= 0"),
])
def test_bad_env_knobs_are_refused_at_construction_naming_the_key(tmp_path, kwargs, match):
    """Checked before the manifest is read: the folder does not even need games."""
    with pytest.raises(ValueError, match=match):
        TextWorldEnvFactory(str(tmp_path), **kwargs)


def test_textworld_env_refuses_a_non_positive_observation_limit(tmp_path):
    with pytest.raises(ValueError, match="max_observation_chars=-1 must be >= 1"):
        TextWorldEnv(tmp_path / "game.z8", max_observation_chars=-1)
