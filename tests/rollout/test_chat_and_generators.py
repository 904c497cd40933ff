"""Token-in/token-out rendering (F08), the HF generator's sampling convention (F02) and its KV reuse."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.chat import ChatFormat
from lightning_opd.rollout.generator import GenerationRequest, SamplingParams
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.sampling import sampling_log_probs
from lightning_opd.rollout.scripted import ScriptedGenerator
from tests.helpers import KeywordEnvFactory, StaticPolicy

SCRIPT = {"apple": ["apple", "apple"], "cherry": ["banana"], "door": ["Door!", "door", "door"], "key": ["key", "key"]}


def _reply(r):
    seq = SCRIPT[r.task_id]
    return seq[min(r.turn, len(seq) - 1)]


def test_f08_scripted_episode_equals_full_template_render(tokenizer):
    """Scripted replies (tokenizer's own encoding + EOS): the episode's ids are one full chat-template render
    of the same conversation, up to the render's last end-of-turn token."""
    envs = KeywordEnvFactory(need=2)
    loop = AgentLoop(envs, ScriptedGenerator(tokenizer, _reply), tokenizer, max_turns=3)
    trajs = loop.run([EpisodeSpec(t, seed=i) for i, t in enumerate(envs.train_tasks())], SamplingParams())
    chat = ChatFormat(tokenizer, envs.system_prompt)
    for traj in trajs:
        messages = [{"role": "system", "content": envs.system_prompt}] + traj.messages
        full = chat.render(messages, add_generation_prompt=False)
        last_eot = len(full) - full[::-1].index(tokenizer.eos_token_id)
        assert traj.token_ids == full[:last_eot], traj.task_id
        # the assistant mask covers exactly the replies' tokens (text + EOS)
        expected = sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) + 1
                       for m in traj.messages if m["role"] == "assistant")
        assert sum(traj.assistant_mask) == expected
    assert [t.num_turns for t in trajs] == [2, 1, 3, 2]


def test_f08_first_prompt_and_user_turn_pieces(tokenizer):
    chat = ChatFormat(tokenizer, "sys")
    assert tokenizer.decode(chat.first_prompt("hi")) == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(chat.user_turn("obs")) == "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n"
    assert chat.end_of_turn_id == tokenizer.eos_token_id


class Recording(HFGenerator):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.outputs = []

    def generate(self, requests, sampling):
        outs = super().generate(requests, sampling)
        self.outputs.append({r.task_id: o for r, o in zip(requests, outs)})
        return outs


def test_f08_sampled_ids_survive_unchanged(tokenizer, tiny_model):
    gen = Recording()
    gen.attach(StaticPolicy(tiny_model, tokenizer), tokenizer.eos_token_id)
    envs = KeywordEnvFactory(need=2)
    loop = AgentLoop(envs, gen, tokenizer, max_turns=3)
    trajs = loop.run([EpisodeSpec(t, seed=i) for i, t in enumerate(envs.train_tasks())],
                     SamplingParams(temperature=1.0, max_new_tokens=6))
    for traj in trajs:
        sampled = [step[traj.task_id] for step in gen.outputs if traj.task_id in step]
        assert len(sampled) == traj.num_turns
        got = [tid for tid, m in zip(traj.token_ids, traj.assistant_mask) if m]
        assert got == [i for o in sampled for i in o.token_ids]
        got_lp = [lp for lp, m in zip(traj.behaviour_logprobs, traj.assistant_mask) if m]
        assert got_lp == [lp for o in sampled for lp in o.logprobs]
        # a reply cut at max_new_tokens is closed by one end-of-turn id outside the loss, same turn index
        for k, o in enumerate(sampled):
            pos = [i for i, (t, m) in enumerate(zip(traj.turn_index, traj.assistant_mask)) if t == k and m]
            assert pos == list(range(pos[0], pos[0] + len(o.token_ids)))
            end = pos[-1] + 1
            if not o.finished:
                assert len(o.token_ids) == 6
                assert traj.token_ids[end] == tokenizer.eos_token_id
                assert traj.assistant_mask[end] == 0 and traj.turn_index[end] == k
        assert traj.cut_replies == sum(not o.finished for o in sampled)
    assert any(t.cut_replies for t in trajs)


