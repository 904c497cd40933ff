"""``lightning-opd experiment`` (lightning_opd/cli/experiment.py): the experiment runner as a subcommand, and
``python -m benchmarks.experiment`` as the same function under its old name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lightning_opd.cli import COMMANDS
from lightning_opd.cli.experiment import experiment_command

ROOT = Path(__file__).resolve().parents[2]


def test_experiment_is_a_subcommand_with_its_own_help(exits):
    assert COMMANDS["experiment"] is experiment_command
    code, out = exits(["experiment", "--help"])
    assert code == 0
    assert out.startswith("usage: lightning-opd experiment [-h] [--results RESULTS] [--summary]")
    assert "--arms ARM [ARM ...]" in out and "experiment YAML" in out


def test_experiment_refuses_a_missing_file_argument(exits):
    code, out = exits(["experiment"])
    assert code == 2 and "the following arguments are required: experiment" in out


def test_python_m_benchmarks_experiment_is_the_same_command():
    import benchmarks.experiment as alias

    assert alias.experiment_command is experiment_command
    out = subprocess.run([sys.executable, "-m", "benchmarks.experiment", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("usage: python -m benchmarks.experiment [-h]") and "--summary" in out
