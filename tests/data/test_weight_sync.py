"""Weight pushes and the async lag gate in the RolloutDataModule (F18): every ``(producer_lead,
weight_sync_interval)`` pair finishes with batch ``i`` sampled by the weights of the last push at or
before learner version ``i - producer_lead``; after a restore (at a version that need not be a multiple of the
interval) and at train start the generator holds exactly the learner's version before the first rollout.
The learner is simulated: one ``next_train_batch`` per version, ``WeightSync.on_policy_update`` after each."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.rollout.scripted import ScriptedGenerator
from tests.helpers import KeywordEnvFactory, StaticPolicy

pytestmark = pytest.mark.timeout(120)


class OwnWeightsGenerator(ScriptedGenerator):
    """Samples with pushed weights only, like vLLM with ``follow_policy`` off: version -1 until the first
    push. ``pushes`` lists the pushed versions; ``at_first_rollout`` the (version, weights) of the first
    ``generate`` call."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, lambda r: r.task_id)
        self.pushes: list[int] = []
        self.weights: dict | None = None
        self.at_first_rollout: tuple[int, int | None] | None = None

    @property
    def policy_version(self) -> int:
        return self.pushes[-1] if self.pushes else -1

    def push_weights(self, state, version: int) -> float:
        with self._lock:
            self.weights, self.pushes = dict(state), [*self.pushes, int(version)]
        return 0.0

    def _generate(self, requests, sampling):
        if self.at_first_rollout is None:
            self.at_first_rollout = (self.policy_version, None if self.weights is None else int(self.weights["w"]))
        return super()._generate(requests, sampling)


class VersionedPolicy(StaticPolicy):
    """Its weights are one number, the version they belong to."""

    def policy_state_dict(self) -> dict:
        return {"w": torch.tensor(self.policy_version)}


def _dm(tokenizer, **kw) -> tuple[RolloutDataModule, VersionedPolicy, OwnWeightsGenerator]:
    gen = OwnWeightsGenerator(tokenizer)
    args = dict(env=KeywordEnvFactory(need=99), generator=gen, episodes_per_step=2, max_turns=1, seed=0)
    args.update(kw)
    dm = RolloutDataModule(**args)
    policy = VersionedPolicy(None, tokenizer)
    dm.connect(policy)
    return dm, policy, gen


def _learn(dm, policy, steps: int, timeout: float = 20.0, train_start: bool = True,
           before_step=None) -> list[tuple[int, list[int]]]:
    """``steps`` learner steps from ``policy.policy_version``: (learner version, behaviour versions) per step.
    ``before_step(version)`` runs before each batch is taken (a controller). Fails (instead of hanging) when the
    learner waits more than ``timeout`` seconds in all."""
    seen: list[tuple[int, list[int]]] = []
    errors: list[BaseException] = []

    def loop():
        try:
            if train_start:
                dm.session.weight_sync.on_policy_update(policy.policy_version, policy.policy_state_dict)  # what OPDModule.on_train_start does
            for _ in range(steps):
                if before_step is not None:
                    before_step(policy.policy_version)
                batch = dm.next_train_batch()
                seen.append((policy.policy_version, batch.behaviour_version.tolist()))
                policy.policy_version += 1  # the optimizer step
                dm.session.weight_sync.on_policy_update(policy.policy_version, policy.policy_state_dict)
        except BaseException as err:  # noqa: BLE001 - re-raised below unless the loop hung
            errors.append(err)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    thread.join(timeout)
    hung = thread.is_alive()
    dm.session.producer.stop(timeout=10)
    thread.join(10)  # a hung learner gets ProducerError once the producer stopped
    assert not hung, f"deadlock: the learner got {len(seen)} of {steps} batches within {timeout} s"
    if errors:
        raise errors[0]
    return seen


