"""F35 without a server: dev mode on a non-loopback ``--host`` refused unless explicitly allowed (``lightning-opd
serve`` and :class:`~lightning_opd.serving.VLLMServer`), the opt-in's command line, an ``--api-key`` value never
printed, the API key never in a ServerError or a client's repr, and pushed weight snapshots owner-only."""

import stat

import pytest
import torch

from lightning_opd.cli.serve import serve_command
from lightning_opd.serving import VLLMServer, free_port
from lightning_opd.serving.client import ServerClient, ServerError
from lightning_opd.serving.server import is_loopback
from lightning_opd.serving.weight_push import ServerWeightPush

KEY = "sk-test-secret-0123456789"


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "teacher-0"])
def test_a_dev_mode_serve_on_a_public_address_is_refused(model_dir, host, capsys):
    with pytest.raises(SystemExit) as e:
        serve_command(["--model", model_dir, "--host", host, "--dev-mode"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"refusing dev mode (VLLM_SERVER_DEV_MODE=1) on host {host!r}" in err
    for words in ("/collective_rpc", "--api-key does not guard them", "--host 127.0.0.1", "SSH tunnel",
                  "forwards only /v1/*", "--allow-public-dev-routes"):
        assert words in err
    with pytest.raises(ValueError, match="refusing dev mode"):
        VLLMServer(model_dir, host=host, port=8002, dev_mode=True)


def test_the_explicit_opt_in_builds_the_public_dev_mode_command(model_dir, monkeypatch):
    started = []
    monkeypatch.setattr("lightning_opd.cli.serve._serve_until_stopped", lambda p, server, host: started.append(server))
    serve_command(["--model", model_dir, "--host", "0.0.0.0", "--port", "8002", "--dev-mode",
                   "--allow-public-dev-routes", "--", "--api-key", KEY])
    (server,) = started
    line = server.shell_command()
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 ") and "--host 0.0.0.0 --port 8002" in line
    assert server.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    assert KEY not in line and "--api-key '<redacted>'" in line and server.command[-1] == KEY


def test_loopback_and_plain_servers_need_no_opt_in(model_dir):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.5")
    VLLMServer(model_dir, host="127.0.0.1", port=8002, dev_mode=True)
    VLLMServer(model_dir, host="0.0.0.0", port=8002, dev_mode=False)  # a teacher: only /v1/*, which a key guards


def test_the_key_is_never_in_an_error_or_the_repr(monkeypatch):
    """Nothing listens: the ServerError (and a /metrics one) names the URL and not the key; repr names the variable."""
    monkeypatch.setenv("LIGHTNING_OPD_API_KEY", KEY)
    url = f"http://127.0.0.1:{free_port()}"
    client = ServerClient(url, timeout_s=2, retries=0)
    assert KEY not in repr(client) and "$LIGHTNING_OPD_API_KEY" in repr(client)
    with pytest.raises(ServerError) as e:
        client.post("/v1/completions", {"prompt": [1]})
    assert url in str(e.value) and KEY not in str(e.value) and KEY not in repr(e.value)
    with pytest.raises(ServerError) as e:
        client.metrics()
    assert KEY not in str(e.value)
    assert KEY not in str(ServerError(url, f"a proxy echoed Bearer {KEY}"))


def test_the_key_falls_back_to_vllms_variable(monkeypatch):
    monkeypatch.delenv("LIGHTNING_OPD_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert "$VLLM_API_KEY" in repr(ServerClient("http://127.0.0.1:1"))
    monkeypatch.delenv("VLLM_API_KEY")
    assert "no API key" in repr(ServerClient("http://127.0.0.1:1"))


def test_pushed_snapshots_are_owner_only(tmp_path):
    for weights_dir in (str(tmp_path / "w"), None):
        pusher = ServerWeightPush(weights_dir)
        try:
            local, remote = pusher.write_snapshot({"w": torch.arange(4, dtype=torch.float32)}, 3)
            assert stat.S_IMODE(local.stat().st_mode) == 0o700
            assert stat.S_IMODE((local / "model.safetensors").stat().st_mode) == 0o600
        finally:
            pusher.close()
