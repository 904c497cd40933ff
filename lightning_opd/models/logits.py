"""The OPD head path: per-token logits from a causal LM's hidden states, equal to ``model(...).logits``.

The losses never call the model's ``forward`` (it would build a ``(B, T, V)`` tensor): they run the
trunk (``model.base_model``) for ``(B, T, D)`` hidden states and apply the output embeddings to the
supervised positions, chunk by chunk (:mod:`lightning_opd.losses.chunked`). Several families change
the logits after their LM head, and a re-implemented head must do the same (F20):

| families (``config.model_type``) | after the head | config key |
|---|---|---|
| Granite, GraniteMoE (+ SWA, hybrid, shared), MiniCPM3 | ``logits / s`` | ``logits_scaling`` |
| HyperCLOVA X | ``logits * s`` | ``logits_scaling`` |
| Cohere, Cohere2, Cohere2-MoE, Cohere Compass | ``logits * s`` | ``logit_scale`` |
| Falcon-H1 | ``logits * s`` | ``lm_head_multiplier`` |
| Gemma2, Gemma3, Gemma3n, Gemma4, VaultGemma, nanochat | ``c * tanh(logits / c)`` | ``final_logit_softcapping`` |
| RecurrentGemma | ``c * tanh(logits / c)`` | ``logits_soft_cap`` |
| xLSTM | ``c * tanh(logits / c)`` | ``output_logit_soft_cap`` |

(MiniCPM3 divides the hidden states before its bias-free head, which is the same map.) The table is
read from transformers' modelling code; it is not what guards the fault kind. :func:`check_head_path`
runs the head path and the model's own forward on a short probe and refuses, at setup, any model for
which they differ (an unlisted post-processing, a head that is not one linear layer, a trunk whose
output is not the head's input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: model_type -> {LogitTransform field: config key}
_FAMILIES: dict[str, dict[str, str]] = {
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                     "granitemoeshared", "minicpm3"), {"divisor": "logits_scaling"}),
    "hyperclovax": {"multiplier": "logits_scaling"},
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass", "cohere_compass_text"),
                    {"multiplier": "logit_scale"}),
    "falcon_h1": {"multiplier": "lm_head_multiplier"},
    **dict.fromkeys(("gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text",
                     "gemma4_unified", "gemma4_unified_text", "vaultgemma", "nanochat"),
                    {"softcap": "final_logit_softcapping"}),
    "recurrent_gemma": {"softcap": "logits_soft_cap"},
    "xlstm": {"softcap": "output_logit_soft_cap"},
}

_PROBE_TOKENS = 16


class UnsupportedArchitectureError(ValueError):
    """The OPD head path cannot reproduce this model's own logits (raised at setup, F20)."""