@pytest.mark.parametrize("interval", [1, 2, 3, 4])
@pytest.mark.parametrize("producer_lead", [1, 2, 3])
def test_every_lag_and_push_interval_pair_finishes(tokenizer, producer_lead, interval):
    """Batch ``i`` waits for the push at ``(i - producer_lead) // interval * interval`` (at least the start version
    0), so its lag is at most ``producer_lead + interval - 1`` = ``max_allowed_lag``; pushes land at multiples of
    the interval."""
    dm, policy, gen = _dm(tokenizer, mode="async", producer_lead=producer_lead, weight_sync_interval=interval)
    steps = 9
    seen = _learn(dm, policy, steps)
    assert [v for v, _ in seen] == list(range(steps))
    for i, (_, behaviour) in enumerate(seen):
        gate = max(0, (i - producer_lead) // interval * interval)
        assert all(gate <= b <= i for b in behaviour), (i, behaviour)
        assert i - min(behaviour) <= dm.max_allowed_lag == producer_lead + interval - 1
    assert gen.pushes == list(range(0, steps + 1, interval))


@pytest.mark.parametrize(("version", "interval", "producer_lead"), [(3, 2, 1), (5, 3, 1), (5, 3, 2), (1, 4, 3)])
@pytest.mark.parametrize("train_start", [True, False], ids=["train-start", "direct"])
def test_async_resume_at_a_version_between_pushes(tokenizer, version, interval, producer_lead, train_start):
    """Restored at a learner version that is not a multiple of the interval: the restored weights are pushed
    before the first rollout (whether or not ``on_policy_update`` ran first), the next pushes land at
    multiples of the interval again, and the run finishes."""
    dm, policy, gen = _dm(tokenizer, mode="async", producer_lead=producer_lead, weight_sync_interval=interval)
    dm.load_state_dict({"train_batches": version})
    policy.policy_version = version
    seen = _learn(dm, policy, 6, train_start=train_start)
    assert gen.at_first_rollout == (version, version)
    assert [v for v, _ in seen] == list(range(version, version + 6))
    first_multiple = -(-(version + 1) // interval) * interval
    assert gen.pushes == [version, *range(first_multiple, version + 7, interval)]
    for i, (_, behaviour) in enumerate(seen, start=version):
        assert all(max(version, (i - producer_lead) // interval * interval) <= b <= i for b in behaviour)


def test_a_reused_generator_gets_the_restored_weights_even_with_a_matching_stamp(tokenizer):
    """A generator kept from an earlier run may already be stamped with the restored version (other weights):
    a restore does not trust the stamp and pushes again."""
    dm, policy, gen = _dm(tokenizer, mode="async", producer_lead=1, weight_sync_interval=2)
    gen.push_weights({"w": torch.tensor(-7)}, 3)  # another run's version 3
    dm.load_state_dict({"train_batches": 3})
    policy.policy_version = 3
    _learn(dm, policy, 2)
    assert gen.pushes[:2] == [3, 3] and gen.at_first_rollout == (3, 3)


def test_forced_lag_resume_pushes_the_restored_copy_before_the_first_rollout(tokenizer):
    """Sync with ``forced_lag=2``, restored at version 3 with the copies of versions 1-3: the first batch is
    sampled by exactly the copy of version 1, also when the generator already claims version 1."""
    dm, policy, gen = _dm(tokenizer, forced_lag=2)
    gen.push_weights({"w": torch.tensor(-7)}, 1)  # stale weights stamped 1
    dm.load_state_dict({"train_batches": 3, "weight_snapshots": {str(v): {"w": torch.tensor(v)} for v in (1, 2, 3)}})
    policy.policy_version = 3
    seen = _learn(dm, policy, 3)
    assert gen.at_first_rollout == (1, 1)
    assert seen == [(3, [1, 1]), (4, [2, 2]), (5, [3, 3])]
    assert int(gen.weights["w"]) == 3


def test_lag_bound_zero_is_synchronous_generation(tokenizer):
    """Producer-side control: ``set_lag_bound(0)`` (the fallback) with pushes every version makes every batch
    with the weights of the version that trains on it, although ``producer_lead`` is 3."""
    dm, policy, gen = _dm(tokenizer, mode="async", producer_lead=3, weight_sync_interval=1)
    assert dm.set_lag_bound(0) == 0 == dm.lead_in_use
    seen = _learn(dm, policy, 6)
    assert seen == [(v, [v, v]) for v in range(6)]
    assert dm.max_allowed_lag == 3  # the on-policy check keeps the configured ceiling


def test_lag_bound_caps_the_lead_with_rare_pushes(tokenizer):
    """producer_lead 2, pushes every 2 versions (max_allowed_lag 3): lag bound 1 gives lead 1 - (2 - 1) = 0, so batch i
    waits for the push at i // 2 * 2 and its lag is at most 1 (2 or 3 without the bound)."""
    dm, policy, gen = _dm(tokenizer, mode="async", producer_lead=2, weight_sync_interval=2)
    assert dm.set_lag_bound(1) == 0
    seen = _learn(dm, policy, 8)
    for i, (_, behaviour) in enumerate(seen):
        assert all(i // 2 * 2 <= b <= i for b in behaviour), (i, behaviour)
    assert dm.set_lag_bound(3) == 2 and dm.set_lag_bound(9) == 2  # never above producer_lead


def test_lowering_the_lag_bound_mid_run_applies_to_batches_not_yet_started(tokenizer):
    """producer_lead 3: at learner version 4 the lag bound drops to 0. Batches up to 7 may already be made (they needed
    version >= i - 3 <= 4) and keep their lag (<= 3); batch 8 onwards waits for its own version."""
    dm, policy, gen = _dm(tokenizer, mode="async", producer_lead=3, weight_sync_interval=1)
    seen = _learn(dm, policy, 11, before_step=lambda v: v == 4 and dm.set_lag_bound(0))
    for i, (_, behaviour) in enumerate(seen):
        assert all(max(0, i - 3) <= b <= i for b in behaviour), (i, behaviour)
        if i >= 8:
            assert behaviour == [i, i]


def test_lag_bound_leaves_sync_and_forced_lag_alone(tokenizer):
    dm, policy, gen = _dm(tokenizer, forced_lag=2)
    assert dm.set_lag_bound(0) == 0
    assert _learn(dm, policy, 4) == [(0, [0, 0]), (1, [0, 0]), (2, [0, 0]), (3, [1, 1])]
