"""The ``Generator`` interface shared by every sampling backend (HF ``generate`` now, vLLM later).

Token in, token out (F08): a request carries the whole conversation so far as token ids, and the
result carries the sampled ids exactly as sampled, with the behaviour log-prob of each under the
distribution actually sampled from (temperature, top-p and top-k applied; F02).

End of a reply (F23): a generator is attached with one set of stop ids
(:func:`lightning_opd.rollout.chat.stop_token_ids`: the tokenizer's EOS, which is the chat template's
end-of-turn token, and every EOS of the model's generation config). Every backend stops on all of them,
and :meth:`Generator.generate` cuts each reply after its first stop id and marks it ``finished``, the one
definition of a finished reply shared by all backends.

Context length (F24): :attr:`Generator.context_limit` is the backend's own limit on prompt + reply
tokens (vLLM's ``max_model_len``, the HF model's ``max_position_embeddings``); the agent loop plays
under the smaller of it and its own ``max_context_tokens``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Hashable, Iterable, Mapping, NamedTuple, Protocol

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig


@dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs, mapped one to one onto every backend.

    Attributes:
        temperature: softmax temperature; ``0`` means greedy decoding.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        max_new_tokens: per-turn reply limit, in tokens. A reply cut here (no stop id) is closed with
            the template's end-of-turn token by the agent loop (masked out of the loss).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationRequest:
    """One reply to sample.

    Attributes:
        key: identifies the episode across turns (backends may reuse cached state for it).
        prompt_ids: the whole conversation so far, ending with the generation prompt (tokens).
        turn: zero-based turn index of the reply.
        seed: per-episode seed (backends that support per-request seeds use it).
        task_id: the episode's task (scripted generators look their replies up by it).
    """

    key: Hashable
    prompt_ids: list[int]
    turn: int = 0
    seed: int = 0
    task_id: str = ""


@dataclass
class GenerationOutput:
    """A sampled reply.

    Attributes:
        token_ids: sampled ids, ending with a stop id if the model stopped (``finished``); nothing
            after the first stop id.
        logprobs: behaviour log-prob of each sampled id under the sampling distribution (nats);
            for greedy decoding, under the temperature-1 distribution (greedy rollouts are not trained on).
        finished: the reply ends with one of the generator's stop ids; ``False`` = cut by
            ``max_new_tokens``. Set by :meth:`Generator.generate` from ``token_ids``.
        policy_version: policy version of the weights that produced it.
        prompt_tokens_computed: prompt tokens whose keys/values this call computed (prefilled), in
            tokens; ``None`` from the backend = the whole prompt (set by :meth:`Generator.generate`).
        prompt_tokens_cached: prompt tokens served from a cache instead (the HF backend's KV cache
            kept between turns, vLLM's prefix cache); ``computed + cached == len(prompt_ids)``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    policy_version: int = 0
    prompt_tokens_computed: int | None = None
    prompt_tokens_cached: int = 0


class PolicySource(Protocol):
    """What a generator that shares the trainer's weights needs from the LightningModule."""

    policy_version: int

    @property
    def policy_model(self): ...  # the student ``PreTrainedModel``


def policy_configs(policy) -> tuple[PretrainedConfig | None, GenerationConfig | None]:
    """The policy's model config and generation config: those of the loaded model
    (``policy.policy_model``), else read from its model directory (``policy.student_path``; the
    DataModule connects before the model is loaded). ``None`` where neither is available; a directory
    without ``generation_config.json`` gives the generation config derived from ``config.json``."""
    model = getattr(policy, "policy_model", None)
    if model is not None:
        return getattr(model, "config", None), getattr(model, "generation_config", None)
    path = getattr(policy, "student_path", None)
    if path is None:
        return None, None
    trust = bool(getattr(policy, "trust_remote_code", False))
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        generation = GenerationConfig.from_model_config(config)
    return config, generation


class ContextLimit(NamedTuple):
    """A backend's own limit on one sequence (prompt + reply).

    Attributes:
        tokens: the limit, in tokens.
        source: the setting it comes from, as the user writes it (named in warnings).
    """

    tokens: int
    source: str


class Generator(ABC):
    """A backend that samples replies for a batch of episodes.

    ``generate`` validates the requests and holds the backend's lock while the subclass's
    ``_generate`` samples, so a concurrent ``push_weights`` (which takes the same lock) never lands
    in the middle of a call: every reply comes from one policy version. It then ends every reply at
    its first stop id (:attr:`stop_ids`) and sets ``finished`` (F23).
    """

    #: ids that end a reply (set by :meth:`attach`); backends stop sampling on every one of them
    stop_ids: frozenset[int] = frozenset()
    _policy: PolicySource | None = None

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def attach(self, policy: PolicySource, stop_ids: Iterable[int]) -> None:
        """Bind to the policy whose weights and version the backend samples with, and to the ids that
        end a reply (:func:`lightning_opd.rollout.chat.stop_token_ids` of the policy's tokenizer and
        generation config).

        Raises:
            ValueError: ``stop_ids`` is empty.
        """
        ids = frozenset(int(i) for i in stop_ids)
        if not ids:
            raise ValueError("attach() needs at least one stop id (see lightning_opd.rollout.chat.stop_token_ids)")
        self._policy = policy
        self.stop_ids = ids

    @property
    def context_limit(self) -> ContextLimit | None:
        """The backend's own limit on prompt + reply tokens (``None``: none of its own)."""
        return None

    @property
    def policy_version(self) -> int:
        """Version of the weights the next ``generate`` call samples with."""
        if self._policy is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a policy; call attach() first")
        return int(self._policy.policy_version)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationOutput]:
        """Sample one reply per request (same order). Each reply ends at its first stop id
        (``finished``) or has no stop id (cut by ``max_new_tokens``), and says how many of its prompt
        tokens were prefilled and how many came from a cache (a backend that does not say prefilled
        them all).

        Raises:
            ValueError: an empty request list or an empty prompt.
        """
        if not requests:
            raise ValueError("generate() needs at least one request")
        if any(not r.prompt_ids for r in requests):
            raise ValueError("every request needs a non-empty prompt_ids")
        with self._lock:
            outs = self._generate(requests, sampling)
            return [self._account_prompt(self._end_at_stop(out), len(r.prompt_ids)) for r, out in zip(requests, outs)]

    @staticmethod
    def _account_prompt(out: GenerationOutput, prompt_len: int) -> GenerationOutput:
        """``out`` with ``prompt_tokens_computed`` set: what the backend reported, else the whole prompt."""
        if out.prompt_tokens_computed is None:
            return replace(out, prompt_tokens_computed=prompt_len - out.prompt_tokens_cached)
        if out.prompt_tokens_computed + out.prompt_tokens_cached != prompt_len:
            raise RuntimeError(f"{out.prompt_tokens_computed} computed + {out.prompt_tokens_cached} cached prompt "
                               f"tokens != the prompt's {prompt_len} (a backend's accounting is wrong)")
        return out

    def _end_at_stop(self, out: GenerationOutput) -> GenerationOutput:
        """``out`` cut after its first stop id, ``finished`` iff it has one (the one definition, F23)."""
        end = next((k + 1 for k, t in enumerate(out.token_ids) if t in self.stop_ids), None)
        if end is None:
            return replace(out, finished=False)
        return replace(out, token_ids=list(out.token_ids[:end]), logprobs=list(out.logprobs[:end]), finished=True)

    @abstractmethod
    def _generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationOutput]:
        """The backend's sampling (called under the lock with validated requests)."""

    @property
    def collective(self) -> bool:
        """Generation is a collective over ranks (the sampling model is sharded with FSDP): every rank
        must make the same number of ``generate`` calls, so the agent loop keeps a rank whose episodes
        have ended stepping with :meth:`idle_step` while others play on (F10)."""
        return False

    def any_rank_active(self, active: bool) -> bool:
        """Whether any rank still has episodes to play (``active`` on this rank). Only collective
        generators communicate; others return ``active``."""
        return active

    def idle_step(self, sampling: SamplingParams) -> None:
        """Take part in one round of collective generation without episodes of this rank (a collective
        generator samples a one-token dummy prompt and discards it; others do nothing)."""

    def push_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        """Serve ``state`` (a student ``state_dict``) from now on, stamped ``version``; returns seconds.

        Backends that sample from their own copy of the weights (vLLM; HF in asynchronous or
        ``forced_lag`` mode) implement it; thread-safe against a concurrent ``generate``.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot load pushed weights")

    def release(self) -> None:
        """Drop per-episode cached state (called when a batch of episodes is finished)."""

    def close(self) -> None:
        """Let go of what the backend holds outside this process's memory: connections, threads, temporary files
        (a served sampler's snapshot folder). Called when the session ends (the DataModule's teardown, or an error
        or Ctrl-C in fit); a later ``generate`` may start over. Default: nothing."""

    @property
    def stats(self) -> dict[str, float]:
        """Running totals of this backend on this rank (a served sampler's requests, tokens, seconds, pushes,
        retries, bytes), logged every step as ``sampler/<key>``. Default: none (``{}``)."""
        return {}
