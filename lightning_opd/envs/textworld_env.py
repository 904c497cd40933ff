"""TextWorld adapter: compact prompts, explicit action parsing, score-change reward.

What the agent sees (one user message per turn, built by :func:`format_observation`)::

    Goal: <objective>                       (every turn; first turn only with repeat_goal=False)
    Observation: <text, whitespace-collapsed, last 600 characters>
    Commands: <admissible commands without examine/look/inventory, comma-separated>

Action parsing (:func:`parse_action`), explicit and deliberately simple: take the first non-empty line
of the reply that still has text once leading ``>``/``-``/``*``/``Command:``/``Action:``, surrounding
quotes or backticks and trailing periods are removed; collapse whitespace and lower-case it. The result
is valid if it equals, ignoring case, one of the game's admissible commands (the full list, including
the hidden examine/look/inventory); the game receives the admissible spelling.
An empty or invalid action does not reach the game: the agent gets an observation saying so, with the
commands again, and the step is flagged ``invalid_action`` (counted as ``rollout/invalid_actions``, F11).

The goal is repeated every turn by default, as verl-agent's ALFWorld prompts do: a 135M-parameter
policy follows a goal in the current message far more reliably than one several turns back.

Reward (``reward``): ``"score"`` (default), the change in the game's score (TextWorld reports the points so
far); ``"progress"``, the change in the share of the quest done, ``(L_{t-1} - L_t) / L_0`` with ``L_t`` the length of
the game's own shortest remaining walkthrough after turn t (TextWorld's ``policy_commands``), so an episode's
rewards add up to the share of the quest it completed (1 for a win; negative if it ends farther from the goal
than it started). The games ``make-games`` writes have one quest worth 1 point (``max_score`` 1), so their score
is the win and nothing else: ``"progress"`` is the partial credit GRPO/ATOD groups need when no episode wins
(PROPOSED, docs/algorithms.md §3.5). ``won``/``lost`` come from the game; truncation (turn or context limit) is the
agent loop's business and a separate flag.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lightning_opd.envs.base import StepResult, TaskListFactory, user_message

SYSTEM_PROMPT = "You play a text adventure. Reply with exactly one command from the list."
HIDDEN_COMMAND_PREFIXES = ("examine", "look", "inventory")
_PREFIX = re.compile(r"^\s*(?:[>\-*]+|(?:command|action)\s*:)\s*", re.IGNORECASE)


def _collapse(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def clean_feedback(text: str, max_chars: int = 600) -> str:
    """Strip TextWorld's prompt/status line (everything from the last ``>``), collapse whitespace and
    keep the last ``max_chars`` characters (characters, not tokens)."""
    cut = text.rfind("\n>")
    if cut >= 0:
        text = text[:cut]
    text = _collapse(text)
    return text[-max_chars:] if max_chars > 0 else text


def visible_commands(admissible: list[str]) -> list[str]:
    """Admissible commands shown to the agent: without examine/look/inventory (they never score)."""
    return [c for c in admissible if not c.startswith(HIDDEN_COMMAND_PREFIXES)]


def format_observation(observation: str, admissible: list[str], goal: str | None = None) -> str:
    """The user message of one turn (see the module docstring)."""
    return user_message(observation, "Commands: " + ", ".join(visible_commands(admissible)), goal)


def choose_command(action: str, commands: list[str]) -> tuple[str | None, str | None]:
    """Match a parsed action against this turn's command list (case ignored).

    Returns:
        ``(command, None)`` with the list's spelling of the command, or ``(None, refusal)``: the action is empty or
        not listed, and ``refusal`` is the text that tells the agent so (the step is then an invalid action, F11).
    """
    if not action:
        return None, "Empty command. Reply with one command from the list."
    command = {c.lower(): c for c in commands}.get(action.lower())
    if command is None:
        return None, f"'{action[:80]}' is not a valid command here. Reply with one command from the list."
    return command, None


def _check_observation_chars(value: int) -> None:
    """Raises ValueError naming the config key when ``value`` (characters) is not positive."""
    if value < 1:
        raise ValueError(f"data.init_args.env.init_args.max_observation_chars={value} must be >= 1 (characters of "
                         "observation text kept per turn; 600 is the default)")


REWARDS = ("score", "progress")


def _check_reward(value: str) -> None:
    """Raises ValueError naming the config key when ``value`` is not one of :data:`REWARDS`."""
    if value not in REWARDS:
        raise ValueError(f"data.init_args.env.init_args.reward={value!r}: use 'score' (the game's points) or "
                         "'progress' (share of the quest's walkthrough done)")


def parse_action(reply: str) -> str:
    """The action in a reply: the first line that still has text once prefixes (``>``, ``-``, ``*``,
    ``Command:``, ``Action:``), surrounding quotes/backticks and trailing ``.``/``!`` are removed
    (repeatedly, in any order); whitespace collapsed, lower-cased.

    Returns ``""`` for a reply without such a line (the environment reports it as an invalid action).
    """
    for line in reply.splitlines():
        previous = None
        while line != previous:
            previous = line
            line = _PREFIX.sub("", line).strip().strip("`'\"").rstrip(".!").strip()
        if line:
            return _collapse(line).lower()
    return ""


class TextWorldEnv:
    """One TextWorld episode behind the :class:`~lightning_opd.envs.base.TextEnv` protocol.

    Args:
        game_file: compiled game (``.z8``/``.ulx``) made by ``lightning-opd make-games``.
        max_observation_chars: characters of observation text kept per turn.
        repeat_goal: show the goal in every user message (``False``: first message only).
        reward: ``"score"`` (points) or ``"progress"`` (share of the quest; see the module docstring).

    Raises:
        ValueError: ``max_observation_chars < 1`` or an unknown ``reward`` (the message names the config key).
    """

    def __init__(self, game_file: str | Path, max_observation_chars: int = 600, repeat_goal: bool = True,
                 reward: str = "score") -> None:
        _check_observation_chars(max_observation_chars)
        _check_reward(reward)
        self.reward = reward
        self._remaining = 0  # progress reward: length of the shortest remaining walkthrough
        self._quest_length = 1
        self.game_file = str(game_file)
        self.max_observation_chars = max_observation_chars
        self.repeat_goal = repeat_goal
        self._goal: str | None = None
        self._env = None
        self._admissible: list[str] = []
        self._score = 0.0

    def _infos(self):
        from textworld import EnvInfos

        return EnvInfos(admissible_commands=True, objective=True, won=True, lost=True, description=True,
                        score=True, max_score=True, policy_commands=self.reward == "progress")

    def reset(self) -> str:
        import textworld.gym

        # max_episode_steps is not used for truncation: the agent loop owns the turn limit.
        env_id = textworld.gym.register_game(self.game_file, request_infos=self._infos(), max_episode_steps=10_000)
        self._env = textworld.gym.make(env_id)
        _, infos = self._env.reset()
        self._admissible = list(infos["admissible_commands"])
        self._score = float(infos["score"])
        if self.reward == "progress":
            self._remaining = len(infos["policy_commands"] or [])
            self._quest_length = max(1, self._remaining)
        obs = clean_feedback(infos["description"], self.max_observation_chars)
        self._goal = infos["objective"]
        return format_observation(obs, self._admissible, goal=self._goal)

    def _message(self, text: str) -> str:
        return format_observation(text, self._admissible, goal=self._goal if self.repeat_goal else None)

    def parse_action(self, reply: str) -> str:
        return parse_action(reply)

    def step(self, action: str) -> StepResult:
        if self._env is None:
            raise RuntimeError("TextWorldEnv.step called before reset()")
        command, refusal = choose_command(action, self._admissible)
        if refusal is not None:
            return StepResult(self._message(refusal), invalid_action=True)
        obs, score, _done, infos = self._env.step(command)
        reward = float(score) - self._score
        self._score = float(score)
        if self.reward == "progress":
            # a won game has no walkthrough left; a lost one keeps its last length (TextWorld gives none)
            remaining = 0 if infos["won"] else len(infos["policy_commands"] or []) or self._remaining
            reward = (self._remaining - remaining) / self._quest_length
            self._remaining = remaining
        self._admissible = list(infos["admissible_commands"])
        text = clean_feedback(obs, self.max_observation_chars)
        return StepResult(self._message(text), reward=reward,
                          won=bool(infos["won"]), lost=bool(infos["lost"]))

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


class TextWorldEnvFactory(TaskListFactory):
    """TextWorld games made by ``lightning-opd make-games`` (``<games_dir>/{train,eval}/*.z8`` plus
    ``manifest.json``).

    Args:
        games_dir: output folder of ``make-games``.
        max_observation_chars: characters of observation text kept per turn.
        num_train: use only the first ``num_train`` training games (``None``: all).
        num_eval: use only the first ``num_eval`` held-out games (``None``: all).
        repeat_goal: show the goal in every user message (``False``: first message only).
        reward: ``"score"`` (the game's points: the win, for make-games' games) or ``"progress"`` (share of the
            quest done: partial credit; see the module docstring).

    Raises:
        FileNotFoundError: no manifest in ``games_dir`` (run ``lightning-opd make-games``).
        ValueError: the manifest is not valid JSON or lists no games (the message names its path), its
            train and held-out splits overlap (same game hash in both), or an unknown ``reward``.
    """

    system_prompt = SYSTEM_PROMPT
    provides_privileged_context = True

    def __init__(self, games_dir: str = "artifacts/games/quest3", max_observation_chars: int = 600,
                 num_train: int | None = None, num_eval: int | None = None, repeat_goal: bool = True,
                 reward: str = "score") -> None:
        _check_observation_chars(max_observation_chars)
        _check_reward(reward)
        self.reward = reward
        for key, value in (("num_train", num_train), ("num_eval", num_eval)):
            if value is not None and value < 0:
                raise ValueError(f"data.init_args.env.init_args.{key}={value} must be >= 0 (games; null = all)")
        self.games_dir = Path(games_dir)
        self.repeat_goal = repeat_goal
        self.max_observation_chars = max_observation_chars
        manifest = self.games_dir / "manifest.json"
        if not manifest.is_file():
            raise FileNotFoundError(
                f"no TextWorld games at {str(self.games_dir)!r} (missing manifest.json); run "
                f"`lightning-opd make-games --out {self.games_dir}` first"
            )
        try:
            self.manifest = json.loads(manifest.read_text())
        except ValueError as err:
            raise ValueError(f"{manifest} is not valid JSON ({err}); regenerate the games with "
                             f"`lightning-opd make-games --out {self.games_dir} --force`") from None
        games = self.manifest.get("games") if isinstance(self.manifest, dict) else None
        if not isinstance(games, list):
            raise ValueError(f"{manifest} has no 'games' list; regenerate the games with "
                             f"`lightning-opd make-games --out {self.games_dir} --force`")
        self._games = {g["task_id"]: g for g in games}
        train = [g["task_id"] for g in games if g["split"] == "train"]
        evals = [g["task_id"] for g in games if g["split"] == "eval"]
        overlap = {self._games[t]["hash"] for t in train} & {self._games[t]["hash"] for t in evals}
        if overlap:
            raise ValueError(f"train and held-out TextWorld games overlap ({len(overlap)} shared hashes)")
        self._keep_first(train, evals, num_train, num_eval)
        if not self._train and not self._eval:
            raise ValueError(f"no games listed in {manifest}")

    def game_file(self, task_id: str) -> Path:
        try:
            return self.games_dir / self._games[task_id]["file"]
        except KeyError:
            raise KeyError(f"unknown TextWorld task id {task_id!r} in {self.games_dir}") from None

    def make(self, task_id: str) -> TextWorldEnv:
        return TextWorldEnv(self.game_file(task_id), self.max_observation_chars, self.repeat_goal, self.reward)

    def expert_actions(self, task_id: str) -> list[str]:
        return list(self._games[task_id]["walkthrough"])

    def privileged_context(self, task_id: str) -> str | None:
        """The game's expert walkthrough as one line: ``"A walkthrough that wins this game: cmd1; cmd2; ..."``
        (``None`` for a game whose manifest lists no walkthrough). PROPOSED, docs/algorithms.md §6.3.

        Raises:
            KeyError: unknown task id.
        """
        if task_id not in self._games:
            raise KeyError(f"unknown TextWorld task id {task_id!r} in {self.games_dir}")
        steps = self.expert_actions(task_id)
        return f"A walkthrough that wins this game: {'; '.join(steps)}" if steps else None
