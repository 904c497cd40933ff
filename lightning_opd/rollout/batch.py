"""Collate trajectories into padded ``(B, T)`` tensors for the learner.

Padding is on the right; every mask comes from lengths and the trajectory's own assistant mask,
never from token values (F03: with pad == EOS the EOS that ends a reply is still trained on). The one
token-value rule is the end of a reply (F23): given the stop ids, a reply's tokens after its first stop id
are never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Collection, Sequence

import torch

from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory


@dataclass
class RolloutBatch:
    """A batch of trajectories as tensors. ``B`` = episodes with at least one token, ``T`` = longest.

    Attributes:
        input_ids: ``(B, T)`` long, right-padded with ``pad_id``.
        attention_mask: ``(B, T)`` long, 1 on real tokens.
        loss_mask: ``(B, T)`` float, 1 on policy-sampled tokens (the tokens trained on).
        turn_index: ``(B, T)`` long, zero-based turn of reply tokens, -1 elsewhere.
        behaviour_logprobs: ``(B, T)`` float, log-prob of each sampled token under the sampling
            distribution (nats), 0 elsewhere.
        behaviour_version: ``(B,)`` long, oldest policy version that produced the episode.
        rewards: ``(B,)`` float, total episode reward (points).
        success: ``(B,)`` float, 1 for a won episode.
        num_turns: ``(B,)`` long, replies per episode (turns).
        group_id: ``(B,)`` long, GRPO group.
        is_probe: ``(B,)`` bool, full-depth probe rollout.
        rollout_cap: ``(B,)`` long, turn cap the episode ran under.
        sample_weight: ``(B,)`` float, per-sample loss weight set by weighting schemes (default 1).
        advantage: ``(B,)`` float, GRPO group advantage Â_i (set by the module for the hybrid loss).
        old_logprobs: ``(B, T)`` float, log π_old of each sampled token (nats; aligned like
            ``behaviour_logprobs``), set by the module when the hybrid loss needs them.
        turn_weight: ``(B, T)`` float, T-DUR weight of each token's turn (aligned like ``loss_mask``).
        teacher_token_mask: ``(B, T)`` float, 1 on reply tokens the teacher sampled in a teacher-played turn (teacher
            intervention, :mod:`lightning_opd.rollout.intervention`; the F23 stop rule applied), 0 elsewhere (all 0
            without intervention). Never in ``loss_mask`` (the student trains on its own turns; their
            ``behaviour_logprobs`` are 0 and ``turn_index`` -1), trained on only with ``teacher_turn_loss``
            (:mod:`lightning_opd.learner.teacher_turns`). ``None`` in a batch built without it.
        sampling: sampling parameters the batch was generated with (the learner scores at the same
            temperature, F02).
        trajectories: the source trajectories (all of them, including empty ones), for logging.
        task_ids: the task id of each row (``B`` strings; empty for a batch built without them), e.g. for routing
            rows to several teachers (:class:`~lightning_opd.teachers.routed.RoutedTeacher`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    turn_index: torch.Tensor
    behaviour_logprobs: torch.Tensor
    behaviour_version: torch.Tensor
    rewards: torch.Tensor
    success: torch.Tensor
    num_turns: torch.Tensor
    group_id: torch.Tensor
    is_probe: torch.Tensor
    rollout_cap: torch.Tensor
    sample_weight: torch.Tensor | None = None
    advantage: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    turn_weight: torch.Tensor | None = None
    teacher_token_mask: torch.Tensor | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    trajectories: list[Trajectory] = field(default_factory=list)
    task_ids: tuple[str, ...] = ()

    _TENSORS = ("input_ids", "attention_mask", "loss_mask", "turn_index", "behaviour_logprobs", "behaviour_version",
                "rewards", "success", "num_turns", "group_id", "is_probe", "rollout_cap", "sample_weight", "advantage",
                "old_logprobs", "turn_weight", "teacher_token_mask")
    _PER_TOKEN = ("input_ids", "attention_mask", "loss_mask", "turn_index", "behaviour_logprobs", "old_logprobs",
                  "turn_weight", "teacher_token_mask")

    def __post_init__(self) -> None:
        if self.sample_weight is None:
            self.sample_weight = torch.ones(self.input_ids.shape[0], dtype=torch.float32,
                                            device=self.input_ids.device)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> "RolloutBatch":
        return replace(self, **{k: getattr(self, k).to(device) for k in self._TENSORS if getattr(self, k) is not None})

    def select(self, index: slice | torch.Tensor) -> "RolloutBatch":
        """Rows ``index`` (a slice or a ``(b,)`` long tensor; trajectories are kept whole for logging)."""
        task_ids = self.task_ids
        if task_ids:
            task_ids = task_ids[index] if isinstance(index, slice) else tuple(task_ids[i] for i in index.tolist())
        return replace(self, **{k: getattr(self, k)[index] for k in self._TENSORS if getattr(self, k) is not None},
                       task_ids=tuple(task_ids))

    @property
    def lengths(self) -> list[int]:
        """Attended tokens of each row (``B`` ints, tokens)."""
        return [int(n) for n in self.attention_mask.sum(dim=1).tolist()]

    def rows(self, start: int, stop: int) -> "RolloutBatch":
        """Rows ``start:stop`` trimmed to the longest of them (at least 1 column)."""
        mb = self.select(slice(start, stop))
        t = max(self.lengths[start:stop], default=0)
        return replace(mb, **{k: getattr(mb, k)[:, :max(t, 1)] for k in self._PER_TOKEN if getattr(mb, k) is not None})

    def split(self, micro_batch_size: int) -> list["RolloutBatch"]:
        """Micro-batches of at most ``micro_batch_size`` rows, each trimmed to its longest row."""
        return [self.rows(start, start + micro_batch_size) for start in range(0, self.size, micro_batch_size)]

    def split_tokens(self, max_tokens: int) -> list["RolloutBatch"]:
        """Micro-batches of consecutive rows whose padded size, rows x longest row, is at most ``max_tokens``
        (tokens), each trimmed to its longest row (:func:`pack_by_tokens`). Row order is kept: concatenated,
        the micro-batches are this batch. A row longer than ``max_tokens`` is a micro-batch of its own (an
        episode is never split: its forward needs its whole prefix)."""
        return [self.rows(start, stop) for start, stop in pack_by_tokens(self.lengths, max_tokens)]

    def masked_rows(self, n: int) -> "RolloutBatch":
        """``n`` padding rows shaped like this batch's (the same optional fields, device and sampling), of 2
        attended tokens (id 0) with ``loss_mask`` 0 and ``turn_index`` -1: a forward on them trains nothing
        (sample weight 1, advantage and log-probs 0, turn weight 1). A rank pads its micro-batches with
        them so that every rank runs the same number of forwards (collectives under FSDP, F19)."""
        dev = self.input_ids.device
        fill = {"attention_mask": 1, "turn_index": NON_ASSISTANT, "sample_weight": 1, "turn_weight": 1}
        values = {k: torch.full((n, 2) if k in self._PER_TOKEN else (n,), fill.get(k, 0), dtype=getattr(self, k).dtype,
                                device=dev)
                  for k in self._TENSORS if getattr(self, k) is not None}
        return replace(self, **values, trajectories=[], task_ids=("",) * n if self.task_ids else ())


def pack_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """Cut rows of ``lengths`` (tokens each, in batch order) into consecutive ranges ``[start, stop)`` whose
    padded size ``(stop - start) * max(lengths[start:stop])`` is at most ``max_tokens``: the fewest ranges,
    and among those the fewest padded tokens (exact, by dynamic programming over the cut points, O(B²)).
    A row longer than ``max_tokens`` is a range of its own.

    Padding-aware but order-preserving (a design choice of this project): the budget counts the padding
    a micro-batch's forward really computes, and the cuts are placed to waste the least of it; rows are not
    sorted by length, because the step's per-row results (the ``(B, T-1)`` log-probs, the per-sample turn
    statistics, ATOD's contiguous PPO mini-batches) are concatenated in batch order. Example: lengths
    ``[10, 100, 100]``, budget 200: ``[(0, 1), (1, 3)]`` (210 padded tokens), where filling ranges greedily
    from the left gives ``[(0, 2), (2, 3)]`` (300).

    Raises:
        ValueError: ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1 (tokens per micro-batch)")
    n = len(lengths)
    best: list[tuple[int, int, int]] = [(0, 0, 0)] + [(n + 1, 0, 0)] * n  # (ranges, padded tokens, last cut)
    for stop in range(1, n + 1):
        longest = 0
        for start in range(stop - 1, -1, -1):
            longest = max(longest, int(lengths[start]), 1)
            padded = (stop - start) * longest
            if padded > max_tokens and stop - start > 1:
                break  # a longer range only pads more
            cand = (best[start][0] + 1, best[start][1] + padded, start)
            if cand[:2] < best[stop][:2]:
                best[stop] = cand
    cuts, stop = [], n
    while stop > 0:
        start = best[stop][2]
        cuts.append((start, stop))
        stop = start
    return cuts[::-1]


def _after_stop(t: Trajectory, stop_ids: Collection[int], reply_mask: list[int] | None = None) -> list[int]:
    """Positions of reply tokens (``reply_mask``, default ``t.assistant_mask``) after a stop id of the same reply."""
    out, stopped_turn = [], None
    replies = t.assistant_mask if reply_mask is None else reply_mask
    for pos, (tok, mask, turn) in enumerate(zip(t.token_ids, replies, t.turn_index)):
        if not mask:
            continue
        if turn == stopped_turn:
            out.append(pos)
        elif tok in stop_ids:
            stopped_turn = turn
    return out


def collate_trajectories(trajs: list[Trajectory], sampling: SamplingParams, pad_id: int = 0,
                         stop_ids: Collection[int] = ()) -> RolloutBatch:
    """Pad ``trajs`` into a :class:`RolloutBatch`. Trajectories without tokens (an environment that
    failed at reset) are left out of the tensors but kept in ``trajectories`` for the statistics.

    Args:
        trajs: the episodes.
        sampling: sampling parameters they were generated with.
        pad_id: id of padding tokens (masks never depend on it).
        stop_ids: ids that end a reply (:func:`lightning_opd.rollout.chat.stop_token_ids`); reply
            tokens after the first stop id of their turn get ``loss_mask`` 0 (F23). Empty: no such rule.

    Raises:
        ValueError: a trajectory's per-token lists have different lengths.
    """
    rows = [t for t in trajs if t.num_tokens > 0]
    for t in rows:
        n = len(t.token_ids)
        if not (len(t.assistant_mask) == len(t.turn_index) == len(t.behaviour_logprobs) == n):
            raise ValueError(f"trajectory {t.task_id}/{t.seed}: per-token lists differ in length")
    b = len(rows)
    length = max((t.num_tokens for t in rows), default=1)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention = torch.zeros((b, length), dtype=torch.long)
    loss_mask = torch.zeros((b, length), dtype=torch.float32)
    turn = torch.full((b, length), NON_ASSISTANT, dtype=torch.long)
    blp = torch.zeros((b, length), dtype=torch.float32)
    teacher = torch.zeros((b, length), dtype=torch.float32)
    for i, t in enumerate(rows):
        n = t.num_tokens
        input_ids[i, :n] = torch.tensor(t.token_ids)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(t.assistant_mask, dtype=torch.float32)
        if stop_ids:
            loss_mask[i, _after_stop(t, stop_ids)] = 0.0
        turn[i, :n] = torch.tensor(t.turn_index)
        blp[i, :n] = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
        if t.teacher_mask:  # teacher-played turns (intervention); the same F23 stop rule as the student's replies
            teacher[i, :len(t.teacher_mask)] = torch.tensor(t.teacher_mask, dtype=torch.float32)
            if stop_ids:
                teacher[i, _after_stop(t, stop_ids, t.teacher_mask)] = 0.0
    turn = torch.where(loss_mask > 0, turn, torch.full_like(turn, NON_ASSISTANT))

    def per_row(values, dtype):
        return torch.tensor(values, dtype=dtype) if rows else torch.zeros(0, dtype=dtype)

    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask, turn_index=turn, behaviour_logprobs=blp,
        behaviour_version=per_row([t.behaviour_version for t in rows], torch.long),
        rewards=per_row([t.total_reward for t in rows], torch.float32),
        success=per_row([float(t.success) for t in rows], torch.float32),
        num_turns=per_row([t.num_turns for t in rows], torch.long),
        group_id=per_row([t.group_id for t in rows], torch.long),
        is_probe=per_row([t.is_probe for t in rows], torch.bool),
        rollout_cap=per_row([t.rollout_cap for t in rows], torch.long),
        sampling=sampling, trajectories=list(trajs), task_ids=tuple(str(t.task_id) for t in rows),
        teacher_token_mask=teacher,
    )


#: keys of :func:`rollout_sums` that are counts (logged as sums); every other key is a mean per episode
ROLLOUT_COUNTS = ("env_errors",)
#: :func:`rollout_sums` key -> the :class:`Trajectory` field summed over episodes (in this order)
_SUMMED_FIELDS = (
    ("success", "success"), ("turns", "num_turns"), ("tokens", "num_tokens"),
    ("assistant_tokens", "num_assistant_tokens"), ("invalid_actions", "invalid_actions"),
    ("cut_replies", "cut_replies"), ("truncated", "truncated"), ("env_errors", "env_error"),
    ("reward", "total_reward"), ("prefill_tokens", "prefill_tokens"), ("cached_prompt_tokens", "cached_prompt_tokens"),
    ("cap", "rollout_cap"), ("is_probe", "is_probe"), ("teacher_turns", "num_teacher_turns"), ("takeovers", "took_over"),
)


def rollout_sums(trajs: list[Trajectory]) -> dict[str, float]:
    """Sums over the episodes of a batch (all episodes, empty ones included) of what :func:`rollout_stats`
    reports: divided by the episodes, summed over ranks first when logged (F27), they give its means.

    Keys as :func:`rollout_stats`'s, each a sum over episodes (``success``: episodes won, ``turns``: turns
    played, ``reward``: points, ...); ``env_errors`` (in :data:`ROLLOUT_COUNTS`) is a count either way.
    """
    return {key: float(sum(map(attrgetter(field), trajs))) for key, field in _SUMMED_FIELDS}


def rollout_stats(trajs: list[Trajectory]) -> dict[str, float]:
    """Episode statistics of a batch (all episodes, empty ones included).

    Keys (``rollout/`` namespace when logged): ``success`` (fraction of episodes), ``turns`` (mean
    turns per episode), ``tokens`` (mean tokens per episode), ``assistant_tokens`` (mean sampled
    tokens per episode), ``invalid_actions`` (mean per episode), ``cut_replies`` (mean per episode),
    ``truncated`` (fraction), ``env_errors`` (count), ``reward`` (mean total reward, points),
    ``prefill_tokens`` and ``cached_prompt_tokens`` (mean per episode over its turns: prompt tokens the generator
    prefilled, and those it served from a cache: HF's KV cache kept between turns, vLLM's prefix cache),
    ``cap`` (mean turn cap the episodes were played at, turns: a training batch shares one, so its cap; TurnOPD's
    rollout-depth controller moves it), ``is_probe`` (fraction of the episodes that were full-depth probes:
    1 in a TurnOPD probe batch, else 0), ``teacher_turns`` (mean turns per episode played by the teacher, teacher
    intervention; 0 without it; ``turns`` counts both roles' turns) and ``takeovers`` (fraction of the episodes a
    takeover policy handed to the teacher).
    These are this batch's values; ``OPDModule`` logs them over all ranks' episodes (:func:`rollout_sums`).
    """
    n = max(1, len(trajs))
    return {k: v if k in ROLLOUT_COUNTS else v / n for k, v in rollout_sums(trajs).items()}
