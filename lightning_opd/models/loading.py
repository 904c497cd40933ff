"""Load a student or teacher from any Hugging Face causal-LM directory.

Weights are read from safetensors (or, for ``.bin`` checkpoints, with ``torch.load(weights_only=True)``
inside transformers); ``trust_remote_code`` stays off unless the caller sets it (F15).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lightning_opd.files import write_dir_atomic
from lightning_opd.models.dropout import check_no_train_mode_noise, disable_dropout

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (``"float32"``, ``"bf16"``, ...) to a ``torch.dtype``.

    Raises:
        ValueError: unknown name; the message lists the accepted ones.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def _check_dir(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a ``Path`` when it is a Hugging Face model directory.

    Raises:
        FileNotFoundError: no ``config.json`` there; a Lightning checkpoint (a file, or an FSDP run's folder of
            shards, F30) is named as such, with the command that reads it.
    """
    from lightning_opd.models.checkpoints import is_sharded_checkpoint, sharded_checkpoint_note

    p = Path(path)
    if is_sharded_checkpoint(p):
        raise FileNotFoundError(f"{what} path {sharded_checkpoint_note(p)}")
    if p.is_file() and p.suffix == ".ckpt":
        raise FileNotFoundError(
            f"{what} path {str(p)!r} is a Lightning checkpoint file, not a Hugging Face model directory. Evaluate "
            f"it with `lightning-opd evaluate --students {p} --base <the run's model.init_args.student>`; set "
            "model.init_args.export_dir to write a model directory when fit ends.")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{what} path {str(p)!r} is not a Hugging Face model directory (no config.json). "
            "Run `lightning-opd prepare-model` (SmolLM2) or point it at a `save_pretrained` directory."
        )
    return p


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer (with its chat template) saved next to a model.

    Raises:
        FileNotFoundError: ``path`` is not a model directory.
        ValueError: the tokenizer has no chat template (the agent loop renders every turn with it).
    """
    p = _check_dir(path, "tokenizer")
    tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer at {str(p)!r} has no chat template; the agent loop needs one")
    return tok


def load_causal_lm(
    path: str | os.PathLike, dtype: str | torch.dtype = "float32", trust_remote_code: bool = False
) -> PreTrainedModel:
    """Load a causal LM from a Hugging Face directory (safetensors preferred; no hub access), with dropout off.

    Every dropout probability of its config is set to 0 before the model is built (F25,
    :func:`~lightning_opd.models.dropout.disable_dropout`; a warning names the keys), so every log-prob it
    computes, in train or eval mode, is deterministic; its ``config`` (and a ``save_pretrained`` of it) says 0.

    Args:
        path: directory written by ``save_pretrained``.
        dtype: parameter dtype. Which is faster depends on the machine: bf16 matmuls ran about 8x fp32 on an AMX
            Xeon and about 2x on an AMD EPYC with ``avx512_bf16``, but slower on CPUs without bf16 instructions
            (:func:`~lightning_opd.models.precision.resolve_precision` probes it).
        trust_remote_code: run modelling code shipped with the checkpoint; off by default (F15).

    Raises:
        FileNotFoundError: ``path`` is not a model directory.
        TrainModeNoiseError: its train-mode forward still differs from its eval-mode forward (a stochastic layer
            no config key turns off; :func:`~lightning_opd.models.dropout.check_no_train_mode_noise`).
    """
    p = _check_dir(path, "model")
    config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    changed = disable_dropout(config)
    if changed:
        log.warning("%s: dropout off in every log-prob pass (F25): %s set to 0 (training, scoring and sampling use "
                    "the model without dropout)", p, ", ".join(f"{k}={v}" for k, v in changed.items()))
    model = AutoModelForCausalLM.from_pretrained(
        str(p), config=config, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code, use_safetensors=None
    )
    check_no_train_mode_noise(model, str(p))
    return model


def save_hf_atomic(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, path: str | os.PathLike) -> Path:
    """Save ``model`` (safetensors) and ``tokenizer`` (with chat template) as a Hugging Face directory,
    atomically (F16). Returns the final path."""

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return write_dir_atomic(path, write)


def save_adapter_atomic(peft_model, path: str | os.PathLike) -> Path:
    """Save only the LoRA adapter of a peft model (``adapter_config.json`` + bf16
    ``adapter_model.safetensors``), atomically. Returns the final path."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        peft_model.peft_config["default"].save_pretrained(str(tmp))
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    return write_dir_atomic(path, write)


def merge_adapter(base: str | os.PathLike, adapter: str | os.PathLike, out: str | os.PathLike,
                  dtype: str = "float32") -> Path:
    """Load ``base``, apply the LoRA ``adapter`` (peft), merge it into the weights and save a plain
    Hugging Face directory (with the base's tokenizer) at ``out``, atomically.

    Raises:
        FileNotFoundError: ``base`` is not a model directory or ``adapter`` has no adapter_config.json.
    """
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no LoRA adapter at {str(adapter)!r} (adapter_config.json missing)")
    model = load_causal_lm(base, dtype)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return save_hf_atomic(merged, load_tokenizer(base), out)
