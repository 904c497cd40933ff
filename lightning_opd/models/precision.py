"""Pick the numeric precision of a run by probing this machine's matmul speed at the model's own shapes.

The machines runs get differ: on an AMD EPYC with ``avx512_bf16`` but no AMX (2026-12-06, 2 cores) a
2048x576x1536 matmul ran at about 150 GFLOP/s in fp32 and about 70 GFLOP/s in bf16 under load, on an Intel Xeon
with AMX (``amx_bf16``) at 342 vs 2,894 GFLOP/s (issue 61). So "fp32 is right on CPU" is a property of a
machine, not of CPUs: :func:`resolve_precision` measures, at the shapes of the model's ``nn.Linear`` layers
(:func:`linear_shapes`), and picks bf16 only where it is faster here.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from lightning_opd.cpu_isa import cpu_name

TRAINER_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
ALLOWED = ("auto",) + TRAINER_PRECISIONS
# Lightning spells the same settings in several ways; these are the ones a user may pass for ours.
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed"}
# bf16-mixed must beat fp32 by this much (geometric mean over the shapes) for ``auto`` to pick it; see
# :func:`resolve_precision` for why 1.3.
BF16_MARGIN = 1.3


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct ``(in_features, out_features)`` of ``model``'s ``nn.Linear`` layers, in order of first use.

    The LM head counts (it is an ``nn.Linear`` in Hugging Face causal LMs, tied or not). SmolLM2-135M gives
    ``[(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]``.
    """
    seen: dict[tuple[int, int], None] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            seen.setdefault((int(module.in_features), int(module.out_features)), None)
    return list(seen)


def config_linear_shapes(config: Any) -> list[tuple[int, int]]:
    """The ``nn.Linear`` shapes of a Llama-like causal LM from its config alone (no weights loaded).

    Reads ``hidden_size``, ``intermediate_size``, ``vocab_size`` and (when present) ``num_attention_heads`` /
    ``num_key_value_heads`` / ``head_dim``: q/o projections ``(hidden, hidden)``, k/v ``(hidden, kv_heads *
    head_dim)``, MLP ``(hidden, intermediate)`` and ``(intermediate, hidden)``, LM head ``(hidden, vocab)``.

    Raises:
        ValueError: the config lacks ``hidden_size``, ``intermediate_size`` or ``vocab_size`` (names which).
    """
    missing = [k for k in ("hidden_size", "intermediate_size", "vocab_size") if getattr(config, k, None) is None]
    if missing:
        raise ValueError(f"model config {type(config).__name__} has no {missing}; pass the model itself to "
                         "resolve_precision (its nn.Linear shapes are read with linear_shapes)")
    hidden, inter, vocab = int(config.hidden_size), int(config.intermediate_size), int(config.vocab_size)
    heads = getattr(config, "num_attention_heads", None)
    shapes = [(hidden, hidden)]
    if heads:
        head_dim = getattr(config, "head_dim", None) or hidden // int(heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads) * int(head_dim)
        shapes.append((hidden, kv))
    shapes += [(hidden, inter), (inter, hidden), (hidden, vocab)]
    return list(dict.fromkeys(shapes))


def matmul_flops(shapes: Iterable[tuple[int, int]], dtype: torch.dtype, tokens: int = 512,
                 min_seconds: float = 0.2, warmup: int = 3,
                 device: str | torch.device = "cpu") -> dict[str, float]:
    """FLOP/s (floating-point operations per second, ``2 * tokens * in * out`` per call) of ``(tokens, in) @ (in,
    out)`` in ``dtype`` on ``device``, for each ``(in, out)`` of ``shapes``.

    Each value is the median over timed calls made after ``warmup`` untimed ones; calls repeat until at least
    ``min_seconds`` of timed calls (and at least 3 of them) have run, so one slow call does not set the number.
    Inputs are random normal. Returns ``{"<in>x<out>": flops_per_second}`` (e.g. ``{"576x1536": 1.5e11}``), in the
    order of ``shapes``, duplicates once.

    Raises:
        ValueError: ``tokens`` < 1, ``min_seconds`` < 0 or ``warmup`` < 0 (names the value).
    """
    if tokens < 1 or min_seconds < 0 or warmup < 0:
        raise ValueError(f"matmul_flops: tokens={tokens} must be >= 1, min_seconds={min_seconds} and "
                         f"warmup={warmup} >= 0")
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict[str, float] = {}
    for d_in, d_out in shapes:
        key = f"{d_in}x{d_out}"
        if key in out:
            continue
        a = torch.randn(tokens, d_in, device=device).to(dtype)
        b = torch.randn(d_in, d_out, device=device).to(dtype)
        with torch.inference_mode():
            for _ in range(warmup):
                torch.matmul(a, b)
            sync()
            times: list[float] = []
            while sum(times) < min_seconds or len(times) < 3:
                start = time.perf_counter()
                torch.matmul(a, b)
                sync()
                times.append(time.perf_counter() - start)
        out[key] = 2.0 * tokens * d_in * d_out / max(statistics.median(times), 1e-12)
    return out


