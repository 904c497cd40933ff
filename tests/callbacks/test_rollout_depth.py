"""RolloutDepthController (TurnOPD §5.1, docs/algorithms.md §2.3/§2.5) on scripted TurnStats: centroid,
quantile, pooling over W probe batches, EMA, clip, censoring, the no-success case, ranks, state."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.callbacks.rollout_depth import RolloutDepthController, depth_quantile, kl_centroid, round_half_up
from lightning_opd.data import RolloutDataModule
from lightning_opd.metrics.turn_stats import TurnStats
from lightning_opd.rollout.scripted import ScriptedGenerator
from tests.helpers import KeywordEnvFactory


class Strategy:
    """One process; ``others`` adds other ranks' vectors to the reduction (a simulated all-reduce)."""

    def __init__(self, others=()):
        self.others = list(others)

    def reduce(self, x, reduce_op):
        assert reduce_op == "sum"
        return x + sum(self.others) if self.others else x

    def broadcast(self, obj, src=0):
        return obj


class Trainer:
    def __init__(self, dm, strategy=None):
        self.datamodule, self.strategy = dm, strategy or Strategy()


class Module:
    def __init__(self):
        self.logged = {}

    def log(self, key, value, batch_size):
        self.logged[key] = value


def _dm(tokenizer, max_turns=8):
    return RolloutDataModule(env=KeywordEnvFactory(), generator=ScriptedGenerator(tokenizer, lambda r: "x"),
                             max_turns=max_turns)


def row(n, win=False, probe=True, kl=None):
    """One episode: ``n`` turns of 2 supervised tokens, per-token KL ``kl[t]`` (default: 1 at turn 0 only)."""
    return {"n": n, "win": win, "probe": probe, "kl": kl if kl is not None else [1.0] + [0.0] * (n - 1)}


def stats(rows, h=8):
    kl, tok = torch.zeros(len(rows), h, dtype=torch.float64), torch.zeros(len(rows), h, dtype=torch.float64)
    for i, r in enumerate(rows):
        for t in range(min(r["n"], h)):
            kl[i, t], tok[i, t] = 2 * r["kl"][t], 2
    return TurnStats(kl_sum=kl, loss_sum=kl.clone(), tokens=tok, num_turns=torch.tensor([r["n"] for r in rows]),
                     success=torch.tensor([float(r["win"]) for r in rows]),
                     is_probe=torch.tensor([r["probe"] for r in rows]),
                     rollout_cap=torch.tensor([8 if r["probe"] else 3 for r in rows]),
                     kept=torch.tensor([r.get("kept", True) for r in rows]))


def _setup(tokenizer, max_turns=8, **kw):
    ctrl, dm, module = RolloutDepthController(**kw), _dm(tokenizer, max_turns), Module()
    trainer = Trainer(dm)
    ctrl.setup(trainer, module, "fit")
    return ctrl, dm, module, trainer


def _step(ctrl, trainer, module, rows, h=8):
    ctrl.on_train_batch_end(trainer, module, {"loss": torch.zeros(()), "turn_stats": stats(rows, h)}, None, 0)
    return ctrl.h_eff, ctrl.h_cov, ctrl.h_bar, ctrl.cap


# -------------------------------------------------------------------------------------------- formulas
def test_kl_centroid_by_hand():
    # K = [1, -1 -> 0, 3, 0/0 -> 0]; m = K+ * n_t/n_0 = [1, 0, 1.5, 0]; centroid = (2 * 1.5) / 2.5
    c = kl_centroid(torch.tensor([2.0, -1.0, 3.0, 0.0]), torch.tensor([2.0, 1.0, 1.0, 0.0]),
                    torch.tensor([2.0, 2.0, 1.0, 0.0]), n0=2)
    assert c == pytest.approx(1.2, abs=1e-6)
    assert kl_centroid(torch.zeros(3), torch.ones(3), torch.ones(3), n0=1) == 0.0  # no KL: centroid 0


