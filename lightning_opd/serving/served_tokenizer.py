"""The tokenizer a ``vllm serve`` process loaded, seen through its own routes (F32).

:class:`ServedTokenizer` answers :func:`~lightning_opd.models.tokenizers.check_served_tokenizer`'s questions with
vLLM 0.32's tokenizer routes, never with the files at the path the server reports (``/v1/models`` ``root`` names the
model directory, not the ``--tokenizer`` it was started with, and may hold other files on the learner's machine):

* ``POST /tokenize {"model", "prompt", "add_special_tokens"}`` -> ``{"tokens": [...]}`` (text -> ids);
* ``POST /tokenize {"model", "messages", "add_generation_prompt"}`` -> the chat template's render as ids;
* ``POST /detokenize {"model", "tokens"}`` -> ``{"prompt": text}`` (the server's ``tokenizer.decode(tokens)`` with
  the tokenizer's default options, vllm/renderers/base.py ``_detokenize_prompt``);
* ``GET /tokenizer_info`` -> the tokenizer's config (bos/eos/unk...; only with ``--enable-tokenizer-info-endpoint``).
"""

from __future__ import annotations

import re

from lightning_opd.serving.client import ServerClient, ServerError

#: the answers that mean "the server refuses this" (an id beyond its vocabulary, a route it does not offer), not "the
#: server failed": HTTP 400 / 404 / 422 (:class:`~lightning_opd.serving.client.ServerError` names the status)
_REFUSED = re.compile(r"answered HTTP (400|404|422)\b")


class ServedTokenizer:
    """The served model ``model``'s tokenizer at ``client``'s server.

    Args:
        client: the server's client (its timeouts, retries and key).
        model: the served model name (``/v1/models`` id).

    Every method raises :class:`~lightning_opd.serving.client.ServerError` (naming the URL) when the server fails
    or answers something unusable.
    """

    def __init__(self, client: ServerClient, model: str) -> None:
        self.client = client
        self.model = model

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self.client.url

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The server's ids of ``text`` (``add_special_tokens``: with the BOS etc. its tokenizer adds)."""
        answer = self.client.post("/tokenize", {"model": self.model, "prompt": text,
                                                "add_special_tokens": bool(add_special_tokens)})
        return [int(t) for t in self._field(answer, "tokens", "/tokenize")]

    def detokenize(self, ids: list[int]) -> str | None:
        """The server's text of ``ids`` (``None``: it refused them with a 4xx, e.g. an id beyond its vocabulary)."""
        try:
            answer = self.client.post("/detokenize", {"model": self.model, "tokens": [int(i) for i in ids]})
        except ServerError as e:
            if not _REFUSED.search(str(e)):
                raise
            return None
        return str(self._field(answer, "prompt", "/detokenize"))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The server's chat-template render of ``messages`` as ids."""
        answer = self.client.post("/tokenize", {"model": self.model, "messages": list(messages),
                                                "add_generation_prompt": bool(add_generation_prompt)})
        return [int(t) for t in self._field(answer, "tokens", "/tokenize (messages)")]

    def info(self) -> dict | None:
        """The server's tokenizer config (``GET /tokenizer_info``); ``None`` when the server does not offer it
        (started without ``--enable-tokenizer-info-endpoint``: a 404)."""
        try:
            answer = self.client.get("/tokenizer_info")
        except ServerError as e:
            if not _REFUSED.search(str(e)):
                raise
            return None
        return answer if isinstance(answer, dict) else None

    def _field(self, answer, key: str, route: str):
        if not isinstance(answer, dict) or key not in answer:
            raise ServerError(self.url, f"malformed answer to {route}: no {key!r} in {str(answer)[:200]}")
        return answer[key]
