"""``StepMetrics``: what :class:`~lightning_opd.learner.opd.OPDModule` logs every training step, with its
metric glossary. A component the module creates in ``__init__`` (its state: the per-turn KL metric and how
many per-turn keys the fit has logged so far).

Metric glossary (logged every step):

| key | unit | reduction |
|---|---|---|
| ``train/loss`` | nats | step loss (§0.5) |
| ``train/kl`` | nats/token | mean exact reverse KL over supervised tokens (whatever the loss), with a teacher that provides ``FULL_VOCAB`` |
| ``kl/turn_NN`` | nats/token | mean over supervised tokens of turn NN (zero-based), token-weighted across ranks; NaN at a step where no episode reached turn NN (after some step did). Student turns only: a turn the teacher played (teacher intervention) has no supervised token, so it is in no ``kl/turn_NN`` (turn NN counts every turn played, both roles) |
| ``train/kl_sampled``, ``kl_sampled/turn_NN`` | nats/token | instead of ``train/kl``, ``kl/turn_NN`` with a teacher without ``FULL_VOCAB`` (a remote endpoint): the same means of the k1 estimate ``log p_S(a_t) - log p_T(a_t)`` of the reverse KL (docs/algorithms.md §6.5) |
| ``train/entropy`` | nats/token | mean student entropy over supervised tokens |
| ``train/grad_norm`` | - | global L2 norm before clipping |
| ``train/lr`` | - | learning rate |
| ``train/supervised_tokens`` | tokens | per step, all ranks |
| ``train/nonfinite_steps_skipped`` | optimizer updates | updates skipped so far in this fit (resumed runs included) because the loss or a gradient was not finite (F28) |
| ``train/kl_k1`` | nats/token | mean over supervised tokens of the sampled-token estimate ``log p_S(a_t) - log p_T(a_t)`` at learner time |
| ``train/off_policy_gap`` | nats/token | ``train/kl - train/kl_k1`` (a teacher with ``FULL_VOCAB``): the off-policy indicator, about 0 on-policy, growing with the drift between the sampling and the learning policy (docs/algorithms.md §7.1); not logged with a served teacher (no exact KL there: ``train/ratio_mean`` and ``rollout/lag_*`` are its signals) |
| ``train/off_policy_gap_corrected`` | nats/token | with the truncated ratio on: ``train/kl`` minus the ratio-weighted estimate ``sum r_t k1_t / N`` |
| ``train/ratio_mean``, ``train/ratio_clip_frac`` | -, fraction | with the truncated ratio on: mean ``sg(min(pi_old/pi_b, C))`` over the step's supervised tokens (all updates), share at the cap C |
| ``train/truncated_ratio``, ``train/uncorrected_off_policy`` | 0/1 | the ratio is applied; a sampled-token loss trains on possibly stale tokens without it (``model.init_args.off_policy.allow_uncorrected``) |
| ``train/applied_updates`` | optimizer updates | applied in the step (0: every update skipped; the step then ages no batch, §7.2) |
| ``train/samples_per_update`` | episodes | samples with supervised tokens that reached an applied update's loss, per applied update (0 when none) |
| ``rollout/*`` | see ``lightning_opd.rollout.batch.rollout_stats`` | per batch: means over all ranks' episodes (sums and counts reduced, F27); ``env_errors`` summed |
| ``rollout/teacher_turns``, ``rollout/takeovers`` | turns, fraction | teacher intervention (``data.init_args.intervention``): mean turns per episode the teacher played, fraction of episodes a takeover handed to the teacher (0 without intervention) |
| ``rollout/teacher_turn_share`` | fraction | teacher turns / all turns played, all ranks' episodes (0 when no turn) |
| ``train/teacher_turn_loss``, ``train/teacher_turn_tokens`` | nats/token, tokens | with ``model.init_args.teacher_turn_loss`` on: mean term (cross-entropy or forward KL) over the step's teacher-sampled tokens, all ranks, and their count (:mod:`lightning_opd.learner.teacher_turns`) |
| ``rollout/lag_max`` | applied updates | max over all ranks' batches of learner version - behaviour version, counting only the steps that applied an update between them (a step whose every update was skipped is not counted, docs/algorithms.md §7.2) |
| ``rollout/lag_mean``, ``rollout/lag_min`` | applied updates | mean / min over all ranks' episodes with a reply of the lag the step trains them at (learner version - the oldest version that played the episode); NaN when no episode has a reply |
| ``rollout/producer_lead`` | policy versions | async only (``data.init_args.mode=async``): the producer lead in force when the step asked for its batch (the staleness monitor's producer-side control lowers it; 0 = synchronous fallback) |
| ``timing/rollout_s``, ``timing/update_s`` | seconds | per step |
| ``turn/survivors_NN`` | episodes | episodes of the step (all ranks) still running at turn NN (TurnOPD §4); 0 once none reach it |
| ``turn/token_share_NN``, ``turn/loss_share_NN`` | fraction | turn NN's share of supervised tokens / of ``sum m w l`` |
| ``train/kappa``, ``train/rho`` | - | ATODModule only: the coefficients the step trained with |
| ``grpo/reward_mean`` | reward units | mean episode reward over all ranks' episodes with a finite reward |
| ``grpo/groups``, ``grpo/equal_reward_groups`` | groups | groups in the batch / of them with all rewards equal (advantage 0), all ranks |
| ``grpo/equal_reward_share`` | fraction | ``equal_reward_groups / groups``: the share of groups with no GRPO signal |
| ``grpo/invalid_rewards``, ``grpo/invalid_groups`` | episodes, groups | non-finite rewards and their groups (advantage 0, F13 fallback), all ranks |
| ``ppo/clip_frac`` | fraction | supervised tokens in the clipped region, over all updates of the step and all ranks |
| ``ppo/ratio_mean``, ``ppo/ratio_min``, ``ppo/ratio_max`` | - | importance ratio pi_theta/pi_old over the same tokens |
| ``ppo/updates`` | optimizer updates | per rollout batch (``ppo_epochs * ppo_mini_batches``) |
| ``tdur/mean_weight`` | - | mean T-DUR turn weight over all ranks' (episode, turn) pairs (with ``tdur``) |
| ``teacher/<name>/token_share``, ``teacher/<name>/kl_sampled`` | fraction, nats/token | several teachers (``RoutedTeacher``): each teacher's share of the step's supervised tokens and mean KL on them, all ranks |
| ``teacher/[<name>/]requests``, ``rows``, ``prompt_tokens``, ``seconds``, ``retries``, ``bytes_sent``, ``bytes_received`` | count, tokens, seconds, bytes | a served teacher (``RemoteTeacher``): running totals of this rank's requests since the fit started |

Every mean over episodes or tokens is the mean over all data-parallel ranks' episodes or tokens: each
rank's sum and count are summed over ranks, then divided (:mod:`lightning_opd.metrics.rank_stats`, F27).
``timing/*`` are this rank's (the logger writes rank 0's).

With several updates per batch, ``train/loss`` and ``train/grad_norm`` are means over the updates and
``train/kl``, ``train/entropy`` means over all updates' supervised tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_opd.metrics.per_turn import PerTurnMean
from lightning_opd.metrics.rank_stats import Max, Mean, Min, RankStat, Sum, all_ranks
from lightning_opd.metrics.turn_stats import TurnStats
from lightning_opd.rollout.batch import ROLLOUT_COUNTS, RolloutBatch, rollout_sums


@dataclass
class StepRecord:
    """What one training step measured, handed to :meth:`StepMetrics.log_step`.

    Attributes:
        batch: the (planned) rollout batch of the step.
        sums: detached sums on this rank: ``loss`` (nats), ``kl`` and ``entropy`` (summed over supervised tokens).
        step_tokens: supervised tokens of the step on all ranks (tokens).
        grad_norm: global gradient L2 norm before clipping (mean over the step's updates).
        lag_max: largest lag of the batch on this rank (policy versions).
        rollout_s, update_s: seconds spent waiting for the batch and training on it.
        turn_stats: the step's per-sample, per-turn sums on this rank (first epoch's updates).
        extra: further scalars of the step (e.g. ATOD's ``grpo/*``, ``ppo/*``), logged as they are (already
            reduced over ranks).
        nonfinite_skipped: optimizer updates skipped so far because the loss or a gradient was not finite (F28).
        kl_name: what ``sums["kl"]`` holds, the metric's name: ``"kl"`` (exact reverse KL) or ``"kl_sampled"`` (its
            k1 estimate, a teacher without ``FULL_VOCAB``), logged as ``train/<kl_name>`` and ``<kl_name>/turn_NN``.
        lags: ``(B,)`` lag of each row on this rank at this step (policy versions; ``-1``: a row without a reply),
            logged as ``rollout/lag_mean`` and ``rollout/lag_min``; ``None``: not logged.
        lead_in_use: the producer lead in force when the step asked for its batch (policy versions; async only; the
            weight sync's), logged as ``rollout/producer_lead``; ``None``: not logged.
    """

    batch: RolloutBatch
    sums: dict[str, torch.Tensor]
    step_tokens: torch.Tensor
    grad_norm: torch.Tensor
    lag_max: int
    rollout_s: float
    update_s: float
    turn_stats: TurnStats
    extra: dict[str, float] = field(default_factory=dict)
    nonfinite_skipped: int = 0
    kl_name: str = "kl"
    lags: torch.Tensor | None = None
    lead_in_use: int | None = None


class StepMetrics(torch.nn.Module):
    """Logs the scalars of one training step (the glossary above), the per-turn KL (:attr:`turn_kl`, fed by
    the module's backward pass), TurnOPD's per-turn shares and, every ``log_text_every_n_steps``, one sample
    episode as TensorBoard text.

    Args:
        max_logged_turns: number of ``kl/turn_NN`` keys tracked (turns).
        log_text_every_n_steps: write one sample episode to TensorBoard text every N steps (0: never).

    Raises:
        ValueError: ``max_logged_turns < 1``.
    """

    def __init__(self, max_logged_turns: int = 16, log_text_every_n_steps: int = 10) -> None:
        super().__init__()
        if max_logged_turns < 1:
            raise ValueError(f"model.max_logged_turns={max_logged_turns} must be >= 1")
        self.turn_kl = PerTurnMean(max_logged_turns)
        self.log_text_every_n_steps = log_text_every_n_steps
        self.turn_keys_logged = 0  # 1 + the deepest turn logged in this fit so far
        #: episodes generated for / used by (reached the loss) the steps so far, all ranks (:meth:`log_rollout_counts`;
        #: the module saves them in checkpoints as ``rollout_totals``)
        self.rollout_totals = {"generated": 0, "used": 0}

    @property
    def num_turns(self) -> int:
        """Turns tracked per sample (``max_logged_turns``)."""
        return self.turn_kl.num_turns

    def log_step(self, module: L.LightningModule, record: StepRecord) -> None:
        """Log ``record`` through ``module.log`` (every rank: the per-turn metric and the turn shares are
        reduced over ranks, collectives every rank reaches)."""
        batch = record.batch
        n = max(1, batch.size)
        tokens = record.step_tokens.clamp(min=1)
        scalars = {
            "train/loss": module.reduce_sum(record.sums["loss"]),
            f"train/{record.kl_name}": module.reduce_sum(record.sums["kl"]) / tokens,
            "train/entropy": module.reduce_sum(record.sums["entropy"]) / tokens,
            "train/grad_norm": record.grad_norm.detach().float(),
            "train/lr": torch.tensor(module.optimizers().param_groups[0]["lr"]),
            "train/supervised_tokens": record.step_tokens.float(),
            "train/policy_version": torch.tensor(float(module.policy_version)),
            "train/nonfinite_steps_skipped": torch.tensor(float(record.nonfinite_skipped)),
            "timing/rollout_s": torch.tensor(record.rollout_s),
            "timing/update_s": torch.tensor(record.update_s),
        }
        scalars.update({k: torch.tensor(v) for k, v in self._rollout_values(module, record).items()})
        for key, value in scalars.items():
            module.log(key, value, batch_size=n, prog_bar=key in ("rollout/success", "train/kl", "train/kl_sampled"))
        turn = self.turn_kl.compute()
        reached = turn["weight"] > 0  # synced: the same on every rank
        nan = torch.full((), float("nan"), device=turn["mean"].device)
        for t in range(self._turn_keys(reached)):
            module.log(f"{record.kl_name}/turn_{t:02d}", turn["mean"][t].float() if reached[t] else nan, batch_size=n)
        self.turn_kl.reset()
        self._log_turn_shares(module, record.turn_stats, n)
        for key, value in record.extra.items():
            module.log(key, float(value), batch_size=n)
        every = self.log_text_every_n_steps
        if every and (module.policy_version - 1) % every == 0 and module.trainer.is_global_zero:
            self._log_episode_text(module, batch)

    @staticmethod
    def _rollout_values(module: L.LightningModule, record: StepRecord) -> dict[str, float]:
        """``rollout/*`` over all ranks' episodes (F27): this rank's sums and episode count reduced, then
        divided (0 when no rank has an episode, as :func:`~lightning_opd.rollout.batch.rollout_stats`);
        ``rollout/env_errors`` summed, ``rollout/lag_max`` the maximum; with ``record.lags``, ``rollout/lag_mean`` and
        ``rollout/lag_min`` over the episodes with a reply (NaN when no rank has one); with ``record.lead_in_use``,
        ``rollout/producer_lead``. Collectives every rank reaches."""
        trajs = record.batch.trajectories
        sums = rollout_sums(trajs)
        stats: dict[str, RankStat] = {f"rollout/{k}": Sum(v) if k in ROLLOUT_COUNTS else Mean(v, len(trajs), empty=0.0)
                                      for k, v in sums.items()}
        # teacher intervention: the share of turns the teacher played, over all ranks
        stats["rollout/teacher_turn_share"] = Mean(sums["teacher_turns"], sums["turns"], empty=0.0)
        stats["rollout/lag_max"] = Max(float(record.lag_max))
        if record.lags is not None:  # the rows with a reply (lag >= 0): the same keys on every rank
            lags = record.lags[record.lags >= 0].double()
            stats["rollout/lag_mean"] = Mean(float(lags.sum()), float(lags.numel()))
            stats["rollout/lag_min"] = Min(float(lags.min()) if lags.numel() else math.inf)
        values = all_ranks(stats, module.reduce_sum, module.reduce_max, module.device)
        if record.lead_in_use is not None:  # the weight sync's, the same on every rank
            values["rollout/producer_lead"] = float(record.lead_in_use)
        return values

    def log_rollout_counts(self, module: L.LightningModule, batch: RolloutBatch) -> dict[str, int]:
        """Log the step's rollouts through ``module.log``, summed over data-parallel ranks (``module.reduce_sum``, a
        collective): ``rollouts/generated`` (episodes played for the batch this step trained on), ``rollouts/used``
        (those with supervised tokens left after the freshness filter M2, i.e. that reached the loss) and the running
        totals ``rollouts/generated_total`` and ``rollouts/used_total`` (:attr:`rollout_totals`). The producer
        discards no batch (docs/algorithms.md §1.5.1), so generated - used = M2's drops + episodes without a reply
        (context full before the first turn); async batches still buffered when fit ends were never trained on and
        are not counted.

        Args:
            module: the learner (``reduce_sum``, ``device``, ``log``).
            batch: the step's batch after its plan (dropped samples have an all-zero loss mask).

        Returns:
            the four values logged (episodes).
        """
        counts = torch.tensor([batch.size, int((batch.loss_mask[:, 1:].sum(1) > 0).sum())], device=module.device)
        generated, used = (int(x) for x in module.reduce_sum(counts).tolist())
        self.rollout_totals = {"generated": self.rollout_totals["generated"] + generated,
                               "used": self.rollout_totals["used"] + used}
        values = {"rollouts/generated": generated, "rollouts/used": used,
                  "rollouts/generated_total": self.rollout_totals["generated"],
                  "rollouts/used_total": self.rollout_totals["used"]}
        for key, value in values.items():
            module.log(key, float(value), batch_size=max(1, batch.size))
        return values

    def _log_turn_shares(self, module: L.LightningModule, stats: TurnStats, n: int) -> None:
        """TurnOPD §4 diagnostics, summed over ranks: ``turn/survivors_NN`` (episodes still running at
        turn NN), ``turn/token_share_NN`` (share of the step's supervised tokens) and
        ``turn/loss_share_NN`` (share of the step loss's numerator ``sum m w l``)."""
        survivors = module.reduce_sum(stats.survivors().to(module.device))
        tokens = module.reduce_sum(stats.tokens.sum(0))
        loss = module.reduce_sum(stats.loss_sum.sum(0))
        token_total, loss_total = tokens.sum(), loss.sum()
        for t in range(self._turn_keys(survivors > 0)):  # reduced: the same key set on every rank
            module.log(f"turn/survivors_{t:02d}", survivors[t].float(), batch_size=n)
            module.log(f"turn/token_share_{t:02d}", (tokens[t] / token_total.clamp(min=1)).float(), batch_size=n)
            share = loss[t] / loss_total if loss_total != 0 else torch.zeros((), dtype=loss.dtype, device=loss.device)
            module.log(f"turn/loss_share_{t:02d}", share.float(), batch_size=n)

    def _turn_keys(self, reached: torch.Tensor) -> int:
        """How many per-turn keys to log this step: ``1 + `` the deepest turn reached in this fit so far.

        ``reached`` is the step's ``(H,)`` bool "some episode reached turn t". Lightning keeps an on-step
        value in its result collection until the epoch ends and hands it to the loggers at every later
        step, so a per-turn key, once logged, is rewritten at every step: NaN KL (no tokens: the mean is
        undefined) and 0 survivors and shares when no episode reached the turn, never last step's value.
        """
        deepest = int(reached.nonzero().max()) + 1 if bool(reached.any()) else 0
        self.turn_keys_logged = max(self.turn_keys_logged, deepest)
        return min(self.turn_keys_logged, reached.numel())

    @staticmethod
    def _log_episode_text(module: L.LightningModule, batch: RolloutBatch) -> None:
        loggers = [lg for lg in module.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers or not batch.trajectories:
            return
        t = batch.trajectories[0]
        head = (f"task `{t.task_id}` | success {t.success} | reward {t.total_reward} | turns {t.num_turns} | "
                f"invalid {t.invalid_actions} | versions {list(t.policy_versions)}")
        body = "\n\n".join(f"**{m['role']}**: {m['content']}" for m in t.messages)
        for lg in loggers:
            lg.experiment.add_text("rollout/episode", head + "\n\n" + body, global_step=module.policy_version)
