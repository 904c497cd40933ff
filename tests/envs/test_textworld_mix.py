"""Mixed TextWorld game sets (lightning_opd/envs/textworld_mix.py, issue 63 design 1): two real tiny sets of different
quest lengths merged, read by the factory and won by their walkthroughs; the refusals, on hand-written manifests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_opd.envs.textworld_env import TextWorldEnvFactory
from lightning_opd.envs.textworld_games import GameSpec, make_games
from lightning_opd.envs.textworld_mix import describe, merge_game_sets, quest_length_of

pytestmark = pytest.mark.filterwarnings("ignore:Game .* is not fully supported")


# ------------------------------------------------------------------------------- real games (about 15 s)
@pytest.fixture(scope="module")
def real_sets(tmp_path_factory):
    """Quest length 1 and quest length 2 (two rooms, three objects), 2 training and 1 held-out game each."""
    root = tmp_path_factory.mktemp("mix")
    return [make_games(root / f"q{n}", num_train=2, num_eval=1, spec=GameSpec(n, 2, 3), seed=5, workers=2,
                       eval_fraction=0.5) for n in (1, 2)]


def test_merged_real_games_load_and_are_won_by_their_walkthroughs(real_sets, tmp_path):
    q1, q2 = real_sets
    src = {n: json.loads((d / "manifest.json").read_text())["games"] for n, d in ((1, q1), (2, q2))}
    out = merge_game_sets(tmp_path / "mix", [q1, q2])
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["num_train"], manifest["num_eval"], manifest["complete"]) == (4, 2, True)
    assert [(s["dir"], s["spec"]["quest_length"], s["train"], s["eval"]) for s in manifest["merged_from"]] == \
        [(str(q1), 1, 2, 1), (str(q2), 2, 2, 1)]
    games = manifest["games"]
    # interleaved within each split, in the sources' order; ids carry the length; the splits are the sources'
    t1 = [g["task_id"] for g in src[1] if g["split"] == "train"]
    t2 = [g["task_id"] for g in src[2] if g["split"] == "train"]
    e1 = [g["task_id"] for g in src[1] if g["split"] == "eval"]
    e2 = [g["task_id"] for g in src[2] if g["split"] == "eval"]
    assert [g["task_id"] for g in games] == [f"q1-{t1[0]}", f"q2-{t2[0]}", f"q1-{t1[1]}", f"q2-{t2[1]}",
                                             f"q1-{e1[0]}", f"q2-{e2[0]}"]
    for g in games:
        n = g["quest_length"]
        original = next(s for s in src[n] if s["task_id"] == g["source_task_id"])
        assert quest_length_of(g["task_id"]) == n and g["source"] == str({1: q1, 2: q2}[n])
        assert [g[k] for k in ("split", "hash", "walkthrough")] == [original[k] for k in ("split", "hash", "walkthrough")]
        assert g["file"] == f"{g['split']}/{g['task_id']}.z8" and (out / g["file"]).with_suffix(".json").is_file()
        assert (out / g["file"]).read_bytes() == (Path(g["source"]) / original["file"]).read_bytes()
    factory = TextWorldEnvFactory(str(out), repeat_goal=False)
    assert factory.train_tasks() == [g["task_id"] for g in games[:4]]
    assert factory.eval_tasks() == [g["task_id"] for g in games[4:]]
    for task in factory.train_tasks() + factory.eval_tasks():
        env = factory.make(task)
        env.reset()
        results = [env.step(a) for a in factory.expert_actions(task)]
        env.close()
        assert results[-1].won, task
    assert describe(out) == [
        f"quest length {n}: 2 train, 1 held-out games; expert walkthroughs "
        f"{min(len(g['walkthrough']) for g in src[n])}-{max(len(g['walkthrough']) for g in src[n])} commands"
        for n in (1, 2)]
    # the first N of each split per source
    small = json.loads((merge_game_sets(tmp_path / "small", [q2, q1], num_train=1, num_eval=0)
                        / "manifest.json").read_text())
    assert [g["task_id"] for g in small["games"]] == [f"q2-{t2[0]}", f"q1-{t1[0]}"]


# --------------------------------------------------------------------------------- hand-written sets
def _fake_set(path: Path, quest_length: int | None, train: int, evals: int, tag: str, complete=True, **extra) -> Path:
    """A make-games-shaped folder: ``train`` + ``evals`` games with dummy .z8/.json files whose bytes name them."""
    games = []
    for split, n in (("train", train), ("eval", evals)):
        (path / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            task = f"{split}-s{i:05d}"
            (path / split / f"{task}.z8").write_text(f"{tag} {task} z8")
            (path / split / f"{task}.json").write_text(f"{tag} {task} logic")
            games.append({"task_id": task, "split": split, "file": f"{split}/{task}.z8", "seed": i,
                          "hash": f"{tag}-{task}", "walkthrough": ["go"] * (quest_length or 1), "objective": "win"})
    spec = None if quest_length is None else {"quest_length": quest_length, "world_size": 3, "nb_objects": 6}
    (path / "manifest.json").write_text(json.dumps({"spec": spec, "seed": 0, "num_train": train, "num_eval": evals,
                                                    "eval_fraction": 0.2, "complete": complete, **extra,
                                                    "games": games}))
    return path


def test_unequal_sets_interleave_and_the_files_are_copied(tmp_path):
    a = _fake_set(tmp_path / "a", 3, train=3, evals=1, tag="a")
    b = _fake_set(tmp_path / "b", 6, train=1, evals=2, tag="b")
    out = merge_game_sets(tmp_path / "mix", [a, b])
    games = json.loads((out / "manifest.json").read_text())["games"]
    assert [g["task_id"] for g in games] == ["q3-train-s00000", "q6-train-s00000", "q3-train-s00001",
                                             "q3-train-s00002", "q3-eval-s00000", "q6-eval-s00000", "q6-eval-s00001"]
    assert (out / "eval" / "q6-eval-s00001.z8").read_text() == "b eval-s00001 z8"
    assert (out / "eval" / "q6-eval-s00001.json").read_text() == "b eval-s00001 logic"
    assert [quest_length_of(g["task_id"]) for g in games] == [g["quest_length"] for g in games] == [3, 6, 3, 3, 3, 6, 6]
    assert quest_length_of("eval-s00001") is None and quest_length_of("q12-x") == 12


@pytest.mark.parametrize(("case", "error", "match"), [
    ("one source", ValueError, r"at least two game sets \(got 1"),
    ("same length", ValueError, r"both hold quest-3 games; give one set per quest length"),
    ("incomplete", ValueError, r"is not a complete make-games output \(\"complete\": False\)"),
    ("no manifest", FileNotFoundError, r"missing manifest\.json.*lightning-opd make-games --out"),
    ("merged source", ValueError, r"is itself a merged set"),
    ("no quest length", ValueError, r"spec\.quest_length=None is not a quest length"),
    ("too few", ValueError, r"has 1 eval games, fewer than the 2 asked for \(--eval\)"),
    ("shared game", ValueError, r"eval-s00000 \(eval\) of .*b is the same game as train-s00000 \(train\) of .*a"),
    ("out is a source", ValueError, r"is also a source"),
    ("nothing", ValueError, r"nothing to merge"),
    ("negative", ValueError, r"num_train=-1 must be >= 0"),
    ("missing file", FileNotFoundError, r"train-s00001\.json is listed in .*manifest\.json but missing"),
])
def test_bad_sources_are_refused_and_nothing_is_written(case, error, match, tmp_path):
    a = _fake_set(tmp_path / "a", 3, train=2, evals=2, tag="a")
    b = _fake_set(tmp_path / "b", 6, train=2, evals=1, tag="b")
    out, kwargs = tmp_path / "out", {}
    sources = [a, b]
    if case == "one source":
        sources = [a]
    elif case == "same length":
        sources = [a, _fake_set(tmp_path / "c", 3, 1, 1, "c")]
    elif case == "incomplete":
        sources = [a, _fake_set(tmp_path / "c", 5, 1, 1, "c", complete=False)]
    elif case == "no manifest":
        sources = [a, tmp_path / "empty"]
    elif case == "merged source":
        sources = [a, _fake_set(tmp_path / "c", 5, 1, 1, "c", merged_from=[{"dir": "x"}])]
    elif case == "no quest length":
        sources = [a, _fake_set(tmp_path / "c", None, 1, 1, "c")]
    elif case == "too few":
        kwargs = {"num_eval": 2}
    elif case == "shared game":
        manifest = json.loads((b / "manifest.json").read_text())
        next(g for g in manifest["games"] if g["split"] == "eval")["hash"] = "a-train-s00000"
        (b / "manifest.json").write_text(json.dumps(manifest))
    elif case == "out is a source":
        out = b
    elif case == "nothing":
        kwargs = {"num_train": 0, "num_eval": 0}
    elif case == "negative":
        kwargs = {"num_train": -1}
    elif case == "missing file":
        (b / "train" / "train-s00001.json").unlink()
    if case != "out is a source":
        out.mkdir()
        (out / "kept").write_text("x")
    with pytest.raises(error, match=match):
        merge_game_sets(out, sources, **kwargs)
    if case != "out is a source":
        assert [p.name for p in out.iterdir()] == ["kept"]  # left as it was
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging folder left behind
