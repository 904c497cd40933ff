"""Prefix reuse across turns on the HF backend (issue 17), counted in tokens fed to the model's forward:
a turn prefills the tokens not yet in the episode's KV cache, not the whole conversation, and a weight
push empties the cache (F09). The vLLM counterpart is in tests/rollout/test_vllm.py."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.chat import ChatFormat, stop_token_ids
from lightning_opd.rollout.generator import GenerationRequest, SamplingParams
from lightning_opd.rollout.hf import HFGenerator
from tests.helpers import KeywordEnvFactory, StaticPolicy


class ForwardCounter:
    """Real (unpadded) tokens fed to each forward of ``model``, grouped by ``generate`` call:
    ``calls[k][0]`` is call k's prefill, the rest its decode steps. The generator's private copy made
    by ``push_weights`` is a deep copy of ``model`` and carries the hook along."""

    def __init__(self, model) -> None:
        self.calls: list[list[int]] = []
        # a plain function, not a bound method: deepcopy shares functions, so the copy counts here too
        self._hook = model.register_forward_pre_hook(lambda module, args, kwargs: self._count(kwargs), with_kwargs=True)

    def _count(self, kwargs) -> None:
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")  # mask (B, cached + fed), may be absent
        fed = ids.shape[1]
        self.calls[-1].append(ids.numel() if mask is None else int(mask[:, -fed:].sum()))

    def prefills(self) -> list[int]:
        return [c[0] for c in self.calls]

    def remove(self) -> None:
        self._hook.remove()


class Counted(HFGenerator):
    def __init__(self, counter: ForwardCounter, **kw) -> None:
        super().__init__(**kw)
        self.counter = counter

    def _generate(self, requests, sampling):
        self.counter.calls.append([])
        return super()._generate(requests, sampling)


def _play(model, tokenizer, reuse: bool):
    counter = ForwardCounter(model)
    try:
        gen = Counted(counter, reuse_kv_cache=reuse)
        gen.attach(StaticPolicy(model, tokenizer), stop_token_ids(tokenizer))
        envs = KeywordEnvFactory(need=3)
        trajs = AgentLoop(envs, gen, tokenizer, max_turns=3).run(
            [EpisodeSpec("apple", seed=0), EpisodeSpec("cherry", seed=1)],
            SamplingParams(temperature=0.0, max_new_tokens=5))
    finally:
        counter.remove()
    return trajs, counter.prefills()


def _prompt_lengths(traj) -> list[int]:
    """Length of the prompt each turn was sampled from: everything before the turn's first reply token."""
    return [next(i for i, (t, m) in enumerate(zip(traj.turn_index, traj.assistant_mask)) if t == k and m)
            for k in range(traj.num_turns)]


def _reply_lengths(traj) -> list[int]:
    """Sampled tokens per turn (the reply as sampled: an end-of-turn id appended to a cut reply is not counted)."""
    lengths = [0] * traj.num_turns
    for turn, m in zip(traj.turn_index, traj.assistant_mask):
        if m and 0 <= turn < len(lengths):
            lengths[turn] += 1
    return lengths


@pytest.mark.timeout(120)
def test_hf_turn_prefills_only_the_tokens_not_in_its_kv_cache(tokenizer, tiny_model):
    """Two 3-turn episodes of different lengths in one batch: turn 0 prefills the first prompt; every
    later turn prefills the previous turn's last sampled token (never fed back while sampling), the
    end-of-turn id closing a cut reply and the new user turn -- prompt_k - prompt_(k-1) - reply_(k-1) + 1
    tokens -- as reported per turn on the trajectory and as counted in the model's forward."""
    trajs, prefills = _play(tiny_model, tokenizer, reuse=True)
    assert [t.num_turns for t in trajs] == [3, 3] and len(prefills) == 3
    chat = ChatFormat(tokenizer, KeywordEnvFactory.system_prompt)
    for traj in trajs:
        prompts, replies = _prompt_lengths(traj), _reply_lengths(traj)
        assert prompts[0] == len(chat.first_prompt(KeywordEnvFactory().make(traj.task_id).reset()))
        want = [prompts[0]] + [prompts[k] - prompts[k - 1] - replies[k - 1] + 1 for k in (1, 2)]
        assert traj.turn_prefill_tokens == want
        assert [c + p for c, p in zip(traj.turn_cached_tokens, traj.turn_prefill_tokens)] == prompts
        assert traj.turn_cached_tokens[0] == 0 and all(c > 0 for c in traj.turn_cached_tokens[1:])
        # a later turn costs its new tokens (a ~45-token user turn), well below its whole prompt
        assert all(p < prompts[k] / 2 for k, p in enumerate(traj.turn_prefill_tokens) if k)
    # the model's forward saw exactly the reported prefills, summed over the batch's rows
    assert prefills == [sum(t.turn_prefill_tokens[k] for t in trajs) for k in range(3)]


@pytest.mark.timeout(120)
def test_hf_without_reuse_every_turn_prefills_its_whole_prompt(tokenizer, tiny_model):
    """The same episodes with ``reuse_kv_cache=False``: identical tokens, every turn pays its whole
    prompt (what the test above would see if the reuse were broken)."""
    reused, _ = _play(tiny_model, tokenizer, reuse=True)
    trajs, prefills = _play(tiny_model, tokenizer, reuse=False)
    for a, b in zip(trajs, reused):
        assert a.token_ids == b.token_ids
        assert a.turn_prefill_tokens == _prompt_lengths(a) and a.turn_cached_tokens == [0, 0, 0]
    assert prefills == [sum(_prompt_lengths(t)[k] for t in trajs) for k in range(3)]
    assert sum(t.prefill_tokens for t in trajs) > 2 * sum(t.prefill_tokens for t in reused)


