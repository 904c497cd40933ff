"""``lightning-opd calibrate-freshness`` (PROPOSED, docs/algorithms.md §1.5) on hand-made per-sample records."""

from __future__ import annotations

import json
import math

import pytest

from lightning_opd.cli import main
from lightning_opd.analysis.freshness_calibration import calibrate


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(step, lag, rho, chi):
    return {"step": step, "rank": 0, "lag": float(lag), "delta": lag / 8, "rho": rho, "chi": chi, "score": 0.0,
            "freshness": 1.0, "kept": True}


def test_medians_at_lag_one_over_all_ranks(tmp_path):
    run = tmp_path / "calib" / "version_0"
    _write(run / "staleness_samples.rank0.jsonl", [_row(1, 0, 0.0, 0.0), _row(2, 1, 0.02, 0.010),
                                                   _row(2, 1, 0.04, 0.000), _row(3, 2, 0.9, 0.9)])
    _write(run / "staleness_samples.rank1.jsonl", [_row(2, 1, 0.10, 0.004), _row(3, 1, 0.06, 0.006)])
    cal = calibrate(tmp_path)  # found below the given directory
    # lag-1 rho: 0.02, 0.04, 0.06, 0.10 -> median (0.04 + 0.06) / 2; chi: 0, 0.004, 0.006, 0.010 -> 0.005
    assert (cal.samples, cal.steps) == (4, (2, 3))
    assert cal.rho == pytest.approx(0.05) and cal.chi == pytest.approx(0.005)
    # at the medians each drift term is its weight 1/3: s = 2 * 1/8 + 1/3 + 1/3, f = 1 / (1 + e^(4 (s - 1)))
    s, f = cal.freshness()
    assert s == pytest.approx(0.25 + 2 / 3) and f == pytest.approx(1 / (1 + math.exp(4 * (0.25 + 2 / 3 - 1))))
    assert calibrate(run, lag=2).rho == pytest.approx(0.9)


def test_cli_prints_the_yaml_lines(tmp_path, capsys):
    _write(tmp_path / "staleness_samples.jsonl", [_row(2, 1, 0.3, 0.0), _row(2, 1, 0.1, 0.0), _row(3, 1, 0.2, 0.0)])
    main(["calibrate-freshness", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# lightning-opd calibrate-freshness: 3 samples at lag 1 (steps 2-3)")
    assert "tau_rho: 0.2" in out and not any(line.startswith("tau_chi:") for line in out)  # median chi 0: kept


@pytest.mark.parametrize(("rows", "args", "message"), [
    (None, [], "no staleness_samples*.jsonl under"),
    ([_row(1, 0, 0.0, 0.0)], [], "no sample at lag 1 in 1 records (lags seen: [0])"),
    ([_row(1, 1, 0.0, 0.0)], [], "median rho at lag 1 is 0.0"),
])
def test_bad_records_exit_1_with_the_reason(tmp_path, capsys, rows, args, message):
    if rows is not None:
        _write(tmp_path / "staleness_samples.jsonl", rows)
    with pytest.raises(SystemExit) as err:
        main(["calibrate-freshness", str(tmp_path), *args])
    assert err.value.code == 1 and message in capsys.readouterr().err


def test_records_of_two_runs_are_refused(tmp_path):
    for v in (0, 1):
        _write(tmp_path / f"version_{v}" / "staleness_samples.jsonl", [_row(1, 1, 0.1, 0.1)])
    with pytest.raises(ValueError, match="records of several runs"):
        calibrate(tmp_path)
