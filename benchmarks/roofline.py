"""Roofline accounting for the benchmarks that time a rollout, an update or a whole OPD step (issue 17).

The machine's two ceilings are measured in the same run (:func:`measure_machine`): matmul FLOP/s at the
model's own ``nn.Linear`` shapes, for each dtype the run computes in (fp32, bf16: a run's roofline uses the peak of
its own dtype), the best shape as the peak, each shape the median of timed calls over at least ``min_seconds``
(:func:`lightning_opd.models.precision.matmul_flops`: the probe the product's ``precision: auto`` uses, so the
product and the benchmarks measure one way), and memory bandwidth (the better of a large copy and a large read). A
workload's roofline time is then computed from counted quantities:

* every forward pass of generation (one prefill per ``generate`` call, then one decode step per
  sampled token but the last) costs ``max(FLOPs / peak, bytes / bandwidth)``, with bytes = every weight
  once + the keys/values of every row's context (:func:`pass_flops`, :func:`pass_bytes`); the prefill
  counts only the prompt tokens actually computed (after the HF KV cache or vLLM's prefix cache);
* an update costs ``FLOPs / peak``: student forward + backward (3x the forward) and teacher forward
  over every real token of every episode (:func:`update_flops`).

FLOPs of a forward (:meth:`ModelShape.forward_flops`): ``2 N_trunk`` per token fed, ``2 N_head`` per
position the output head runs on (generation: one per row, the last; the learner: the supervised
positions), attention ``4 L H d_head`` per (query, key) pair, causal, counted exactly: a token at
position ``c + j`` of a row with ``c`` cached tokens attends to ``c + j`` keys. The PaLM convention
(appendix B) with exact causal attention and the head where it runs; recomputation (activation or head
checkpointing) is not counted: model FLOPs, not hardware FLOPs. The achieved fraction printed is
``roofline seconds / measured seconds`` (1 = at the roofline).

Source: PROPOSED, docs/algorithms.md is silent on it; the FLOP convention is Chowdhery et al. 2022
(PaLM), appendix B, and Williams et al. 2009 (roofline).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import torch

from lightning_opd.models.precision import linear_shapes, matmul_flops


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP and byte counts need from a causal LM.

    Attributes:
        trunk_params: weights of every ``nn.Linear`` but the output head (matmul parameters per token).
        head_params: weights of the output head (``V x d``; tied or not, one matmul per position it runs on).
        layers, heads, head_dim, kv_heads: attention shape.
        weight_bytes: bytes of every parameter (tied ones once): what one forward reads.
        kv_dtype_bytes: bytes per cached key/value element.
    """

    trunk_params: int
    head_params: int
    layers: int
    heads: int
    head_dim: int
    kv_heads: int
    weight_bytes: int
    kv_dtype_bytes: int = 4

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelShape":
        """The shape of a Hugging Face causal LM (its config, its ``nn.Linear`` modules, its parameters)."""
        cfg = model.config
        head = model.get_output_embeddings()
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        params = list(model.parameters())  # tied parameters appear once
        return cls(trunk_params=linear - head.weight.numel(), head_params=head.weight.numel(),
                   layers=cfg.num_hidden_layers, heads=heads, head_dim=head_dim,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   weight_bytes=sum(p.numel() * p.element_size() for p in params),
                   kv_dtype_bytes=params[0].element_size())

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's keys and values over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    def attention_flops(self, new: int, cached: int = 0) -> int:
        """Score and value FLOPs of ``new`` causal tokens after ``cached`` ones:
        ``4 L H d_head (new * cached + new (new + 1) / 2)``."""
        pairs = new * cached + new * (new + 1) // 2
        return 4 * self.layers * self.heads * self.head_dim * pairs

    def forward_flops(self, new: int, cached: int = 0, head: int | None = None) -> int:
        """FLOPs of one row's forward over ``new`` tokens after ``cached`` ones, the output head on
        ``head`` positions (default: all ``new``)."""
        head = new if head is None else head
        return 2 * self.trunk_params * new + 2 * self.head_params * head + self.attention_flops(new, cached)


