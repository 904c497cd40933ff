"""EpisodeSampler: task order, seeds, GRPO groups, rank slices, probe batches, held-out shares, resume."""

import random

import pytest

from lightning_opd.rollout.sampler import EpisodeSampler
from tests.helpers import KeywordEnvFactory

TRAIN = ["apple", "cherry", "door", "key"]


def _order(seed: int, epoch: int) -> list[str]:
    tasks = list(TRAIN)
    random.Random(seed * 7919 + epoch).shuffle(tasks)
    return tasks


def test_groups_seeds_and_rank_slices_by_hand():
    """4 episodes per rank, groups of 2, 2 ranks: the global batch is 8 episodes = 4 tasks x 2; rank 1 keeps
    episodes 4..7 (tasks 3 and 4 of the order), seeds 3 * 1_000_003 + index, group id index // 2."""
    s = EpisodeSampler(KeywordEnvFactory(), episodes_per_step=4, max_turns=5, group_size=2, seed=3)
    s.set_rank(1, 2)
    specs = s.next_episodes(4)
    order = _order(3, 0)
    assert [x.task_id for x in specs] == [order[2], order[2], order[3], order[3]]
    assert [x.seed for x in specs] == [3 * 1_000_003 + i for i in (4, 5, 6, 7)]
    assert [x.group_id for x in specs] == [2, 2, 3, 3]
    assert {x.max_turns for x in specs} == {5} and not any(x.is_probe for x in specs)
    # the next batch starts the second pass over the tasks (epoch 1, a new order)
    nxt = s.next_episodes(4)
    assert (s.epoch, s.cursor) == (1, 4) and [x.task_id for x in nxt][::2] == _order(3, 1)[2:4]


def test_probe_batches_follow_the_schedule_and_keep_their_cap():
    """warmup 2, interval 3, full depth 9: batches 0, 1, 3, 6 are probes at 9 turns, the others at max_turns."""
    s = EpisodeSampler(KeywordEnvFactory(), episodes_per_step=1, max_turns=4)
    s.set_probe_schedule(2, 3, 9)
    batches = [s.next_batch() for _ in range(7)]
    assert [b[0].is_probe for b in batches] == [True, True, False, True, False, False, True]
    assert [b[0].max_turns for b in batches] == [9, 9, 4, 9, 4, 4, 9]
    s.set_max_turns(2)
    s.clear_probe_schedule()
    assert (s.next_batch()[0].max_turns, s.batches_started) == (2, 8)


def test_held_out_shares_are_disjoint_and_equally_many():
    """2 held-out tasks on 3 ranks, batches of 1: every rank yields 1 batch (rank 2 an empty one)."""
    out = []
    for rank in range(3):
        s = EpisodeSampler(KeywordEnvFactory(), episodes_per_step=1, max_turns=1)
        s.set_rank(rank, 3)
        out.append([[(x.task_id, x.seed, x.max_turns) for x in b] for b in s.eval_batches(max_turns=6, batch_size=1)])
    assert out == [[[("north", 0, 6)]], [[("south", 1, 6)]], [[]]]


def test_state_dict_resumes_the_same_episodes():
    a = EpisodeSampler(KeywordEnvFactory(), episodes_per_step=2, max_turns=3, group_size=2, seed=1)
    for _ in range(3):
        a.next_batch()
    b = EpisodeSampler(KeywordEnvFactory(), episodes_per_step=2, max_turns=3, group_size=2, seed=1)
    b.load_state_dict(a.state_dict())
    assert a.state_dict() == {"epoch": 0, "cursor": 3, "episodes_started": 6}  # 3 batches x 1 group of 2
    assert [(x.task_id, x.seed, x.group_id) for x in a.next_episodes(2)] == \
        [(x.task_id, x.seed, x.group_id) for x in b.next_episodes(2)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(episodes_per_step=0), r"data.init_args.episodes_per_step=0 must be >= 1"),
    (dict(max_turns=0), r"data.init_args.max_turns=0 must be >= 1"),
    (dict(episodes_per_step=3, group_size=2), r"episodes_per_step=3 must be a multiple of data.init_args.group_size=2"),
])
def test_bad_arguments_name_their_key(kwargs, message):
    args = dict(episodes_per_step=2, max_turns=2) | kwargs
    with pytest.raises(ValueError, match=message):
        EpisodeSampler(KeywordEnvFactory(), **args)


def test_bad_knobs_are_refused():
    s = EpisodeSampler(KeywordEnvFactory(), episodes_per_step=1, max_turns=1)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        s.set_rank(2, 2)
    with pytest.raises(ValueError, match="interval=0 must be >= 1"):
        s.set_probe_schedule(0, 0, 3)
    with pytest.raises(ValueError, match="max_turns=0 must be >= 1"):
        s.set_max_turns(0)