@dataclass(frozen=True)
class LogitTransform:
    """What a model family applies to its LM head's output: ``logits * multiplier / divisor``, then
    ``softcap * tanh(logits / softcap)`` when ``softcap`` is set. Elementwise, so it commutes with
    cutting the vocabulary. Identity by default."""

    multiplier: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``(..., V)`` -> ``(..., V)``, same dtype, in the order the modelling code applies it."""
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def logit_transform(config) -> LogitTransform:
    """The logit post-processing of the family of ``config`` (a ``PretrainedConfig``; a multimodal
    config is looked up by its own and its text config's ``model_type``, values read from the text
    config). Unlisted families get the identity (:func:`check_head_path` refuses them if that is wrong)."""
    text = config.get_text_config()
    keys = _FAMILIES.get(config.model_type) or _FAMILIES.get(text.model_type) or {}
    values = {}
    for field, key in keys.items():
        value = getattr(text, key, None)
        if value is None:
            value = getattr(config, key, None)
        if value is not None:
            values[field] = float(value)
    return LogitTransform(**values)


def trunk(model):
    """The decoder stack of a causal LM, without its LM head: ``model.base_model`` (transformers' name for it), or
    for a peft model (a LoRA student) that of the model it wraps, whose layers carry the adapter
    (``PeftModel.base_model`` is peft's ``LoraModel``, which returns logits)."""
    from lightning_opd.models.lora import is_lora_model

    return (model.get_base_model() if is_lora_model(model) else model).base_model


def trunk_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``(B, T)`` ids and mask -> ``(B, T, D)`` final hidden states of :func:`trunk` ``(model)`` (after its
    last norm), i.e. the input of the output embeddings."""
    return trunk(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def output_head(model, vocab_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``(n, D) -> (n, vocab_size)``: ``model``'s output embeddings, cut to the first ``vocab_size``
    columns (the shared vocabulary, F01b), then the family's :func:`logit_transform`.

    Raises:
        UnsupportedArchitectureError: the model has no output embeddings.
    """
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedArchitectureError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() "
                                           "is None); OPD needs a causal LM with an LM head")
    transform = logit_transform(model.config)

    def apply(h: torch.Tensor) -> torch.Tensor:
        return transform(head(h)[..., :vocab_size])

    return apply


def _tolerance(dtype: torch.dtype) -> float:
    """Allowed log-prob difference per unit of logit magnitude: rounding of the two paths, not a
    post-processing step (a missing ``/ 8`` moves log-probs by a large fraction of the logits)."""
    return 1e-5 if dtype in (torch.float32, torch.float64) else 4 * torch.finfo(dtype).eps


@torch.no_grad()
def check_head_path(model, vocab_size: int, key: str) -> float:
    """Refuse ``model`` unless :func:`trunk_hidden_states` + :func:`output_head` give the log-probs of
    its own forward (``log_softmax(model(ids).logits[..., :vocab_size])``) on a 16-token probe.

    Runs in eval mode (no dropout) and restores the model's mode. Call it on an unsharded model.

    Args:
        model: a Hugging Face causal LM.
        vocab_size: the shared vocabulary the losses use (columns beyond it are cut on both paths).
        key: the config key that named the model (e.g. ``model.init_args.teacher``), for the message.

    Returns:
        The largest log-prob difference on the probe (nats).

    Raises:
        UnsupportedArchitectureError: the two paths disagree, or the head path cannot run on this
            model; the message names the architecture, the key, the difference and the fix.
    """
    name = f"{type(model).__name__} (model_type {model.config.model_type!r})"
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    # on the CPU generator's device explicitly (configure_model may run under a `torch.device` context)
    ids = torch.randint(0, vocab_size, (1, _PROBE_TOKENS), generator=gen, device="cpu").to(device)  # (1, P)
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        reference = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, :, :vocab_size]  # (P, V)
        try:
            ours = output_head(model, vocab_size)(trunk_hidden_states(model, ids, mask)[0])  # (P, V)
        except UnsupportedArchitectureError as err:
            raise UnsupportedArchitectureError(f"{key}: {err}") from None
        except Exception as err:  # the trunk or head does not have the interface the losses use
            raise UnsupportedArchitectureError(
                f"{key}: {name} cannot be scored by OPD's head path (base_model -> output embeddings): "
                f"{type(err).__name__}: {err}. Use a decoder-only causal LM such as Llama, Qwen2/3, SmolLM2, "
                "Gemma or Granite") from err
    finally:
        model.train(was_training)
    if ours.shape != reference.shape:
        raise UnsupportedArchitectureError(f"{key}: {name}: OPD's head path gives {tuple(ours.shape)} logits, the "
                                           f"model's forward {tuple(reference.shape)} on a {_PROBE_TOKENS}-token probe")
    err = (torch.log_softmax(ours.float(), -1) - torch.log_softmax(reference.float(), -1)).abs().max().item()
    allowed = _tolerance(model.dtype) * max(1.0, reference.float().abs().max().item())
    if not err <= allowed:  # also NaN
        raise UnsupportedArchitectureError(
            f"{key}: {name}: OPD's head path (base_model -> output embeddings -> {logit_transform(model.config)}) "
            f"differs from the model's own forward by {err:.3g} nats per token (allowed {allowed:.2g}), so the "
            "losses would train on wrong log-probs. The family post-processes its logits in a way "
            "lightning_opd.models.logits does not know: add it to _FAMILIES there (a config key and "
            "multiplier/divisor/softcap), or use a supported architecture")
    return err