@dataclass(frozen=True)
class PrecisionChoice:
    """What :func:`resolve_precision` picked.

    Attributes:
        trainer_precision: Lightning's ``Trainer(precision=...)`` for the student: ``"32-true"``, ``"bf16-mixed"``
            or ``"bf16-true"``.
        weights_dtype: dtype of frozen weights that follow the pick (the in-process teacher, the in-process vLLM
            engine): ``torch.float32`` for ``32-true``, ``torch.bfloat16`` otherwise.
        probe: what was measured: ``{"cpu": cpu_name(), "device": ..., "gflops": {"float32": {"576x1536": ...},
            "bfloat16": {...}}, "speedup_geomean": ...}`` (GFLOP/s); ``{}`` where nothing was probed.
        reason: one sentence saying why.
    """

    trainer_precision: str
    weights_dtype: torch.dtype
    probe: dict = field(default_factory=dict)
    reason: str = ""

    def as_dict(self) -> dict:
        """JSON-ready form (the dtype as its name, e.g. ``"bfloat16"``), for hparams and logs."""
        return {"trainer_precision": self.trainer_precision, "weights_dtype": str(self.weights_dtype).split(".")[-1],
                "probe": self.probe, "reason": self.reason}


def normalize_precision(requested: Any) -> str:
    """``requested`` as one of :data:`ALLOWED` (``"auto"``, ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``;
    ``32`` / ``"32"`` mean ``"32-true"``, ``"bf16"`` means ``"bf16-mixed"``).

    Raises:
        ValueError: any other value (names it and the allowed ones).
    """
    value = _ALIASES.get(requested, requested)
    if value not in ALLOWED:
        raise ValueError(f"precision {requested!r} is not supported; use one of {ALLOWED} (auto probes this "
                         "machine; 32-true is exact fp32)")
    return value


