"""The LoRA student's parts (lightning_opd/models/lora.py): configuration, the adapter that generators load, vLLM's
limits, and what the untrained adapter is (the base model exactly, Hu et al. 2021 eq. 3)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_opd.models.lora import (AdapterState, LoRAConfig, adapter_state, apply_lora, check_vllm_lora,
                                       load_adapter_state, merged_state_dict)
from lightning_opd.models.logits import trunk_hidden_states
from tests.helpers import make_model


def _lora_model(tokenizer, rank=4, seed=0, **kw):
    torch.manual_seed(seed)
    return apply_lora(make_model(tokenizer, seed=seed), LoRAConfig(rank=rank, **kw))


def test_config_defaults_and_refusals():
    cfg = LoRAConfig(rank=4)
    assert cfg.scaling_alpha == 8.0 and cfg.vllm_max_lora_rank == 8
    assert cfg.push == "auto" and cfg.pushes_adapter  # unresolved auto: the adapter
    assert cfg.resolved("cpu").push == "merged" and cfg.resolved("cuda").push == "adapter"
    assert LoRAConfig(rank=4, push="adapter").resolved("cpu").push == "adapter"  # explicit: kept
    assert LoRAConfig(rank=16, alpha=4).scaling_alpha == 4.0 and LoRAConfig(rank=16).vllm_max_lora_rank == 16
    assert LoRAConfig(rank=17).vllm_max_lora_rank == 32
    peft_cfg = cfg.peft_config()
    assert peft_cfg.r == 4 and peft_cfg.lora_alpha == 8.0 and peft_cfg.lora_dropout == 0.0  # F25: no dropout key
    for bad, key in ((dict(rank=0), "lora.rank=0"), (dict(rank=513), "lora.rank=513"), (dict(alpha=0), "alpha=0"),
                     (dict(target_modules=[]), "target_modules"), (dict(push="full"), "push='full'")):
        with pytest.raises(ValueError, match=key):
            LoRAConfig(**bad)


def test_untrained_adapter_is_the_base_model_and_only_adapter_parameters_train(tokenizer):
    base = make_model(tokenizer, seed=0)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        want = base(input_ids=ids).logits
    model = apply_lora(base, LoRAConfig(rank=4))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # B = 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 7 linear layers (q, k, v, o, gate, up, down) x (A, B) with all-linear; not the LM head
    assert len(trainable) == 2 * 7 * 2
    # the trunk the learner's head path runs carries the adapter (not peft's LoraModel, which returns logits)
    assert trunk_hidden_states(model, ids, None).shape == (1, 6, model.config.hidden_size)


def test_adapter_state_holds_the_adapter_alone_with_its_byte_count(tokenizer, tmp_path):
    model = _lora_model(tokenizer, rank=4)
    state = adapter_state(model, base_model="/models/base")
    hidden, inter, layers = model.config.hidden_size, model.config.intermediate_size, model.config.num_hidden_layers
    kv = model.config.num_key_value_heads * (hidden // model.config.num_attention_heads)
    # per layer, rank r: A (r, in) + B (out, r) for q (h->h), k, v (h->kv), o (h->h), gate, up (h->i), down (i->h)
    per_layer = sum(4 * (i + o) for i, o in ((hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
                                              (hidden, inter), (hidden, inter), (inter, hidden)))
    assert state.nbytes == layers * per_layer * 4  # fp32 bytes
    assert state.rank == 4 and all(".lora_" in k for k in state)
    path = state.save(tmp_path / "adapter")
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["base_model_name_or_path"] == "/models/base" and cfg["lora_dropout"] == 0.0
    from safetensors.torch import load_file

    saved = load_file(str(path / "adapter_model.safetensors"))
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in state)


def test_load_adapter_state_copies_exactly_and_refuses_another_adapter(tokenizer):
    src, dst = _lora_model(tokenizer, rank=4, seed=0), _lora_model(tokenizer, rank=4, seed=0)
    with torch.no_grad():
        for n, p in src.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    load_adapter_state(dst, adapter_state(src))
    ids = torch.tensor([[2, 4, 6, 8]])
    with torch.no_grad():
        torch.testing.assert_close(dst(input_ids=ids).logits, src(input_ids=ids).logits, atol=0, rtol=0)
    with pytest.raises(KeyError, match="another model.init_args.lora"):
        load_adapter_state(dst, adapter_state(_lora_model(tokenizer, rank=4, target_modules=["q_proj"])))


def test_vllm_engine_arguments_for_a_lora_student():
    cfg = LoRAConfig(rank=4)
    assert check_vllm_lora(None, {}) == {}
    assert check_vllm_lora(cfg, {}) == dict(enable_lora=True, max_lora_rank=8, max_loras=1)
    assert check_vllm_lora(cfg, {"max_lora_rank": 64, "max_loras": 3}, min_loras=3) == dict(
        enable_lora=True, max_lora_rank=64, max_loras=3)
    with pytest.raises(ValueError, match="max_lora_rank=4: vLLM accepts"):
        check_vllm_lora(LoRAConfig(rank=4), {"max_lora_rank": 4})
    with pytest.raises(ValueError, match="max_lora_rank=8.*>= the adapter's rank 16"):
        check_vllm_lora(LoRAConfig(rank=16), {"max_lora_rank": 8})
    with pytest.raises(ValueError, match="max_loras=1: at least 3"):
        check_vllm_lora(cfg, {"max_loras": 1}, min_loras=3)
    with pytest.raises(ValueError, match="enable_lora=false"):
        check_vllm_lora(cfg, {"enable_lora": False})
    assert check_vllm_lora(LoRAConfig(rank=4, push="merged"), {}) == {}  # full weights: no LoRA in the engine


def test_adapter_state_is_a_mapping_a_full_push_path_can_tell_apart(tokenizer):
    state = adapter_state(_lora_model(tokenizer, rank=2))
    assert isinstance(state, AdapterState) and isinstance(state, dict)
    assert not isinstance(make_model(tokenizer).state_dict(), AdapterState)


def test_merged_state_dict_is_base_plus_scaled_b_a_under_the_base_names(tokenizer):
    import copy

    model = _lora_model(tokenizer, rank=4, alpha=2.0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    merged = merged_state_dict(model)
    base = make_model(tokenizer, seed=0)
    assert merged.keys() == base.state_dict().keys()
    layer = model.get_base_model().model.layers[1].mlp.down_proj
    want = layer.base_layer.weight + (2.0 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(merged["model.layers.1.mlp.down_proj.weight"], want.detach(), atol=1e-6, rtol=0)
    assert torch.equal(merged["lm_head.weight"], base.state_dict()["lm_head.weight"])  # not a target: as it was
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    for k, v in reference.items():
        torch.testing.assert_close(merged[k], v, atol=1e-6, rtol=0, msg=k)
