"""A low-variance metric beside success: the student's teacher-forced reverse KL on the teacher's own
greedy trajectories of the held-out tasks.

The teacher plays every held-out task once, greedily (:func:`teacher_trajectories`; cached in a JSON
file keyed by the teacher, its weight files, the environment, the tasks and the episode limits, so a
second evaluation reuses them). The student is then scored teacher-forced on those fixed token
sequences: at every assistant token ``t`` of the teacher's replies (``assistant_mask == 1``), the exact
full-vocabulary reverse KL

    KL_t = sum_v p_S(v | s_t) (log p_S(v | s_t) - log p_T(v | s_t))        (nats)

of the two next-token distributions at temperature 1, computed by
:class:`~lightning_opd.losses.divergences.FullVocabReverseKL` (fp32 upcast, heads cut to the shared
vocabulary, chunked). Because the sequences are the same for every student, two students are compared
on identical states, with no sampling noise and no success threshold: the measure moves before success
does. It is 0 exactly when the student's distributions equal the teacher's on those states.

Reductions (:class:`TrajectoryKL`): ``mean`` = sum of ``KL_t`` over all assistant tokens / their number
(nats/token); ``per_turn[n]`` the same over the tokens of zero-based turn ``n``; ``per_task`` the
per-task sums and token counts (a task's own mean is ``kl_sum / tokens``).

:func:`kl_by_outcome` scores other fixed trajectories the same way (the student's own greedy episodes in
``evaluate``), split into won and failed episodes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from lightning_opd.files import write_text_atomic
from lightning_opd.rollout.batch import collate_trajectories
from lightning_opd.losses.divergences import FullVocabReverseKL
from lightning_opd.models.fsdp import with_root_params
from lightning_opd.models.logits import output_head, trunk_hidden_states
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.types import Trajectory

CACHE_FORMAT = "lightning-opd-teacher-trajectories/1"


@dataclass
class TrajectoryKL:
    """The student's reverse KL on the teacher's trajectories.

    Attributes:
        mean: token-weighted mean over every assistant token (nats/token); NaN without tokens.
        per_turn: ``per_turn[n]``: mean over the tokens of zero-based turn ``n`` (nats/token).
        tokens_per_turn: assistant tokens of each turn.
        per_task: task id -> ``{"kl_sum": nats, "tokens": count}``.
        tokens: assistant tokens scored.
    """

    mean: float
    per_turn: list[float] = field(default_factory=list)
    tokens_per_turn: list[int] = field(default_factory=list)
    per_task: dict[str, dict[str, float]] = field(default_factory=dict)
    tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _fingerprint(model_dir: str | os.PathLike) -> list:
    """Names, sizes and modification times of the weight files of ``model_dir`` (a retrained teacher
    written to the same path gets another cache entry)."""
    p = Path(model_dir)
    files = sorted(list(p.glob("*.safetensors")) + list(p.glob("*.bin")))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def cache_key(teacher: str | os.PathLike, env_id: dict, tasks: Sequence[str], max_turns: int, max_new_tokens: int,
              max_context_tokens: int) -> dict:
    """What the teacher's trajectories depend on: the teacher directory (resolved) and its weight files,
    the environment (``env_id``: class path and arguments), the task ids and the episode limits."""
    return {"teacher": str(Path(teacher).resolve()), "weights": _fingerprint(teacher), "env": env_id,
            "tasks": list(tasks), "max_turns": int(max_turns), "max_new_tokens": int(max_new_tokens),
            "max_context_tokens": int(max_context_tokens)}


def cache_path(cache_dir: str | os.PathLike, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"{Path(key['teacher']).name}-{digest}.json"


def load_cached(path: Path, key: dict) -> list[Trajectory] | None:
    """The cached trajectories at ``path`` if the file exists, parses and was written for ``key``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != CACHE_FORMAT or data.get("key") != key:
        return None
    return [Trajectory(**t) for t in data["trajectories"]]


def save_cached(path: Path, key: dict, trajectories: Sequence[Trajectory]) -> Path:
    """Write the cache file atomically (:func:`~lightning_opd.files.write_text_atomic`)."""
    data = {"format": CACHE_FORMAT, "key": key, "trajectories": [asdict(t) for t in trajectories]}
    return write_text_atomic(path, json.dumps(data))


