"""``RolloutDepthController``: TurnOPD's adaptive rollout-depth budgeting (arXiv 2607.05804 §5.1;
docs/algorithms.md §2.3 and Algorithm 1 in §2.5).

Full-depth *probe* batches (every batch during ``warmup`` steps, then every ``probe_interval`` steps;
scheduled through ``RolloutDataModule.set_probe_schedule``) measure where the per-turn KL sits and how deep
successful episodes go; all other batches run at the cap ``Ĥ`` this controller sets with
``datamodule.set_max_turns``. Only probe rows update it: capped rollouts are censored and would shrink the
cap further and further ("bias trap"). Per probe step, over the probe rows of all ranks::

    K_t = Σ kl_sum[:, t] / Σ tokens[:, t]          n_t = survivors at turn t,  n_0 = probe rows
    m_t = max(K_t, 0) n_t / n_0     q_t = m_t / (Σ_j m_j + ε)     H_eff = round(Σ_t t q_t)
    H_cov = min{H : F_succ(H) >= p}  over successful probes of the last W probe batches (>= 8 of them)
    H̄ ← max(H_eff, H_cov)  (first probe),  else  (1 - α) H̄ + α max(H_eff, H_cov)
    Ĥ = clip(round(H̄) + 1, H_min, H_max)

From the paper (as quoted, docs/algorithms.md sources): the centroid, the success quantile with p = 0.8
and the 8-success refresh rule, max of the two arms, EMA α = 0.3, warm-up 3, probe interval 8, H_min = 2.

PROPOSED in docs/algorithms.md, not from the paper: ε = 1e-8; completion depth = zero-based index of
the last turn (``num_turns - 1``), the unit of t; pooling the successes of the last ``window`` = 4 probe
batches; H_cov unset until the first refresh (H_eff alone until then); H_max read once at setup from the
DataModule's configured ``max_turns``; ``round`` = round half up. Options, off by default (the default is
the paper's rule alone, docs/algorithms.md §6.1): the ``cdf="full"`` fallback (all probe trajectories,
quantile ``full_quantile``, used while too few successes are pooled), and the solved-depth floor
``solved_floor_quantile`` = q (the cap is at least ``Q_q(L_succ) + 1`` turns over the pooled wins). The floor
is a quantile, never the maximum: a floor at the deepest pooled win (the default until 2026-12-03) let one long
win lift the cap to the horizon for the whole window (issue 39: 5 -> 11 of 12 turns with H_eff = H_cov = 3).

Ranks: every step all ranks sum one vector (per-turn KL and token sums, survivors, probe rows, and
histograms of completion depths) with ``trainer.strategy.reduce(..., "sum")``; a histogram over
``0 .. H_max-1`` is shape-stable, so ranks with different numbers of rows reduce exactly. Rank 0's
decision is broadcast.

Logged (``controller/``, every step):

| key | unit | meaning |
|---|---|---|
| ``probe`` | 0/1 | this step trained on probe rows (the controller updated) |
| ``cap`` | turns | Ĥ, cap of the next non-probe batches |
| ``h_eff`` | turn index | last KL centroid (after the first probe) |
| ``h_cov`` | turn index | coverage quantile (once refreshed) |
| ``h_bar`` | turn index | EMA H̄ (after the first probe) |
| ``successes_pooled`` | episodes | successful probes in the window |

The cap each batch was played at and whether it was a probe batch are logged by the module with the batch's
other statistics (``rollout/cap``, turns; ``rollout/is_probe``, fraction of the episodes;
:func:`~lightning_opd.rollout.batch.rollout_stats`), beside its training success ``rollout/success``: the
experiment summary's validity checks read them (:mod:`lightning_opd.analysis.rollout_validity`).
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

CDFS = ("success", "full")


def round_half_up(x: float) -> int:
    """``round`` of the algorithm (PROPOSED: half up, so 2.5 -> 3; Python's ``round`` would give 2)."""
    return math.floor(x + 0.5)


def kl_centroid(kl_sum: torch.Tensor, tokens: torch.Tensor, survivors: torch.Tensor, n0: float,
                eps: float = 1e-8) -> float:
    """Survivor-weighted KL centroid ``Σ_t t q_t`` (turn index, not rounded).

    Args:
        kl_sum: ``(H,)`` summed per-token KL of turn t over the probe rows (nats).
        tokens: ``(H,)`` supervised tokens of turn t over the probe rows.
        survivors: ``(H,)`` probe rows still running at turn t (``n_t``).
        n0: probe rows (``n_0`` > 0).
        eps: ε in ``q_t``.
    """
    k = torch.where(tokens > 0, kl_sum / tokens.clamp(min=1), torch.zeros_like(kl_sum))  # K_t
    m = k.clamp(min=0) * survivors / n0
    q = m / (m.sum() + eps)
    return float((torch.arange(len(q), dtype=q.dtype, device=q.device) * q).sum())


def depth_quantile(hist: list[int], p: float) -> int:
    """``min{H : F(H) >= p}`` for the empirical CDF of a histogram of completion depths (``hist[d]`` =
    episodes that ended with last turn index d; must not be empty)."""
    total, cum = sum(hist), 0
    for depth, count in enumerate(hist):
        cum += count
        if cum >= p * total - 1e-9:
            return depth
    return len(hist) - 1


class RolloutDepthController(Callback):
    """TurnOPD rollout-depth controller (§5.1): probe schedule, KL centroid, success quantile, EMA, cap.

    Args:
        h_min: H_min, lowest cap (turns).
        warmup: steps played at full depth from the start (optimizer steps).
        probe_interval: afterwards every N-th step is a full-depth probe (optimizer steps).
        quantile: p of the success CDF.
        min_successes: pooled successful probes needed to refresh H_cov (episodes).
        window: W, probe batches whose successes are pooled (batches).
        ema: α_ema in H̄ ← (1 - α) H̄ + α H_ctrl.
        eps: ε in q_t.
        cdf: ``"success"`` (default, the paper's rule) or ``"full"``: with ``"full"``, while fewer than
            ``min_successes`` successes are pooled, H_cov is refreshed from all pooled probe trajectories
            instead (PROPOSED fallback for scarce successes); ``"success"`` never falls back.
        full_quantile: p of the full-population CDF (the paper suggests 0.4-0.6).
        solved_floor_quantile: ``None`` (default: no floor, the paper's rule) or q in (0, 1]: while any win is
            pooled the cap is at least ``Q_q(L_succ) + 1`` turns, ``Q_q`` the q-quantile of the pooled winning
            completion depths (PROPOSED, docs/algorithms.md §6.1: a cap below it cuts episodes the student
            can win). With n pooled wins, any q > (n - 1) / n is their maximum (e.g. 0.95 with fewer than 20).
        solved_floor: removed (kept so that old configs get a clear message): ``True`` raises, ``False`` /
            ``None`` are ignored.

    Raises:
        ValueError: an argument out of range (named in the message); ``solved_floor=True``; at setup,
            ``h_min`` above the DataModule's ``max_turns``.
        TypeError: at setup, a DataModule without ``set_max_turns``/``set_probe_schedule``.
    """

    def __init__(self, h_min: int = 2, warmup: int = 3, probe_interval: int = 8, quantile: float = 0.8,
                 min_successes: int = 8, window: int = 4, ema: float = 0.3, eps: float = 1e-8,
                 cdf: str = "success", full_quantile: float = 0.5, solved_floor_quantile: float | None = None,
                 solved_floor: bool | None = None) -> None:
        for name, value, low in (("h_min", h_min, 1), ("warmup", warmup, 0), ("probe_interval", probe_interval, 1),
                                 ("min_successes", min_successes, 1), ("window", window, 1)):
            if value < low:
                raise ValueError(f"{name}={value} must be >= {low}")
        for name, value in (("quantile", quantile), ("ema", ema), ("full_quantile", full_quantile)):
            if not 0 < value <= 1:
                raise ValueError(f"{name}={value} must be in (0, 1]")
        if eps <= 0:
            raise ValueError(f"eps={eps} must be > 0")
        if cdf not in CDFS:
            raise ValueError(f"cdf={cdf!r}: use one of {CDFS}")
        if solved_floor_quantile is not None and (isinstance(solved_floor_quantile, bool)
                                                  or not 0 < solved_floor_quantile <= 1):
            raise ValueError(f"solved_floor_quantile={solved_floor_quantile!r} must be in (0, 1], or null for no "
                             "floor (the paper's rule)")
        if solved_floor:
            raise ValueError("solved_floor=True (a floor at the deepest pooled win) was removed: one long win "
                             "lifted the cap to the horizon (docs/algorithms.md §6.1). Drop it for the paper's "
                             "rule, or set solved_floor_quantile (a quantile of the pooled winning depths, e.g. 0.9)")
        self.h_min, self.warmup, self.probe_interval = h_min, warmup, probe_interval
        self.quantile, self.min_successes, self.window, self.ema, self.eps = quantile, min_successes, window, ema, eps
        self.cdf, self.full_quantile, self.solved_floor_quantile = cdf, full_quantile, solved_floor_quantile
        # state (plain numbers and lists; persisted)
        self.h_max: int | None = None  # read once at setup
        self.cap: int | None = None  # Ĥ
        self.h_bar: float | None = None
        self.h_cov: int | None = None
        self.h_eff: int | None = None
        self.pool: list[tuple[list[int], list[int]]] = []  # last W probe batches: (success, all) depth histograms
        self._probe_step = False
        self._restarting = False
        self._warned = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(h_min=self.h_min, warmup=self.warmup, probe_interval=self.probe_interval)

    @property
    def successes_pooled(self) -> int:
        return sum(sum(s) for s, _ in self.pool)

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        dm = trainer.datamodule
        if dm is None or not (hasattr(dm, "set_max_turns") and hasattr(dm, "set_probe_schedule")):
            raise TypeError(f"RolloutDepthController needs a RolloutDataModule-like DataModule, got {type(dm).__name__}")
        if self.h_max is None:
            self.h_max = int(dm.max_turns)
        if self.h_min > self.h_max:
            raise ValueError(f"h_min={self.h_min} is above the DataModule's max_turns={self.h_max}")
        if self.cap is None:
            self.cap = self.h_max
        self._apply(dm)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._restarting:  # restored after setup (FSDP restores callbacks late): apply here
            self._apply(trainer.datamodule)
            self._restarting = False

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._update(trainer, outputs.get("turn_stats") if isinstance(outputs, dict) else None)
        self._log(pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"h_max": self.h_max, "cap": self.cap, "h_bar": self.h_bar, "h_cov": self.h_cov, "h_eff": self.h_eff,
                "pool": [[list(s), list(a)] for s, a in self.pool]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.h_max = state_dict.get("h_max", self.h_max)
        self.cap = state_dict.get("cap", self.cap)
        self.h_bar = state_dict.get("h_bar")
        self.h_cov = state_dict.get("h_cov")
        self.h_eff = state_dict.get("h_eff")
        self.pool = [(list(s), list(a)) for s, a in state_dict.get("pool", [])]
        self._restarting = True

    # -------------------------------------------------------------------------------------- internals
    def _apply(self, dm) -> None:
        dm.set_probe_schedule(self.warmup, self.probe_interval, self.h_max)
        dm.set_max_turns(self.cap)

    def _reduced_sums(self, trainer: L.Trainer, stats) -> torch.Tensor:
        """One ``sum`` over ranks of ``[kl_sum (H), tokens (H), survivors (H), n_0, success hist (D),
        all hist (D)]`` over this rank's probe rows (float64; D = H_max)."""
        rows = stats.is_probe.bool() & stats.kept.bool()  # a probe a filter dropped has no KL to give
        ended = rows & (stats.num_turns > 0)
        depth = (stats.num_turns - 1).clamp(0, self.h_max - 1).long()  # zero-based index of the last turn
        won = ended & stats.success.bool()
        hist = torch.stack([torch.bincount(depth[won], minlength=self.h_max),
                            torch.bincount(depth[ended], minlength=self.h_max)]).to(stats.kl_sum)  # (2, D)
        vec = torch.cat([stats.kl_sum[rows].sum(0), stats.tokens[rows].sum(0), stats.survivors(rows).to(hist),
                         rows.sum().to(hist)[None], hist.flatten()])
        return trainer.strategy.reduce(vec, reduce_op="sum")

    def _update(self, trainer: L.Trainer, stats) -> None:
        """One controller step from ``stats``, the :class:`~lightning_opd.metrics.turn_stats.TurnStats` the
        step just trained on returned (``outputs["turn_stats"]`` of ``training_step``; ``None``: nothing)."""
        self._probe_step = False
        if stats is None or self.h_max is None:
            return
        h, d = stats.num_tracked_turns, self.h_max
        if h < d and not self._warned:
            rank_zero_warn(f"RolloutDepthController: the module tracks {h} turns < H_max={d}; deeper turns' KL "
                           "is not seen by the centroid (raise model.max_logged_turns)")
            self._warned = True
        vec = self._reduced_sums(trainer, stats)
        n0 = float(vec[3 * h])
        if n0 <= 0:  # no probe rows on any rank: nothing uncensored to learn from
            return
        self._probe_step = True
        h_eff = round_half_up(kl_centroid(vec[:h], vec[h:2 * h], vec[2 * h:3 * h], n0, self.eps))
        succ = [int(round(x)) for x in vec[3 * h + 1:3 * h + 1 + d].tolist()]
        every = [int(round(x)) for x in vec[3 * h + 1 + d:].tolist()]
        self.pool = (self.pool + [(succ, every)])[-self.window:]
        decision = self._decide(h_eff)
        decision = trainer.strategy.broadcast(decision, src=0)  # rank 0 decides the rollout shape
        self.h_eff, self.h_cov, self.h_bar, self.cap = decision
        trainer.datamodule.set_max_turns(self.cap)

    def _decide(self, h_eff: int) -> tuple[int, int | None, float, int]:
        """``(H_eff, H_cov, H̄, Ĥ)`` after one probe step (uses the pool, already updated)."""
        h_cov = self.h_cov
        success = [sum(col) for col in zip(*(s for s, _ in self.pool))]
        every = [sum(col) for col in zip(*(a for _, a in self.pool))]
        if sum(success) >= self.min_successes:
            h_cov = depth_quantile(success, self.quantile)
        elif self.cdf == "full" and sum(every) >= self.min_successes:
            h_cov = depth_quantile(every, self.full_quantile)
        h_ctrl = h_eff if h_cov is None else max(h_eff, h_cov)
        h_bar = float(h_ctrl) if self.h_bar is None else (1 - self.ema) * self.h_bar + self.ema * h_ctrl
        cap = min(max(round_half_up(h_bar) + 1, self._floor(success)), self.h_max)
        return h_eff, h_cov, h_bar, cap

    def _floor(self, success: list[int]) -> int:
        """Lowest cap (turns): ``H_min``, or with ``solved_floor_quantile`` q and a pooled win
        ``max(H_min, Q_q(L_succ) + 1)`` (``success``: pooled histogram of winning depths; PROPOSED, §6.1)."""
        if self.solved_floor_quantile is None or not any(success):
            return self.h_min
        return max(self.h_min, depth_quantile(success, self.solved_floor_quantile) + 1)

    def _log(self, pl_module: L.LightningModule) -> None:
        values = {"probe": float(self._probe_step), "cap": float(self.cap or 0),
                  "successes_pooled": float(self.successes_pooled)}
        for key in ("h_eff", "h_cov", "h_bar"):
            if getattr(self, key) is not None:  # the same on every rank (decided from reduced sums)
                values[key] = float(getattr(self, key))
        for key, value in values.items():
            pl_module.log(f"controller/{key}", value, batch_size=1)
