"""ScienceWorld adapter (``scienceworld`` 1.2.3): elementary-science tasks in a simulated house, with variations.

ScienceWorld (Wang et al., 2022) has 30 task types; each has numbered *variations* (which objects, where they
are) split by the package into train / dev / test (``get_variations_train/dev/test``; e.g. find-living-thing:
variations 0-149 train, 150-224 dev, 225-299 test). Its engine is a JAR run by a Java process (py4j). Task ids
are ``"<task name>-<split>-v<variation>"`` (e.g. ``"find-living-thing-test-v225"``): a stable key for pairing.
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

Java: as for TextWorldExpress (:func:`lightning_opd.envs.textworld_express.java_bin_dir`); an engine JVM here is
about 300 MB resident with the default 512 MiB heap cap. A factory keeps a pool of them, one per concurrent episode.
"""

from __future__ import annotations

import re
import weakref

from lightning_opd.envs.base import EnvFactory, StepResult
from lightning_opd.envs.textworld_env import parse_action
from lightning_opd.envs.java_engines import (
    INSTALL_HINT,
    EnginePool,
    check_count,
    check_eval_split,
    check_positive,
    launch_engine,
)

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
    lines = [] if goal is None else ["Goal: " + re.sub(r"\s+", " ", goal).strip()]
    lines.append(f"Observation: {observation}")
    lines.append("Actions: " + ", ".join(ACTION_TEMPLATES))
    return "\n".join(lines)


def task_id(task: str, split: str, variation: int) -> str:
    """``"<task>-<split>-v<variation>"``, e.g. ``task_id("find-plant", "test", 225) == "find-plant-test-v225"``."""
    return f"{task}-{split}-v{variation}"


def parse_task_id(tid: str) -> tuple[str, str, int]:
    """``(task, split, variation)`` of a :func:`task_id`.

    Raises:
        KeyError: ``tid`` is not of that form.
    """
    m = re.fullmatch(r"([a-z0-9-]+)-(train|dev|test)-v(\d+)", tid)
    if m is None:
        raise KeyError(f"{tid!r} is not a ScienceWorld task id (<task>-<train|dev|test>-v<variation>)")
    return m.group(1), m.group(2), int(m.group(3))


def _goal(engine) -> str:
    text = str(engine.get_task_description())
    return re.sub(r"^\s*Task Description:\s*", "", text)


class ScienceWorldEnv:
    """One ScienceWorld episode behind the :class:`~lightning_opd.envs.base.TextEnv` protocol.

    Args:
        pool: engines to borrow one from (for the episode; given back by :meth:`close`).
        task, variation: the world (see :func:`task_id`).
        simplifications: the engine's simplification string (``""``: none, the benchmark's setting).
        max_observation_chars: characters of observation text kept per turn.
        repeat_goal: show the goal in every user message (``False``: first message only).
    """

    def __init__(self, pool: EnginePool, task: str, variation: int, simplifications: str = "",
                 max_observation_chars: int = 1500, repeat_goal: bool = True) -> None:
        self.pool, self.task, self.variation, self.simplifications = pool, task, variation, simplifications
        self.max_observation_chars, self.repeat_goal = max_observation_chars, repeat_goal
        self._engine = None
        self._goal = ""
        #: the engine's score so far, 0-100 (below 0 after a failure)
        self.score = 0
        self.completed = False

    @property
    def benchmark_score(self) -> float:
        """The score as papers report it: 0-100, a failure (negative score) counted as 0."""
        return float(max(self.score, 0))

    def _call(self, fn, *args, **kwargs):
        """Run an engine call; an error discards the engine (its state is unknown) and propagates."""
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.pool.discard(self._engine)
            self._engine = None
            raise

    def reset(self) -> str:
        if self._engine is None:
            self._engine = self.pool.acquire()
        engine = self._engine
        self._call(engine.load, self.task, self.variation, self.simplifications, generateGoldPath=False)
        obs, infos = self._call(engine.reset)
        self.score, self.completed = int(infos["score"]), False
        self._goal = self._call(_goal, engine)
        return format_observation(clean_observation(obs, self.max_observation_chars), self._goal)

    def _message(self, text: str) -> str:
        return format_observation(text, self._goal if self.repeat_goal else None)

    def parse_action(self, reply: str) -> str:
        return parse_action(reply)

    def step(self, action: str) -> StepResult:
        if self._engine is None:
            raise RuntimeError("ScienceWorldEnv.step called before reset()")
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

    def close(self) -> None:
        if self._engine is not None:
            self.pool.release(self._engine)
            self._engine = None


def _stop(engine) -> None:
    engine.close()