@pytest.mark.parametrize(("hist", "p", "expected"), [
    ([0, 2, 3, 4, 1], 0.8, 3),  # cumulative 0, 2, 5, 9 >= 8
    ([0, 2, 3, 4, 1], 0.5, 2),  # 5 >= 5
    ([0, 2, 3, 4, 1], 1.0, 4),
    ([2, 1, 1, 1, 5], 0.8, 4),  # 5 of 10 at depth <= 3 < 8
    ([1], 0.8, 0),
])
def test_depth_quantile_by_hand(hist, p, expected):
    assert depth_quantile(hist, p) == expected


def test_round_half_up():
    assert [round_half_up(x) for x in (0.5, 1.49, 1.5, 2.5, 2.55)] == [1, 1, 2, 3, 3]


# -------------------------------------------------------------------------------------------- controller
def test_state_key_and_validation():
    assert RolloutDepthController().state_key == "RolloutDepthController{'h_min': 2, 'warmup': 3, 'probe_interval': 8}"
    for kw, bad in (({"h_min": 0}, "h_min=0"), ({"probe_interval": 0}, "probe_interval=0"), ({"window": 0}, "window=0"),
                    ({"quantile": 1.5}, "quantile=1.5"), ({"ema": 0.0}, "ema=0.0"), ({"cdf": "half"}, "cdf='half'"),
                    ({"warmup": -1}, "warmup=-1"), ({"eps": 0}, "eps=0"),
                    ({"solved_floor_quantile": 0.0}, "solved_floor_quantile=0.0"),
                    ({"solved_floor_quantile": 1.5}, "solved_floor_quantile=1.5"),
                    ({"solved_floor_quantile": True}, "solved_floor_quantile=True"),
                    ({"solved_floor": True}, "solved_floor=True")):
        with pytest.raises(ValueError, match=bad):
            RolloutDepthController(**kw)
    assert RolloutDepthController(solved_floor=False).solved_floor_quantile is None  # old configs' "off" still load


def test_setup_reads_h_max_once_and_sets_the_probe_schedule(tokenizer):
    ctrl, dm, _, trainer = _setup(tokenizer, max_turns=8)
    assert ctrl.h_max == 8 and ctrl.cap == 8 and dm.max_turns == 8
    assert dm.sampler.probe_schedule == (3, 8, 8)
    assert [k for k in range(20) if dm.sampler.is_probe_batch(k)] == [0, 1, 2, 8, 16]
    dm.set_max_turns(3)  # the controller's own later changes never feed back into H_max
    ctrl.setup(trainer, Module(), "fit")
    assert ctrl.h_max == 8
    with pytest.raises(ValueError, match="h_min=5 is above the DataModule's max_turns=4"):
        _setup(tokenizer, max_turns=4, h_min=5)


def test_survivor_weighted_centroid_sets_the_first_cap(tokenizer):
    ctrl, dm, module, trainer = _setup(tokenizer)
    # K = [1, .5, .5, 2], n = [4, 4, 2, 1] of 4: m = [1, .5, .25, .5]; centroid 2.5/2.25 = 1.11 -> 1
    rows = [row(4, kl=[1, .5, .5, 2]), row(3, kl=[1, .5, .5]), row(2, kl=[1, .5]), row(2, kl=[1, .5])]
    assert _step(ctrl, trainer, module, rows) == (1, None, 1.0, 2)  # H̄ = H_eff (no H_cov); cap 1 + 1
    assert dm.max_turns == 2
    assert module.logged["controller/probe"] == 1.0 and module.logged["controller/h_eff"] == 1.0
    assert "controller/h_cov" not in module.logged


def test_probe_rows_dropped_by_a_filter_are_ignored(tokenizer):
    """A probe a weighting filter dropped (``kept`` False: no tokens reached the loss) counts neither in
    n_0 nor in the survivors: the decision equals the one without that row."""
    rows = [row(4, kl=[1, .5, .5, 2]), row(3, kl=[1, .5, .5]), row(2, kl=[1, .5]), row(2, kl=[1, .5])]
    dropped = dict(row(8, kl=[0, 0, 0, 0, 0, 0, 0, 9]), kept=False)
    ctrl_a, _, module_a, trainer_a = _setup(tokenizer)
    ctrl_b, _, module_b, trainer_b = _setup(tokenizer)
    assert _step(ctrl_a, trainer_a, module_a, rows + [dropped]) == _step(ctrl_b, trainer_b, module_b, rows) == (1, None, 1.0, 2)