@pytest.mark.timeout(120)
def test_hf_weight_push_empties_the_kv_cache(tokenizer, tiny_model):
    """After ``push_weights`` the next turn prefills its whole prompt (no key/value computed with the old
    weights is reused, F09); the turn after it reuses the cache again."""
    counter = ForwardCounter(tiny_model)
    try:
        gen = Counted(counter)
        gen.attach(StaticPolicy(tiny_model, tokenizer), stop_token_ids(tokenizer))
        chat, greedy = ChatFormat(tokenizer), SamplingParams(temperature=0.0, max_new_tokens=4)
        prompt = chat.first_prompt("apple door")
        user = chat.user_turn("Again.")

        def turn(prompt, out):
            return prompt + out.token_ids + ([] if out.finished else [chat.end_of_turn_id]) + user

        (out0,) = gen.generate([GenerationRequest(key="e", prompt_ids=prompt)], greedy)
        gen.push_weights({k: v.clone() for k, v in tiny_model.state_dict().items()}, version=1)
        p1 = turn(prompt, out0)
        (out1,) = gen.generate([GenerationRequest(key="e", prompt_ids=p1, turn=1)], greedy)
        p2 = turn(p1, out1)
        (out2,) = gen.generate([GenerationRequest(key="e", prompt_ids=p2, turn=2)], greedy)
    finally:
        counter.remove()
    assert (out1.prompt_tokens_computed, out1.prompt_tokens_cached, out1.policy_version) == (len(p1), 0, 1)
    assert out2.prompt_tokens_cached == len(p1) + len(out1.token_ids) - 1
    assert out2.prompt_tokens_computed == len(p2) - out2.prompt_tokens_cached
    assert out2.prompt_tokens_computed == len(p2) - len(p1) - len(out1.token_ids) + 1
    assert counter.prefills() == [len(prompt), len(p1), out2.prompt_tokens_computed]


def test_generate_fills_in_the_accounting_of_a_backend_that_reports_none(tokenizer):
    """A backend that reports no prompt accounting is taken to prefill the whole prompt; a backend whose
    two counts do not add up to the prompt is refused."""
    from tests.rollout.test_chat_and_generators import _Fixed

    gen = _Fixed([9, 2])
    gen.attach(StaticPolicy(None, tokenizer), {2})
    (out,) = gen.generate([GenerationRequest(key=0, prompt_ids=[5, 6, 7])], SamplingParams())
    assert (out.prompt_tokens_computed, out.prompt_tokens_cached) == (3, 0)

    class Wrong(_Fixed):
        def _generate(self, requests, sampling):
            return [o.__class__(**{**o.__dict__, "prompt_tokens_computed": 1, "prompt_tokens_cached": 1})
                    for o in super()._generate(requests, sampling)]

    wrong = Wrong([9, 2])
    wrong.attach(StaticPolicy(None, tokenizer), {2})
    with pytest.raises(RuntimeError, match="1 computed \\+ 1 cached prompt tokens != the prompt's 3"):
        wrong.generate([GenerationRequest(key=0, prompt_ids=[5, 6, 7])], SamplingParams())


def test_trajectory_token_counts_and_reply_lengths_exclude_the_appended_end_of_turn():
    from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory

    t = Trajectory(task_id="t", turn_versions=[0, 0], turn_prefill_tokens=[3, 4], turn_cached_tokens=[0, 5])
    t.append([1, 2, 3], assistant=False, turn=NON_ASSISTANT)
    t.append([7, 8], assistant=True, turn=0)
    t.append([2], assistant=False, turn=0)  # end-of-turn id closing the cut reply 0
    t.append([4, 5, 6, 4], assistant=False, turn=NON_ASSISTANT)
    t.append([9, 2], assistant=True, turn=1)
    assert _reply_lengths(t) == [2, 2]  # the helper the prefill test above relies on
    assert (t.prefill_tokens, t.cached_prompt_tokens) == (7, 5)
    assert torch.tensor(t.turn_prefill_tokens).sum() == 7


@pytest.mark.timeout(120)
def test_hf_reuse_keeps_the_seeded_samples(tokenizer, tiny_model):
    """Sampling (temperature 1, top-p 0.9) with the same episode seeds: the same replies and behaviour
    log-probs with and without the KV cache kept between turns (same distribution, same random stream)."""
    envs, runs = KeywordEnvFactory(need=3), {}
    for reuse in (True, False):
        gen = HFGenerator(reuse_kv_cache=reuse)
        gen.attach(StaticPolicy(tiny_model, tokenizer), stop_token_ids(tokenizer))
        runs[reuse] = AgentLoop(envs, gen, tokenizer, max_turns=3).run(
            [EpisodeSpec(t, seed=i) for i, t in enumerate(envs.train_tasks())],
            SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6))
    assert sum(t.num_turns for t in runs[True]) > len(runs[True])  # later turns were played (and reused)
    assert sum(t.cached_prompt_tokens for t in runs[True]) > 0
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.behaviour_logprobs), torch.tensor(b.behaviour_logprobs),
                                   atol=1e-5, rtol=0)
