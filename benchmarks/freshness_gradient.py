"""Mechanism check for f-OPD (issue 18): at FIXED learner weights θ_v, does a sample's freshness predict how
well its gradient agrees with the fresh-batch gradient?

1. Policy versions: ``--versions`` (v, default 4) real OPD steps from the student (the project's ``OPDModule``
   and ``RolloutDataModule`` under a Lightning ``Trainer``, conf/textworld/opd.yaml's recipe: analytic reverse
   KL (``--loss sampled``: the sampled-token reverse KL of conf/model/opd_sampled.yaml, issue 18's experiment
   recipe with ``--lr 1e-4``), AdamW ``--lr`` 5e-5, ``--episodes`` 4 episodes/step, gradient clipping 1.0), a CPU copy of the student's
   weights kept at every version 0..v (:class:`VersionSnapshots`, through ``policy_state_dict``).
2. Samples: for each lag l of ``--lags`` (0 1 2 4), ``--samples-per-lag`` (16) training episodes played by the
   weights of version v - l (the DataModule's generator, weights pushed with ``push_weights``, its agent loop and
   training sampling settings), the rollout-time (behaviour) log-probs kept as the async path keeps them. Every
   lag plays the same tasks (paired design: a lag difference is not a task difference) with its own episode
   seeds. A separate fresh reference batch (``--reference`` 16 episodes, lag 0, other tasks) gives G.
3. At θ_v: per sample i, the gradient g_i of the module's OPD loss (``OPDModule.backward_step``: signal
   recomputed at learner time, token-mean over the sample) w.r.t. the student's parameters (all of them by
   default; ``--last-blocks K``: only the last K decoder blocks, the final norm and the LM head if it is not
   tied to the input embeddings, the others frozen meanwhile so the backward pass stops at block L-K), and G,
   the gradient of the reference batch's loss (token-mean over the batch). Recorded: cos(g_i, G) (streamed:
   only G and the current g_i are held, in float64), and the sample's freshness f_i (the ``StalenessMonitor``'s
   own ``FreshnessWeighting``: as shipped (``default``), each other score variant of the component (``age_only``)
   and any ``--variant NAME='{"freshness_kwarg": value}'``) with its components from ``staleness_diagnostics``: lag
   Δ (versions), rollout drift ρ and supervision drift χ (nats), score s.
4. Printed and saved (benchmarks/results/freshness_gradient.json, keyed by the settings, and the markdown table
   benchmarks/results/freshness_gradient.md): Spearman rank correlation of f_i (each variant), lag, ρ, χ and s
   with cos_i over all samples, each with a bootstrap 95% CI (samples resampled, ``--bootstrap`` 2000 times);
   per lag the means of cos, f, ρ and χ, and the correlations within each lag (where the age term is constant,
   so only the drift part can rank samples); each variant's correlation minus the age-only score's, paired on
   the same resamples (does the drift part add to the lag?); seconds per phase and the machine (cores,
   threads). A rerun with the same settings re-summarises the stored per-sample records instead of measuring.

Expected signs if freshness measures what it claims: Spearman(f, cos) > 0; Spearman(lag, cos), Spearman(ρ, cos)
and Spearman(χ, cos) < 0. The ``age_only`` freshness (a decreasing function of the lag alone) has exactly minus
the lag's Spearman correlation (same ties).

Deliberate simplifications: the HF backend samples (no vLLM); one reference batch estimates the fresh gradient
(its own sampling noise bounds how high any cos can go); versions come from the first v steps of one run.

Run: .venv/bin/python -m benchmarks.freshness_gradient   (needs `make prepare teacher`)
Cost, measured on 2 shared CPU cores with 1 torch thread (2 versions, lags 0 and 1, 2 samples each, 2 reference
episodes, 8 turns: 12 min wall, 5.4 min CPU): about 25-30 s per 8-turn episode for its gradient and freshness
passes over all 135M parameters, so the default run (4 steps of 4 episodes, 64 samples + 16 reference episodes
generated and differentiated) takes roughly 1-1.5 hours on 2 idle cores; memory about 6 GB (5 weight copies,
G and g_i in float64). Smoke test (about 2.5 min): ``--versions 2 --lags 0 1 2 --samples-per-lag 2
--reference 2 --max-turns 2``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from dataclasses import replace
from typing import Callable, Mapping

import lightning as L
import numpy as np
import torch

from benchmarks.common import RESULTS, ResultFile, add_artifact_args, markdown_table, with_machine
from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.data import RolloutDataModule
from lightning_opd.envs.base import EnvFactory
from lightning_opd.learner import OPDModule
from lightning_opd.losses.divergences import FullVocabReverseKL, SampledTokenReverseKL
from lightning_opd.losses.freshness import SCORES, FreshnessConfig, staleness_diagnostics
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.rollout.types import Trajectory

# ------------------------------------------------------------------------------------------ statistics


def average_ranks(x) -> np.ndarray:
    """1-based ranks of ``x`` (``(n,)``), ties given the mean of the ranks they span (e.g. ``[1, 2, 2, 3]`` ->
    ``[1, 2.5, 2.5, 4]``)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    xs = x[order]
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or xs[end] != xs[start]:
            ranks[order[start:end]] = (start + end + 1) / 2.0  # mean of ranks start+1 .. end
            start = end
    return ranks


