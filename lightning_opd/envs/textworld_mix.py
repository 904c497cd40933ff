"""Mixed TextWorld game sets: several ``make-games`` outputs, one quest length each, merged into one games directory
(``lightning-opd merge-games``), e.g. quest-3 and quest-6 games for a task mix whose needed depth varies (issue 63,
design 1: benchmarks/experiments/turnopd_mix.yaml). The result is read by
:class:`~lightning_opd.envs.textworld_env.TextWorldEnvFactory` like any other games directory.

What the merge does and keeps:

- Each source is a complete ``make-games`` output (``"complete": true``) of one quest length, read from its
  manifest's ``spec.quest_length`` (the commands the expert needs). Two sources with the same quest length are
  refused: the length is what tells a source's games apart.
- It copies the first ``num_train`` training and the first ``num_eval`` held-out games of every source (manifest
  order; ``None``: all) with their game logic (``.z8`` and the ``.json`` beside it), and keeps each game's split.
  ``make-games`` put every game in its split by a hash of the game, so no held-out game is a training game unless the
  same game is in two sources: the merge refuses any game (hash) found twice.
- Each game is renamed ``q<L>-<task id>`` (``q6-eval-s00012``): task ids stay unique, and every per-task result
  (``evaluate``'s records) can be split by quest length from its id alone (:func:`quest_length_of`). The manifest
  also records, per game, ``quest_length``, ``source`` (the source directory) and ``source_task_id``.
- Within a split the games are interleaved over the sources in the order given (q3, q6, q3, q6, ...; a longer
  source's remainder last), so the factory's first-N subsets (``num_train``/``num_eval``) are as mixed as the whole.

Output: ``<out>/{train,eval}/q<L>-<task id>.{z8,json}`` and ``<out>/manifest.json`` (``merged_from``: per source its
directory, spec, seed and the numbers of games taken; ``num_train``, ``num_eval``, ``complete``: true; ``games``),
written whole or not at all (:func:`~lightning_opd.files.write_dir_atomic`).
Source: PROPOSED (issue 63, design 1); docs/algorithms.md is silent on task mixes.
"""

from __future__ import annotations

import json
import re
import shutil
from itertools import zip_longest
from pathlib import Path
from typing import Sequence

from lightning_opd.files import write_dir_atomic

SPLITS = ("train", "eval")
_PREFIX = re.compile(r"^q(\d+)-")


def quest_length_of(task_id: str) -> int | None:
    """The quest length a merged game's task id carries (``"q6-eval-s00012"`` -> 6); ``None`` for an id without the
    ``q<L>-`` prefix (a game of a set that was not merged)."""
    m = _PREFIX.match(task_id)
    return int(m.group(1)) if m else None


def _read_source(path: Path) -> tuple[dict, int]:
    """A source's manifest and quest length.

    Raises:
        FileNotFoundError: no manifest.json (names the ``make-games`` command).
        ValueError: not valid JSON, no ``games`` list, not complete, itself a merged set, or no integer
            ``spec.quest_length`` >= 1 (each names the file).
    """
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"no games at {str(path)!r} (missing manifest.json); make them first with "
                                f"`lightning-opd make-games --out {path} --quest-length L ...`")
    try:
        data = json.loads(manifest.read_text())
    except ValueError as err:
        raise ValueError(f"{manifest} is not valid JSON ({err}); regenerate it with `lightning-opd make-games "
                         f"--out {path} --force ...`") from None
    if not isinstance(data, dict) or not isinstance(data.get("games"), list):
        raise ValueError(f"{manifest} has no 'games' list; regenerate it with `lightning-opd make-games`")
    if "merged_from" in data:
        raise ValueError(f"{path} is itself a merged set; merge the make-games outputs it came from "
                         f"({', '.join(str(s.get('dir')) for s in data['merged_from'])})")
    if data.get("complete") is not True:
        raise ValueError(f"{manifest} is not a complete make-games output (\"complete\": {data.get('complete')!r}); "
                         "rerun make-games until it finishes")
    length = (data.get("spec") or {}).get("quest_length")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"{manifest}: spec.quest_length={length!r} is not a quest length (an integer >= 1); is it "
                         "a make-games output?")
    return data, length


def _pick(path: Path, data: dict, split: str, n: int | None) -> list[dict]:
    """The first ``n`` games of ``split`` (all when ``None``). Raises ValueError when the source has fewer."""
    games = [g for g in data["games"] if g.get("split") == split]
    if n is not None and len(games) < n:
        flag = "--train" if split == "train" else "--eval"
        raise ValueError(f"{path} has {len(games)} {split} games, fewer than the {n} asked for ({flag}); lower "
                         f"{flag} or make more games there")
    return games if n is None else games[:n]


def _interleave(columns: Sequence[list]) -> list:
    """``[[a1, a2, a3], [b1]] -> [a1, b1, a2, a3]``: one from each in turn, the longer ones' remainders last."""
    return [x for row in zip_longest(*columns) for x in row if x is not None]


