"""Hugging Face ``generate`` backend, sharing the trainer's student weights (synchronous mode).

Multi-turn episodes re-send the whole conversation every turn (token in, token out). Re-encoding the
history each turn costs O(turns^2) tokens of prefill, so this backend keeps the KV cache of the last
call and, when the next call's requests extend the cached conversations token for token (same keys,
same policy version), feeds only the new tokens. Rows are aligned with padding in the middle of the
sequence; positions come from the attention mask, so the result equals a fresh left-padded prefill
(pinned by tests/rollout/test_chat_and_generators.py). A version change or any mismatch falls back to a
fresh prefill, so weights pushed between calls can never be served from a stale cache (F09). Each
reply reports its prompt tokens prefilled vs served from the cache (``prompt_tokens_computed`` /
``prompt_tokens_cached``; counted against the model's forward in tests/rollout/test_prefix_reuse.py).

Weights: by default the backend samples from the attached student itself (synchronous mode: always
the current weights, no copy). The first :meth:`HFGenerator.push_weights` gives it a private copy
that later pushes overwrite (asynchronous and ``forced_lag`` modes); a lock keeps a push from
landing in the middle of a ``generate`` call, so every reply comes from one version.

Sampling (F02, F26): ``generate`` fills every field of the ``GenerationConfig`` it is given that is unset (``None``)
from the model's ``generation_config.json`` (``repetition_penalty``, ``no_repeat_ngram_size``, ``suppress_tokens``,
``min_p``, ``bad_words_ids``, ...) and then from transformers' global defaults (``top_k=50``), which would make the
sampler draw from another distribution than the trainer scores. The backend passes an
:class:`ExplicitGenerationConfig`, which ``generate`` cannot complete: every knob is the generator's own
(:data:`SAMPLING_KNOBS`, the rest off), so replies are drawn from temperature, top-k and top-p of
:class:`~lightning_opd.rollout.generator.SamplingParams` alone.
Only the model's EOS ids are read from its generation config (the stop ids, F23).
"""

from __future__ import annotations

import copy as copy_module
import logging
import time
from dataclasses import dataclass
from typing import Hashable, Mapping

import torch
import torch.distributed as dist
from transformers import DynamicCache, GenerationConfig

from lightning_opd.models.fsdp import is_sharded, unsharded_copy
from lightning_opd.models.lora import AdapterState, is_lora_model, load_adapter_state
from lightning_opd.rollout.generator import (ContextLimit, GenerationOutput, GenerationRequest, Generator,
                                             SamplingParams, policy_configs)

log = logging.getLogger(__name__)

#: every ``generate`` knob that changes the distribution a reply is drawn from, or its length, at the value that
#: turns it off (F26). The knobs whose off value is ``None`` (``suppress_tokens``, ``begin_suppress_tokens``,
#: ``bad_words_ids``, ``sequence_bias``, ``forced_bos_token_id``, ``forced_eos_token_id``, ``min_length``,
#: ``exponential_decay_length_penalty``, ``min_p``, ``top_h``, ``guidance_scale``, ``watermarking_config``,
#: ``stop_strings``, ``max_time``, ``penalty_alpha``, ``dola_layers``, ``prompt_lookup_num_tokens``) stay ``None``:
#: an :class:`ExplicitGenerationConfig` is never completed from the model's generation config
SAMPLING_KNOBS = dict(num_beams=1, num_beam_groups=1, num_return_sequences=1, diversity_penalty=0.0, length_penalty=1.0,
                      early_stopping=False, min_new_tokens=0, repetition_penalty=1.0,
                      encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0,
                      typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, renormalize_logits=False,
                      remove_invalid_values=False)

#: generation-config keys that do not change the sampling distribution (ids the generator sets or reads itself)
_NOT_SAMPLING = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "transformers_version",
                 "_from_model_config", "use_cache", "cache_implementation", "max_length", "max_new_tokens",
                 "output_attentions", "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate"}


