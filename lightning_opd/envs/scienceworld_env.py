"""ScienceWorld adapter (``scienceworld`` 1.2.3): elementary-science tasks in a simulated house, with variations.

ScienceWorld (Wang et al., 2022) has 30 task types; each has numbered *variations* (which objects, where they
are) split by the package into train / dev / test (``get_variations_train/dev/test``; e.g. find-living-thing:
variations 0-149 train, 150-224 dev, 225-299 test). Its engine is a JAR run by a Java process (py4j). Task ids
are ``"<task name>-<split>-v<variation>"`` (:func:`format_task_id`) (e.g. ``"find-living-thing-test-v225"``): a stable key for pairing.
Training tasks are the train variations of every task type in ``task_names``; held-out tasks their test variations
(``eval_split="dev"`` picks the dev variations instead).

What the agent sees (one user message per turn, built by :func:`format_observation`)::

    Goal: <the task description>                  (every turn; first turn only with repeat_goal=False)
    Observation: <text: one line per line of the engine's output, tabs removed, at most max_observation_chars>
    Actions: open OBJ, close OBJ, ..., go to OBJ, ...   (ACTION_TEMPLATES, the same every turn)

The first observation is the engine's ``look around`` (the room and what is in it). Observations keep their
*first* ``max_observation_chars`` characters, with ``" [...]"`` appended when cut.

Valid-action text: ScienceWorld's valid action list is huge (over 400 object combinations in the first room of
find-living-thing, most of them nonsense such as "connect agent to air") and does not even hold every gold step
(``move egg blue jay egg in inventory to red box`` is not on it but works). The adapter therefore shows the
engine's 25 action templates (:data:`ACTION_TEMPLATES`: ``get_possible_actions()`` with ``reset task`` removed and
``go OBJ`` written ``go to OBJ`` as the gold paths write it; the engine takes both) and lets the engine's own parser
judge the action.

Action parsing: :func:`lightning_opd.envs.textworld_env.parse_action` (first non-empty line with prefixes, quotes
and trailing periods removed, lower-cased). An empty action and ``reset task`` never reach the engine; any other
action does, and the engine's "No known action matches that input." (nothing changes, no move counted) comes back
with ``invalid_action=True`` (F11). When the engine finds an action ambiguous it lists numbered choices ("Ambiguous
request: Please enter the number ..."); the next reply is then the number (a valid action; gold paths use it).

Score, reward and success: the engine's score is 0-100 (sub-goals done; it can be above 0 at the start). ``won``:
the engine's completion flag with score 100; ``lost``: the score below 0 (the engine's failure: focusing on a wrong
object sets it to -100, and the task can no longer be won) or the task completed with a lower score. Reward: the change in score / 100 per step, so an episode's rewards add
up to (final score - start score) / 100. :attr:`ScienceWorldEnv.score` holds the current score (0-100; the
benchmark's score of the episode; papers report failures as 0, see :attr:`ScienceWorldEnv.benchmark_score`).

Expert: the engine's gold action sequence (``generateGoldPath=True``), verbatim, for :meth:`expert_actions` and
:meth:`privileged_context`, generated once per task and factory. The engine's generator picks among equivalent
choices on each load (find-living-thing: which living thing, which door to the outside) and lists some objects in a
varying order; the world of a variation is the same. A gold path can end with ``wait1`` after the step that
already wins (lifespan tasks): the episode ends at the win, one step early. Gold paths that answer an ambiguity
question by number (grow-fruit, mendelian genetics; none of :data:`DEFAULT_TASKS`) may pick a different object
when replayed on another load, since the choices are listed in the engine's order of that load.

Task types: the default :data:`DEFAULT_TASKS` are those whose gold paths are at most 16 steps on every variation,
so that an episode of 8-16 turns can finish: gold path length (steps, trailing waits included) min / median / max
over all variations of all three splits, ``simplifications=""``, measured once per variation:

==========================================  ==========  ====================  ================================
task                                        variations  gold min/median/max   what it takes
==========================================  ==========  ====================  ================================
find-living-thing                           300         6 / 12 / 16           go outside, focus, carry to a box
find-animal                                 300         6 / 12 / 16
find-plant                                  300         8 / 12 / 16
find-non-living-thing                       300         3 / 7 / 11
lifespan-longest-lived                      125         2 / 6 / 8             focus on one of three animals
lifespan-shortest-lived                     125         2 / 6 / 8
lifespan-longest-lived-then-shortest-lived  125         3 / 7 / 9
power-component                             20          9 / 13 / 15           create a circuit
==========================================  ==========  ====================  ================================

Every other task type has gold paths over 16 steps on some variations (12 sampled per type, 4 per split:
identify-life-stages-2 10-17 and chemistry-mix-paint-secondary-color 7-23 over all their 10 and 36 variations,
boil 38-164, mendelian genetics 139-261; the table in docs/usage.md).

Java: as for TextWorldExpress (:func:`lightning_opd.envs.java_engines.java_bin_dir`); an engine JVM here is
about 300 MB resident with the default 512 MiB heap cap. A factory keeps a pool of them, one per concurrent episode
(the pool, the settings and the task lists: :class:`lightning_opd.envs.java_env.JavaEngineEnvFactory`).
"""

