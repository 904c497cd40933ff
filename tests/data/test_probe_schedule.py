"""TurnOPD probe schedule in the RolloutDataModule (docs/algorithms.md §2.5): batch k is a full-depth probe
iff ``k < warmup or k % interval == 0``; cap and probe flag are fixed when a batch starts and travel with
every sample, in sync and async mode; the batch counter survives ``state_dict``."""

from __future__ import annotations

import time

import pytest

from lightning_opd.data import RolloutDataModule
from lightning_opd.rollout.scripted import ScriptedGenerator
from tests.helpers import KeywordEnvFactory, StaticPolicy

pytestmark = pytest.mark.timeout(120)

# warmup 2, interval 3: probes at k = 0, 1, 3, 6, 9
WARMUP, INTERVAL, FULL = 2, 3, 5
PROBES = {0, 1, 3, 6, 9}


def _dm(tokenizer, reply_fn=None, **kw) -> tuple[RolloutDataModule, StaticPolicy]:
    """Episodes never end before their cap (the keyword is needed 99 times), so ``num_turns == cap``."""
    gen = ScriptedGenerator(tokenizer, reply_fn or (lambda r: r.task_id))
    args = dict(env=KeywordEnvFactory(need=99), generator=gen, episodes_per_step=2, max_turns=4, seed=0)
    args.update(kw)
    dm = RolloutDataModule(**args)
    policy = StaticPolicy(None, tokenizer)
    dm.connect(policy)
    return dm, policy


def _assert_batch(batch, probe: bool, cap: int) -> None:
    assert batch.is_probe.tolist() == [probe] * 2
    assert batch.rollout_cap.tolist() == [cap] * 2
    assert batch.num_turns.tolist() == [cap] * 2  # the cap really bounded the episode
    assert all(t.is_probe == probe and t.rollout_cap == cap for t in batch.trajectories)


def test_schedule_predicate_and_validation(tokenizer):
    dm, _ = _dm(tokenizer)
    assert not any(dm.sampler.is_probe_batch(k) for k in range(10))  # no schedule: no probes
    dm.set_probe_schedule(WARMUP, INTERVAL, FULL)
    assert {k for k in range(10) if dm.sampler.is_probe_batch(k)} == PROBES
    for args, bad in (((-1, 3, 5), "warmup=-1"), ((0, 0, 5), "interval=0"), ((0, 3, 0), "full_depth=0")):
        with pytest.raises(ValueError, match=bad):
            dm.set_probe_schedule(*args)
    dm.clear_probe_schedule()
    assert dm.sampler.probe_schedule is None and not dm.sampler.is_probe_batch(0)


def test_sync_probe_flags_and_caps_follow_the_schedule(tokenizer):
    dm, policy = _dm(tokenizer)
    dm.set_probe_schedule(WARMUP, INTERVAL, FULL)
    caps = [4, 4, 3, 3, 2, 2, 3, 3]  # set by a "controller" before batch k
    for k, cap in enumerate(caps):
        dm.set_max_turns(cap)
        policy.policy_version = k
        batch = dm.next_train_batch()
        _assert_batch(batch, k in PROBES, FULL if k in PROBES else cap)
        assert batch.behaviour_version.tolist() == [k, k]
    assert dm.state_dict()["per_rank"][0]["train_batches"] == len(caps)


def test_batch_counter_resumes_from_state_dict(tokenizer):
    dm, _ = _dm(tokenizer)
    dm.set_probe_schedule(WARMUP, INTERVAL, FULL)
    dm.set_max_turns(2)
    for _ in range(5):
        dm.next_train_batch()
    state = dm.state_dict()
    assert state["per_rank"][0]["train_batches"] == 5 and "max_turns" not in state["per_rank"][0]
    resumed, _ = _dm(tokenizer)
    resumed.set_probe_schedule(WARMUP, INTERVAL, FULL)
    resumed.load_state_dict(state)
    resumed.set_max_turns(2)  # what the depth controller, the cap's one owner, restores
    _assert_batch(resumed.next_train_batch(), False, 2)  # k = 5
    _assert_batch(resumed.next_train_batch(), True, FULL)  # k = 6
    fresh, _ = _dm(tokenizer)  # an old checkpoint without the key starts the count at 0
    fresh.set_probe_schedule(WARMUP, INTERVAL, FULL)
    old = {k: v for k, v in state["per_rank"][0].items() if k not in ("train_batches", "batches_started")}
    fresh.load_state_dict(old)
    _assert_batch(fresh.next_train_batch(), True, FULL)


@pytest.mark.parametrize("producer_lead", [1, 2])
def test_async_samples_carry_the_cap_set_when_their_batch_started(tokenizer, producer_lead):
    """The producer plays ahead in its own thread. During turn 1 of batch i (i.e. after batch i started)
    the reply function sets the cap to ``caps[i]``: batch i keeps the cap it started with, batch i+1 (a
    non-probe) runs at ``caps[i]``; probe batches are indexed by batches started (= learner version)."""
    caps = [4, 2, 3, 2, 4, 3, 2, 3, 2, 4]
    holder = {}

    def reply(r):
        if r.turn == 1:
            dm = holder["dm"]
            dm.set_max_turns(caps[dm.sampler.batches_started - 1])  # only the producer thread starts batches
        return r.task_id

    dm, policy = _dm(tokenizer, reply, mode="async", producer_lead=producer_lead)
    holder["dm"] = dm
    dm.set_probe_schedule(WARMUP, INTERVAL, FULL)
    try:
        for k in range(len(caps)):
            batch = dm.next_train_batch()
            expected = FULL if k in PROBES else (caps[k - 1] if k else 4)
            _assert_batch(batch, k in PROBES, expected)
            assert 0 <= k - int(batch.behaviour_version.max()) <= producer_lead
            policy.policy_version = k + 1  # the learner's optimizer step
            dm.session.producer.notify_version()
    finally:
        dm.session.producer.stop()
    assert dm.state_dict()["per_rank"][0]["train_batches"] == len(caps)
    assert dm.sampler.batches_started >= len(caps)  # the producer ran ahead


def test_async_resume_keeps_the_lag_gate(tokenizer):
    """Resumed at learner version 5 with producer_lead 1, the producer may start batches 5 and 6 only (batch i
    waits for weights of version i - 1), not run ahead from a counter reset to 0."""
    dm, policy = _dm(tokenizer, mode="async", producer_lead=1)
    dm.load_state_dict({"train_batches": 5})
    policy.policy_version = 5
    try:
        dm.next_train_batch()
        time.sleep(0.5)  # time for a wrongly ungated producer to start batch 7
        assert dm.sampler.batches_started == 7
    finally:
        dm.session.producer.stop()