class ExplicitGenerationConfig(GenerationConfig):
    """A ``GenerationConfig`` that ``generate`` uses as given (F26).

    transformers 5 completes the config passed to ``generate`` with ``update(defaults_only=True)``: every field
    left ``None`` is taken from the model's ``generation_config.json``, then from transformers' global defaults
    (``GenerationMixin._prepare_generation_config``). This class ignores those completions, so a field left
    ``None`` stays off; updates that set values (``generate``'s own keyword arguments) apply as usual.
    """

    def update(self, defaults_only: bool = False, allow_custom_entries: bool = False, **kwargs):
        if defaults_only:  # a completion from the model's generation config or the global defaults
            return dict(kwargs)
        return super().update(allow_custom_entries=allow_custom_entries, **kwargs)


def model_sampling_knobs(model) -> dict:
    """The knobs of ``model``'s generation config that would change its sampling distribution (``{key: value}``;
    everything but the special-token ids and cache settings): what :class:`HFGenerator` does not apply."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    return {k: v for k, v in config.to_diff_dict().items() if k not in _NOT_SAMPLING and v is not None}


@dataclass
class _KVState:
    cache: DynamicCache
    mask: torch.Tensor  # (B, L) 1 = real cached token
    rows: dict[Hashable, int]
    cached_ids: list[list[int]]  # per row: the real tokens whose keys/values are in ``cache``
    version: int


def _left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask, left-padded; the mask comes from lengths, never from token values (F03)."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), length), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        if s:
            ids[i, length - len(s):] = torch.tensor(s, dtype=torch.long, device=device)
            mask[i, length - len(s):] = 1
    return ids, mask


class HFGenerator(Generator):
    """Batched sampling with ``transformers``' ``generate`` on the attached student model.

    Args:
        reuse_kv_cache: keep the KV cache between turns of the same episodes (see module docstring).
        pad_token_id: id used for padding (any id works: masks come from lengths); default: the
            smallest stop id.

    Stops on every one of the attached stop ids (F23). Its :attr:`context_limit` is the sampling
    model's ``max_position_embeddings`` (F24).
    """

    def __init__(self, reuse_kv_cache: bool = True, pad_token_id: int | None = None) -> None:
        super().__init__()
        self.reuse_kv_cache = reuse_kv_cache
        self.pad_token_id = pad_token_id
        self._state: _KVState | None = None
        self._own_model: torch.nn.Module | None = None
        self._own_version: int | None = None
        self._warned_models: set[int] = set()  # ids of models whose generation-config knobs were named (F26)

    def release(self) -> None:
        self._state = None

    @property
    def context_limit(self) -> ContextLimit | None:
        """``max_position_embeddings`` of the sampling model (read from the policy's model directory
        before the model is loaded); ``None`` when not attached or the config has none."""
        config = self._own_model.config if self._own_model is not None else policy_configs(self._policy)[0]
        limit = getattr(config, "max_position_embeddings", None)
        if not limit:
            return None
        return ContextLimit(int(limit), "max_position_embeddings in the student's config.json")

    @property
    def _filler_id(self) -> int:
        """Id for padding and the idle dummy prompt (any id works: masks come from lengths)."""
        return self.pad_token_id if self.pad_token_id is not None else min(self.stop_ids)

    @property
    def policy_version(self) -> int:
        if self._own_model is not None:
            return int(self._own_version)
        return super().policy_version

    def push_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        """Copy ``state`` into the backend's private model (created from the attached student on the
        first push) and stamp it ``version``; returns seconds. A LoRA student's
        :class:`~lightning_opd.models.lora.AdapterState` replaces the copy's adapter; its merged weights
        (``lora.push: merged``) load into a merged copy.

        Raises:
            KeyError: an adapter whose tensors are not the copy's (:func:`~lightning_opd.models.lora.load_adapter_state`).
        """
        t0 = time.perf_counter()
        with self._lock:
            if self._own_model is None:
                source = self._policy.policy_model
                if is_lora_model(source) and not isinstance(state, AdapterState):  # lora.push: merged
                    copy = copy_module.deepcopy(source).merge_and_unload()
                else:
                    copy = unsharded_copy(source)
                self._own_model = copy.eval().requires_grad_(False)
            if isinstance(state, AdapterState):  # a LoRA student: its copy's adapter is replaced, the base stays
                load_adapter_state(self._own_model, state)
            else:
                with torch.no_grad():
                    self._own_model.load_state_dict(state, strict=True)
            self._own_version = int(version)
            self._state = None  # no KV entry computed with other weights survives (F09)
        return time.perf_counter() - t0

    @property
    def collective(self) -> bool:
        """Sampling from a sharded live student (FSDP, several ranks): ``generate`` is a collective."""
        if self._own_model is not None or self._policy is None or self._policy.policy_model is None:
            return False
        return is_sharded(self._policy.policy_model) and dist.is_initialized() and dist.get_world_size() > 1

    def any_rank_active(self, active: bool) -> bool:
        if not self.collective:
            return active
        flag = torch.tensor([int(active)], device=next(self._policy.policy_model.parameters()).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def idle_step(self, sampling: SamplingParams) -> None:
        if self.collective:  # a one-token dummy prompt; synced decoding runs as long as the other ranks
            self.generate([GenerationRequest(key=("idle", id(self)), prompt_ids=[self._filler_id])], sampling)
            self.release()

    def _generation_config(self, sampling: SamplingParams, pad_id: int) -> ExplicitGenerationConfig:
        """The complete config of one ``generate`` call: ``sampling``'s temperature, top-k (0: off) and top-p,
        every other knob of :data:`SAMPLING_KNOBS` off, the rest ``None`` and left so (F02, F26)."""
        common = dict(SAMPLING_KNOBS, max_new_tokens=sampling.max_new_tokens, pad_token_id=pad_id,
                      eos_token_id=sorted(self.stop_ids), output_scores=True, return_dict_in_generate=True,
                      use_cache=True)
        if sampling.greedy:
            return ExplicitGenerationConfig(do_sample=False, **common)
        return ExplicitGenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                        top_k=sampling.top_k, **common)

    def _name_ignored_knobs(self, model) -> None:
        """Warn once per model about the knobs of its generation config that are not applied (F26)."""
        if id(model) in self._warned_models:
            return
        self._warned_models.add(id(model))
        knobs = model_sampling_knobs(model)
        if knobs:
            log.warning("HFGenerator samples with data.init_args.sampling alone (temperature, top_p, top_k), the "
                        "distribution the trainer scores (F26); the model's generation config also sets %s, which "
                        "are not applied", ", ".join(f"{k}={v!r}" for k, v in sorted(knobs.items())))

    def _reusable(self, requests: list[GenerationRequest], version: int) -> bool:
        st = self._state
        if not self.reuse_kv_cache or st is None or st.version != version:
            return False
        for r in requests:
            row = st.rows.get(r.key)
            if row is None:
                return False
            cached = st.cached_ids[row]
            if len(r.prompt_ids) <= len(cached) or r.prompt_ids[: len(cached)] != cached:
                return False
        return len({r.key for r in requests}) == len(requests)

    def _sampling_model(self):
        """The model that samples: the backend's own copy after a weight push, else the attached policy's.

        Raises:
            RuntimeError: neither is there.
        """
        if self._own_model is not None:
            model = self._own_model
        else:
            model = self._policy.policy_model if self._policy is not None else None
        if model is None:
            raise RuntimeError("HFGenerator is not attached to a loaded policy model")
        return model

    def _model_inputs(self, requests: list[GenerationRequest], version: int, pad_id: int, device):
        """``(input_ids, attention_mask, cache, cached_lens)`` of one ``generate`` call: the prompts' new suffixes
        behind the kept KV cache when every request continues its row (:meth:`_reusable`), else the whole prompts,
        left-padded, with an empty cache. ``cached_lens``: prompt tokens per request served from the cache."""
        if self._reusable(requests, version):
            st = self._state
            rows = torch.tensor([st.rows[r.key] for r in requests], device=device)
            cache = st.cache
            cache.batch_select_indices(rows)
            prev_mask = st.mask.index_select(0, rows)
            cached_lens = [len(st.cached_ids[st.rows[r.key]]) for r in requests]
            suffixes = [r.prompt_ids[n_cached:] for r, n_cached in zip(requests, cached_lens)]
            seg_ids, seg_mask = _left_pad(suffixes, pad_id, device)
            filler = torch.full_like(prev_mask, pad_id)
            input_ids = torch.cat([filler, seg_ids], dim=1)  # (B, L_cache + S); cached part is not re-fed
            attention_mask = torch.cat([prev_mask, seg_mask], dim=1)
        else:
            cache = DynamicCache()
            cached_lens = [0] * len(requests)
            input_ids, attention_mask = _left_pad([r.prompt_ids for r in requests], pad_id, device)
        return input_ids, attention_mask, cache, cached_lens

    def _sample(self, model, requests: list[GenerationRequest], input_ids: torch.Tensor,
                attention_mask: torch.Tensor, cache, sampling: SamplingParams, pad_id: int):
        """``model.generate`` in eval mode under a forked RNG seeded from the requests' episode seeds and turns."""
        self._name_ignored_knobs(model)
        was_training = model.training
        model.eval()
        seed = hash((tuple(r.seed for r in requests), tuple(r.turn for r in requests))) & 0x7FFF_FFFF
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                                      generation_config=self._generation_config(sampling, pad_id),
                                      synced_gpus=self.collective)  # F10: own weights are never collective
        finally:
            model.train(was_training)

    def _kv_state(self, out, requests: list[GenerationRequest], attention_mask: torch.Tensor,
                  first_eot: torch.Tensor, kept: list[int], new_list: list[list[int]], version: int,
                  device) -> _KVState:
        """The KV cache to keep after a call: it holds keys/values of the input and of new tokens 0..n-2 (the last
        one was not fed)."""
        n = out.sequences.shape[1] - attention_mask.shape[1]
        pos = torch.arange(max(n - 1, 0), device=device)
        new_mask = (pos.unsqueeze(0) < first_eot.unsqueeze(1) + 1).long()  # (B, n-1) 1 = real token
        base = [r.prompt_ids for r in requests]
        return _KVState(
            cache=out.past_key_values,
            mask=torch.cat([attention_mask, new_mask], dim=1),
            rows={r.key: i for i, r in enumerate(requests)},
            cached_ids=[base[i] + new_list[i][: min(kept[i], n - 1)] for i in range(len(requests))],
            version=version,
        )

    @torch.no_grad()
    def _generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationOutput]:
        model = self._sampling_model()
        version = self.policy_version
        device = next(model.parameters()).device
        pad_id = self._filler_id
        input_ids, attention_mask, cache, cached_lens = self._model_inputs(requests, version, pad_id, device)
        self._state = None
        out = self._sample(model, requests, input_ids, attention_mask, cache, sampling, pad_id)

        in_len = input_ids.shape[1]
        new = out.sequences[:, in_len:]  # (B, n)
        n = new.shape[1]
        scores = torch.stack(out.scores, dim=1).float()  # (B, n, V) processed: temperature/top-k/top-p applied
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # (B, n)
        is_eot = torch.isin(new, torch.tensor(sorted(self.stop_ids), device=new.device))  # (B, n) any stop id
        has_eot = is_eot.any(dim=1)
        first_eot = torch.where(has_eot, is_eot.float().argmax(dim=1), torch.full_like(has_eot, n - 1, dtype=torch.long))
        kept = (first_eot + 1).tolist()  # tokens kept per row (up to and including the first stop id)

        outputs = []
        new_list, lp_list = new.tolist(), logprobs.tolist()
        for i in range(len(requests)):
            outputs.append(GenerationOutput(token_ids=new_list[i][: kept[i]], logprobs=lp_list[i][: kept[i]],
                                            finished=bool(has_eot[i]), policy_version=version,
                                            prompt_tokens_computed=len(requests[i].prompt_ids) - cached_lens[i],
                                            prompt_tokens_cached=cached_lens[i]))

        if self.reuse_kv_cache and out.past_key_values is not None:
            self._state = self._kv_state(out, requests, attention_mask, first_eot, kept, new_list, version, device)
        return outputs