from __future__ import annotations

import re

from lightning_opd.envs.base import StepResult, user_message
from lightning_opd.envs.java_engines import INSTALL_HINT, EnginePool
from lightning_opd.envs.java_env import JavaEngineEnvFactory, JavaEngineEpisode, parse_world_id

SYSTEM_PROMPT = "You do science tasks in a text world. Reply with exactly one action."
#: task types whose gold paths fit 8-16 turns (measured; see the module docstring and docs/usage.md)
DEFAULT_TASKS = (
    "find-living-thing", "find-animal", "find-plant", "find-non-living-thing",
    "lifespan-longest-lived", "lifespan-shortest-lived", "lifespan-longest-lived-then-shortest-lived",
    "power-component",
)
#: the engine's action templates (``get_possible_actions()`` in template-id order) with ``reset task`` removed
#: and ``go OBJ`` written ``go to OBJ``; OBJ is anything the observation names
ACTION_TEMPLATES = (
    "open OBJ", "close OBJ", "go to OBJ", "look around", "look at OBJ", "look in OBJ", "activate OBJ",
    "deactivate OBJ", "eat OBJ", "move OBJ to OBJ", "pour OBJ in OBJ", "focus on OBJ", "use OBJ on OBJ",
    "read OBJ", "flush OBJ", "connect OBJ to OBJ", "disconnect OBJ", "wait1", "wait", "inventory", "pick up OBJ",
    "put down OBJ", "mix OBJ", "task", "dunk OBJ in OBJ",
)
REFUSED_ACTIONS = ("reset task",)
NO_MATCH = "No known action matches that input."


def _import_scienceworld():
    try:
        import scienceworld
    except ImportError as err:
        raise ImportError(f"ScienceWorld is not installed ({err}); {INSTALL_HINT}") from None
    return scienceworld


def clean_observation(text: str, max_chars: int) -> str:
    """One line per non-empty line of ``text`` (each stripped of tabs and spaces), then the first ``max_chars``
    characters with ``" [...]"`` appended when cut."""
    text = "\n".join(line.strip() for line in text.splitlines() if line.strip())
    return text if len(text) <= max_chars else text[:max_chars].rstrip() + " [...]"


def format_observation(observation: str, goal: str | None = None) -> str:
    """The user message of one turn (see the module docstring); ``observation`` is already cleaned."""
    return user_message(observation, "Actions: " + ", ".join(ACTION_TEMPLATES), goal)


def format_task_id(task_name: str, split: str, variation: int) -> str:
    """``"<task name>-<split>-v<variation>"``, e.g. ``format_task_id("find-plant", "test", 225) ==
    "find-plant-test-v225"``."""
    return f"{task_name}-{split}-v{variation}"