def spearman(x, y) -> float:
    """Spearman rank correlation of ``x`` and ``y`` (each ``(n,)``): the Pearson correlation of their average
    ranks (ties included). NaN when either is constant or ``n < 2`` (no ranking to correlate).

    Raises:
        ValueError: ``x`` and ``y`` differ in length.
    """
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} x values but {len(y)} y values")
    if len(x) < 2:
        return float("nan")
    rx, ry = average_ranks(x), average_ranks(y)
    dx, dy = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    return float((dx * dy).sum()) / den if den > 0 else float("nan")


def _percentile_bootstrap(statistic: Callable[[np.ndarray], float], n: int, n_boot: int, level: float,
                          seed: int) -> tuple[float, float, int]:
    """``statistic(idx)`` over ``n_boot`` resamples ``idx`` of ``range(n)`` with replacement; NaN values left out.
    Returns the ``(1 - level)/2`` and ``(1 + level)/2`` quantiles and the resamples used (NaN, NaN, 0 if none)."""
    if n_boot < 1:
        raise ValueError(f"--bootstrap={n_boot} must be >= 1")
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    values = [v for v in (statistic(rng.integers(0, n, size=n)) for _ in range(n_boot)) if not math.isnan(v)]
    if not values:
        return float("nan"), float("nan"), 0
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi), len(values)