class Row(NamedTuple):
    """One episode's share of a ``generate`` call: prompt tokens served from a cache and computed, and the
    tokens it sampled."""

    cached: int
    computed: int
    sampled: int


def generation_passes(rows: list[Row]) -> list[list[tuple[int, int]]]:
    """The forward passes of one ``generate`` call, each a list of ``(context tokens before, tokens fed)``
    per row taking part: the prefill (``(cached, computed)`` per row), then decode step ``j = 1 ..
    max(sampled) - 1`` feeding sampled token ``j - 1`` of every row that sampled more than ``j``
    (the last sampled token is never fed back)."""
    passes = [[(r.cached, r.computed) for r in rows]]
    for j in range(1, max((r.sampled for r in rows), default=0)):
        passes.append([(r.cached + r.computed + j - 1, 1) for r in rows if r.sampled > j])
    return passes


def pass_flops(shape: ModelShape, rows: list[tuple[int, int]]) -> int:
    """FLOPs of one generation forward pass: every row's tokens fed, the head on its last position."""
    return sum(shape.forward_flops(new, cached, head=1) for cached, new in rows)


def pass_bytes(shape: ModelShape, rows: list[tuple[int, int]]) -> int:
    """Bytes one generation forward pass moves at least: every weight once, and every row's keys and
    values (the cached ones read, the new ones written)."""
    return shape.weight_bytes + shape.kv_bytes_per_token * sum(cached + new for cached, new in rows)


@dataclass(frozen=True)
class Machine:
    """The two ceilings, measured.

    Attributes:
        matmul_flops: best matmul FLOP/s at the model's shapes, in the dtype the workload computes in.
        bandwidth: memory bandwidth, bytes/s.
    """

    matmul_flops: float
    bandwidth: float

    def pass_seconds(self, flops: float, nbytes: float) -> float:
        """Roofline seconds of one pass: the slower of its compute and its memory traffic."""
        return max(flops / self.matmul_flops, nbytes / self.bandwidth)


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_flops(model: torch.nn.Module, dtype: torch.dtype = torch.float32, tokens: int = 512,
                         min_seconds: float = 0.2, warmup: int = 3) -> dict[str, float]:
    """FLOP/s of ``torch.matmul`` ``(tokens, in) @ (in, out)`` in ``dtype`` (what the run computes in, not
    necessarily the weights' dtype: bf16-mixed keeps fp32 weights) for every distinct ``nn.Linear`` shape of
    ``model``, keyed ``"<in>x<out>"``: each the median of timed calls over at least ``min_seconds`` after ``warmup``
    untimed ones (:func:`lightning_opd.models.precision.matmul_flops` at
    :func:`lightning_opd.models.precision.linear_shapes`)."""
    return matmul_flops(linear_shapes(model), dtype, tokens, min_seconds, warmup)


def measure_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth in bytes/s of a large fp32 copy (``2 nbytes`` moved: read + write) and of a large
    read (a sum), best of ``repeats`` each."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    copy = 2 * nbytes / _best_seconds(functools.partial(dst.copy_, src), repeats)
    read = nbytes / _best_seconds(src.sum, repeats)
    return {"copy": copy, "read": read}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the key of a dtype in :func:`measure_machine`'s result."""
    return str(dtype).removeprefix("torch.")