def _score_like_trainer(model, prompt, out_ids, sampling):
    ids = torch.tensor([prompt + out_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # positions predicting out_ids
    lp = sampling_log_probs(logits, sampling)
    return lp.gather(-1, torch.tensor(out_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.6, max_new_tokens=12),
                                      SamplingParams(temperature=1.0, max_new_tokens=12),
                                      SamplingParams(temperature=1.3, max_new_tokens=12),
                                      SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=12),
                                      SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12)])
def test_f02_behaviour_logprobs_describe_the_sampling_distribution(tokenizer, tiny_model, sampling):
    gen = HFGenerator(reuse_kv_cache=False)
    gen.attach(StaticPolicy(tiny_model, tokenizer), tokenizer.eos_token_id)
    chat = ChatFormat(tokenizer)
    prompts = [chat.first_prompt(w) for w in ("apple door", "go north now", "key")]
    outs = gen.generate([GenerationRequest(key=i, prompt_ids=list(p), seed=i) for i, p in enumerate(prompts)], sampling)
    diffs, raw_diffs = [], []
    for p, o in zip(prompts, outs):
        trainer_lp = _score_like_trainer(tiny_model, list(p), o.token_ids, sampling)
        diffs.append((trainer_lp - torch.tensor(o.logprobs)).abs())
        raw = _score_like_trainer(tiny_model, list(p), o.token_ids, SamplingParams(temperature=1.0))
        raw_diffs.append((raw - torch.tensor(o.logprobs)).abs())
    diff = torch.cat(diffs)
    assert torch.isfinite(diff).all() and diff.mean().item() < 1e-4
    if sampling != SamplingParams(temperature=1.0, max_new_tokens=12):
        # the un-tempered, untruncated distribution is measurably different: the check has teeth
        assert torch.cat(raw_diffs).mean().item() > 1e-2


def test_kv_reuse_equals_fresh_prefill(tokenizer, tiny_model):
    """Greedy multi-turn episodes: identical ids and log-probs with and without the KV cache reuse."""
    envs = KeywordEnvFactory(need=3)
    results = {}
    for reuse in (True, False):
        gen = HFGenerator(reuse_kv_cache=reuse)
        gen.attach(StaticPolicy(tiny_model, tokenizer), tokenizer.eos_token_id)
        loop = AgentLoop(envs, gen, tokenizer, max_turns=3)
        results[reuse] = loop.run([EpisodeSpec(t, seed=i) for i, t in enumerate(envs.train_tasks())],
                                  SamplingParams(temperature=0.0, max_new_tokens=5))
    assert any(t.num_turns > 1 for t in results[True])
    for a, b in zip(results[True], results[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.behaviour_logprobs), torch.tensor(b.behaviour_logprobs),
                                   atol=1e-5, rtol=0)


def test_kv_cache_dropped_when_the_policy_version_changes(tokenizer, tiny_model):
    policy = StaticPolicy(tiny_model, tokenizer)
    gen = HFGenerator()
    gen.attach(policy, tokenizer.eos_token_id)
    prompt = ChatFormat(tokenizer).first_prompt("apple")
    out = gen.generate([GenerationRequest(key="a", prompt_ids=prompt)], SamplingParams(temperature=0.0, max_new_tokens=3))
    follow = GenerationRequest(key="a", prompt_ids=prompt + out[0].token_ids + [tokenizer.eos_token_id, 5, 6])
    assert gen._reusable([follow], version=0)
    policy.policy_version = 1
    assert not gen._reusable([follow], version=1)
    assert gen.generate([follow], SamplingParams(temperature=0.0, max_new_tokens=2))[0].policy_version == 1


def test_generation_config_does_not_leak_defaults(tokenizer, tiny_model):
    """GenerationConfig's default top_k=50 must not apply when top_k=0 (F02)."""
    gen = HFGenerator()
    gen.attach(StaticPolicy(tiny_model, tokenizer), tokenizer.eos_token_id)
    cfg = gen._generation_config(SamplingParams(temperature=1.0, top_k=0), pad_id=0)
    assert cfg.top_k == 0 and cfg.top_p == 1.0 and cfg.do_sample and cfg.temperature == 1.0


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