def resolve_precision(requested: Any, model_or_shapes: nn.Module | Any | Iterable[tuple[int, int]],
                      device: str | torch.device = "cpu", min_seconds: float = 0.05,
                      tokens: int = 256) -> PrecisionChoice:
    """The precision a run uses: ``requested`` as given, or for ``"auto"`` what this machine runs fastest.

    Args:
        requested: ``"auto"``, ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"`` (see :func:`normalize_precision`).
        model_or_shapes: the student (an ``nn.Module``), its Hugging Face config (see :func:`config_linear_shapes`)
            or a list of ``(in_features, out_features)``; only read for ``"auto"`` on a CPU.
        device: where the student trains (``"cpu"``, ``"cuda"``, ``"cuda:0"``).
        min_seconds: timed seconds per shape and dtype of the CPU probe (:func:`matmul_flops`); the default keeps
            the whole probe of a 5-shape model near 1 s on 2 cores.
        tokens: rows of the probed matmuls (256: large enough for both dtypes' kernels to reach their blocked
            speed, small enough that SmolLM2's 576x49152 head, 4 calls per dtype, stays well under a second).

    ``auto`` on CUDA: ``bf16-mixed`` where ``torch.cuda.is_bf16_supported()``, else ``32-true``; nothing is
    probed (every bf16-capable GPU runs bf16 matmuls at least 2x fp32). ``auto`` on a CPU probes fp32 and bf16 at
    the model's shapes and picks ``bf16-mixed`` when bf16's geometric-mean speedup over the shapes is at least
    :data:`BF16_MARGIN` (1.3x). Why 1.3: bf16-mixed only speeds up the matmuls; autocast adds casts of
    activations and of the fp32 master weights at every step, and the optimizer, the loss in fp32 and the rest of
    the step do not get faster, so with matmuls about 70% of the step (measured roofline share 55-58%) a 1.3x
    matmul gain is worth about 1.15x of the step, the least worth a precision change; below it, run-to-run noise
    of the probe (about 10% on a shared 2-core machine) could flip the pick. An AMX Xeon measures 4-8x, an EPYC
    without AMX 0.5x, so the margin decides nothing on the fleet's machines but keeps near-ties at fp32.

    Raises:
        ValueError: ``requested`` is not allowed (names it and :data:`ALLOWED`).
    """
    value = normalize_precision(requested)
    if value != "auto":
        return PrecisionChoice(value, _weights_dtype(value), {}, f"precision {value} was set explicitly")
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice("bf16-mixed", torch.bfloat16, {"device": str(device)},
                                   "auto on a CUDA GPU with bf16 support picks bf16-mixed (no probe needed)")
        return PrecisionChoice("32-true", torch.float32, {"device": str(device)},
                               "auto on a CUDA GPU without bf16 support picks 32-true (no probe needed)")
    shapes = _shapes_of(model_or_shapes)
    probe = probe_dtypes(shapes, device, min_seconds=min_seconds, tokens=tokens)
    speedup = probe["speedup_geomean"]
    numbers = ", ".join(f"{k}: {probe['gflops']['float32'][k]:.0f} vs {probe['gflops']['bfloat16'][k]:.0f}"
                        for k in probe["gflops"]["float32"])
    where = f"on {probe['cpu']} ({numbers} GFLOP/s fp32 vs bf16)"
    if speedup >= BF16_MARGIN:
        return PrecisionChoice("bf16-mixed", torch.bfloat16, probe, f"auto picked bf16-mixed: bf16 matmuls ran "
                               f"{speedup:.2f}x fp32 (>= {BF16_MARGIN}x) {where}")
    return PrecisionChoice("32-true", torch.float32, probe, f"auto picked 32-true: bf16 matmuls ran {speedup:.2f}x "
                           f"fp32 (< {BF16_MARGIN}x needed for bf16) {where}")


def probe_dtypes(shapes: list[tuple[int, int]], device: str | torch.device = "cpu", min_seconds: float = 0.05,
                 tokens: int = 512, warmup: int = 1) -> dict:
    """GFLOP/s of fp32 and bf16 matmuls at ``shapes`` (:func:`matmul_flops`), alternated per shape so load changes
    hit both dtypes alike, and bf16's geometric-mean speedup: ``{"cpu", "device", "tokens", "gflops": {"float32":
    {...}, "bfloat16": {...}}, "speedup_geomean"}``. One warm-up call per shape and dtype (the first call pays
    oneDNN's kernel creation; more would double the cost of SmolLM2's 576x49152 head, 0.2-0.7 s a call in fp32)."""
    gflops: dict[str, dict[str, float]] = {"float32": {}, "bfloat16": {}}
    for shape in shapes:
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            for key, flops in matmul_flops([shape], dtype, tokens, min_seconds, warmup, device=device).items():
                gflops[name][key] = round(flops / 1e9, 1)
    ratios = [gflops["bfloat16"][k] / max(gflops["float32"][k], 1e-9) for k in gflops["float32"]]
    speedup = math.exp(sum(math.log(max(r, 1e-9)) for r in ratios) / len(ratios)) if ratios else 0.0
    return {"cpu": cpu_name(), "device": str(device), "tokens": tokens, "gflops": gflops,
            "speedup_geomean": round(speedup, 3)}


#: Lag-0 on-policy tolerance: the largest mean over a batch's supervised tokens of |log π_learner - log π_b| (nats per
#: token) between the learner's log-probs of the sampled tokens (at the Trainer's precision) and the behaviour
#: log-probs the sampler recorded, for a batch sampled by the weights being trained. See :func:`lag0_logprob_tolerance`.
LAG0_LOGPROB_TOLERANCE = {"32-true": 1e-3, "bf16-mixed": 0.15, "bf16-true": 0.15}