def merge_game_sets(out: str | Path, sources: Sequence[str | Path], num_train: int | None = None,
                    num_eval: int | None = None) -> Path:
    """Merge ``make-games`` outputs of different quest lengths into ``out`` (module docstring).

    Args:
        out: the merged games directory (replaced whole when the merge is done).
        sources: two or more ``make-games`` outputs, one quest length each; their order is the interleaving order.
        num_train, num_eval: games taken per source from each split (the first ones in its manifest); ``None``: all.

    Returns:
        ``out``.

    Raises:
        ValueError: fewer than two sources, a negative count, nothing to merge, ``out`` among the sources, a bad
            source manifest (:func:`_read_source`), two sources with one quest length, a source with fewer games
            than asked, or one game (hash) in two places (its task ids and sources named). Nothing is written then.
        FileNotFoundError: a source without manifest.json, or a game file (``.z8`` or its ``.json``) it lists
            missing (``out`` is left as it was).
    """
    out, paths = Path(out), [Path(s) for s in sources]
    if len(paths) < 2:
        raise ValueError(f"merge needs at least two game sets (got {len(paths)}: {[str(p) for p in paths]})")
    for key, n in (("num_train", num_train), ("num_eval", num_eval)):
        if n is not None and n < 0:
            raise ValueError(f"{key}={n} must be >= 0 (games per source; None = all)")
    if any(p.resolve() == out.resolve() for p in paths):
        raise ValueError(f"--out {out} is also a source; merge into a new directory")
    by_length: dict[int, Path] = {}
    taken: list[tuple[Path, dict, int, dict[str, list[dict]]]] = []
    where: dict[str, str] = {}  # game hash -> "task id of source"
    for path in paths:
        data, length = _read_source(path)
        if length in by_length:
            raise ValueError(f"{by_length[length]} and {path} both hold quest-{length} games; give one set per quest "
                             "length (the length names the merged games: q<L>-<task id>)")
        by_length[length] = path
        picked = {split: _pick(path, data, split, n) for split, n in (("train", num_train), ("eval", num_eval))}
        for g in picked["train"] + picked["eval"]:
            here = f"{g['task_id']} ({g['split']}) of {path}"
            if g["hash"] in where:
                raise ValueError(f"{here} is the same game as {where[g['hash']]} (equal hash): the sets must not "
                                 "share games (a held-out game could then be trained on)")
            where[g["hash"]] = here
        taken.append((path, data, length, picked))
    if not where:
        raise ValueError("nothing to merge: num_train and num_eval select no game")
    games: list[dict] = []
    for split in SPLITS:
        games += _interleave([[{**g, "task_id": f"q{length}-{g['task_id']}", "quest_length": length,
                                "source": str(path), "source_task_id": g["task_id"], "_from": path / g["file"]}
                               for g in picked[split]] for path, _, length, picked in taken])
    for g in games:
        for f in (g["_from"], g["_from"].with_suffix(".json")):
            if not f.is_file():
                raise FileNotFoundError(f"{f} is listed in {Path(g['source']) / 'manifest.json'} but missing; "
                                        f"regenerate that set with `lightning-opd make-games --force`")
    header = {"merged_from": [{"dir": str(path), "spec": data.get("spec"), "seed": data.get("seed"),
                               "eval_fraction": data.get("eval_fraction"), "train": len(picked["train"]),
                               "eval": len(picked["eval"])} for path, data, _, picked in taken],
              "num_train": sum(len(p["train"]) for *_, p in taken), "num_eval": sum(len(p["eval"]) for *_, p in taken),
              "complete": True}

    def write(tmp: Path) -> None:
        listed = []
        for g in games:
            src = g.pop("_from")
            g["file"] = f"{g['split']}/{g['task_id']}{src.suffix}"
            (tmp / g["split"]).mkdir(exist_ok=True)
            shutil.copyfile(src, tmp / g["file"])
            shutil.copyfile(src.with_suffix(".json"), (tmp / g["file"]).with_suffix(".json"))
            listed.append(g)
        (tmp / "manifest.json").write_text(json.dumps({**header, "games": listed}, indent=1))

    return write_dir_atomic(out, write)


def describe(games_dir: str | Path) -> list[str]:
    """One line per quest length of a merged set: its training and held-out games and the length of their expert
    walkthroughs (commands), e.g. ``"quest length 6: 100 train, 25 held-out games; expert walkthroughs 6-6
    commands"``; the turn limit of a run on the set should be above the longest.

    Raises:
        FileNotFoundError: no manifest.json in ``games_dir``.
    """
    games = json.loads((Path(games_dir) / "manifest.json").read_text())["games"]
    lines = []
    for length in sorted({g["quest_length"] for g in games}):
        mine = [g for g in games if g["quest_length"] == length]
        steps = [len(g["walkthrough"]) for g in mine]
        count = {s: sum(g["split"] == s for g in mine) for s in SPLITS}
        lines.append(f"quest length {length}: {count['train']} train, {count['eval']} held-out games; expert "
                     f"walkthroughs {min(steps)}-{max(steps)} commands")
    return lines