class ScienceWorldEnvFactory(EnvFactory):
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
    provides_privileged_context = True

    def __init__(self, task_names: list[str] | None = None, num_train: int | None = None,
                 num_eval: int | None = None, eval_split: str = "test", simplifications: str = "",
                 max_observation_chars: int = 1500, repeat_goal: bool = True, max_heap_mb: int = 512) -> None:
        tasks = list(DEFAULT_TASKS if task_names is None else task_names)
        if not tasks:
            raise ValueError("data.init_args.env.init_args.task_names is empty; name at least one ScienceWorld task "
                             f"(default: {', '.join(DEFAULT_TASKS)})")
        check_eval_split(eval_split)
        check_count("num_train", num_train)
        check_count("num_eval", num_eval)
        check_positive("max_observation_chars", max_observation_chars, "characters of observation text per turn")
        check_positive("max_heap_mb", max_heap_mb, "MiB of JVM heap per engine")
        sw = _import_scienceworld()
        self.task_names, self.eval_split, self.simplifications = tasks, eval_split, simplifications
        self.max_observation_chars, self.repeat_goal, self.max_heap_mb = max_observation_chars, repeat_goal, max_heap_mb
        self.pool = EnginePool(lambda: launch_engine(lambda: sw.ScienceWorldEnv("", envStepLimit=1_000_000),
                                                     max_heap_mb), _stop)
        self._finalizer = weakref.finalize(self, self.pool.close)
        engine = self.pool.acquire()
        self._variations: dict[str, dict[str, list[int]]] = {}
        try:
            known = [str(t) for t in engine.get_task_names()]
            unknown = [t for t in tasks if t not in known]
            if unknown:
                raise ValueError(f"data.init_args.env.init_args.task_names: {unknown} not ScienceWorld task names; "
                                 f"choose from {', '.join(known)}")
            for task in tasks:
                engine.load(task, 0, simplifications)
                self._variations[task] = {"train": [int(v) for v in engine.get_variations_train()],
                                          "dev": [int(v) for v in engine.get_variations_dev()],
                                          "test": [int(v) for v in engine.get_variations_test()]}
        except ValueError as err:
            self.pool.close()
            if "Unknown simplification" in str(err):
                raise ValueError(f"data.init_args.env.init_args.simplifications={simplifications!r}: {err}") from None
            raise
        self.pool.release(engine)
        self._train, self._eval = [], []
        for task in tasks:
            train, held_out = self._variations[task]["train"], self._variations[task][eval_split]
            if set(train) & set(held_out):
                raise ValueError(f"ScienceWorld {task}: train and {eval_split} variations overlap")
            self._train += [task_id(task, "train", v) for v in train[:num_train]]
            self._eval += [task_id(task, eval_split, v) for v in held_out[:num_eval]]
        self._gold: dict[str, list[str]] = {}

    def train_tasks(self) -> list[str]:
        return list(self._train)

    def eval_tasks(self) -> list[str]:
        return list(self._eval)

    def _world(self, tid: str) -> tuple[str, int]:
        """``(task, variation)`` of a task id of this factory.

        Raises:
            KeyError: not a task id of this factory's task types, or a variation outside its split.
        """
        task, split, variation = parse_task_id(tid)
        if task not in self._variations or variation not in self._variations[task][split]:
            raise KeyError(f"unknown ScienceWorld task id {tid!r} (task types: {', '.join(self.task_names)})")
        return task, variation

    def make(self, task_id: str) -> ScienceWorldEnv:
        task, variation = self._world(task_id)
        return ScienceWorldEnv(self.pool, task, variation, self.simplifications, self.max_observation_chars,
                               self.repeat_goal)

    def expert_actions(self, task_id: str) -> list[str]:
        """The engine's gold action sequence for ``task_id``, generated on the first call and cached (the engine may
        generate another, equivalent one in another process; see the module docstring).

        Raises:
            KeyError: unknown task id.
        """
        if task_id not in self._gold:
            task, variation = self._world(task_id)
            engine = self.pool.acquire()
            try:
                engine.load(task, variation, self.simplifications, generateGoldPath=True)
                gold = [str(a) for a in engine.get_gold_action_sequence()]
            except Exception:
                self.pool.discard(engine)
                raise
            self.pool.release(engine)
            self._gold[task_id] = gold
        return list(self._gold[task_id])

    def privileged_context(self, task_id: str) -> str | None:
        """``"A walkthrough that wins this game: act1; act2; ..."`` (the gold path). PROPOSED,
        docs/algorithms.md §6.3.

        Raises:
            KeyError: unknown task id.
        """
        return f"A walkthrough that wins this game: {'; '.join(self.expert_actions(task_id))}"

    def close(self) -> None:
        """Shut down the factory's engine JVMs (also done when the factory is garbage-collected or Python exits)."""
        self.pool.close()
