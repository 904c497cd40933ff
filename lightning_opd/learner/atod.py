"""``ATODModule``: ATOD's hybrid objective on top of :class:`~lightning_opd.learner.opd.OPDModule`
(docs/algorithms.md §3; arXiv 2606.27814).

The loss is :class:`~lightning_opd.losses.grpo.ClippedSurrogate`. Before the first update the batch gets its
GRPO group advantages, its old log-probs and, with ``tdur``, its T-DUR turn weights
(:meth:`ATODModule.prepare_hybrid`); then ``ppo_epochs`` passes over ``ppo_mini_batches`` contiguous
mini-batches, one optimizer update each, all on the same advantages. The whole batch is still one rollout
iteration: ``policy_version`` moves by 1 (§3.1 note), while ``trainer.global_step`` (and so
``trainer.max_steps``) counts optimizer updates, ``updates_per_batch`` per batch. ``kappa`` and ``rho`` may be
changed between steps through :meth:`ATODModule.set_kappa` / :meth:`ATODModule.set_rho` (``AnnealingSchedule``),
which check the value when it is set.

F22 (docs/faults.md): at setup, a knob combination that makes a term of the loss identically zero is refused, naming
both keys (:meth:`ATODModule.check_loss_terms`). What the check needs is handed over explicitly before it runs: the
schedules of κ and ρ by their callbacks (:meth:`ATODModule.set_kappa_schedule` / :meth:`ATODModule.set_rho_schedule`,
in the callbacks' setup, which Lightning runs before the module's) and the rollouts' group size and temperature by
the DataModule binding (:meth:`ATODModule.connect_data`, :class:`RolloutGroups`).

Deliberate simplification: PPO mini-batches are contiguous row ranges, the same in every epoch (no
shuffling).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_opd.learner.opd import OPDModule
from lightning_opd.losses.divergences import TokenDivergence, TokenLoss
from lightning_opd.losses.grpo import ClippedSurrogate, EpisodeReward, compute_rewards, group_advantages
from lightning_opd.losses.tdur import tdur_weights
from lightning_opd.metrics.rank_stats import Max, Mean, Min, RankStat, Sum, all_ranks
from lightning_opd.rollout.batch import RolloutBatch


def _coefficient(name: str, value: float) -> float:
    """``value`` as a float, checked: κ and ρ are finite and >= 0.

    Raises:
        ValueError: naming ``model.<name>``.
    """
    value = float(value)
    if not (value >= 0 and value != float("inf")):
        raise ValueError(f"model.{name}={value} must be a finite number >= 0")
    return value


@dataclass(frozen=True)
class PPOUpdates:
    """How a rollout batch is trained on (ATOD §3.4, PPO): ``epochs`` passes, each of ``mini_batches``
    optimizer updates on contiguous row ranges.

    Attributes:
        epochs: passes over each rollout batch (``model.init_args.ppo_epochs``, >= 1).
        mini_batches: optimizer updates per pass (``model.init_args.ppo_mini_batches``, >= 1).

    Raises:
        ValueError: a value below 1, naming its configuration key.
    """

    epochs: int = 1
    mini_batches: int = 1

    def __post_init__(self) -> None:
        for name, value in (("ppo_epochs", self.epochs), ("ppo_mini_batches", self.mini_batches)):
            if value < 1:
                raise ValueError(f"model.{name}={value} must be >= 1")

    @property
    def per_batch(self) -> int:
        """Optimizer updates per rollout batch (``epochs * mini_batches``)."""
        return self.epochs * self.mini_batches


@dataclass(frozen=True)
class RolloutGroups:
    """What the F22 check (:meth:`ATODModule.check_loss_terms`) knows of the training rollouts, handed over by
    :meth:`ATODModule.connect_data`.

    Attributes:
        group_size: episodes per task sharing a GRPO group (``data.init_args.group_size``); ``None``: unknown
            (a DataModule without groups), and the checks that need it are skipped.
        temperature: sampling temperature of the training rollouts (``data.init_args.temperature``); ``None``:
            unknown.
    """

    group_size: int | None = None
    temperature: float | None = None


@runtime_checkable
class CoefficientSchedule(Protocol):
    """What the F22 check reads of a callback that sets ``kappa`` or ``rho`` before every rollout batch
    (:class:`lightning_opd.callbacks.annealing.AnnealingSchedule` is one, and hands itself over through
    :meth:`ATODModule.set_kappa_schedule` / :meth:`ATODModule.set_rho_schedule`): the coefficient it drives, its
    value at every rollout iteration, the iteration after which it is constant, and how messages name it."""

    attribute: str
    start: float
    end: float
    horizon: int | None
    schedule_name: str

    def value_at(self, step: int) -> float:
        """The coefficient at rollout iteration ``step``."""


class ATODModule(OPDModule):
    """ATOD: on-policy distillation with a GRPO reward term, PPO updates and T-DUR turn weights (§3).

    The constructor takes ATOD's own knobs, by keyword; every other argument goes to
    :class:`~lightning_opd.learner.opd.OPDModule` unchanged (``**kwargs``), so its list is written once, there:
    the same ``model.init_args`` keys (``student``, ``teacher``, ``optimizer``, ``micro_batch_size``, ...), which the
    CLI resolves through ``super().__init__`` and lists in ``--help`` with OPDModule's descriptions.

    Args:
        loss: the clipped surrogate (default ``ClippedSurrogate()``, clip ε 0.2).
        kappa: κ, coefficient of the OPD term of the hybrid advantage (§3.1); 1 with ``rho = 0`` and one
            update per batch = the sampled-token OPD loss.
        rho: ρ, coefficient of the GRPO term; 0 = no reward signal.
        ppo_epochs: passes over each rollout batch (each pass: ``ppo_mini_batches`` optimizer updates).
        ppo_mini_batches: optimizer updates per pass, on contiguous row ranges of the batch.
        tdur: weight the OPD term by T-DUR turn weights (§3.3; never the GRPO term); costs one teacher pass
            per batch.
        reward: episode reward for the GRPO term (default ``EpisodeReward()``: 1 per won episode).
        advantage_eps: ε_A added to the group standard deviation (PROPOSED 1e-6).
        **kwargs: the arguments of :class:`~lightning_opd.learner.opd.OPDModule` (``student`` and ``teacher``
            required); ``aggregation="sequence"`` is the paper's per-sequence mean (docs/algorithms.md §0.5's
            option), each PPO mini-batch dividing by its own sequences.

    Raises:
        ValueError: a loss other than ``ClippedSurrogate``; a non-positive ``ppo_epochs`` or ``ppo_mini_batches``;
            a negative or non-finite ``kappa`` or ``rho``; a negative ``advantage_eps``; and everything
            :class:`~lightning_opd.learner.opd.OPDModule` refuses. At fit setup: F22 (:meth:`check_loss_terms`).
    """

    def __init__(self, *, loss: ClippedSurrogate | None = None, kappa: float = 1.0, rho: float = 0.0,
                 ppo_epochs: int = 1, ppo_mini_batches: int = 1, tdur: bool = False, reward: EpisodeReward | None = None,
                 advantage_eps: float = 1e-6, **kwargs: Any) -> None:
        self.ppo = PPOUpdates(ppo_epochs, ppo_mini_batches)
        if advantage_eps < 0:
            raise ValueError(f"model.advantage_eps={advantage_eps} must be >= 0")
        kappa, rho = _coefficient("kappa", kappa), _coefficient("rho", rho)
        super().__init__(loss=loss, **kwargs)
        self.kappa, self.rho, self.tdur = kappa, rho, tdur
        self.reward_fn = reward if reward is not None else EpisodeReward()
        self.advantage_eps = advantage_eps
        self._step_stats: dict[str, RankStat] = self._new_step_stats()  # of the current step, this rank (logged)
        #: the schedules of kappa/rho handed over for the next fit's F22 check (set_kappa_schedule, set_rho_schedule)
        self._schedules: dict[str, CoefficientSchedule] = {}
        #: the training rollouts' group size and temperature (connect_data), for the F22 check
        self.rollout_groups = RolloutGroups()

    # ----------------------------------------------------------------------------------- the objective
    @staticmethod
    def default_loss() -> TokenDivergence:
        """The loss when ``model.init_args.loss`` is not given: ``ClippedSurrogate()`` (clip ε 0.2)."""
        return ClippedSurrogate()

    def check_loss(self, loss: TokenDivergence) -> None:
        """Raises:
            ValueError: the loss is not ``ClippedSurrogate`` (the only loss that takes the hybrid advantages)."""
        if not isinstance(loss, ClippedSurrogate):
            raise ValueError(f"model.init_args.loss: ATODModule's hybrid objective needs loss "
                             f"lightning_opd.losses.ClippedSurrogate, got {type(loss).__name__} (for a plain "
                             "divergence use model.class_path=lightning_opd.learner.OPDModule)")

    @property
    def kappa(self) -> float:
        """κ, the OPD term's coefficient the next rollout batches train with (checked when set)."""
        return self._kappa

    @kappa.setter
    def kappa(self, value: float) -> None:
        self._kappa = _coefficient("kappa", value)

    @property
    def rho(self) -> float:
        """ρ, the GRPO term's coefficient the next rollout batches train with (checked when set)."""
        return self._rho

    @rho.setter
    def rho(self, value: float) -> None:
        self._rho = _coefficient("rho", value)

    def set_kappa(self, value: float) -> None:
        """Set κ for the next rollout batches (a schedule's value).

        Raises:
            ValueError: ``value`` negative or not finite (``model.kappa=...``).
        """
        self.kappa = value

    def set_rho(self, value: float) -> None:
        """Set ρ for the next rollout batches (a schedule's value).

        Raises:
            ValueError: ``value`` negative or not finite (``model.rho=...``).
        """
        self.rho = value

    def set_kappa_schedule(self, schedule: CoefficientSchedule) -> None:
        """Hand over the schedule that will set κ before every rollout batch of the next fit, for its F22 check at
        setup (``AnnealingSchedule`` calls this in its fit setup; the last one handed over wins, as it does for the
        values). The check consumes it.

        Raises:
            TypeError: ``schedule`` is not a :class:`CoefficientSchedule` of ``kappa``.
        """
        self._hand_over_schedule("kappa", schedule)

    def set_rho_schedule(self, schedule: CoefficientSchedule) -> None:
        """Hand over the schedule that will set ρ, like :meth:`set_kappa_schedule`.

        Raises:
            TypeError: ``schedule`` is not a :class:`CoefficientSchedule` of ``rho``.
        """
        self._hand_over_schedule("rho", schedule)

    def _hand_over_schedule(self, name: str, schedule: CoefficientSchedule) -> None:
        if not isinstance(schedule, CoefficientSchedule) or schedule.attribute != name:
            raise TypeError(f"set_{name}_schedule: expected a schedule of {name!r} (attribute, start, end, horizon, "
                            f"schedule_name, value_at), got {type(schedule).__name__} "
                            f"(attribute={getattr(schedule, 'attribute', None)!r})")  # getattr: any object may come
        self._schedules[name] = schedule

    def connect_data(self, datamodule) -> None:
        """Bind the DataModule (:meth:`PolicyModule.connect_data`) and take the training rollouts' group size
        (``group_size``) and temperature (``sampling.temperature``) from it into :attr:`rollout_groups` (each
        ``None`` where the DataModule has none), for the F22 check."""
        super().connect_data(datamodule)
        self.rollout_groups = RolloutGroups(  # getattr: a DataModule without GRPO groups or sampling has neither
            getattr(datamodule, "group_size", None), getattr(getattr(datamodule, "sampling", None), "temperature", None))

    @property
    def ppo_epochs(self) -> int:
        """Passes over each rollout batch (``model.init_args.ppo_epochs``)."""
        return self.ppo.epochs

    @property
    def ppo_mini_batches(self) -> int:
        """Optimizer updates per pass (``model.init_args.ppo_mini_batches``)."""
        return self.ppo.mini_batches

    @property
    def updates_per_batch(self) -> int:
        """Optimizer updates per rollout batch (``ppo_epochs * ppo_mini_batches``)."""
        return self.ppo.per_batch

    @property
    def needs_old_logprobs(self) -> bool:
        """The hybrid loss needs a collection-time pass for π_old (several updates per batch, or T-DUR)."""
        return self.updates_per_batch > 1 or self.tdur

    @property
    def needs_learner_logprobs(self) -> bool:
        return self.needs_old_logprobs or super().needs_learner_logprobs

    def setup(self, stage: str) -> None:
        """At ``fit`` setup (after the DataModule's and the callbacks' setup, so the DataModule is bound and every
        schedule has been handed over with its horizon known): refuse a knob combination that makes a loss term
        identically zero (F22, :meth:`check_loss_terms`), consuming the schedules handed over."""
        super().setup(stage)
        if stage == "fit":
            schedules, self._schedules = self._schedules, {}
            self.check_loss_terms(self.trainer.max_steps, schedules)

    def _coefficient_plan(self, max_steps: int | None,
                          schedules: dict[str, CoefficientSchedule]) -> dict[str, tuple[list[float], str]]:
        """``{"kappa": (values, key), "rho": (values, key)}``: the coefficient at every rollout iteration
        ``0..n`` after which nothing changes any more (the latest horizon of ``schedules``, the
        :class:`CoefficientSchedule` of each coefficient, capped by the iterations of a fit of ``max_steps``
        optimizer updates), and the configuration key that sets it (the schedule, which overrides the module's
        value, or ``model.init_args.<name>``)."""
        last = max((cb.horizon for cb in schedules.values()), default=0)
        if max_steps is not None and max_steps > 0:
            last = min(last, max(1, max_steps // self.updates_per_batch) - 1)
        plan = {}
        for name in ("kappa", "rho"):
            cb = schedules.get(name)
            if cb is None:
                value = float(self.kappa if name == "kappa" else self.rho)
                plan[name] = ([value] * (last + 1), f"model.init_args.{name}={value}")
            else:
                plan[name] = ([cb.value_at(s) for s in range(last + 1)],
                              f"the {cb.schedule_name} callback (trainer.callbacks: init_args.start={cb.start}, "
                              f"init_args.end={cb.end})")
        return plan

    def check_loss_terms(self, max_steps: int | None, schedules: dict[str, CoefficientSchedule] | None = None) -> None:
        """F22: refuse a configuration under which a term of the hybrid loss is identically zero. The rollouts'
        group size and temperature are those of :attr:`rollout_groups` (handed over by :meth:`connect_data`).

        Args:
            max_steps: the fit's ``trainer.max_steps`` (optimizer updates; ``None`` or <= 0: unbounded).
            schedules: ``{"kappa" | "rho": schedule}`` that set the coefficients before every rollout batch (what
                :meth:`set_kappa_schedule` / :meth:`set_rho_schedule` received); without one, the module's value.

        Refused, at any rollout iteration of the fit (schedules included, see :meth:`_coefficient_plan`):

        * ``rho > 0`` with ``data.group_size = 1``: every GRPO group is one episode, every advantage 0;
        * ``rho > 0`` with ``data.group_size > 1`` and ``data.temperature = 0``: greedy rollouts play every
          episode of a group (one task) the same way, so their rewards are equal and the advantages 0;
        * ``rho > 0`` with the default ``EpisodeReward`` and both of its weights 0: every reward is 0;
        * ``kappa = 0`` and ``rho = 0`` together: the advantage is 0 on every token, nothing to learn;
        * ``tdur`` with ``kappa = 0`` at every iteration: T-DUR weights only the OPD term, which is off.

        Raises:
            ValueError: naming both keys and the fix.
        """
        plan = self._coefficient_plan(max_steps, schedules or {})
        (kappas, kappa_key), (rhos, rho_key) = plan["kappa"], plan["rho"]
        group_size, temperature = self.rollout_groups.group_size, self.rollout_groups.temperature
        reward = self.reward_fn
        if any(r > 0 for r in rhos):
            if group_size == 1:
                raise ValueError(f"{rho_key} makes rho > 0 with data.init_args.group_size=1: every GRPO group holds "
                                 "one episode, so every advantage is exactly 0 and the rho term trains nothing; set "
                                 "data.init_args.group_size >= 2 (data.init_args.episodes_per_step a multiple of it) "
                                 "or rho = 0")
            if group_size is not None and temperature == 0:
                raise ValueError(f"{rho_key} makes rho > 0 with data.init_args.temperature=0: greedy rollouts play "
                                 f"the {group_size} episodes of a group alike, so their rewards are equal and every "
                                 "advantage is 0; set data.init_args.temperature > 0 or rho = 0")
            if type(reward) is EpisodeReward and reward.success_weight == 0 and reward.score_weight == 0:
                raise ValueError(f"{rho_key} makes rho > 0 with model.init_args.reward.init_args.success_weight=0 "
                                 "and model.init_args.reward.init_args.score_weight=0: every reward is 0, so every "
                                 "advantage is 0; give the reward a non-zero weight or set rho = 0")
        idle = [s for s, (k, r) in enumerate(zip(kappas, rhos)) if k == 0 and r == 0]
        if idle:
            raise ValueError(f"{kappa_key} and {rho_key} give kappa = 0 and rho = 0 at rollout iteration {idle[0]}: "
                             "the advantage is 0 on every token and the step learns nothing; keep kappa > 0 "
                             "(OPD term) or rho > 0 (GRPO term) at every iteration")
        if self.tdur and all(k == 0 for k in kappas):
            raise ValueError(f"model.init_args.tdur=true with {kappa_key}: T-DUR weights only the OPD term, which "
                             "kappa = 0 switches off; set tdur=false or kappa > 0")

    def advantage_inputs(self, batch: RolloutBatch) -> dict[str, torch.Tensor | None]:
        """``(b, T-1)`` per-token inputs of the hybrid loss for one (micro-)batch: ``opd_weight`` = κ · w_turn,
        ``grpo_term`` = ρ · Â (the episode's advantage on each of its tokens; T-DUR never enters it) and
        ``old_logprobs`` (``None``: π_old = sg(π_θ), one update per batch without T-DUR).

        Raises:
            RuntimeError: ``rho != 0`` but the batch has no advantages (:meth:`prepare_hybrid` not run).
        """
        shape = (batch.size, batch.input_ids.shape[1] - 1)
        dev = batch.input_ids.device
        w = batch.turn_weight[:, 1:] if batch.turn_weight is not None else torch.ones(shape, device=dev)
        if batch.advantage is None and self.rho != 0:
            raise RuntimeError("hybrid loss with rho != 0 on a batch without GRPO advantages: call prepare_hybrid first")
        adv = batch.advantage if batch.advantage is not None else torch.zeros(batch.size, device=dev)
        return {"opd_weight": float(self.kappa) * w.float(),
                "grpo_term": (float(self.rho) * adv.float())[:, None].expand(shape),
                "old_logprobs": batch.old_logprobs[:, 1:] if batch.old_logprobs is not None else None}

    def prepare_hybrid(self, batch: RolloutBatch, student_logprobs: torch.Tensor | None = None) -> RolloutBatch:
        """Stage I-II of ATOD (§3.4) for the whole batch, before its first update: rewards (checked, F13),
        group advantages (over every episode of the group in the batch: staleness filters drop groups
        whole, so a kept group is complete), old log-probs (the learner's, now; see ``ClippedSurrogate``)
        when :attr:`needs_old_logprobs`, and T-DUR weights from the old and teacher log-probs.

        Args:
            batch: the planned rollout batch.
            student_logprobs: ``(B, T-1)`` learner log-probs already computed this step (reused as π_old).

        Raises:
            RewardFunctionError: the reward function raised or returned the wrong count (F13).
        """
        rewards = compute_rewards(self.reward_fn, batch)
        groups = group_advantages(rewards, batch.group_id, self.advantage_eps)
        finite = torch.isfinite(rewards)
        stats: dict[str, RankStat] = {  # this rank's sums and counts (F27: reduced over ranks in step_extras)
            "grpo/reward_mean": Mean(float(rewards[finite].sum()), float(finite.sum()), empty=0.0),
            "grpo/groups": Sum(groups.groups), "grpo/equal_reward_groups": Sum(groups.equal_groups),
            "grpo/equal_reward_share": Mean(groups.equal_groups, groups.groups, empty=0.0),
            "grpo/invalid_rewards": Sum(groups.invalid_rewards), "grpo/invalid_groups": Sum(groups.invalid_groups)}
        out = replace(batch, advantage=groups.advantage.to(batch.input_ids.device))
        if self.needs_old_logprobs:
            old = student_logprobs if student_logprobs is not None else self.student_logprobs(batch)
            out = replace(out, old_logprobs=torch.cat([torch.zeros_like(old[:, :1]), old], dim=1))  # (B, T)
            if self.tdur:
                mask = batch.loss_mask[:, 1:]
                tw = tdur_weights(old, self.teacher_logprobs(batch), mask, batch.turn_index[:, 1:])
                w = tw.token_weight.float()
                out = replace(out, turn_weight=torch.cat([torch.ones_like(w[:, :1]), w], dim=1))
                present = tw.present & (mask.sum(1) > 0)[:, None]  # the (episode, turn) pairs of mean_weight
                stats["tdur/mean_weight"] = Mean(float(tw.turn_weight[present].sum()), float(present.sum()), empty=0.0)
        self._step_stats.update(stats)
        return out

    def mini_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """The batch's ``ppo_mini_batches`` contiguous row ranges (the batch itself when 1), always that many,
        empty ones included: every rank takes part in every update, whatever its rows (F19; the update's
        micro-batches are agreed in ``backward_step``)."""
        if self.ppo.mini_batches == 1:
            return [batch]
        idx = torch.arange(batch.size, device=batch.input_ids.device)
        return [batch.select(part) for part in torch.tensor_split(idx, self.ppo.mini_batches)]

    # ------------------------------------------------------------------------------ OPDModule's hooks
    def training_step(self, dataloader_iter):
        self._step_stats = self._new_step_stats()
        return super().training_step(dataloader_iter)

    @staticmethod
    def _new_step_stats() -> dict[str, RankStat]:
        """The ``ppo/`` statistics of a step before its first micro-batch, on every rank (the same keys on every
        rank, also one without supervised tokens: :meth:`step_extras` reduces them over ranks)."""
        return {"ppo/clip_frac": Mean(0.0, 0.0), "ppo/ratio_mean": Mean(0.0, 0.0),
                "ppo/ratio_min": Min(float("inf")), "ppo/ratio_max": Max(float("-inf"))}

    def prepare_batch(self, batch: RolloutBatch, student_logprobs: torch.Tensor | None) -> RolloutBatch:
        """:meth:`prepare_hybrid`: advantages, old log-probs and T-DUR, fixed for all updates of the batch."""
        return self.prepare_hybrid(batch, student_logprobs)

    def loss_inputs(self, batch: RolloutBatch) -> dict[str, torch.Tensor | None]:
        """:meth:`advantage_inputs` (the keyword inputs of ``ClippedSurrogate.token_terms``)."""
        return self.advantage_inputs(batch)

    def updates(self, batch: RolloutBatch) -> list[tuple[int, RolloutBatch]]:
        """``ppo_epochs`` passes over :meth:`mini_batches`."""
        return [(epoch, part) for epoch in range(self.ppo.epochs) for part in self.mini_batches(batch)]

    def after_micro_batch(self, micro_batch: RolloutBatch, out: TokenLoss, keep: torch.Tensor) -> None:
        """Accumulate the clip fraction and ratio statistics of one micro-batch (the ratios the loss saw,
        :meth:`~lightning_opd.losses.grpo.ClippedSurrogate.ratio_stats`)."""
        inputs = self.advantage_inputs(micro_batch)
        ratio, clipped = self.loss_fn.ratio_stats(out, **inputs)
        ratio, st = ratio[keep].double(), self._step_stats
        if ratio.numel():
            n = ratio.numel()
            st["ppo/clip_frac"] = Mean(st["ppo/clip_frac"].total + float(clipped[keep].sum()), st["ppo/clip_frac"].count + n)
            st["ppo/ratio_mean"] = Mean(st["ppo/ratio_mean"].total + float(ratio.sum()), st["ppo/ratio_mean"].count + n)
            st["ppo/ratio_min"] = Min(min(st["ppo/ratio_min"].value, float(ratio.min())))
            st["ppo/ratio_max"] = Max(max(st["ppo/ratio_max"].value, float(ratio.max())))

    def step_extras(self) -> dict[str, float]:
        """``grpo/*``, ``tdur/*`` and ``ppo/*`` of the step over all ranks' episodes, groups and tokens (sums and
        counts reduced, then divided: F27; collectives every rank reaches, with the same keys on every rank),
        ``train/kappa``, ``train/rho``. The ``ppo/`` ratio statistics are left out when no rank had a supervised
        token."""
        values = all_ranks(self._step_stats, self.reduce_sum, self.reduce_max, self.device)
        values = {k: v for k, v in values.items() if not (k.startswith("ppo/") and v != v)}  # NaN: no token anywhere
        values.update({"train/kappa": float(self.kappa), "train/rho": float(self.rho),
                       "ppo/updates": float(self.updates_per_batch)})
        return values
