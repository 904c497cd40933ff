"""Stock ``vllm serve`` processes as teachers and samplers: start them, reach them (timeouts, retries, heartbeat)."""

from lightning_opd.serving.client import Heartbeat, ServerClient, ServerError
from lightning_opd.serving.server import VLLMServer, free_port, vllm_serve_command

__all__ = ["Heartbeat", "ServerClient", "ServerError", "VLLMServer", "free_port", "vllm_serve_command"]