def measure_machine(model: torch.nn.Module, dtypes: Sequence[torch.dtype] = (torch.float32,), tokens: int = 512,
                    nbytes: int = 1 << 28, repeats: int = 5, min_seconds: float = 0.2) -> dict:
    """The ceilings for ``model`` on this machine with torch's current thread count, the matmul peak per dtype of
    ``dtypes`` (:func:`measure_matmul_flops`, ``min_seconds`` per shape and dtype) and the bandwidth (best of
    ``repeats`` per probe).

    Returns:
        ``{"matmul_flops", "dtype", "matmul_by_shape", "matmul_flops_by_dtype", "matmul_by_dtype_shape",
        "bandwidth", "bandwidth_by_probe", "threads", "tokens", "min_seconds"}`` (FLOP/s, bytes/s): a dtype's peak
        is its best shape; ``matmul_flops`` / ``matmul_by_shape`` are those of ``dtypes[0]`` (named by ``dtype``),
        the others keyed by :func:`dtype_name`; the bandwidth is the better probe (:class:`Machine` takes
        ``matmul_flops`` and ``bandwidth``).

    Raises:
        ValueError: ``dtypes`` is empty.
    """
    if not dtypes:
        raise ValueError("measure_machine: dtypes is empty; pass the dtypes the run computes in, e.g. "
                         "(torch.float32,) or (torch.float32, torch.bfloat16)")
    by_dtype = {dtype_name(d): measure_matmul_flops(model, d, tokens, min_seconds) for d in dtypes}
    peaks = {name: max(shapes.values()) for name, shapes in by_dtype.items()}
    first = dtype_name(dtypes[0])
    bw = measure_bandwidth(nbytes, repeats)
    return {"matmul_flops": peaks[first], "dtype": first, "matmul_by_shape": by_dtype[first],
            "matmul_flops_by_dtype": peaks, "matmul_by_dtype_shape": by_dtype, "bandwidth": max(bw.values()),
            "bandwidth_by_probe": bw, "threads": torch.get_num_threads(), "tokens": tokens, "min_seconds": min_seconds}


class GenerationLog:
    """Records every ``generate`` call of a generator (its instance method wrapped): wall seconds, and
    per request the prompt tokens cached / computed and the tokens sampled (:class:`Row`)."""

    def __init__(self, generator) -> None:
        self.calls: list[list[Row]] = []
        self.seconds = 0.0
        inner = generator.generate

        def generate(requests, sampling):
            t0 = time.perf_counter()
            outs = inner(requests, sampling)
            self.seconds += time.perf_counter() - t0
            self.calls.append([Row(o.prompt_tokens_cached, o.prompt_tokens_computed, len(o.token_ids)) for o in outs])
            return outs

        generator.generate = generate

    def reset(self) -> None:
        self.calls, self.seconds = [], 0.0


def rollout_roofline(shape: ModelShape, machine: Machine, calls: Iterable[list[Row]]) -> dict:
    """Counted quantities and the roofline seconds of a rollout's ``generate`` calls.

    Returns:
        ``prefill_tokens`` / ``cached_tokens`` (prompt tokens computed / served from a cache),
        ``sampled_tokens``, ``passes`` (forward passes: prefills + decode steps), ``flops``, ``bytes``
        and ``roofline_s`` (sum over passes of :meth:`Machine.pass_seconds`).
    """
    out = dict(prefill_tokens=0, cached_tokens=0, sampled_tokens=0, passes=0, flops=0, bytes=0, roofline_s=0.0)
    for rows in calls:
        out["prefill_tokens"] += sum(r.computed for r in rows)
        out["cached_tokens"] += sum(r.cached for r in rows)
        out["sampled_tokens"] += sum(r.sampled for r in rows)
        for p in generation_passes(rows):
            flops, nbytes = pass_flops(shape, p), pass_bytes(shape, p)
            out["passes"] += 1
            out["flops"] += flops
            out["bytes"] += nbytes
            out["roofline_s"] += machine.pass_seconds(flops, nbytes)
    return out


def update_flops(student: ModelShape, teacher: ModelShape, episodes: Iterable[tuple[int, int]]) -> dict:
    """Model FLOPs of one update over ``episodes`` given as ``(real tokens T, supervised positions S)``:
    student forward + backward ``3 x (2 N_trunk T + attention(T)) + 6 N_head S``, teacher forward
    ``2 N_trunk T + attention(T) + 2 N_head S`` (padding not counted: it is waste)."""
    s = t = 0
    for tokens, supervised in episodes:
        s += 3 * student.forward_flops(tokens, head=supervised)
        t += teacher.forward_flops(tokens, head=supervised)
    return {"student_flops": s, "teacher_flops": t, "flops": s + t}


def fraction(roofline_s: float, measured_s: float) -> float:
    """Achieved fraction of the roofline: ``roofline_s / measured_s``.

    Raises:
        ValueError: ``measured_s`` is not positive.
    """
    if measured_s <= 0:
        raise ValueError(f"measured_s={measured_s} must be > 0 seconds")
    return roofline_s / measured_s
