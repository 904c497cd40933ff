"""Stock ``vllm serve`` processes as teachers and samplers: start them, reach them (timeouts, retries, heartbeat), one
pool per served model, weights pushed to them."""

from lightning_opd.serving.client import Heartbeat, ServerClient, ServerError
from lightning_opd.serving.pool import ServerPool, rank_world
from lightning_opd.serving.served_tokenizer import ServedTokenizer
from lightning_opd.serving.server import VLLMServer, free_port, vllm_serve_command
from lightning_opd.serving.weight_push import ServerAdapterPush, ServerWeightPush

__all__ = ["Heartbeat", "ServedTokenizer", "ServerAdapterPush", "ServerClient", "ServerError", "ServerPool",
           "ServerWeightPush", "VLLMServer", "free_port", "rank_world", "vllm_serve_command"]
