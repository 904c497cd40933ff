"""A LoRA student: the configuration, the adapter that generators load, and vLLM's limits on it.

The student keeps its base weights frozen and trains a LoRA adapter (peft): ``W x + (alpha / r) B A x`` on each target
linear layer, ``A`` ``(r, in)`` Gaussian-initialised and ``B`` ``(out, r)`` zero-initialised, so the untrained adapter
is the base model exactly (Hu et al. 2021, arXiv 2106.09685, eq. 3). Only the adapter reaches the generators:
:class:`AdapterState` is what ``PolicyModule.policy_state_dict`` returns for such a student, about 1% of the bytes of
the full ``state_dict`` at rank 16 on SmolLM2-135M (docs/benchmarks.md#lora-push). A generator loads it as the
adapter of one policy version: vLLM (in process: ``LLM.llm_engine.add_lora``; served:
``POST /v1/load_lora_adapter``) names each version's adapter with its own LoRA id, so a sample's version is the
adapter it was drawn with; HF sampling loads it into its copy of the peft model.

Dropout: the adapter's ``lora_dropout`` is always 0, as every other dropout of the student (F25: log-probs of fixed
tokens must not be noisy); there is no key for it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

#: what a LoRA student pushes to its generators (:attr:`LoRAConfig.push`)
PUSH_MODES = ("auto", "adapter", "merged")

#: the ranks vLLM 0.32 accepts as ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``): an adapter of rank r is served
#: by an engine started with the smallest of these >= r
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    """``model.init_args.lora``: train the student as a LoRA adapter (peft) on its frozen base weights.

    Attributes:
        rank: r, the adapter's rank (>= 1; at most 512, vLLM's largest ``max_lora_rank``).
        alpha: the scaling numerator (the update is ``alpha / rank * B A``); ``None``: ``2 * rank``.
        target_modules: peft's ``target_modules``: ``"all-linear"`` (every linear layer of the decoder, not the LM
            head) or a list of module names (``["q_proj", "v_proj"]``).
        push: what generators receive each version: ``"adapter"`` (the adapter alone, :class:`AdapterState`; vLLM
            samples with base + adapter through its LoRA kernels), ``"merged"`` (the base with the adapter merged in,
            :func:`merged_state_dict`, pushed as a full fine-tune's weights: the engine runs without LoRA) or
            ``"auto"`` (default: ``merged`` when the learner runs on CPU, ``adapter`` otherwise; resolved at setup,
            :meth:`resolved`; ``adapter`` where nothing resolves it). On CPU vLLM 0.32's LoRA kernels are torch
            reference ops (``punica_cpu``): sampling with an adapter took 5.9x the time of the same engine without
            LoRA (docs/benchmarks.md#lora-push), far more than the full-size push saves; on a GPU ``adapter`` is the
            point.

    Raises:
        ValueError: ``rank`` outside ``[1, 512]``, ``alpha <= 0``, an empty ``target_modules`` or an unknown ``push``
            (naming the key).
    """

    rank: int = 16
    alpha: float | None = None
    target_modules: str | list[str] = "all-linear"
    push: str = "auto"

    def __post_init__(self) -> None:
        if not 1 <= int(self.rank) <= VLLM_MAX_LORA_RANKS[-1]:
            raise ValueError(f"model.init_args.lora.rank={self.rank}: use an integer in [1, {VLLM_MAX_LORA_RANKS[-1]}] "
                             "(the adapter's rank; vLLM serves up to 512)")
        if self.alpha is not None and not float(self.alpha) > 0:
            raise ValueError(f"model.init_args.lora.alpha={self.alpha} must be > 0 (or null for 2 * rank)")
        if not self.target_modules:
            raise ValueError("model.init_args.lora.target_modules is empty: use 'all-linear' or a list of module names")
        if self.push not in PUSH_MODES:
            raise ValueError(f"model.init_args.lora.push={self.push!r}: use one of {PUSH_MODES} (adapter: the adapter "
                             "alone; merged: the base with the adapter merged in, full-speed sampling on CPU; auto: "
                             "merged on CPU, adapter elsewhere)")

    @property
    def pushes_adapter(self) -> bool:
        """Whether generators receive the adapter alone (``push`` ``adapter``, or ``auto`` not resolved)."""
        return self.push != "merged"

    def resolved(self, device_type: str) -> "LoRAConfig":
        """This configuration with ``push: auto`` made concrete for a learner on ``device_type`` (``"cpu"``:
        ``merged``; anything else: ``adapter``); an explicit ``push`` is kept."""
        if self.push != "auto":
            return self
        return dataclasses.replace(self, push="merged" if device_type == "cpu" else "adapter")

    @property
    def scaling_alpha(self) -> float:
        """``alpha``, or ``2 * rank`` when it is ``None``."""
        return float(self.alpha) if self.alpha is not None else 2.0 * int(self.rank)

    def peft_config(self):
        """The ``peft.LoraConfig`` (dropout 0, no bias terms, ``task_type="CAUSAL_LM"``)."""
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=int(self.rank), lora_alpha=self.scaling_alpha, lora_dropout=0.0, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM")

    @property
    def vllm_max_lora_rank(self) -> int:
        """The smallest of vLLM's :data:`VLLM_MAX_LORA_RANKS` that holds ``rank``."""
        return next(r for r in VLLM_MAX_LORA_RANKS if r >= int(self.rank))


def apply_lora(model, config: LoRAConfig):
    """Wrap ``model`` (a ``PreTrainedModel``) as a peft model with a fresh adapter of ``config``: base weights frozen
    (``requires_grad=False``), adapter weights trainable, ``B = 0`` so the outputs equal the base model's. With
    gradient checkpointing on the base, the input embeddings' output requires grad (peft needs it for the
    checkpointed layers to reach the adapter)."""
    from peft import get_peft_model

    if getattr(model, "is_gradient_checkpointing", False):
        model.enable_input_require_grads()
    return get_peft_model(model, config.peft_config())


def is_lora_model(model) -> bool:
    """Whether ``model`` is a peft model (a LoRA student)."""
    return model is not None and hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class AdapterState(dict):
    """A LoRA adapter's weights as one policy version ships them: ``{peft name: tensor}`` (CPU, detached, the
    student's dtype; names as ``peft.get_peft_model_state_dict`` writes them, e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, ``(r, in)``; ``...lora_B.weight``,
    ``(out, r)``) and the ``peft.LoraConfig`` it belongs to (:attr:`peft_config`).

    What ``PolicyModule.policy_state_dict`` returns for a LoRA student, so every weight path (pushes, forced-lag
    snapshots, evaluation pushes) carries the adapter alone; a generator tells it from a full ``state_dict`` with
    ``isinstance``.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], peft_config, base_model: str | None = None) -> None:
        super().__init__(tensors)
        self.peft_config = peft_config
        #: the base model's directory (written as ``base_model_name_or_path`` of ``adapter_config.json``)
        self.base_model = base_model

    @property
    def rank(self) -> int:
        """The adapter's rank r."""
        return int(self.peft_config.r)

    @property
    def nbytes(self) -> int:
        """Bytes of the adapter's tensors (what a push ships, before any file framing)."""
        return sum(t.numel() * t.element_size() for t in self.values())

    def save(self, path: str | os.PathLike) -> Path:
        """Write the adapter as a peft directory at ``path`` (``adapter_config.json`` and ``adapter_model.safetensors``
        in the tensors' own dtype, so a generator loads exactly the learner's values; not atomic: pushes write a fresh
        directory each time). Returns the path."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.peft_config.save_pretrained(str(path))
        if self.base_model is not None:  # peft writes the base it was built on; name the student's directory
            cfg_path = path / "adapter_config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["base_model_name_or_path"] = str(self.base_model)
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
        save_file({k: v.contiguous() for k, v in self.items()}, str(path / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        return path


def adapter_state(peft_model, base_model: str | None = None) -> AdapterState:
    """The adapter of ``peft_model`` (its ``"default"`` adapter) as an :class:`AdapterState` of detached CPU copies."""
    from peft import get_peft_model_state_dict

    tensors = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(peft_model).items()}
    return AdapterState(tensors, peft_model.peft_config["default"], base_model)


def load_adapter_state(peft_model, state: AdapterState) -> None:
    """Load ``state`` into ``peft_model``'s ``"default"`` adapter, every tensor of it (no grad).

    Raises:
        KeyError: ``state`` lacks some of the adapter's tensors or has tensors it does not know (naming a few).
    """
    from peft import set_peft_model_state_dict

    own = set(adapter_state_names(peft_model))
    missing, unknown = sorted(own - set(state)), sorted(set(state) - own)
    if missing or unknown:
        raise KeyError(f"the pushed adapter does not match the model's: missing {missing[:3]}, unknown {unknown[:3]} "
                       f"({len(missing)} and {len(unknown)} in all): was it trained with another model.init_args.lora?")
    with torch.no_grad():
        set_peft_model_state_dict(peft_model, dict(state))


def merged_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """The full ``state_dict`` of the model ``peft_model`` wraps with its ``"default"`` adapter merged in, as the base
    model names it (``model.layers.0.self_attn.q_proj.weight``, ``(out, in)``: ``W + (alpha / r) B A``; every other
    tensor as it is): what ``peft``'s ``merge_and_unload`` would hold, computed without copying the model. CPU,
    detached; what a LoRA student with ``push: merged`` sends to its generators."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    state = {name.replace(".base_layer", ""): t.detach().to("cpu", copy=True)
             for name, t in base.state_dict().items() if ".lora_" not in name}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                key = f"{name}.weight"
                state[key] += module.get_delta_weight("default").detach().to("cpu", state[key].dtype)
    return state


def adapter_state_names(peft_model) -> list[str]:
    """The names :func:`adapter_state` gives ``peft_model``'s adapter tensors."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(peft_model).keys())


def check_vllm_lora(config: LoRAConfig | None, engine_kwargs: Mapping, min_loras: int = 1,
                    key: str = "data.init_args.generator.init_args.engine_kwargs") -> dict:
    """The ``vllm.LLM`` keyword arguments that serve a LoRA student's adapters (``enable_lora``, ``max_lora_rank``:
    the smallest vLLM rank that holds ``config.rank``, ``max_loras``: at least ``min_loras`` adapters at once), merged
    over ``engine_kwargs``; ``{}`` without a LoRA student or with ``push: merged`` (full weights are pushed).

    Raises:
        ValueError: ``engine_kwargs`` sets ``enable_lora: false``, a ``max_lora_rank`` below the adapter's rank or one
            vLLM does not accept, or ``max_loras < min_loras`` (naming ``key`` and what to set).
    """
    if config is None or not config.pushes_adapter:
        return {}
    kw = dict(enable_lora=True, max_lora_rank=config.vllm_max_lora_rank, max_loras=max(1, int(min_loras)))
    if engine_kwargs.get("enable_lora") is False:
        raise ValueError(f"{key}.enable_lora=false with a LoRA student (model.init_args.lora): the engine must load "
                         "its adapters; drop the key")
    rank = engine_kwargs.get("max_lora_rank")
    if rank is not None and (int(rank) not in VLLM_MAX_LORA_RANKS or int(rank) < int(config.rank)):
        raise ValueError(f"{key}.max_lora_rank={rank}: vLLM accepts {VLLM_MAX_LORA_RANKS} and it must be >= the "
                         f"adapter's rank {config.rank} (model.init_args.lora.rank); drop it to get "
                         f"{config.vllm_max_lora_rank}")
    loras = engine_kwargs.get("max_loras")
    if loras is not None and int(loras) < kw["max_loras"]:
        raise ValueError(f"{key}.max_loras={loras}: at least {kw['max_loras']} adapters must be loadable at once "
                         "(the versions in flight); drop it or raise it")
    kw.update({k: engine_kwargs[k] for k in ("max_lora_rank", "max_loras") if engine_kwargs.get(k) is not None})
    return kw
