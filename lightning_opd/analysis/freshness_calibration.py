"""``lightning-opd calibrate-freshness``: f-OPD's drift tolerances τ_ρ, τ_χ from a measured run (PROPOSED,
docs/algorithms.md §1.5).

Reads the per-sample records a ``StalenessMonitor`` in ``mode: measure`` writes
(``staleness_samples.jsonl``, one JSON object per sample with ``lag`` in versions and ``rho``, ``chi`` in
nats; ``staleness_samples.rank<N>.jsonl`` per rank under data parallelism) and sets each tolerance to the
median drift of the samples at one lag (default 1), so that a lag-1 sample with the median drifts has each
drift term at its weight, and scores about the middle of the freshness scale. Prints the YAML lines to paste
into the monitor's ``init_args.freshness``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_opd.losses.freshness import FreshnessDiagnostics, freshness_score

RECORDS = "staleness_samples*.jsonl"


@dataclass
class Calibration:
    """Median drifts at one lag.

    Attributes:
        lag: the lag the samples were selected at (versions).
        samples: how many records had that lag.
        steps: ``(first, last)`` step of those records.
        rho, chi: median ρ and χ of those samples (nats): the proposed τ_ρ and τ_χ (``chi`` 0: no sample with
            an earlier turn; keep τ_χ).
        files: the record files read.
    """

    lag: int
    samples: int
    steps: tuple[int, int]
    rho: float
    chi: float
    files: list[Path]

    def freshness(self, lag_cap: int = 8) -> tuple[float, float]:
        """``(s, f)`` of a sample at :attr:`lag` with the median drifts, scored with τ = the medians and the
        default balance and transform (:func:`~lightning_opd.losses.freshness.freshness_score`)."""
        one = torch.ones(1, dtype=torch.float64)
        diag = FreshnessDiagnostics(lag=one * self.lag, delta=(one * self.lag / lag_cap).clamp(max=1.0),
                                    rho=one * self.rho, chi=one * self.chi)
        s, f = freshness_score(diag, tau_rho=self.rho, tau_chi=self.chi if self.chi > 0 else 1.0)
        return float(s), float(f)


def find_records(run_dir: str | Path) -> list[Path]:
    """The record files of one run under ``run_dir`` (searched recursively).

    Raises:
        FileNotFoundError: none found (the message says how to make them).
        ValueError: records of more than one run (several directories hold them; name one).
    """
    files = sorted(Path(run_dir).rglob(RECORDS))
    if not files:
        raise FileNotFoundError(f"no {RECORDS} under {run_dir}: run fit with --config "
                                "conf/callbacks/staleness_measure.yaml (StalenessMonitor mode: measure), then pass "
                                "its log directory (e.g. runs/opd/version_0)")
    dirs = sorted({str(f.parent) for f in files})
    if len(dirs) > 1:
        raise ValueError(f"records of several runs under {run_dir}: {', '.join(dirs)}; pass one of them")
    return files


def calibrate(run_dir: str | Path, lag: int = 1) -> Calibration:
    """Median ρ and χ of the recorded samples at ``lag``.

    Raises:
        FileNotFoundError, ValueError: see :func:`find_records`; no sample at ``lag``; median ρ of 0 (the
            weights did not move between versions: nothing to calibrate against).
    """
    files = find_records(run_dir)
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    at = [r for r in rows if round(float(r["lag"])) == lag]
    if not at:
        lags = sorted({round(float(r["lag"])) for r in rows})
        raise ValueError(f"no sample at lag {lag} in {len(rows)} records (lags seen: {lags}); run with "
                         f"--data.init_args.forced_lag={lag} or pass --lag")
    rho = statistics.median(float(r["rho"]) for r in at)
    chi = statistics.median(float(r["chi"]) for r in at)
    if rho <= 0:
        raise ValueError(f"median rho at lag {lag} is {rho}: the student did not change between versions")
    steps = [int(r["step"]) for r in at]
    return Calibration(lag=lag, samples=len(at), steps=(min(steps), max(steps)), rho=rho, chi=chi, files=files)


def yaml_lines(cal: Calibration, lag_cap: int = 8) -> str:
    """The lines to paste under the ``StalenessMonitor``'s ``init_args.freshness:``, with a comment saying where
    they come from."""
    s, f = cal.freshness(lag_cap)
    lines = [f"# lightning-opd calibrate-freshness: {cal.samples} samples at lag {cal.lag} (steps {cal.steps[0]}-"
             f"{cal.steps[1]}) in {cal.files[0].parent}",
             f"# median rho {cal.rho:.4g} nats, median chi {cal.chi:.4g} nats; a lag-{cal.lag} sample at the medians "
             f"scores s = {s:.3f}, f = {f:.3f} (default balance)",
             "# paste under the StalenessMonitor's init_args.freshness:",
             f"tau_rho: {cal.rho:.4g}"]
    if cal.chi > 0:
        lines.append(f"tau_chi: {cal.chi:.4g}")
    else:
        lines.append("# tau_chi: not set (median chi is 0: no sample had an earlier turn); keep the configured one")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Entry point of ``lightning-opd calibrate-freshness``; exits 1 with the reason on bad records."""
    p = argparse.ArgumentParser(prog="lightning-opd calibrate-freshness",
                                description="Set f-OPD's drift tolerances tau_rho, tau_chi to the median drifts at "
                                            "lag 1 of a measure-only run (docs/algorithms.md §1.5); prints YAML.")
    p.add_argument("run_dir", help="the run's log directory (holds staleness_samples.jsonl)")
    p.add_argument("--lag", type=int, default=1, help="select the samples at this lag (versions, default 1)")
    p.add_argument("--lag-cap", type=int, default=8, help="the monitor's freshness.lag_cap (for the printed check)")
    a = p.parse_args(argv)
    if a.lag < 1:
        p.error(f"--lag {a.lag}: must be >= 1 (lag 0 has no drift)")
    try:
        print(yaml_lines(calibrate(a.run_dir, a.lag), a.lag_cap))
    except (FileNotFoundError, ValueError) as err:
        p.exit(1, f"lightning-opd calibrate-freshness: error: {err.args[0]}\n")