def lag0_logprob_tolerance(trainer_precision: Any) -> float:
    """The lag-0 on-policy tolerance (nats per token, :data:`LAG0_LOGPROB_TOLERANCE`) under ``trainer_precision``;
    ``exp(tol) - 1`` bounds how far a lag-0 batch's mean truncated importance ratio may sit from 1.

    fp32 (``32-true``): 1e-3, the F02 bound of tests/rollout/test_vllm_fit.py. bf16: measured 2026-12-06 on this
    project's 2-core AMD EPYC (``avx512_bf16``), lag-0 batches of a synchronous fit (2 steps x 4 episodes of
    tests/helpers.py's keyword game, temperature 1, SGD), per batch: mean |Δ| over the supervised tokens, then in
    brackets the largest token |Δ|, the largest episode mean (ρ) and the range of the token ratios exp(Δ):

    * HF sampler (the live student; it runs inside the step's autocast) / bf16-mixed learner: 0 on the tiny model
      (the same bf16 computation);
    * vLLM fp32 / fp32 learner: tiny (hidden 128) 2.5e-7, 2.4e-7 (1.9e-6); SmolLM2-135M 4.4e-6, 6.8e-6 (3.6e-5);
    * vLLM fp32 / bf16-mixed learner: tiny 0.0114, 0.0115 (0.039; 0.013; 0.96-1.04); SmolLM2-135M 0.029, 0.044
      (0.44; 0.066; 0.65-1.22);
    * vLLM bf16 (``dtype: auto`` following the pick) / bf16-mixed learner: tiny 0.0107, 0.0116 (0.060; 0.016;
      0.95-1.06); SmolLM2-135M 0.041, 0.057 (0.31; 0.075; 0.80-1.37); mean ratio 1.01.

    0.15 is 2.6x the largest measured batch mean (0.057): bf16 keeps 8 mantissa bits (about 0.4% of each logit,
    several hundredths of a nat on SmolLM2's logits), so a lag-0 batch is not exact under bf16 and an fp32 bound
    (1e-3) would call every bf16 batch off-policy. Note for the StalenessMonitor: SmolLM2's episode means ρ reached
    0.075 nats at lag 0 under bf16, three quarters of the default drift tolerance ``tau_rho`` 0.1 (0.37 of the
    calibrated 0.2036): recalibrate ``tau_rho`` (``lightning-opd calibrate-freshness``) at the precision a run uses.
    Other values (``16-mixed``, ...) get the bf16 bound.
    """
    return LAG0_LOGPROB_TOLERANCE.get(str(trainer_precision), LAG0_LOGPROB_TOLERANCE["bf16-mixed"])


def _weights_dtype(trainer_precision: str) -> torch.dtype:
    return torch.float32 if trainer_precision == "32-true" else torch.bfloat16


def weights_dtype_for(trainer_precision: Any) -> torch.dtype | None:
    """The dtype frozen weights (in-process teacher, in-process vLLM engine) left at ``dtype: auto`` take under
    the Trainer's ``precision`` (``trainer.precision``, e.g. ``"bf16-mixed"``): ``torch.bfloat16`` for the bf16
    settings, ``None`` for any other (fp32 and the rest: they keep the student's dtype, as before issue 61)."""
    return torch.bfloat16 if str(trainer_precision) in ("bf16-mixed", "bf16-true", "bf16") else None


def _shapes_of(model_or_shapes: Any) -> list[tuple[int, int]]:
    if isinstance(model_or_shapes, nn.Module):
        return linear_shapes(model_or_shapes)
    if hasattr(model_or_shapes, "hidden_size") or hasattr(model_or_shapes, "vocab_size"):
        return config_linear_shapes(model_or_shapes)
    shapes = [(int(i), int(o)) for i, o in model_or_shapes]
    if not shapes:
        raise ValueError("resolve_precision: no shapes to probe (empty list); pass the model or its config")
    return shapes


def resolve_student_precision(requested: Any, student: str, device: str | torch.device = "cpu",
                              trust_remote_code: bool = False) -> PrecisionChoice:
    """:func:`resolve_precision` at the ``nn.Linear`` shapes of the student model directory ``student`` (read from
    its ``config.json``; no weights are loaded); on CUDA no probe.

    Raises:
        ValueError: ``requested`` is not a precision; the student's config cannot be read (names the path).
    """
    if str(device).startswith("cuda"):
        return resolve_precision(requested, [], device)
    from transformers import AutoConfig

    try:
        shapes = config_linear_shapes(AutoConfig.from_pretrained(student, trust_remote_code=trust_remote_code))
    except (OSError, ValueError) as err:
        raise ValueError(f"precision {requested!r}: cannot read the student's config at {student} ({err}); fix the "
                         "path or set a precision (32-true, bf16-mixed)") from None
    return resolve_precision(requested, shapes, device)

