"""Fixtures of the command-line tests: every test in its own working directory (``isolate``), and ``exits``."""

from __future__ import annotations

import pytest

from lightning_opd.cli import main


@pytest.fixture(autouse=True)
def _isolate(isolate):
    yield


@pytest.fixture
def exits(capsys):
    """``exits(argv)``: run ``lightning-opd argv`` expecting it to exit; returns its exit code and what it printed
    (standard error, then standard output)."""
    def run(argv: list[str]) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        captured = capsys.readouterr()
        return exc.value.code, captured.err + captured.out
    return run
