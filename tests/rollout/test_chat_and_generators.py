"""Token-in/token-out rendering (F08), the HF generator's sampling convention (F02) and its KV reuse."""

from __future__ import annotations

import pytest
import torch

from transformers import GenerationConfig

from lightning_opd.data import RolloutDataModule
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.chat import ChatFormat, ChatTemplateError, stop_token_ids
from lightning_opd.rollout.generator import (GenerationOutput, GenerationRequest, Generator, SamplingParams,
                                             policy_configs)
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.scripted import ScriptedGenerator
from tests.helpers import (KeywordEnvFactory, LongObservationEnvFactory, StaticPolicy,
                           assert_only_the_long_episode_truncated, assert_replies_end_on_the_second_eos,
                           make_second_eos_model, sampling_log_probs)

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
    gen.attach(StaticPolicy(tiny_model, tokenizer), stop_token_ids(tokenizer))
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
    gen.attach(StaticPolicy(tiny_model, tokenizer), stop_token_ids(tokenizer))
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
        gen.attach(StaticPolicy(tiny_model, tokenizer), stop_token_ids(tokenizer))
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
    gen.attach(policy, stop_token_ids(tokenizer))
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
    gen.attach(StaticPolicy(tiny_model, tokenizer), stop_token_ids(tokenizer))
    cfg = gen._generation_config(SamplingParams(temperature=1.0, top_k=0), pad_id=0)
    assert cfg.top_k == 0 and cfg.top_p == 1.0 and cfg.do_sample and cfg.temperature == 1.0


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)


# ------------------------------------------------------------------------ F23: several end-of-sequence ids


class DirPolicy:
    """An ``OPDModule`` stand-in: its model directory is known when the DataModule connects, the model
    itself is loaded later (``configure_model`` runs after the DataModule's ``setup``)."""

    def __init__(self, path: str, tokenizer, version: int = 0) -> None:
        self.student_path, self.tokenizer, self.policy_model, self.policy_version = path, tokenizer, None, version


def test_f23_stop_ids_are_the_tokenizer_eos_and_every_generation_config_eos(tmp_path, tokenizer):
    eos = tokenizer.eos_token_id
    assert eos == 2
    assert stop_token_ids(tokenizer) == {2}
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=7)) == {2, 7}
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=[2, 0])) == {0, 2}
    # read from the model directory before the model is loaded, and from the loaded model
    model = make_second_eos_model(tokenizer)
    model.save_pretrained(tmp_path / "m")
    assert stop_token_ids(tokenizer, policy_configs(DirPolicy(str(tmp_path / "m"), tokenizer))[1]) == {0, 2}
    assert stop_token_ids(tokenizer, policy_configs(StaticPolicy(model, tokenizer))[1]) == {0, 2}
    # no generation_config.json: the one derived from config.json
    (tmp_path / "m" / "generation_config.json").unlink()
    assert stop_token_ids(tokenizer, policy_configs(DirPolicy(str(tmp_path / "m"), tokenizer))[1]) == {2}
    assert policy_configs(StaticPolicy(None, tokenizer)) == (None, None)

    class NoEos:
        eos_token_id = None

    with pytest.raises(ChatTemplateError, match="no eos token"):
        stop_token_ids(NoEos())


class _Fixed(Generator):
    """Returns ``ids`` (log-probs -1, -2, ...) for every request, claiming it was cut."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids

    @property
    def policy_version(self) -> int:
        return 0

    def _generate(self, requests, sampling):
        return [GenerationOutput(token_ids=list(self.ids), logprobs=[-1.0 - k for k in range(len(self.ids))],
                                 finished=False) for _ in requests]


def test_f23_generate_ends_every_reply_at_its_first_stop_id(tokenizer):
    """One rule for every backend: a reply ends after its first stop id (finished), or has none (cut)."""
    request = [GenerationRequest(key=0, prompt_ids=[5])]
    gen = _Fixed([9, 0, 7, 2, 8])
    gen.attach(StaticPolicy(None, tokenizer), {2, 0})
    (out,) = gen.generate(request, SamplingParams())
    assert (out.token_ids, out.logprobs, out.finished) == ([9, 0], [-1.0, -2.0], True)
    gen.attach(StaticPolicy(None, tokenizer), {2})
    (out,) = gen.generate(request, SamplingParams())
    assert (out.token_ids, out.logprobs, out.finished) == ([9, 0, 7, 2], [-1.0, -2.0, -3.0, -4.0], True)
    gen.attach(StaticPolicy(None, tokenizer), {3})
    (out,) = gen.generate(request, SamplingParams())
    assert (out.token_ids, out.finished) == ([9, 0, 7, 2, 8], False)
    with pytest.raises(ValueError, match="at least one stop id"):
        gen.attach(StaticPolicy(None, tokenizer), [])


def test_f23_agent_loop_needs_the_end_of_turn_id_among_the_stop_ids(tokenizer):
    gen = _Fixed([9])
    gen.attach(StaticPolicy(None, tokenizer), {0})
    with pytest.raises(ValueError, match="lack the chat template's end-of-turn id 2"):
        AgentLoop(KeywordEnvFactory(), gen, tokenizer)


@pytest.mark.timeout(120)
def test_f23_hf_reply_ending_on_the_second_eos_is_finished(tmp_path, tokenizer):
    """Generation config ``eos_token_id: [2, 0]``, a model that replies "key" then 0: the HF backend stops
    at 0, the reply is finished (no end-of-turn id appended, not a cut reply) and nothing after it is
    trained on."""
    model = make_second_eos_model(tokenizer)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    envs = KeywordEnvFactory(need=2)
    dm = RolloutDataModule(env=envs, generator=HFGenerator(), episodes_per_step=4, max_turns=2, max_new_tokens=6)
    policy = DirPolicy(str(tmp_path / "m"), tokenizer)
    dm.connect(policy)
    policy.policy_model = model  # configure_model
    assert_replies_end_on_the_second_eos(dm.next_train_batch(), tokenizer, envs)
    assert dm.generator.stop_ids == {0, 2}


# ------------------------------------------------------------------------ F24: two context limits


@pytest.mark.timeout(120)
def test_f24_hf_episode_over_the_model_limit_ends_truncated(tokenizer):
    """``data.max_context_tokens`` 2048 above the model's ``max_position_embeddings`` 256: a warning names
    both, the loop plays under 256, and the episode whose observation does not fit ends as truncated
    while the others play on."""
    model = make_second_eos_model(tokenizer)
    model.config.max_position_embeddings = 256
    dm = RolloutDataModule(env=LongObservationEnvFactory(need=2), generator=HFGenerator(), episodes_per_step=4,
                           max_turns=2, max_new_tokens=4, max_context_tokens=2048)
    with pytest.warns(UserWarning, match=r"max_context_tokens=2048 \(data\.init_args\.max_context_tokens\) is above "
                                         r"the generator's limit 256 \(max_position_embeddings"):
        dm.connect(StaticPolicy(model, tokenizer))
    assert dm.session.loop.max_context_tokens == 256
    assert_only_the_long_episode_truncated(dm.next_train_batch(), limit=256)
