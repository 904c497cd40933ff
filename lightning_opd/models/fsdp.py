"""torch FSDP2 (``fully_shard``) for Hugging Face causal LMs, under Lightning's ``ModelParallelStrategy``.

Sharding (applied in ``PolicyModule.configure_model``): every decoder layer (the model's
``_no_split_modules`` classes) is its own FSDP unit, then the root (embeddings, final norm and LM head,
which may be tied to the embeddings, so they stay in one unit). Mixed precision is FSDP's
``MixedPrecisionPolicy`` (e.g. bf16 parameters and activations, fp32 gradient reduction).

The OPD losses do not call the model's ``forward``: they run the base model for hidden states and
apply the LM head chunk by chunk (``OPDModule.token_losses``). FSDP2 only gathers the root's parameters
around ``forward``, so :func:`shard_causal_lm` registers a second forward method, ``opd_call(fn,
*args)``, that runs ``fn`` with the root's parameters gathered; :func:`with_root_params` calls through it
on a sharded model and calls ``fn`` directly otherwise. The root keeps its parameters gathered after
the forward (FSDP2's default for the root), so the chunked heads recomputed in the backward pass find
them.

Generation from a sharded student (HF ``generate``) is collective: every rank must run the same number
of forwards. ``generate(synced_gpus=True)`` keeps ranks decoding until all are done (F10), and the agent
loop keeps a rank whose episodes have ended stepping with a dummy request until every rank is done.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

try:  # torch >= 2.6 exports FSDP2 here
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = None  # type: ignore[assignment]


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` for data-parallel FSDP2: the whole world (all processes of
    all nodes) is the ``data_parallel`` mesh dimension and there is no tensor parallelism.

    ``ModelParallelStrategy``'s ``"auto"`` sizes put the processes of one node on the *tensor*-parallel
    dimension, which ``OPDModule`` does not use; this subclass only changes those defaults. Runs on GPUs
    (NCCL) and on CPU (gloo). Other arguments: see ``ModelParallelStrategy``.
    """

    def __init__(self, **kwargs: Any) -> None:
        for key in ("data_parallel_size", "tensor_parallel_size"):
            if key in kwargs:
                raise ValueError(f"FSDP2Strategy sets {key} itself (all processes data-parallel); use "
                                 "lightning.pytorch.strategies.ModelParallelStrategy to choose the mesh")
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded with FSDP2's ``fully_shard``."""
    return FSDPModule is not None and isinstance(model, FSDPModule)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of the classes Hugging Face names in ``model._no_split_modules`` (decoder layers).

    Raises:
        ValueError: the model names none, or none are found.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]  # also once sharded
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (its _no_split_modules is {sorted(names)}); "
                         "FSDP needs one unit per layer")
    return layers


def _opd_call(self: nn.Module, fn: Callable, *args: Any) -> Any:
    return fn(*args)


def shard_causal_lm(model: nn.Module, mesh, mixed_precision: MixedPrecisionPolicy | None = None,
                    reshard_after_forward: bool = True) -> nn.Module:
    """Apply ``fully_shard`` to every decoder layer, then to the root, over the 1-D ``mesh``; register
    ``opd_call`` as a forward method (see the module docstring). Returns ``model`` (sharded in place).

    Args:
        model: a Hugging Face ``PreTrainedModel`` with parameters on the mesh's device type (or meta).
        mesh: a 1-D ``DeviceMesh`` of the data-parallel ranks.
        mixed_precision: FSDP2 ``MixedPrecisionPolicy`` (``None``: parameters' own dtype throughout).
        reshard_after_forward: free each layer's gathered parameters after its forward (re-gathered for
            backward): less memory, one more all-gather per layer.
    """
    kw = {"mesh": mesh, "mp_policy": mixed_precision or MixedPrecisionPolicy()}
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, **kw)
    model.opd_call = types.MethodType(_opd_call, model)
    register_fsdp_forward_method(model, "opd_call")
    return model


def with_root_params(model: nn.Module, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` with ``model``'s root parameters (embeddings, norm, LM head) gathered when it is sharded."""
    call = getattr(model, "opd_call", None)
    return call(fn, *args) if call is not None and is_sharded(model) else fn(*args)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) ``state_dict`` on CPU; a collective on every rank when sharded (all
    ranks get the full tensors). Plain ``state_dict()`` (detached CPU copies) otherwise."""
    state = model.state_dict()
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def unsharded_copy(model: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """A plain (unsharded) copy of a Hugging Face model: ``deepcopy``, or for an FSDP-sharded model a
    fresh model of the same config loaded from a full-state gather (a collective on every rank), with
    tied weights re-tied; on ``device`` (default: the model's)."""
    import copy

    target = device if device is not None else next(iter(model.parameters())).device
    if not is_sharded(model):
        return copy.deepcopy(model).to(target)
    from transformers import AutoModelForCausalLM

    state = full_state_dict(model)
    with torch.device(target):  # real buffers (e.g. rotary frequencies, not in the state dict) on the target
        plain = AutoModelForCausalLM.from_config(model.config, dtype=state[next(iter(state))].dtype)
    plain.load_state_dict(state, strict=True)
    plain.tie_weights()
    return plain


def mixed_precision_policy(param_dtype: str | None, reduce_dtype: str | None = "float32"):
    """An FSDP2 ``MixedPrecisionPolicy`` from dtype names (``None`` for ``param_dtype``: no policy)."""
    if param_dtype is None:
        return None
    from lightning_opd.models.loading import resolve_dtype

    return MixedPrecisionPolicy(param_dtype=resolve_dtype(param_dtype),
                                reduce_dtype=None if reduce_dtype is None else resolve_dtype(reduce_dtype))