def parse_task_id(tid: str) -> tuple[str, str, int]:
    """``(task name, split, variation)`` of a :func:`format_task_id`.

    Raises:
        KeyError: ``tid`` is not of that form.
    """
    return parse_world_id(tid, "[a-z0-9-]+", "v", "ScienceWorld task id (<task>-<train|dev|test>-v<variation>)")


def _goal(engine) -> str:
    text = str(engine.get_task_description())
    return re.sub(r"^\s*Task Description:\s*", "", text)


class ScienceWorldEnv(JavaEngineEpisode):
    """One ScienceWorld episode behind the :class:`~lightning_opd.envs.base.TextEnv` protocol.

    Args:
        pool: engines to borrow one from (for the episode; given back by :meth:`close`).
        task_name, variation: the world (see :func:`format_task_id`).
        simplifications: the engine's simplification string (``""``: none, the benchmark's setting).
        max_observation_chars: characters of observation text kept per turn.
        repeat_goal: show the goal in every user message (``False``: first message only).
    """

    def __init__(self, pool: EnginePool, task_name: str, variation: int, simplifications: str = "",
                 max_observation_chars: int = 1500, repeat_goal: bool = True) -> None:
        super().__init__(pool, max_observation_chars, repeat_goal)
        self.task_name, self.variation, self.simplifications = task_name, variation, simplifications
        #: the engine's score so far, 0-100 (below 0 after a failure)
        self.score = 0
        self.completed = False

    @property
    def benchmark_score(self) -> float:
        """The score as papers report it: 0-100, a failure (negative score) counted as 0."""
        return float(max(self.score, 0))

    def reset(self) -> str:
        engine = self._borrow_engine()
        self._call(engine.load, self.task_name, self.variation, self.simplifications, generateGoldPath=False)
        obs, infos = self._call(engine.reset)
        self.score, self.completed = int(infos["score"]), False
        self._goal = self._call(_goal, engine)
        return format_observation(clean_observation(obs, self.max_observation_chars), self._goal)

    def _message(self, text: str) -> str:
        return format_observation(text, self._shown_goal)

    def step(self, action: str) -> StepResult:
        self._require_engine()
        if not action:
            return StepResult(self._message("Empty action. Reply with one action."), invalid_action=True)
        if action.lower() in REFUSED_ACTIONS:
            return StepResult(self._message(f"'{action}' is not allowed. Reply with one action."),
                              invalid_action=True)
        # the engine's own calls (the package's step() also fetches the 400+ valid actions every turn)
        server = self._engine.server
        obs = str(self._call(server.step, action))
        if obs.strip() == NO_MATCH:
            msg = f"'{action[:80]}': {NO_MATCH} Reply with one action."
            return StepResult(self._message(msg), invalid_action=True)
        score = int(round(100 * float(self._call(server.getScore))))
        completed = bool(self._call(server.getCompleted))
        reward = (score - self.score) / 100.0
        self.score, self.completed = score, completed
        won = completed and score >= 100
        lost = (completed and not won) or score < 0
        return StepResult(self._message(clean_observation(obs, self.max_observation_chars)), reward=reward,
                          won=won, lost=lost)