def bootstrap_ci(x, y, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float, int]:
    """Percentile bootstrap CI of :func:`spearman` over samples: ``n_boot`` resamples of the ``n`` pairs with
    replacement; resamples where a side is constant (NaN) are left out.

    Returns:
        ``(low, high, used)``: the ``(1 - level)/2`` and ``(1 + level)/2`` quantiles and the number of resamples
        used (NaN, NaN, 0 when none had a defined correlation).

    Raises:
        ValueError: ``n_boot < 1`` or ``level`` outside (0, 1).
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return _percentile_bootstrap(lambda idx: spearman(x[idx], y[idx]), len(x), n_boot, level, seed)


def bootstrap_difference_ci(x1, x2, y, n_boot: int = 2000, level: float = 0.95,
                            seed: int = 0) -> tuple[float, float, float, int]:
    """Paired percentile bootstrap of ``spearman(x1, y) - spearman(x2, y)`` (each ``(n,)``): both correlations on
    the same resampled samples, so the CI says whether ``x1`` ranks ``y`` better than ``x2`` does on these data
    (e.g. a freshness variant against the age-only score). Resamples where either correlation is NaN are left out.

    Returns:
        ``(difference, low, high, used)``: the difference on all samples, the ``(1 - level)/2`` and
        ``(1 + level)/2`` quantiles, and the resamples used (NaN bounds and 0 when none was defined).

    Raises:
        ValueError: lengths differ, ``n_boot < 1`` or ``level`` outside (0, 1).
    """
    if not len(x1) == len(x2) == len(y):
        raise ValueError(f"bootstrap_difference_ci: lengths {len(x1)}, {len(x2)}, {len(y)} differ")
    x1, x2, y = (np.asarray(v, dtype=np.float64) for v in (x1, x2, y))
    lo, hi, used = _percentile_bootstrap(lambda idx: spearman(x1[idx], y[idx]) - spearman(x2[idx], y[idx]),
                                         len(y), n_boot, level, seed)
    return spearman(x1, y) - spearman(x2, y), lo, hi, used


# ---------------------------------------------------------------------------------- policy versions


class VersionSnapshots(L.Callback):
    """Keeps a CPU copy of the student's weights at every policy version reached in fit (version 0 at train
    start, then after every rollout iteration): ``snapshots[version] = pl_module.policy_state_dict()``."""

    def __init__(self) -> None:
        self.snapshots: dict[int, Mapping[str, torch.Tensor]] = {}

    def _keep(self, pl_module) -> None:
        self.snapshots[int(pl_module.policy_version)] = pl_module.policy_state_dict()

    def on_train_start(self, trainer, pl_module) -> None:
        self._keep(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._keep(pl_module)


LOSSES = {"analytic": FullVocabReverseKL, "sampled": SampledTokenReverseKL}


def make_versions(student: str, teacher: str, env: EnvFactory, versions: int, lr: float, episodes: int,
                  max_turns: int, max_new_tokens: int, accelerator: str = "cpu", seed: int = 0,
                  loss: str = "analytic") -> tuple[OPDModule, RolloutDataModule, dict[int, Mapping[str, torch.Tensor]]]:
    """Run ``versions`` synchronous OPD steps (conf/textworld/opd.yaml's recipe, with ``loss``: ``analytic``
    full-vocabulary reverse KL or ``sampled``-token reverse KL, conf/model/opd_sampled.yaml, the loss issue 18's
    experiment uses) and return the module (student at θ_v; its loss is also the one the per-sample gradients
    differentiate), the connected DataModule and the CPU weights of versions ``0..versions``.

    Raises:
        ValueError: ``versions < 1``, ``lr <= 0`` or an unknown ``loss``.
    """
    if loss not in LOSSES:
        raise ValueError(f"--loss={loss!r}: use one of {sorted(LOSSES)}")
    if versions < 1:
        raise ValueError(f"--versions={versions} must be >= 1 (OPD steps before the measurement)")
    if lr <= 0:
        raise ValueError(f"--lr={lr} must be > 0")
    L.seed_everything(seed, verbose=False)
    module = OPDModule(student=student, teacher=teacher, loss=LOSSES[loss](), log_text_every_n_steps=0,
                       optimizer=lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0), micro_batch_size=1,
                       grad_clip_norm=1.0)
    dm = RolloutDataModule(env, episodes_per_step=episodes, max_turns=max_turns, max_new_tokens=max_new_tokens,
                           max_context_tokens=2048, temperature=1.0, seed=seed)
    keep = VersionSnapshots()
    L.Trainer(accelerator=accelerator, devices=1, max_steps=versions, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
              callbacks=[keep]).fit(module, datamodule=dm)
    if sorted(keep.snapshots) != list(range(versions + 1)):
        raise RuntimeError(f"expected weights of versions 0..{versions}, kept {sorted(keep.snapshots)}")
    return module, dm, keep.snapshots


# -------------------------------------------------------------------------------------------- samples


def play(dm: RolloutDataModule, state: Mapping[str, torch.Tensor], version: int, specs) -> list[Trajectory]:
    """Play ``specs`` (``EpisodeSpec``) with the weights ``state`` stamped ``version`` (pushed to the DataModule's
    generator), with the training sampling settings; behaviour log-probs and versions recorded per token/turn."""
    dm.generator.push_weights(state, version)
    return dm.session.play(list(specs), dm.sampling)


def collate(dm: RolloutDataModule, trajs: list[Trajectory], device) -> RolloutBatch:
    """``trajs`` as a :class:`RolloutBatch` on ``device`` (the DataModule's padding and stop ids)."""
    return dm.session.collate(trajs, dm.sampling).to(device)


def make_samples(dm: RolloutDataModule, snapshots: Mapping[int, Mapping[str, torch.Tensor]], lags: list[int],
                 per_lag: int, reference: int) -> tuple[list[tuple[int, Trajectory]], list[Trajectory]]:
    """``(samples, reference)``: ``per_lag`` episodes per lag, played by version ``v - lag`` (v = the newest
    snapshot), the same tasks for every lag with distinct seeds (the DataModule's sampler); and ``reference``
    fresh (lag 0) episodes of other tasks.

    Raises:
        ValueError: a lag outside ``[0, v]``, ``per_lag < 1`` or ``reference < 1``.
    """
    v = max(snapshots)
    bad = [lag for lag in lags if not 0 <= lag <= v]
    if bad:
        raise ValueError(f"--lags {bad}: each must be in [0, --versions={v}]")
    if per_lag < 1 or reference < 1:
        raise ValueError(f"--samples-per-lag={per_lag} and --reference={reference} must be >= 1")
    tasks = [s.task_id for s in dm.sampler.next_episodes(per_lag)]
    samples = []
    for lag in lags:
        specs = [replace(s, task_id=t) for s, t in zip(dm.sampler.next_episodes(per_lag), tasks)]  # fresh seeds, same tasks
        samples += [(lag, t) for t in play(dm, snapshots[v - lag], v - lag, specs)]
    ref = play(dm, snapshots[v], v, dm.sampler.next_episodes(reference))
    return samples, ref


# ------------------------------------------------------------------------------------------ gradients


def measured_parameters(student: torch.nn.Module, last_blocks: int | None) -> list[tuple[str, torch.nn.Parameter]]:
    """The student's parameters the gradients are taken over: all (``last_blocks=None``), or the last
    ``last_blocks`` decoder blocks, the final norm and the LM head, unless the head is tied to the input
    embeddings (SmolLM2): then the shared matrix is left out, since its gradient would need a backward pass
    through every block, which is what the subset saves. Tied weights appear once.

    Raises:
        ValueError: ``last_blocks < 1``.
    """
    named = list(student.named_parameters())
    if last_blocks is None:
        return named
    if last_blocks < 1:
        raise ValueError(f"--last-blocks={last_blocks} must be >= 1 (omit it for all parameters)")
    block = re.compile(r"\.layers\.(\d+)\.")
    n_layers = 1 + max((int(m.group(1)) for n, _ in named if (m := block.search(n))), default=-1)
    first = n_layers - last_blocks
    embeddings = student.get_input_embeddings().weight
    return [(n, p) for n, p in named
            if p is not embeddings and not ((m := block.search(n)) and int(m.group(1)) < first)]


def loss_gradient(module: OPDModule, batch: RolloutBatch, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Gradient of the module's OPD loss on ``batch`` (token-mean over its supervised tokens, §0.5; signal
    recomputed under the current student) w.r.t. ``params``, one float64 tensor per parameter; the parameters'
    ``.grad`` is cleared before and after. Parameters of the student outside ``params`` are frozen meanwhile.

    Raises:
        ValueError: ``batch`` has no supervised token.
    """
    tokens = batch.loss_mask[:, 1:].sum()
    if tokens <= 0:
        raise ValueError("the batch has no supervised token: no loss, no gradient")
    chosen = {id(p) for p in params}
    frozen = [p for p in module.student.parameters() if id(p) not in chosen and p.requires_grad]
    for p in module.student.parameters():
        p.grad = None
    for p in frozen:
        p.requires_grad_(False)
    try:
        module.backward_step(batch, tokens.to(module.device), lambda loss: loss.backward())
    finally:
        for p in frozen:
            p.requires_grad_(True)
    grads = [torch.zeros(p.shape, dtype=torch.float64, device=p.device) if p.grad is None else p.grad.double()
             for p in params]
    for p in module.student.parameters():
        p.grad = None
    return grads


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """cos of two gradients given as lists of tensors (float64 sums; NaN when one is zero)."""
    dot = sum(float((x * y).sum()) for x, y in zip(a, b))
    na = math.sqrt(sum(float((x * x).sum()) for x in a))
    nb = math.sqrt(sum(float((y * y).sum()) for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else float("nan")


def gradient_cosines(module: OPDModule, samples: list[RolloutBatch], reference: RolloutBatch,
                     params: list[torch.nn.Parameter]) -> tuple[list[float], list[float], float]:
    """``(cos, norms, G_norm)``: cos(g_i, G) and ‖g_i‖ of every one-episode batch of ``samples``, ‖G‖ of the
    ``reference`` batch (see :func:`loss_gradient`). Only G and the current g_i are held."""
    g_ref = loss_gradient(module, reference, params)
    ref_norm = math.sqrt(sum(float((g * g).sum()) for g in g_ref))
    cos, norms = [], []
    for batch in samples:
        g = loss_gradient(module, batch, params)
        cos.append(cosine(g, g_ref))
        norms.append(math.sqrt(sum(float((x * x).sum()) for x in g)))
        del g
    return cos, norms, ref_norm


# ------------------------------------------------------------------------------------------ freshness


def freshness_of(module: OPDModule, batch: RolloutBatch, variants: Mapping[str, StalenessMonitor]) -> dict:
    """Freshness diagnostics of a one-episode ``batch`` at the learner's current weights: ``lag`` (versions),
    ``delta``, ``rho``, ``chi`` (nats) from ``staleness_diagnostics`` with the default monitor's Δ_cap, and per
    variant its ``FreshnessWeighting``'s score ``s_<name>`` and freshness ``f_<name>`` (``plan`` on the batch)."""
    lp = module.student_logprobs(batch)  # (1, T-1) at θ_v
    lag = (module.policy_version - batch.behaviour_version).clamp(min=0)
    blp, mask, turns = batch.behaviour_logprobs[:, 1:], batch.loss_mask[:, 1:], batch.turn_index[:, 1:]
    first = next(iter(variants.values())).freshness
    diag = staleness_diagnostics(lag, lp, blp, mask, turns, first.config.lag_cap)
    out = {"lag": int(lag[0]), "delta": float(diag.delta[0]), "rho": float(diag.rho[0]), "chi": float(diag.chi[0])}
    for name, monitor in variants.items():
        weighting = monitor.freshness
        weighting.plan(lag, lp, blp, mask, turns, batch.group_id, lambda t: t)
        report = weighting.report()
        out[f"f_{name}"] = float(report.freshness[0])
        out[f"s_{name}"] = float(report.stats["score"])
    return out


def score_variants(extra: list[tuple[str, dict]] = ()) -> dict[str, StalenessMonitor]:
    """The freshness scores measured: ``default`` (a ``StalenessMonitor()`` as shipped), one per other score
    variant of the component (:data:`~lightning_opd.losses.freshness.SCORES`, e.g. ``age_only``) with the
    monitor's other defaults, then ``extra`` (name, :class:`~lightning_opd.losses.freshness.FreshnessConfig` keyword
    arguments: the monitor's ``init_args.freshness``).

    Raises:
        ValueError: a name used twice.
    """
    default = StalenessMonitor()
    variants = {"default": default}
    variants.update({s: StalenessMonitor(freshness=FreshnessConfig(score=s)) for s in SCORES
                     if s != default.freshness.config.score})
    for name, kwargs in extra:
        if name in variants:
            raise ValueError(f"--variant {name}: the name is taken (measured: {', '.join(variants)})")
        variants[name] = StalenessMonitor(freshness=FreshnessConfig(**kwargs))
    return variants


# ----------------------------------------------------------------------------------------- the run


def summarize(records: list[dict], variants: list[str], n_boot: int, seed: int = 0) -> dict:
    """From the per-sample ``records``: Spearman correlations with cos (and bootstrap CIs) of each freshness
    variant and component over all samples; per lag the means and the same correlations within the lag
    (``within_lag``: does a score rank samples of one lag, where the age term is constant?); and each variant's
    correlation minus the age-only score's, paired on the same resamples (``minus_age_only``: does the drift
    part add anything to the lag?), when ``age_only`` is among the ``variants``."""
    ok = [r for r in records if not math.isnan(r["cos"])]
    cos = [r["cos"] for r in ok]
    keys = [f"f_{v}" for v in variants] + [f"s_{v}" for v in variants] + ["lag", "rho", "chi"]

    def correlations(rows: list[dict], names: list[str]) -> dict:
        y = [r["cos"] for r in rows]
        out = {}
        for key in names:
            x = [r[key] for r in rows]
            lo, hi, used = bootstrap_ci(x, y, n_boot, seed=seed)
            out[key] = {"spearman": spearman(x, y), "ci_low": lo, "ci_high": hi, "resamples": used}
        return out

    corr = correlations(ok, keys)
    per_lag, within = {}, {}
    for lag in sorted({r["lag"] for r in ok}):
        rows = [r for r in ok if r["lag"] == lag]
        per_lag[str(lag)] = {"n": len(rows), **{k: float(np.mean([r[k] for r in rows]))
                                               for k in ["cos"] + [f"f_{v}" for v in variants] + ["rho", "chi"]}}
        within[str(lag)] = correlations(rows, [f"f_{v}" for v in variants if v != "age_only"] + ["rho", "chi"])
    minus_age = {}
    if "age_only" in variants:
        for v in variants:
            if v != "age_only":
                d, lo, hi, used = bootstrap_difference_ci([r[f"f_{v}"] for r in ok], [r["f_age_only"] for r in ok],
                                                          cos, n_boot, seed=seed)
                minus_age[f"f_{v}"] = {"difference": d, "ci_low": lo, "ci_high": hi, "resamples": used}
    return {"n": len(ok), "n_undefined_cos": len(records) - len(ok), "spearman_with_cos": corr, "per_lag": per_lag,
            "within_lag": within, "minus_age_only": minus_age}


def machine() -> dict:
    """CPU model and cores (:func:`benchmarks.common.machine`), the host's CPU count, torch threads and GPU (if any)
    of this run."""
    out = with_machine({"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()})
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def measure(args, env: EnvFactory) -> dict:
    """The whole check (steps 1-4 of the module docstring) with ``args`` (the parsed command line) in ``env``;
    returns per-sample records, the summary, seconds per phase and the machine."""
    t0 = time.perf_counter()
    module, dm, snapshots = make_versions(args.model, args.teacher, env, args.versions, args.lr, args.episodes,
                                          args.max_turns, args.max_new_tokens, args.accelerator, args.seed,
                                          args.loss)
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    module.to(device)  # Lightning moves the module back to the CPU after fit; the teacher is outside its tree
    module.teacher_model.to(device)
    t1 = time.perf_counter()
    samples, ref = make_samples(dm, snapshots, args.lags, args.samples_per_lag, args.reference)
    t2 = time.perf_counter()
    variants = score_variants(args.variant)
    kept = [(lag, t) for lag, t in samples if collate(dm, [t], "cpu").loss_mask[:, 1:].sum() > 0]
    batches = [collate(dm, [t], device) for _, t in kept]
    params = [p for _, p in measured_parameters(module.student, args.last_blocks)]
    cos, norms, ref_norm = gradient_cosines(module, batches, collate(dm, ref, device), params)
    records = []
    for (lag, traj), batch, c, n in zip(kept, batches, cos, norms):
        fresh = freshness_of(module, batch, variants)
        assert fresh["lag"] == lag, (fresh["lag"], lag)
        records.append({"cos": c, "grad_norm": n, **fresh, "task": traj.task_id, "seed": traj.seed,
                        "turns": traj.num_turns, "tokens": int(batch.loss_mask[:, 1:].sum()),
                        "success": bool(traj.success)})
    t3 = time.perf_counter()
    return {"records": records, "summary": summarize(records, list(variants), args.bootstrap, args.seed),
            "dropped_empty_samples": len(samples) - len(kept), "reference_episodes": len(ref),
            "reference_grad_norm": ref_norm, "measured_parameters": sum(p.numel() for p in params),
            "seconds": {"versions": t1 - t0, "generate": t2 - t1, "gradients": t3 - t2, "total": t3 - t0},
            "machine": machine()}


def report(result: dict, key: str) -> str:
    """The markdown tables of one result."""
    s = result["summary"]
    rows = [[k, f"{c['spearman']:+.3f}", f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]"]
            for k, c in s["spearman_with_cos"].items()]
    f_keys = [k for k in next(iter(s["per_lag"].values()), {}) if k.startswith("f_")]
    lag_rows = [[lag, r["n"], f"{r['cos']:.3f}", *[f"{r[k]:.3f}" for k in f_keys], f"{r['rho']:.3f}",
                 f"{r['chi']:.3f}"] for lag, r in s["per_lag"].items()]
    sec, m = result["seconds"], result["machine"]
    return "\n".join([
        f"### freshness vs gradient agreement ({key})", "",
        f"{s['n']} samples (cos undefined: {s['n_undefined_cos']}, no supervised token: "
        f"{result['dropped_empty_samples']}); G from {result['reference_episodes']} fresh episodes; gradients over "
        f"{result['measured_parameters']:,} parameters", "",
        markdown_table(["quantity", "Spearman with cos(g_i, G)", "bootstrap 95% CI"], rows), "",
        markdown_table(["lag", "samples", "mean cos", *[f"mean {k}" for k in f_keys], "mean ρ (nats)",
                        "mean χ (nats)"], lag_rows), "",
        *_extra_tables(s),
        f"{sec['total']:.0f} s (versions {sec['versions']:.0f}, generation {sec['generate']:.0f}, gradients + "
        f"freshness {sec['gradients']:.0f}) on {m['cpu_count']} cores, {m['torch_threads']} torch threads"
        + (f", {m['gpu']}" if "gpu" in m else ""), ""])


def _extra_tables(s: dict) -> list[str]:
    """The within-lag and minus-age-only tables of a summary (absent from summaries written before them)."""
    out = []
    within = s.get("within_lag") or {}
    if within:
        names = list(next(iter(within.values())))
        rows = [[lag, s["per_lag"][lag]["n"], *[f"{c[k]['spearman']:+.3f} [{c[k]['ci_low']:+.3f}, "
                                                 f"{c[k]['ci_high']:+.3f}]" for k in names]]
                for lag, c in within.items()]
        out += ["Within one lag (the age term constant): Spearman with cos [bootstrap 95% CI]", "",
                markdown_table(["lag", "samples", *names], rows), ""]
    minus = s.get("minus_age_only") or {}
    if minus:
        rows = [[k, f"{c['difference']:+.3f}", f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]",
                 "higher" if c["ci_low"] > 0 else "lower" if c["ci_high"] < 0 else "no difference detected"]
                for k, c in minus.items()]
        out += [markdown_table(["score", "Spearman minus f_age_only's", "paired bootstrap 95% CI", "verdict"], rows),
                ""]
    return out


def _variant(text: str) -> tuple[str, dict]:
    name, _, kw = text.partition("=")
    if not name or not kw:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: write NAME='{{\"kwarg\": value}}' (FreshnessConfig "
                                         "keyword arguments as JSON: the monitor's init_args.freshness)")
    try:
        value = json.loads(kw)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: not JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: the JSON must be an object of keyword arguments")
    return name, value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p)
    p.add_argument("--versions", type=int, default=4, help="OPD steps before the measurement (v)")
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate of those steps (drift per step)")
    p.add_argument("--episodes", type=int, default=4, help="episodes per OPD step")
    p.add_argument("--loss", choices=sorted(LOSSES), default="analytic",
                   help="OPD loss of the steps and of the gradients: analytic (conf/textworld/opd.yaml) or sampled "
                        "(conf/model/opd_sampled.yaml, issue 18's experiment)")
    p.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 4], help="lags measured (versions, <= v)")
    p.add_argument("--samples-per-lag", type=int, default=16)
    p.add_argument("--reference", type=int, default=16, help="fresh episodes of the reference batch (G)")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--last-blocks", type=int, default=None,
                   help="gradients over the last K decoder blocks + final norm (+ an untied LM head) only "
                        "(default: all)")
    p.add_argument("--variant", type=_variant, action="append", default=[],
                   help="extra freshness score: NAME='{\"FreshnessConfig kwarg\": value}' (the monitor's "
                        "init_args.freshness; repeatable)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the CIs")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default="freshness_gradient", help="result file name under benchmarks/results")
    return p


