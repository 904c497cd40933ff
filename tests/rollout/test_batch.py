"""Collate (F03: masks from lengths, never from token values) and the RolloutBuffer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_opd.rollout.batch import collate_trajectories, pack_by_tokens, rollout_stats
from lightning_opd.rollout.buffer import RolloutBuffer
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.types import Trajectory

EOS = PAD = 2  # the F03 case: pad id == eos id


def _traj(reply_lengths: list[int], task="t") -> Trajectory:
    t = Trajectory(task_id=task)
    t.append([5, 6, 7], assistant=False, turn=-1)
    for k, n in enumerate(reply_lengths):
        t.append([9] * (n - 1) + [EOS], assistant=True, turn=k, logprobs=[-0.5] * n)
        t.turn_versions.append(0)
        if k + 1 < len(reply_lengths):
            t.append([EOS, 8, 8], assistant=False, turn=-1)  # observation turn that also contains the pad id
    return t


def test_f03_loss_mask_counts_every_completion_token_including_eos():
    trajs = [_traj([3]), _traj([5, 2]), _traj([1, 1, 4])]
    batch = collate_trajectories(trajs, SamplingParams(), pad_id=PAD)
    assert batch.loss_mask.sum(1).tolist() == [3.0, 7.0, 6.0]
    # every EOS that ends a reply is trained on although it equals the pad id
    for i, t in enumerate(trajs):
        n = t.num_tokens
        eos_pos = [p for p in range(n) if t.token_ids[p] == EOS and t.assistant_mask[p]]
        assert all(batch.loss_mask[i, p] == 1 for p in eos_pos)
        assert batch.attention_mask[i].sum().item() == n
        assert (batch.input_ids[i, n:] == PAD).all() and (batch.loss_mask[i, n:] == 0).all()
    assert batch.input_ids.shape == (3, max(t.num_tokens for t in trajs))


def test_turn_index_and_behaviour_logprobs_are_aligned():
    batch = collate_trajectories([_traj([2, 3])], SamplingParams(), pad_id=PAD)
    row_turn = batch.turn_index[0].tolist()
    assert row_turn == [-1, -1, -1, 0, 0, -1, -1, -1, 1, 1, 1]
    assert batch.behaviour_logprobs[0].tolist() == [0, 0, 0, -0.5, -0.5, 0, 0, 0, -0.5, -0.5, -0.5]


def test_empty_trajectories_are_left_out_of_tensors_but_counted():
    empty = Trajectory(task_id="broken", env_error=True)
    batch = collate_trajectories([_traj([2]), empty], SamplingParams(), pad_id=PAD)
    assert batch.size == 1 and len(batch.trajectories) == 2
    assert rollout_stats(batch.trajectories)["env_errors"] == 1.0


def test_rollout_stats_report_prefilled_and_cached_prompt_tokens_per_episode():
    a, b = _traj([2, 2]), _traj([3])
    a.turn_prefill_tokens, a.turn_cached_tokens = [3, 3], [0, 5]  # turn 2 reuses turn 1's 5 tokens
    b.turn_prefill_tokens, b.turn_cached_tokens = [3], [0]
    stats = rollout_stats([a, b, Trajectory(task_id="broken", env_error=True)])
    assert stats["prefill_tokens"] == pytest.approx(9 / 3) and stats["cached_prompt_tokens"] == pytest.approx(5 / 3)


def test_rollout_stats_report_the_batch_cap_and_probe_share():
    """TurnOPD's validity checks read the cap a batch was played at and whether it was a probe batch: a capped
    batch of 2 episodes at 5 turns, and a probe batch of 2 at the full 12 (one of them an environment error, which
    still ran under the batch's cap)."""
    capped = [Trajectory(task_id="a", rollout_cap=5), Trajectory(task_id="b", rollout_cap=5)]
    probe = [Trajectory(task_id="a", rollout_cap=12, is_probe=True),
             Trajectory(task_id="b", rollout_cap=12, is_probe=True, env_error=True)]
    assert (rollout_stats(capped)["cap"], rollout_stats(capped)["is_probe"]) == (5.0, 0.0)
    assert (rollout_stats(probe)["cap"], rollout_stats(probe)["is_probe"]) == (12.0, 1.0)
    assert rollout_stats(capped + probe)["cap"] == pytest.approx((5 + 5 + 12 + 12) / 4)


def test_split_trims_each_micro_batch_to_its_longest_row():
    batch = collate_trajectories([_traj([2]), _traj([2, 5, 5])], SamplingParams(), pad_id=PAD)
    short, long = batch.split(1)
    assert short.input_ids.shape == (1, 5) and long.input_ids.shape == (1, batch.input_ids.shape[1])


@pytest.mark.parametrize(("lengths", "budget", "ranges"), [
    ([10, 100, 100], 200, [(0, 1), (1, 3)]),  # 210 padded tokens; greedy from the left: (0, 2), (2, 3) = 300
    ([10, 100, 100], 300, [(0, 3)]),  # 3 x 100 fits exactly
    ([10, 100, 100], 99, [(0, 1), (1, 2), (2, 3)]),  # rows over the budget are micro-batches of their own
    ([50, 50, 50, 50], 100, [(0, 2), (2, 4)]),
    ([4, 21, 5, 12], 24, [(0, 1), (1, 2), (2, 4)]),  # 2 x 12 = 24 fits, 2 x 21 does not
    ([7], 1, [(0, 1)]),
    ([], 100, []),
])
def test_pack_by_tokens_fewest_ranges_then_least_padding(lengths, budget, ranges):
    assert pack_by_tokens(lengths, budget) == ranges


def test_pack_by_tokens_refuses_a_budget_below_one():
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        pack_by_tokens([3], 0)


def test_split_tokens_keeps_row_order_and_trims_each_micro_batch():
    trajs = [_traj([1]), _traj([2, 5, 5]), _traj([2]), _traj([3, 3])]
    batch = collate_trajectories(trajs, SamplingParams(), pad_id=PAD)
    assert batch.lengths == [4, 21, 5, 12]
    parts = batch.split_tokens(24)
    assert [p.input_ids.shape for p in parts] == [(1, 4), (1, 21), (2, 12)]
    for name in ("input_ids", "attention_mask", "loss_mask", "turn_index", "behaviour_logprobs"):
        rows = [row[:n] for p in parts for row, n in zip(getattr(p, name), p.lengths)]
        assert [r.tolist() for r in rows] == [getattr(batch, name)[i, :n].tolist() for i, n in enumerate(batch.lengths)]
    assert torch.equal(torch.cat([p.behaviour_version for p in parts]), batch.behaviour_version)


def test_mismatched_token_lists_raise():
    t = _traj([2])
    t.behaviour_logprobs.pop()
    with pytest.raises(ValueError, match="per-token lists differ"):
        collate_trajectories([t], SamplingParams())


def test_buffer_back_pressure_and_error_propagation():
    buf = RolloutBuffer(capacity=1)
    buf.put([_traj([1])])
    with pytest.raises(TimeoutError, match="still full"):
        buf.put([_traj([1])], timeout=0.05)
    assert len(buf) == 1
    assert len(buf.get(timeout=1)) == 1

    def fail():
        time.sleep(0.05)
        buf.put_error(ValueError("engine died"))

    threading.Thread(target=fail).start()
    with pytest.raises(RuntimeError, match="producer failed") as err:
        buf.get(timeout=5)
    assert isinstance(err.value.__cause__, ValueError)
    with pytest.raises(ValueError):
        RolloutBuffer(capacity=0)


def test_f23_reply_tokens_after_a_stop_id_are_not_trained_on():
    """Stop ids {2, 0}: a reply [9, 0, 9, 2] is trained on up to its first stop id (0); an observation
    that contains a stop id, and the next reply, are untouched."""
    t = Trajectory(task_id="t")
    t.append([5, 6], assistant=False, turn=-1)
    t.append([9, 0, 9, 2], assistant=True, turn=0, logprobs=[-0.5] * 4)
    t.append([0, 8], assistant=False, turn=-1)
    t.append([9, 2], assistant=True, turn=1, logprobs=[-0.5] * 2)
    batch = collate_trajectories([t], SamplingParams(), pad_id=PAD, stop_ids={EOS, 0})
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    assert batch.turn_index[0].tolist() == [-1, -1, 0, 0, -1, -1, -1, -1, 1, 1]
    # without stop ids the trajectory's own mask is used as is
    assert collate_trajectories([t], SamplingParams(), pad_id=PAD).loss_mask[0].tolist() == t.assistant_mask