def play_greedy(loop: AgentLoop, tasks: Sequence[str], max_turns: int, max_new_tokens: int,
                batch_size: int = 50) -> list[Trajectory]:
    """Every task once with greedy decoding through ``loop`` (episode seed 0: greedy decoding ignores it),
    ``batch_size`` episodes at a time; one :class:`Trajectory` per task, in order."""
    sampling = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens)
    out: list[Trajectory] = []
    for start in range(0, len(tasks), batch_size):
        specs = [EpisodeSpec(task_id=t, seed=0, max_turns=max_turns) for t in tasks[start:start + batch_size]]
        out += loop.run(specs, sampling)
    return out


def teacher_trajectories(loop_factory, teacher: str | os.PathLike, env_id: dict, tasks: Sequence[str], *,
                         max_turns: int, max_new_tokens: int, max_context_tokens: int,
                         cache_dir: str | os.PathLike | None, batch_size: int = 50) -> tuple[list[Trajectory], Path | None]:
    """The teacher's greedy trajectory of every task, from the cache when it holds them.

    Args:
        loop_factory: ``() -> AgentLoop`` playing the teacher (called only on a cache miss).
        teacher: teacher model directory (part of the cache key, with its weight files).
        env_id: class path and arguments of the environment (part of the key).
        tasks: task ids, in order.
        max_turns, max_new_tokens, max_context_tokens: episode limits (turns, tokens; part of the key).
        cache_dir: where cache files live (``None``: no cache).
        batch_size: episodes played together.

    Returns:
        ``(trajectories, cache file or None)``.
    """
    key = cache_key(teacher, env_id, tasks, max_turns, max_new_tokens, max_context_tokens)
    path = cache_path(cache_dir, key) if cache_dir is not None else None
    if path is not None:
        cached = load_cached(path, key)
        if cached is not None:
            return cached, path
    trajs = play_greedy(loop_factory(), list(tasks), max_turns, max_new_tokens, batch_size)
    if path is not None:
        save_cached(path, key, trajs)
    return trajs, path


@torch.no_grad()
def trajectory_kl(student, teacher, trajectories: Sequence[Trajectory], vocab_size: int, pad_id: int = 0,
                  micro_batch_size: int = 1, chunk_size: int = 256, teacher_states: dict | None = None) -> TrajectoryKL:
    """Teacher-forced reverse KL(student || teacher) on the assistant tokens of ``trajectories``
    (module docstring), through :class:`FullVocabReverseKL`.

    Args:
        student, teacher: Hugging Face causal LMs sharing one tokenizer (check it with
            :func:`~lightning_opd.models.tokenizers.check_tokenizers_compatible`, which gives ``vocab_size``).
            A sharded (FSDP2) student is fine when every rank calls this with the same trajectories.
        trajectories: fixed episodes (the teacher's); ``assistant_mask`` marks the scored tokens.
        vocab_size: shared real vocabulary ``V``; logits are compared over ``[:V]`` (F01b).
        pad_id: padding id (masks come from lengths, F03).
        micro_batch_size: trajectories per forward pass.
        chunk_size: tokens per LM-head chunk.
        teacher_states: a dict kept by the caller across calls on the same ``trajectories`` and ``teacher``
            (several students scored on the teacher's episodes): the teacher's trunk hidden states at the scored
            positions, ``(N, D_T)`` per micro-batch, stored on the first call and reused, so the teacher's
            forward runs once instead of once per student. ``None``: computed every call.

    Returns:
        :class:`TrajectoryKL` (nats/token).
    """
    loss = FullVocabReverseKL(chunk_size=chunk_size)
    device = next(student.parameters()).device
    t_device = next(teacher.parameters()).device
    head_s, head_t = output_head(student, vocab_size), output_head(teacher, vocab_size)
    tally = _Tally()
    modes = (student.training, teacher.training)
    student.eval()
    teacher.eval()
    try:
        rows_with_tokens = [t for t in trajectories if t.num_assistant_tokens > 0]
        for start in range(0, len(rows_with_tokens), micro_batch_size):
            chunk = rows_with_tokens[start:start + micro_batch_size]
            batch, rows, cols, turns = _scored_positions(chunk, pad_id)
            ids, mask = batch.input_ids, batch.attention_mask  # (b, T)
            targets = ids[:, 1:][rows, cols]  # (N,)
            key = (micro_batch_size, start, tuple(t.task_id for t in chunk), ids.shape)
            h_t = None if teacher_states is None else teacher_states.get(key)
            if h_t is None:
                h_t = trunk_hidden_states(teacher, ids.to(t_device), mask.to(t_device))[rows, cols]  # (N, D_T)
                if teacher_states is not None:
                    teacher_states[key] = h_t

            def student_side():
                h_s = trunk_hidden_states(student, ids.to(device), mask.to(device))[rows.to(device), cols.to(device)]
                return loss(h_s, h_t.to(device), targets.to(device), head_s,
                            lambda h: head_t(h.to(t_device)).to(device), temperature=1.0)

            tally.add(chunk, rows, turns, with_root_params(student, student_side).kl.double().cpu())
    finally:
        student.train(modes[0])
        teacher.train(modes[1])
    return tally.result()