def main(argv: list[str] | None = None, env_factory: Callable[[str], EnvFactory] | None = None) -> dict:
    a = parser().parse_args(argv)
    if env_factory is None:
        from lightning_opd.envs.textworld_env import TextWorldEnvFactory

        env_factory = TextWorldEnvFactory
    loss = "" if a.loss == "analytic" else f"{a.loss}/"  # keys of earlier (analytic-only) results stay valid
    key = (f"v{a.versions}/lr{a.lr}/e{a.episodes}/{loss}lags{'-'.join(map(str, a.lags))}/n{a.samples_per_lag}/"
           f"r{a.reference}/t{a.max_turns}/m{a.max_new_tokens}/p{a.last_blocks or 'all'}/s{a.seed}"
           + "".join(f"/{n}={json.dumps(kw, sort_keys=True)}" for n, kw in a.variant))
    results = ResultFile(a.results)
    if key not in results:
        print(f"running {key} ...", flush=True)
        results.put(key, measure(a, env_factory(a.games)))
    else:  # a stored run is re-summarised from its per-sample records (the statistics may have grown since)
        stored = [k[2:] for k in results[key]["records"][0] if k.startswith("f_")] if results[key]["records"] else []
        variants = sorted(stored, key=lambda v: ({"default": 0, "age_only": 1}.get(v, 2), v))
        results.put(key, {**results[key], "summary": summarize(results[key]["records"], variants, a.bootstrap,
                                                               a.seed)})
    text = report(results[key], key)
    print(text)
    (RESULTS / f"{a.results}.md").write_text(
        "\n".join(report(results[k], k) for k in sorted(results.data)))
    return results[key]


if __name__ == "__main__":
    main()
