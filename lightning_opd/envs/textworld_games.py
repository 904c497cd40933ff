"""Offline generation of TextWorld games with non-overlapping train / held-out splits.

Games are generated from consecutive seeds with TextWorld's Python API (``make_game`` +
``compile_game``, about 1.5 s each), deduplicated by a hash of their content (different seeds can give
identical games), and assigned to a split *by that hash*: identical games always land in the same
split, so the splits cannot overlap. Quest length is the horizon knob (the expert needs that many
commands). Output: ``<out>/{train,eval}/<task_id>.z8`` and ``<out>/manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class GameSpec:
    """Generation knobs (TextWorld ``tw-make custom`` equivalents)."""

    quest_length: int = 3
    world_size: int = 3
    nb_objects: int = 6


def _game_hash(game_json: dict) -> str:
    content = {k: game_json.get(k) for k in ("world", "quests", "infos", "objective")}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _generate_one(args: tuple[int, GameSpec, str]) -> dict:
    seed, spec, tmp_dir = args
    import textworld
    from textworld.generator import compile_game, make_game

    opts = textworld.GameOptions()
    opts.seeds = seed
    opts.nb_rooms = spec.world_size
    opts.nb_objects = spec.nb_objects
    opts.quest_length = spec.quest_length
    opts.path = os.path.join(tmp_dir, f"seed{seed}.z8")
    opts.force_recompile = True
    game = make_game(opts)
    path = compile_game(game, opts)
    meta = json.loads(Path(path).with_suffix(".json").read_text())
    return {"seed": seed, "path": path, "hash": _game_hash(meta), "walkthrough": list(game.metadata["walkthrough"]),
            "objective": game.objective}


def in_eval_split(game_hash: str, eval_fraction: float) -> bool:
    """Split rule: a game is held out iff the first 8 hex digits of its hash, read as a fraction of
    2**32, fall below ``eval_fraction``."""
    return int(game_hash[:8], 16) / 2**32 < eval_fraction


def seed_budget(num_train: int, num_eval: int, eval_fraction: float = 0.2) -> int:
    """Default seed budget of :func:`make_games`: ``4 * ceil(max(num_train / (1 - f), num_eval / f)) + 20``
    with ``f = eval_fraction``, i.e. four times the seeds needed on average to fill the slower split
    (held-out games alone: ``num_eval / f`` seeds, five per game at ``f = 0.2``), plus 20."""
    return 4 * math.ceil(max(num_train / (1.0 - eval_fraction), num_eval / eval_fraction)) + 20


INCOMPLETE_SUFFIX = ".incomplete"  # where make_games keeps the games of an attempt that ran out


def _finish(stage: Path, splits: dict[str, list[dict]], header: dict, out: Path) -> None:
    """Move the generated games of ``splits`` into ``stage/{train,eval}/``, write ``stage/manifest.json``
    (``header`` plus the games) and rename ``stage`` to ``out``, replacing an existing ``out``."""
    games = []
    for split, items in splits.items():
        (stage / split).mkdir(parents=True, exist_ok=True)
        for res in items:
            task_id = f"{split}-s{res['seed']:05d}"
            # the .json next to the .z8 carries the game's logic (admissible commands need it)
            shutil.move(res["path"], stage / split / f"{task_id}.z8")
            shutil.move(str(Path(res["path"]).with_suffix(".json")), stage / split / f"{task_id}.json")
            games.append({"task_id": task_id, "split": split, "file": f"{split}/{task_id}.z8", "seed": res["seed"],
                          "hash": res["hash"], "walkthrough": res["walkthrough"], "objective": res["objective"]})
    for leftover in stage.glob("seed*"):
        leftover.unlink()
    (stage / "manifest.json").write_text(json.dumps({**header, "games": games}, indent=1))
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage.rename(out)


def _check_counts(num_train: int, num_eval: int, eval_fraction: float) -> None:
    """Raises ValueError for a negative count, no game asked for, or ``eval_fraction`` outside (0, 1)."""
    if num_train < 0 or num_eval < 0 or num_train + num_eval < 1:
        raise ValueError(f"num_train={num_train}, num_eval={num_eval}: both must be >= 0 and one >= 1")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")


def _exhaustion_cause(tried: int, repeats: int, eval_fraction: float, max_attempts: int) -> str:
    """Why ``tried`` seeds did not give enough games: the game space (most seeds repeated a game) or the budget."""
    if repeats > tried // 2:
        return (f"the game space ran out: {repeats} of the {tried} seeds repeated an earlier game; "
                "increase quest_length, world_size or nb_objects")
    return (f"the seed budget ran out ({repeats} repeated games; a game falls in the held-out "
            f"split with probability {eval_fraction}): raise max_attempts (--max-attempts, "
            f"{max_attempts} here); increase quest_length, world_size or nb_objects only if most "
            "seeds repeat")


def _keep_partial(stage: Path, splits: dict[str, list[dict]], header: dict, out: Path) -> str:
    """Keep the games made so far in ``<out>.incomplete`` (or drop the empty stage); returns what was kept, in
    words, for the error message."""
    made = sum(map(len, splits.values()))
    if not made:
        shutil.rmtree(stage, ignore_errors=True)
        return "no game was made"
    partial = out.with_name(out.name + INCOMPLETE_SUFFIX)
    _finish(stage, splits, header, partial)
    return (f"the {made} games made are kept in {partial} (manifest.json marked \"complete\": false; "
            f"{out} is untouched)")


def _seeds_needed(want: dict[str, int], splits: dict[str, list[dict]], share: dict[str, float], workers: int) -> int:
    """Seeds expected to fill what is missing, each split filling at its own rate (at least ``workers``)."""
    return max(workers, math.ceil(max((want[s] - len(splits[s])) / share[s] for s in splits)))


def make_games(out: str | Path, num_train: int = 100, num_eval: int = 50, spec: GameSpec = GameSpec(),
               seed: int = 0, workers: int = 2, max_attempts: int | None = None, eval_fraction: float = 0.2) -> Path:
    """Generate ``num_train`` training and ``num_eval`` held-out games into ``out``.

    Args:
        out: output folder (replaced atomically when generation finishes).
        num_train, num_eval: games per split.
        spec: quest length (horizon), world size (rooms) and number of objects.
        seed: first generation seed; seeds ``seed, seed+1, ...`` are tried in order.
        workers: generator processes.
        max_attempts: give up after this many seeds (default :func:`seed_budget`: 4 times the seeds the
            split needs on average, plus 20; only ``eval_fraction`` of games fall in the held-out split).
        eval_fraction: split rule (:func:`in_eval_split`); fixed, not derived from the counts, so a
            game's split never depends on how many games are asked for.

    Returns:
        ``out``.

    Raises:
        ValueError: a negative count, no game asked for, or ``eval_fraction`` outside (0, 1).
        RuntimeError: not enough games within ``max_attempts`` seeds; the message says whether the seed
            budget ran out (raise ``max_attempts``) or most seeds repeated earlier games (the game space is
            too small: raise quest length, world size or number of objects), and where the games made were
            kept: ``<out>.incomplete`` (its manifest has ``"complete": false``); ``out`` is left as it was.
    """
    out = Path(out)
    _check_counts(num_train, num_eval, eval_fraction)
    max_attempts = max_attempts or seed_budget(num_train, num_eval, eval_fraction)
    header = {"spec": asdict(spec), "seed": seed, "num_train": num_train, "num_eval": num_eval,
              "eval_fraction": eval_fraction}
    share = {"train": 1.0 - eval_fraction, "eval": eval_fraction}
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    want = {"train": num_train, "eval": num_eval}
    next_seed = seed
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        while any(len(splits[s]) < want[s] for s in splits):
            if next_seed - seed >= max_attempts:
                tried = next_seed - seed
                cause = _exhaustion_cause(tried, tried - len(seen), eval_fraction, max_attempts)
                kept = _keep_partial(stage, splits, {**header, "complete": False, "seeds_tried": tried, "cause": cause},
                                     out)
                raise RuntimeError(
                    f"only {len(splits['train'])}/{num_train} train and {len(splits['eval'])}/{num_eval} held-out "
                    f"games after {tried} seeds (seeds {seed}-{next_seed - 1}) with {spec}: {cause}. {kept}"
                )
            n = min(_seeds_needed(want, splits, share, workers), max_attempts - (next_seed - seed))
            batch = [(s, spec, str(stage)) for s in range(next_seed, next_seed + n)]
            next_seed += n
            for res in pool.map(_generate_one, batch):
                if res["hash"] in seen:
                    continue
                seen.add(res["hash"])
                split = "eval" if in_eval_split(res["hash"], eval_fraction) else "train"
                if len(splits[split]) < want[split]:
                    splits[split].append(res)
    _finish(stage, splits, {**header, "complete": True}, out)
    return out
