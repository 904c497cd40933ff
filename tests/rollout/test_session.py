"""RolloutSession: the one wiring of policy, stop ids, generator, agent loop, producer and weight sync."""

import pytest

from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.sampler import EpisodeSampler
from lightning_opd.rollout.scripted import ScriptedGenerator
from lightning_opd.rollout.session import RolloutSession
from lightning_opd.rollout.weight_sync import SyncConfig
from tests.helpers import KeywordEnvFactory, StaticPolicy, make_model, make_tokenizer


@pytest.fixture(scope="module")
def policy():
    tok = make_tokenizer(extra_words=("apple", "cherry", "door", "key", "banana"))
    return StaticPolicy(make_model(tok), tok, version=3)


def _session(policy, **kwargs) -> RolloutSession:
    env = KeywordEnvFactory(need=2)
    gen = ScriptedGenerator(policy.tokenizer, lambda r: r.task_id)  # says the keyword: wins in 2 turns
    return RolloutSession(env, gen, max_context_tokens=512, **kwargs)


def test_not_connected_and_no_sampler_are_clear_errors(policy):
    s = _session(policy)
    with pytest.raises(RuntimeError, match="not connected to a policy"):
        s.play([], SamplingParams())
    s.connect(policy)
    with pytest.raises(RuntimeError, match="needs an EpisodeSampler"):
        s.play_batch()


def test_training_batches_come_from_the_sampler_and_count(policy):
    sampler = EpisodeSampler(KeywordEnvFactory(), episodes_per_step=2, max_turns=4, seed=0)
    s = _session(policy, sampler=sampler, sampling=SamplingParams(temperature=1.0, max_new_tokens=8))
    weight_sync = s.connect(policy)
    assert s.connect(policy) is weight_sync and s.generator_version == 3  # once; the generator follows the policy
    batch = s.next_batch()
    assert len(batch.trajectories) == 2 and all(t.success and t.num_turns == 2 for t in batch.trajectories)
    assert (sampler.batches_started, s.batches_taken) == (1, 1)
    assert s.state_dict() == {"epoch": 0, "cursor": 2, "episodes_started": 2, "train_batches": 1, "batches_started": 1}
    # the loop stops on the tokenizer's EOS and pads with it (the tiny tokenizer has no pad token)
    assert s.loop.stop_ids == frozenset({policy.tokenizer.eos_token_id}) and s.pad_id == policy.tokenizer.eos_token_id


def test_held_out_pass_plays_every_task_once(policy):
    sampler = EpisodeSampler(KeywordEnvFactory(), episodes_per_step=1, max_turns=4)
    s = _session(policy, sampler=sampler)
    s.connect(policy)
    batches = list(s.eval_batches(SamplingParams(temperature=0.0, max_new_tokens=8), max_turns=1, batch_size=1))
    assert [[t.task_id for t in b.trajectories] for b in batches] == [["north"], ["south"]]
    assert all(t.num_turns == 1 and t.truncated for b in batches for t in b.trajectories)  # need 2, cap 1


@pytest.mark.parametrize("bound, lead", [(0, 0), (1, 0), (2, 1), (3, 2), (9, 2)])
def test_lag_bound_sets_the_producer_lead(policy, bound, lead):
    """async, producer lead 2, pushes every 2 versions: lead = min(2, max(0, bound - (2 - 1)))."""
    s = _session(policy, sync=SyncConfig(mode="async", producer_lead=2, weight_sync_interval=2))
    assert s.lead_in_use == 2
    assert s.set_lag_bound(bound) == lead == s.lead_in_use  # before connect: kept for the producer
    s.connect(policy)
    assert s.producer.lead_in_use == lead
