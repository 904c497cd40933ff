"""f-OPD freshness: per-sample staleness diagnostics, the freshness score and the truncated
importance ratio. PROPOSED in docs/algorithms.md §1.4, not from the paper (its text was not
available); the decomposition into rollout drift and supervision drift follows the f-OPD abstract.

All functions are pure and batched: ``B`` samples (episodes), ``T`` token positions. Log-probs are in
nats, lags in policy versions (rollout iterations, §3.1 note).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FreshnessDiagnostics:
    """Per-sample diagnostics, each ``(B,)``.

    Attributes:
        lag: version lag Δ_i = learner version − oldest behaviour version (versions).
        delta: δ_i = min(Δ_i / Δ_cap, 1) (unitless, in [0, 1]).
        rho: ρ_i = mean over supervised tokens of |log π_θ − log π_b| (nats): rollout drift.
        chi: χ_i = mean over supervised tokens of the context drift c_t accumulated over earlier
            turns (nats): supervision drift; 0 for single-turn samples.
    """

    lag: torch.Tensor
    delta: torch.Tensor
    rho: torch.Tensor
    chi: torch.Tensor


def staleness_diagnostics(lag: torch.Tensor, student_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                          mask: torch.Tensor, turns: torch.Tensor, lag_cap: int = 8) -> FreshnessDiagnostics:
    """The three diagnostics of §1.4 (PROPOSED).

    Args:
        lag: ``(B,)`` version lag per sample.
        student_logprobs: ``(B, T)`` log π_θ(a_t|s_t) of the sampled tokens under the learner's weights.
        behaviour_logprobs: ``(B, T)`` log π_b(a_t|s_t) recorded at rollout time.
        mask: ``(B, T)`` 1 on supervised (sampled) tokens.
        turns: ``(B, T)`` zero-based turn of each token (-1 off the mask).
        lag_cap: Δ_cap, the fixed ceiling of the lag scale (versions).

    For token t in turn k: ``c_t = |Σ_{t' supervised, turn(t') < k} (log π_θ − log π_b)(t')| /
    max(1, #supervised tokens in turns < k)``; ``χ_i = mean_t c_t``.

    Raises:
        ValueError: ``lag_cap < 1``.
    """
    if lag_cap < 1:
        raise ValueError(f"lag_cap={lag_cap} must be >= 1")
    m = (mask > 0).to(torch.float64)
    d = (student_logprobs.double() - behaviour_logprobs.double()) * m  # (B, T)
    n = m.sum(dim=1).clamp(min=1.0)  # (B,)
    rho = d.abs().sum(dim=1) / n
    k_max = int(turns.max().item()) + 1 if turns.numel() else 0
    chi = torch.zeros_like(rho)
    if k_max > 1:
        t = turns.clamp(min=0).long()
        per_turn_d = torch.zeros(d.shape[0], k_max, dtype=torch.float64, device=d.device).scatter_add_(1, t, d)
        per_turn_n = torch.zeros_like(per_turn_d).scatter_add_(1, t, m)
        before_d = torch.cumsum(per_turn_d, 1) - per_turn_d  # sums over turns strictly before k
        before_n = torch.cumsum(per_turn_n, 1) - per_turn_n
        c = before_d.abs() / before_n.clamp(min=1.0)  # (B, K)
        chi = (c * per_turn_n).sum(dim=1) / n
    lag = lag.double()
    delta = (lag / lag_cap).clamp(min=0.0, max=1.0)
    return FreshnessDiagnostics(lag=lag, delta=delta, rho=rho, chi=chi)


def freshness_score(diag: FreshnessDiagnostics, tau_rho: float = 0.1, tau_chi: float = 0.1, alpha: float = 4.0,
                    beta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Staleness ``s_i = (δ_i + ρ_i/τ_ρ + χ_i/τ_χ) / 3`` and freshness ``f_i = 1 / (1 + exp(α (s_i − β)))``
    (§1.4, PROPOSED; absolute scales, so a synchronous sample scores s ≈ 0, f ≈ 0.98).

    Returns:
        ``(s, f)``, each ``(B,)`` float64.

    Raises:
        ValueError: a non-positive tolerance.
    """
    if tau_rho <= 0 or tau_chi <= 0:
        raise ValueError(f"tolerances must be > 0 nats, got tau_rho={tau_rho}, tau_chi={tau_chi}")
    s = (diag.delta + diag.rho / tau_rho + diag.chi / tau_chi) / 3.0
    f = torch.sigmoid(-alpha * (s - beta))
    return s, f


def truncated_importance_ratio(student_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                               cap: float = 2.0) -> torch.Tensor:
    """``sg(min(π_θ/π_b, C))`` per token, ``(B, T)`` (TIS-style, §1.4 M3, PROPOSED): reweights the
    per-token loss, carries no gradient."""
    return torch.exp(student_logprobs.detach() - behaviour_logprobs.detach()).clamp(max=cap)