class ScienceWorldEnvFactory(JavaEngineEnvFactory):
    """ScienceWorld task types on the package's own variation splits.

    Args:
        task_names: task types (ScienceWorld names such as ``"find-living-thing"``; ``None``: :data:`DEFAULT_TASKS`).
        num_train: use only the first ``num_train`` train variations *of each task type* (``None``: all).
        num_eval: use only the first ``num_eval`` held-out variations of each task type (``None``: all).
        eval_split: the held-out split, ``"test"`` (default) or ``"dev"``.
        simplifications: the engine's simplification string, e.g. ``"easy"`` (``""``: none, the benchmark's
            setting; gold path lengths in the docs are for ``""``).
        max_observation_chars: characters of observation text kept per turn.
        repeat_goal: show the goal in every user message.
        max_heap_mb: each engine JVM's maximum heap, MiB.

    Task ids are listed task type by task type, in ``task_names`` order.

    Raises:
        ValueError: an unknown task name (the message names it and lists the 30 valid names), an empty
            ``task_names``, an unknown ``eval_split`` or simplification, a negative count or
            ``max_observation_chars < 1``.
        ImportError: ``scienceworld`` is not installed (the message says how to install it).
        RuntimeError: no Java runtime (the message says how to install one).
    """

    system_prompt = SYSTEM_PROMPT

    def __init__(self, task_names: list[str] | None = None, num_train: int | None = None,
                 num_eval: int | None = None, eval_split: str = "test", simplifications: str = "",
                 max_observation_chars: int = 1500, repeat_goal: bool = True, max_heap_mb: int = 512) -> None:
        task_names = list(DEFAULT_TASKS if task_names is None else task_names)
        if not task_names:
            raise ValueError("data.init_args.env.init_args.task_names is empty; name at least one ScienceWorld task "
                             f"(default: {', '.join(DEFAULT_TASKS)})")
        super().__init__(num_train, num_eval, eval_split, max_observation_chars, repeat_goal, max_heap_mb)
        self.task_names, self.simplifications = task_names, simplifications
        self._variations = self._read_variations()
        for name in task_names:
            self._add_tasks(self._variations[name], lambda split, v, name=name: format_task_id(name, split, v),
                            num_train, num_eval, f"ScienceWorld {name}", "variations")
        self._gold: dict[str, list[str]] = {}

    @staticmethod
    def _engine_constructor():
        sw = _import_scienceworld()
        return lambda: sw.ScienceWorldEnv("", envStepLimit=1_000_000)

    def _read_variations(self) -> dict[str, dict[str, list[int]]]:
        """``{task name: {split: variations}}`` of :attr:`task_names`, read from one engine.

        Raises:
            ValueError: an unknown task name or simplification (the pool is shut down).
        """
        variations: dict[str, dict[str, list[int]]] = {}
        engine = self.pool.acquire()
        try:
            known = [str(t) for t in engine.get_task_names()]
            unknown = [t for t in self.task_names if t not in known]
            if unknown:
                raise ValueError(f"data.init_args.env.init_args.task_names: {unknown} not ScienceWorld task names; "
                                 f"choose from {', '.join(known)}")
            for name in self.task_names:
                engine.load(name, 0, self.simplifications)
                variations[name] = {"train": [int(v) for v in engine.get_variations_train()],
                                    "dev": [int(v) for v in engine.get_variations_dev()],
                                    "test": [int(v) for v in engine.get_variations_test()]}
        except ValueError as err:
            self.pool.close()
            if "Unknown simplification" in str(err):
                raise ValueError(f"data.init_args.env.init_args.simplifications={self.simplifications!r}: "
                                 f"{err}") from None
            raise
        self.pool.release(engine)
        return variations

    def _world(self, tid: str) -> tuple[str, int]:
        """``(task name, variation)`` of a task id of this factory.

        Raises:
            KeyError: not a task id of this factory's task types, or a variation outside its split.
        """
        name, split, variation = parse_task_id(tid)
        if name not in self._variations or variation not in self._variations[name][split]:
            raise KeyError(f"unknown ScienceWorld task id {tid!r} (task types: {', '.join(self.task_names)})")
        return name, variation

    def make(self, task_id: str) -> ScienceWorldEnv:
        name, variation = self._world(task_id)
        return ScienceWorldEnv(self.pool, name, variation, self.simplifications, self.max_observation_chars,
                               self.repeat_goal)

    def expert_actions(self, task_id: str) -> list[str]:
        """The engine's gold action sequence for ``task_id``, generated on the first call and cached (the engine may
        generate another, equivalent one in another process; see the module docstring).

        Raises:
            KeyError: unknown task id.
        """
        if task_id not in self._gold:
            name, variation = self._world(task_id)
            with self._borrowed_engine() as engine:
                engine.load(name, variation, self.simplifications, generateGoldPath=True)
                gold = [str(a) for a in engine.get_gold_action_sequence()]
            self._gold[task_id] = gold
        return list(self._gold[task_id])
