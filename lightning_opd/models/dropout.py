"""Dropout off in every pass that computes log-probs (F25).

OPD's losses, the behaviour signal (the learner's no-grad log-probs of the freshness weighting, ATOD's old
log-probs) and the teacher's scores are log-probs of fixed tokens: with dropout on, ``KL(student || teacher)`` is
not 0 for a student equal to its teacher, and every log-prob is noisy. The student trains in ``train()`` mode (HF
gradient checkpointing only runs in train mode, and Lightning switches modes around validation), so dropout is
turned off where it is defined instead of by mode: :func:`disable_dropout` sets every dropout probability of a
model's config to 0 *before* the model is built (:func:`~lightning_opd.models.loading.load_causal_lm`), so every
module built from it (``nn.Dropout(config.resid_pdrop)``, Llama's ``attention_dropout``, a function reading the
config at forward time) has probability 0, whatever its mode, on one process or sharded (FSDP2 shards the built
model), with or without a LoRA adapter (whose own ``lora_dropout`` is 0 in :mod:`lightning_opd.learner.sft`).
:func:`check_no_train_mode_noise` then refuses a model whose train-mode forward still differs from its eval-mode
forward (a stochastic layer that no config key controls).
"""

from __future__ import annotations

import re

import torch

#: config keys holding a dropout-like probability: ``attention_dropout``, ``hidden_dropout_prob``, GPT-2's
#: ``resid_pdrop``/``embd_pdrop``/``attn_pdrop``, ``layerdrop``, ``drop_path_rate``, MoE ``router_jitter_noise``
_KEY = re.compile(r"dropout|pdrop|layerdrop|drop_path|jitter_noise", re.IGNORECASE)

_PROBE_TOKENS = 16


class TrainModeNoiseError(ValueError):
    """A model's forward in train mode differs from its forward in eval mode after :func:`disable_dropout`."""


def disable_dropout(config, prefix: str = "") -> dict[str, float]:
    """Set every dropout-like probability of ``config`` (a ``PretrainedConfig``, nested configs such as
    ``text_config`` included) to 0, in place.

    Args:
        config: the model's config, before the model is built from it.
        prefix: prepended to the key names returned (used for nested configs).

    Returns:
        ``{key: old value}`` of the keys that were above 0 (``text_config.attention_dropout`` for a nested one).
    """
    from transformers import PretrainedConfig

    changed: dict[str, float] = {}
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            changed.update(disable_dropout(value, f"{prefix}{key}."))
        elif _KEY.search(key) and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            changed[f"{prefix}{key}"] = value
            setattr(config, key, type(value)(0))
    return changed


@torch.no_grad()
def check_no_train_mode_noise(model, label: str) -> float:
    """Refuse ``model`` unless its forward gives the same log-probs in train mode as in eval mode on a
    16-token probe (what a model with every dropout at 0 does). Restores the model's mode and the CPU random
    state. Call it on an unsharded model.

    Args:
        model: a Hugging Face causal LM.
        label: what named the model (a path or a config key such as ``model.init_args.student``), for the message.

    Returns:
        The largest log-prob difference between the two modes on the probe (nats; 0 for a deterministic model).

    Raises:
        TrainModeNoiseError: the two modes differ by more than rounding; names the model, the difference and the fix.
    """
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, _PROBE_TOKENS), generator=gen, device="cpu").to(device)  # (1, P)
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]):
            logits = {}
            for mode in (False, True):
                model.train(mode)
                logits[mode] = model(input_ids=ids, use_cache=False).logits[0].float()  # (P, V)
    finally:
        model.train(was_training)
    diff = (torch.log_softmax(logits[True], -1) - torch.log_softmax(logits[False], -1)).abs().max().item()
    rounding = 1e-5 if model.dtype in (torch.float32, torch.float64) else 4 * torch.finfo(model.dtype).eps
    allowed = rounding * max(1.0, logits[False].abs().max().item())  # other kernels in train mode, not noise
    if not diff <= allowed:  # also NaN
        raise TrainModeNoiseError(
            f"{label}: {type(model).__name__} (model_type {model.config.model_type!r}) gives other log-probs in train "
            f"mode than in eval mode ({diff:.3g} nats per token on a {_PROBE_TOKENS}-token probe) although every "
            "dropout key of its config was set to 0: it has a stochastic layer that no config key turns off, so the "
            "OPD loss, the behaviour signal and the teacher's scores would be noisy (F25). Set that layer's "
            "probability to 0 in its config.json, or use an architecture without it (Llama, Qwen2/3, SmolLM2, Gemma)")
    return diff