def _scored_positions(chunk: Sequence[Trajectory], pad_id: int):
    """``(batch, rows, cols, turns)``: ``chunk`` collated and its scored positions, each ``(N,)``: row, column
    (predicting token ``cols + 1``, an assistant token) and that token's zero-based turn."""
    batch = collate_trajectories(list(chunk), SamplingParams(temperature=1.0), pad_id)
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)  # (N,), (N,)
    return batch, rows, cols, batch.turn_index[:, 1:][rows, cols]


class _Tally:
    """Sums of KL (nats) and token counts per turn and per task, over micro-batches; :meth:`result` gives the
    :class:`TrajectoryKL`."""

    def __init__(self) -> None:
        self.kl_sums: list[float] = []
        self.counts: list[int] = []
        self.per_task: dict[str, dict[str, float]] = {}

    def add(self, chunk: Sequence[Trajectory], rows: torch.Tensor, turns: torch.Tensor, kl: torch.Tensor) -> None:
        """``kl``: ``(N,)`` nats at the scored positions of ``chunk`` (their ``rows`` and ``turns``, ``(N,)``)."""
        for n in range(int(turns.max()) + 1 if len(turns) else 0):
            sel = turns == n
            while len(self.kl_sums) <= n:
                self.kl_sums.append(0.0)
                self.counts.append(0)
            self.kl_sums[n] += float(kl[sel].sum())
            self.counts[n] += int(sel.sum())
        for i, traj in enumerate(chunk):
            sel = rows == i
            entry = self.per_task.setdefault(traj.task_id, {"kl_sum": 0.0, "tokens": 0})
            entry["kl_sum"] += float(kl[sel].sum())
            entry["tokens"] += int(sel.sum())

    def result(self) -> TrajectoryKL:
        total = sum(self.counts)
        return TrajectoryKL(mean=sum(self.kl_sums) / total if total else math.nan,
                            per_turn=[s / c if c else math.nan for s, c in zip(self.kl_sums, self.counts)],
                            tokens_per_turn=self.counts, per_task=self.per_task, tokens=total)


def zero_kl(trajectories: Sequence[Trajectory]) -> TrajectoryKL:
    """The teacher's own KL on its trajectories: 0 nats at every position :func:`trajectory_kl` scores, counted by
    the same code (per turn and per task), without a forward pass."""
    tally = _Tally()
    for traj in trajectories:
        if traj.num_assistant_tokens > 0:
            _, rows, _, turns = _scored_positions([traj], 0)
            tally.add([traj], rows, turns, torch.zeros(len(rows), dtype=torch.float64))
    return tally.result()


def split_by_outcome(trajectories: Sequence[Trajectory]) -> dict[str, list[Trajectory]]:
    """``{"won": [...], "failed": [...]}``: won episodes and the rest (lost, out of turns, cut); episodes
    whose environment failed are in neither (their end says nothing about the policy)."""
    kept = [t for t in trajectories if not t.env_error]
    return {"won": [t for t in kept if t.success], "failed": [t for t in kept if not t.success]}


def kl_by_outcome(student, teacher, trajectories: Sequence[Trajectory], vocab_size: int, pad_id: int = 0,
                  **kwargs) -> dict[str, dict]:
    """The student's reverse KL to the teacher on ``trajectories`` (typically its own greedy episodes),
    separately on won and failed ones (:func:`split_by_outcome`), through :func:`trajectory_kl`.

    Returns:
        ``{"won" | "failed": {"episodes": n, "mean": nats/token, "per_turn": [nats/token per zero-based turn],
        "tokens_per_turn": [...], "tokens": n}}``; ``mean`` is NaN and the lists empty for an outcome with no
        episode. Further keyword arguments go to :func:`trajectory_kl`.
    """
    out = {}
    for outcome, trajs in split_by_outcome(trajectories).items():
        kl = trajectory_kl(student, teacher, trajs, vocab_size, pad_id, **kwargs)
        out[outcome] = {"episodes": len(trajs), "mean": kl.mean, "per_turn": kl.per_turn,
                        "tokens_per_turn": kl.tokens_per_turn, "tokens": kl.tokens}
    return out