FAIL8 = [row(8)] * 4
# (rows, expected (H_eff, H_cov, H̄, Ĥ), successes pooled); H_max 8, W 4, p 0.8, α 0.3
TABLE = [
    # depths 2, 2, 3, 4: 4 successes < 8, H_cov unset; H̄ = 0, cap clip(0 + 1, 2, 8) = 2
    ([row(3, True), row(3, True), row(4, True), row(5, True)], (0, None, 0.0, 2), 4),
    # + depths 4, 4, 5, 5: 8 pooled {2:2, 3:1, 4:3, 5:2}; F >= .8 first at 5; H̄ = .3 * 5 = 1.5 -> 2, cap 3
    ([row(5, True), row(5, True), row(6, True), row(6, True)], (0, 5, 1.5, 3), 8),
    # a non-probe (capped, censored) batch full of deep successes: ignored
    ([row(3, True, probe=False, kl=[0, 0, 9])] * 4, (0, 5, 1.5, 3), 8),
    # failures: the window still holds 8 successes; H̄ = .7 * 1.5 + .3 * 5 = 2.55 -> 3, cap 4
    (FAIL8, (0, 5, 2.55, 4), 8),
    (FAIL8, (0, 5, 3.285, 4), 8),
    # W = 4: the first batch leaves the window, 4 successes: keep H_cov; H̄ = 3.7995 -> 4, cap 5
    (FAIL8, (0, 5, 3.7995, 5), 4),
    # KL on the last turn: H_eff 7 > H_cov; H̄ = .7 * 3.7995 + .3 * 7 = 4.75965 -> 5, cap 6
    ([row(8, kl=[0] * 7 + [1])] * 4, (7, 5, 4.75965, 6), 0),
]


def test_table_centroid_quantile_pooling_ema_clip_and_censoring(tokenizer):
    ctrl, dm, module, trainer = _setup(tokenizer, cdf="success", solved_floor=False)  # the paper's rule alone
    for i, (rows, (h_eff, h_cov, h_bar, cap), pooled) in enumerate(TABLE):
        got = _step(ctrl, trainer, module, rows)
        assert got[:2] == (h_eff, h_cov) and got[2] == pytest.approx(h_bar) and got[3] == cap, i
        assert dm.max_turns == cap and ctrl.successes_pooled == pooled, i
        assert module.logged["controller/probe"] == float(rows[0]["probe"]), i
        assert module.logged["controller/cap"] == cap and module.logged["controller/successes_pooled"] == pooled


def test_cap_is_clipped_to_h_max(tokenizer):
    ctrl, dm, module, trainer = _setup(tokenizer, max_turns=4)
    assert _step(ctrl, trainer, module, [row(8, kl=[0] * 7 + [1])] * 2) == (7, None, 7.0, 4)
    assert dm.max_turns == 4


@pytest.mark.parametrize(("cdf", "expected"), [("success", (0, None, 0.0, 2)), ("full", (0, 3, 0.9, 2))])
def test_no_success_keeps_h_cov_unset_unless_full_cdf(tokenizer, cdf, expected):
    ctrl, _, module, trainer = _setup(tokenizer, cdf=cdf, full_quantile=0.5)
    batch = [row(2), row(4), row(4), row(8)]  # depths 1, 3, 3, 7, all failures
    assert _step(ctrl, trainer, module, batch) == (0, None, 0.0, 2)  # 4 trajectories < 8 either way
    # 8 pooled {1:2, 3:4, 7:2}: full CDF >= .5 first at 3; H̄ = .3 * 3 = .9
    got = _step(ctrl, trainer, module, batch)
    assert got[:2] == expected[:2] and got[2] == pytest.approx(expected[2]) and got[3] == expected[3]


def test_defaults_are_the_papers_rule_without_a_floor():
    """docs/algorithms.md §6.1: success CDF only, no solved-depth floor, unless asked for."""
    ctrl = RolloutDepthController()
    assert ctrl.cdf == "success" and ctrl.solved_floor_quantile is None


