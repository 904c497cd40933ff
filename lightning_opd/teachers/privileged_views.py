"""The privileged teacher's views of an episode: the token ids the teacher scores and where each student token
sits in them (PROPOSED, docs/algorithms.md §6.3; used by
:class:`~lightning_opd.teachers.privileged.PrivilegedTeacher`).

Two views (``PrivilegedTeacher(view=...)``):

* ``"walkthrough"`` (:func:`teacher_view`, issue 42): the student's first prompt (system message + first
  observation, one chat-template render with the generation prompt, :class:`~lightning_opd.rollout.chat.ChatFormat`)
  re-rendered with the privileged text inserted (``placement``), followed by the student's ids after the first
  prompt unchanged. Later turns are token deltas appended by the agent loop (F08), so they are the same ids in both
  sequences; every later position moves by one constant ``offset`` (tokens).
* ``"next_action"`` (:func:`next_action_view`; PROPOSED after PivotOPD arXiv 2609.40285, "hint only the gold action
  of the current turn"): every user message (the first prompt and each later user turn) re-rendered with the
  expert's next action for the turn that follows it appended (:func:`hinted_user_text`, :data:`HINT_FORMAT`; the
  action from :func:`expert_next_actions`); replies are kept token for token. The hint enters every turn, so
  positions move by a different amount after each user turn: the view carries a per-position map.

Both are a :class:`TeacherView`: ``ids``, ``positions`` (student position j -> view position) and ``kept`` (token j
is copied verbatim: ``ids[positions[j]] == token_ids[j]``). The teacher's logits at ``positions[j] - 1`` score the
student's token ``j``. The privileged text only enters this copy: the rollouts, the student's forward and the
loss's student side never contain it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_opd.models.tokenizers import first_difference
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.rollout.chat import ChatFormat
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory

PLACEMENTS = ("system", "before_observation")
VIEWS = ("walkthrough", "next_action")
#: the one-step hint appended to a user message (``next_action`` view), after a blank line
HINT_FORMAT = "Hint: the next command is: {action}"


class TeacherViewError(ValueError):
    """An episode's ids are not the chat template's renders of its messages where a view re-renders them (its first
    prompt; with the next_action view, also each user turn) (F08), or a view does not hold a student token at its
    mapped position."""


def privileged_messages(system_prompt: str | None, first_user: str, privileged: str,
                        placement: str) -> list[dict[str, str]]:
    """The teacher's first-prompt messages: the student's (``system_prompt``, ``first_user``) with ``privileged``
    inserted.

    ``"system"``: appended to the system message after a blank line (a system message of its own when the student
    has none; it then replaces a template's default system message). ``"before_observation"``: before the first
    observation in the first user message, followed by a blank line.

    Raises:
        ValueError: an unknown ``placement``.
    """
    if placement == "system":
        system = privileged if system_prompt is None else f"{system_prompt}\n\n{privileged}"
        return [{"role": "system", "content": system}, {"role": "user", "content": first_user}]
    if placement == "before_observation":
        head = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        return head + [{"role": "user", "content": f"{privileged}\n\n{first_user}"}]
    raise ValueError(f"placement={placement!r}: use one of {PLACEMENTS} (where the privileged text goes in the "
                     "teacher's first prompt)")



def teacher_view(traj: Trajectory, privileged: str, chat: ChatFormat,
                 placement: str = "system") -> tuple[list[int], int]:
    """The teacher's token sequence of an episode and the shift of every position after its first prompt.

    ``traj.token_ids`` = ``first_prompt + rest``, where ``first_prompt`` is ``chat.first_prompt(messages[0])`` (the
    system message and the first observation, generation prompt included). The view is ``P + rest`` with ``P`` the
    render of :func:`privileged_messages` with the generation prompt; ``offset = len(P) - len(first_prompt)``. So
    ``view[j + offset] == traj.token_ids[j]`` for every ``j >= len(first_prompt)`` (the replies and later turns,
    token for token), and the teacher's logits at ``j - 1 + offset`` score the student's token ``j``.

    Args:
        traj: the episode (``token_ids``, ``assistant_mask``, ``messages[0]`` = the first user message).
        privileged: the privileged text.
        chat: the student's :class:`ChatFormat` (its tokenizer and the environment's system prompt).
        placement: ``"system"`` or ``"before_observation"`` (:func:`privileged_messages`).

    Returns:
        ``(view_ids, offset)``: ``(T + offset,)`` ids, and the shift in tokens (negative when, with no system
        prompt and ``placement="system"``, the privileged system message is shorter than the template's default).

    Raises:
        TeacherViewError: ``traj`` has no first user message, or its ids do not start with that message's render
            (the message names the task and the first differing position), or a token of the first prompt is
            marked as sampled.
        ValueError: an unknown ``placement``.
    """
    view, offset, _ = _view_parts(traj, privileged, chat, placement)
    return view, offset


def _view_parts(traj: Trajectory, privileged: str, chat: ChatFormat, placement: str) -> tuple[list[int], int, int]:
    """:func:`teacher_view`'s ``(view_ids, offset)`` and the length of the student's first prompt (tokens)."""
    first_user, n = _first_prompt(traj, chat)
    view_prompt = chat.render(privileged_messages(chat.system_prompt, first_user, privileged, placement),
                              add_generation_prompt=True)
    return view_prompt + list(traj.token_ids[n:]), len(view_prompt) - n, n


def _first_prompt(traj: Trajectory, chat: ChatFormat) -> tuple[str, int]:
    """The episode's first user message and the length of its first prompt's render (tokens), checked against its ids.

    Raises:
        TeacherViewError: see :func:`teacher_view`.
    """
    if not traj.messages or traj.messages[0].get("role") != "user":
        raise TeacherViewError(f"episode of task {traj.task_id!r} has no first user message (messages[0]); the "
                               "teacher's view re-renders it")
    first_user = traj.messages[0]["content"]
    prompt = chat.first_prompt(first_user)
    n = len(prompt)
    if traj.token_ids[:n] != prompt:
        pos = first_difference(traj.token_ids[:n], prompt)
        got = traj.token_ids[pos] if pos < traj.num_tokens else "end of episode"
        want = prompt[pos] if pos < n else "end of prompt"
        raise TeacherViewError(
            f"episode of task {traj.task_id!r}: its ids differ from the chat template's render of its first prompt at "
            f"position {pos} (episode {got}, render {want}); the teacher's view needs the episode rendered by "
            "ChatFormat.first_prompt with the same tokenizer and system prompt (F08)")
    if any(traj.assistant_mask[:n]):
        raise TeacherViewError(f"episode of task {traj.task_id!r}: a token of its first prompt (positions < {n}) "
                               "is marked as sampled")
    return first_user, n


@dataclass
class TeacherView:
    """One episode as the teacher sees it.

    Attributes:
        ids: ``(T',)`` the teacher's token ids.
        positions: ``(T,)`` for each student position j, its position in ``ids``; a student token the view replaced
            (inside a re-rendered user message) maps into its replacement, aligned at the end (no counterpart: a
            finite, meaningless score, masked by the loss).
        kept: ``(T,)`` whether token j is in the view verbatim (``ids[positions[j]] == token_ids[j]``): every id after
            the first prompt (walkthrough), every reply token (next_action).
    """

    ids: list[int]
    positions: list[int]
    kept: list[bool]


def walkthrough_view(traj: Trajectory, privileged: str, chat: ChatFormat, placement: str = "system") -> TeacherView:
    """:func:`teacher_view` as a :class:`TeacherView`: ``positions[j] = j + offset`` after the first prompt (``n``
    tokens), ``j`` inside it (read unshifted); ``kept`` = ``j >= n``.

    Raises:
        TeacherViewError, ValueError: see :func:`teacher_view`.
    """
    view, offset, n = _view_parts(traj, privileged, chat, placement)
    return TeacherView(view, [j if j < n else j + offset for j in range(traj.num_tokens)],
                       [j >= n for j in range(traj.num_tokens)])


def hinted_user_text(text: str, action: str | None) -> str:
    """A user message with the one-step hint appended after a blank line (:data:`HINT_FORMAT`); unchanged when
    ``action`` is ``None`` (no expert action left for that turn)."""
    return text if action is None else f"{text}\n\n{HINT_FORMAT.format(action=action)}"


def next_action_view(traj: Trajectory, hints: dict[int, str], chat: ChatFormat) -> TeacherView:
    """The one-step-hint view (PROPOSED after PivotOPD arXiv 2609.40285): each user message before turn k
    re-rendered as :func:`hinted_user_text` ``(message, hints.get(k))``, replies kept token for token.

    The student's ids are walked the way the agent loop wrote them (F08): the first prompt
    (``chat.first_prompt(messages[0])``), then runs of reply tokens (``turn_index == k``: the reply and an appended
    end-of-turn id) and user turns (``turn_index == -1``: ``chat.user_turn(the next user message)``). The first
    prompt becomes ``chat.first_prompt(hinted 0)`` and the user turn before turn k ``chat.user_turn(hinted k)``;
    each reply token j then sits at ``positions[j]`` = its own position plus the hint tokens inserted before it.

    Args:
        traj: the episode (``token_ids``, ``turn_index``, ``messages``: the user messages in order).
        hints: turn -> the expert's next action (:func:`expert_next_actions`); turns without one get no hint.
        chat: the student's :class:`ChatFormat`.

    Raises:
        TeacherViewError: the first prompt is not its render (:func:`teacher_view`), a user turn has no user message
            or its ids are not ``chat.user_turn`` of it (naming the task and the position).
    """
    first_user, n = _first_prompt(traj, chat)
    users = [m["content"] for m in traj.messages if m.get("role") == "user"]
    view = chat.first_prompt(hinted_user_text(first_user, hints.get(0)))
    positions = _end_aligned(0, n, 0, len(view))
    kept, ids, turns = [False] * n, traj.token_ids, traj.turn_index
    j, user, turn = n, 1, 0
    while j < traj.num_tokens:
        e = j
        while e < traj.num_tokens and turns[e] == turns[j]:  # one run: a reply of turn k, or a user turn (-1)
            e += 1
        if turns[j] != NON_ASSISTANT:  # a reply (and its appended end-of-turn id): kept token for token
            positions += range(len(view), len(view) + e - j)
            kept += [True] * (e - j)
            view += ids[j:e]
            turn = turns[j] + 1
        else:
            seg = _user_segment(traj, users, user, j, e, chat)
            hinted = chat.user_turn(hinted_user_text(users[user], hints.get(turn))) if turn in hints else seg
            positions += _end_aligned(j, e, len(view), len(view) + len(hinted))
            kept += [False] * (e - j)
            view += hinted
            user += 1
        j = e
    return TeacherView(view, positions, kept)


def _end_aligned(start: int, end: int, vstart: int, vend: int) -> list[int]:
    """Positions ``start .. end-1`` of a student segment mapped into its replacement ``vstart .. vend-1``, aligned at
    the end (the generation prompt's last token onto the replacement's), never before ``vstart``."""
    return [max(vstart, vend - (end - j)) for j in range(start, end)]


def _user_segment(traj: Trajectory, users: list[str], user: int, j: int, e: int, chat: ChatFormat) -> list[int]:
    """``chat.user_turn(users[user])``, checked to be the episode's ids ``j .. e-1`` (a user turn).

    Raises:
        TeacherViewError: no such user message, or other ids (naming the task and the first differing position).
    """
    if user >= len(users):
        raise TeacherViewError(f"episode of task {traj.task_id!r}: the user turn at position {j} has no user message "
                               f"(messages holds {len(users)}); the next_action view re-renders each user turn")
    seg = chat.user_turn(users[user])
    if traj.token_ids[j:e] != seg:
        pos = first_difference(traj.token_ids[j:e], seg)
        raise TeacherViewError(f"episode of task {traj.task_id!r}: its ids at position {j + pos} differ from "
                               f"ChatFormat.user_turn of user message {user}; the next_action view needs the turns the "
                               "agent loop appended, token for token (F08)")
    return seg


def expert_next_actions(traj: Trajectory, expert: list[str]) -> dict[int, str]:
    """The expert's next action at each turn of an episode: turn -> ``expert[p]``, where ``p`` counts the expert's
    actions the student has already taken in order (a reply whose first line equals ``expert[p]``, case and spaces
    ignored, moves ``p`` on; any other reply leaves it). Turns after the expert's last action are left out.

    PROPOSED (issue 42's hint-use diagnostic): with TextWorld's walkthrough as the expert, the command the
    privileged text says comes next.
    """
    out: dict[int, str] = {}
    p = 0
    replies = [m["content"] for m in traj.messages if m.get("role") == "assistant"]
    for turn, reply in enumerate(replies):
        if p >= len(expert):
            break
        out[turn] = expert[p]
        lines = reply.strip().splitlines()
        if lines and " ".join(lines[0].lower().split()) == " ".join(expert[p].lower().split()):
            p += 1
    return out


def row_trajectories(batch: RolloutBatch) -> list[tuple[str, Trajectory | None]]:
    """Each row of ``batch`` as ``(task id, its Trajectory)``, matched in ``batch.trajectories`` by task id and token ids
    (so also in a micro-batch); ``("", None)`` for a row with no task id (padding), ``(task, None)`` when unmatched."""
    by_ids = {(str(t.task_id), tuple(t.token_ids)): t for t in batch.trajectories if t.num_tokens > 0}
    out = []
    for r, n in enumerate(batch.lengths):
        task = batch.task_ids[r] if batch.task_ids else ""
        out.append((task, by_ids.get((task, tuple(batch.input_ids[r, :n].tolist()))) if task else None))
    return out