def _kl_at(n, t):
    """Per-token KL 1 at turn ``t`` only, over ``n`` turns (all 0 if the episode ends before turn t)."""
    return [1.0 if i == t else 0.0 for i in range(n)]


# Issue 39's pool, H_max = 12 (the quest-3 runs), three probe batches, all in the window (W = 4):
#   probe 1: 4 failures at 12 turns, KL on turn 4 only: H_eff = 4, no win
#   probe 2: 6 wins of 2, 3, 3, 4, 4, 4 turns (depths 1, 2, 2, 3, 3, 3), KL on turn 3 only: H_eff = 3
#   probe 3: 6 wins of 2, 3, 3, 4, 4, 11 turns (depths 1, 2, 2, 3, 3, 10), KL on turn 3 only: H_eff = 3
# pooled wins after probe 3: {1: 2, 2: 4, 3: 5, 10: 1} = 12 wins, 11 of them at depth <= 3, one at 10.
ISSUE39 = [[row(12, kl=_kl_at(12, 4))] * 4,
           [row(n, True, kl=_kl_at(n, 3)) for n in (2, 3, 3, 4, 4, 4)],
           [row(n, True, kl=_kl_at(n, 3)) for n in (2, 3, 3, 4, 4, 11)]]


@pytest.mark.timeout(60)
def test_one_long_win_does_not_lift_the_default_cap(tokenizer):
    """Issue 39 item 1: the paper's rule (the default) by hand, p = 0.8, α = 0.3, H_min = 2, H_max = 12:
    probe 1: no win, H_cov unset: H_ctrl = H_eff = 4; H̄ = 4 (first probe); cap clip(round(4) + 1) = 5
    probe 2: 6 wins < 8: H_cov unset: H_ctrl = 3; H̄ = .7 * 4 + .3 * 3 = 3.7; cap round(3.7) + 1 = 5
    probe 3: 12 wins >= 8: F_succ at depth 1, 2, 3 = 2/12, 6/12, 11/12 >= .8 first at 3: H_cov = 3;
             H_ctrl = max(3, 3) = 3; H̄ = .7 * 3.7 + .3 * 3 = 3.49; cap round(3.49) + 1 = 4, in [2, 12]: 4.
    The old defaults (solved_floor: true = the deepest pooled win) floored probe 3's cap at 10 + 1 = 11."""
    ctrl, dm, module, trainer = _setup(tokenizer, max_turns=12)
    got = [_step(ctrl, trainer, module, rows, h=12) for rows in ISSUE39]
    assert [g[3] for g in got] == [5, 5, 4] and dm.max_turns == 4
    for (h_eff, h_cov, h_bar, cap), expected in zip(got, [(4, None, 4.0, 5), (3, None, 3.7, 5), (3, 3, 3.49, 4)]):
        assert (h_eff, h_cov, cap) == expected[:2] + expected[3:] and h_bar == pytest.approx(expected[2])
    assert ctrl.successes_pooled == 12


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kw", "caps"), [
    ({}, [5, 5, 4]),                                    # no floor: the paper's rule (above)
    ({"solved_floor_quantile": 0.5}, [5, 5, 4]),        # Q_.5: cum 2, 6 >= 6 at depth 2: floor 3 < 4
    ({"solved_floor_quantile": 0.9}, [5, 5, 4]),        # Q_.9: 10.8 first reached at depth 3 (cum 11): floor 4
    ({"solved_floor_quantile": 0.95}, [5, 5, 11]),      # Q_.95: 11.4 > 11, only the 12th win: depth 10, floor 11
    ({"solved_floor_quantile": 1.0}, [5, 5, 11]),       # Q_1 = the deepest win: floor 11 (the old floor)
    ({"cdf": "full", "solved_floor_quantile": 1.0}, [5, 5, 11]),  # the old defaults
])
def test_solved_floor_is_a_quantile_of_the_pooled_wins(tokenizer, kw, caps):
    """The floor on issue 39's pool (12 wins: {1: 2, 2: 4, 3: 5, 10: 1}) is ``Q_q(L_succ) + 1`` against the
    paper's cap 4 at probe 3 (probe 2's floors, on 6 wins {1: 1, 2: 2, 3: 3}, are at most 3 + 1 = 4 < 5; probe 1
    has no win). With 12 wins any q > 11/12 is the maximum, so 0.95 is no safeguard on a pool this small.
    With ``cdf: full`` probe 2's H_cov is the full-CDF median of 10 episodes {1: 1, 2: 2, 3: 3, 11: 4}: 3, the
    same H_ctrl."""
    ctrl, _, module, trainer = _setup(tokenizer, max_turns=12, **kw)
    assert [_step(ctrl, trainer, module, rows, h=12)[3] for rows in ISSUE39] == caps


def test_quantile_floor_keeps_the_cap_above_a_lone_win(tokenizer):
    """The quest-5 collapse (issue 19): one win at 5 turns (depth 4), the KL all on turn 0 (H_eff = 0), too few
    successes for H_cov. The paper's rule alone: H̄ = 0, cap clip(0 + 1, 2, 8) = 2, below the 5 turns the win
    took; with a quantile floor (any q: one win) the cap is 4 + 1 = 5. Next batch, failures only: the win is
    still in the window (W = 4), H̄ = 0 stays, cap 5; after W more failure batches the win leaves the window and
    the cap may fall to 2."""
    batch = [row(5, True), row(8), row(8), row(8)]
    plain, _, m0, t0 = _setup(tokenizer)
    assert _step(plain, t0, m0, batch) == (0, None, 0.0, 2)
    ctrl, dm, module, trainer = _setup(tokenizer, solved_floor_quantile=0.9)
    assert _step(ctrl, trainer, module, batch) == (0, None, 0.0, 5) and dm.max_turns == 5
    for _ in range(3):
        assert _step(ctrl, trainer, module, FAIL8)[3] == 5  # the win is pooled for W = 4 probe batches
    assert _step(ctrl, trainer, module, FAIL8) == (0, None, 0.0, 2)  # window of 4 failure batches: no floor


def test_ranks_are_reduced_exactly(tokenizer):
    """Rows split over two ranks (different row counts) give the decision of one rank holding them all."""
    rows = [row(5, True), row(5, True), row(6, True), row(6, True), row(3, True), row(3, True), row(4, True),
            row(5, True), row(7, kl=[0, 0, 0, 1, 0, 0, 0])]
    single, _, module, trainer = _setup(tokenizer)
    expect = _step(single, trainer, module, rows)
    assert expect[1] == 5  # 8 successes in one batch
    other, _, other_module, other_trainer = _setup(tokenizer)
    vec = other._reduced_sums(other_trainer, stats(rows[:3]))  # rank 1's contribution
    ctrl, _, module, _ = _setup(tokenizer)
    trainer = Trainer(_dm(tokenizer), Strategy(others=[vec]))
    ctrl.setup(trainer, module, "fit")
    got = _step(ctrl, trainer, module, rows[3:])
    assert got[:2] == expect[:2] and got[2] == pytest.approx(expect[2]) and got[3] == expect[3]


def test_state_dict_round_trip_continues_identically(tokenizer):
    paper = {"cdf": "success", "solved_floor": False}  # TABLE's hand-worked caps
    ctrl, _, module, trainer = _setup(tokenizer, **paper)
    for rows, _, _ in TABLE[:4]:
        _step(ctrl, trainer, module, rows)
    state = ctrl.state_dict()
    assert set(state) == {"h_max", "cap", "h_bar", "h_cov", "h_eff", "pool"}
    resumed, dm, module2, trainer2 = _setup(tokenizer, max_turns=6, **paper)  # configured differently: H_max comes back
    resumed.load_state_dict(state)
    resumed.on_train_start(trainer2, module2)
    assert dm.sampler.probe_schedule == (3, 8, 8) and dm.max_turns == ctrl.cap == 4
    for rows, _, _ in TABLE[4:]:
        assert _step(resumed, trainer2, module2, rows) == _step(ctrl, trainer, module, rows)
    assert resumed.state_dict() == ctrl.state_dict()


def test_too_few_tracked_turns_warns(tokenizer):
    ctrl, _, module, trainer = _setup(tokenizer)
    with pytest.warns(UserWarning, match="tracks 4 turns < H_max=8"):
        _step(ctrl, trainer, module, [row(4)], h=4)
