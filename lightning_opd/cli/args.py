"""Argument types and checks shared by the helper commands (plain ``argparse``: each helper parses its own
arguments, so ``lightning-opd <helper> --help`` and its errors are argparse's)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def command_parser(name: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """The ``argparse`` parser of ``lightning-opd <name>`` (its ``prog`` and ``description``; ``kwargs`` as
    :class:`argparse.ArgumentParser`'s)."""
    return argparse.ArgumentParser(prog=f"lightning-opd {name}", description=description, **kwargs)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= low``; the error names the value (``argument --train: -3 must be >= 0``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    parse.__name__ = f"int>={low}"
    return parse


def fraction(text: str) -> float:
    """An argparse ``type``: a number in the open interval (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1)")
    return value


def output_args(p: argparse.ArgumentParser, default: str | None, out_help: str = "output directory",
                force_help: str = "replace an existing --out directory") -> None:
    """Add the ``--out`` (default ``default``) and ``--force`` arguments every command that writes a directory
    has (checked with :func:`refuse_existing`)."""
    p.add_argument("--out", default=default, help=out_help)
    p.add_argument("--force", action="store_true", help=force_help)


def refuse_existing(p: argparse.ArgumentParser, out: str, force: bool) -> None:
    """``p.error`` (exit 2) when ``out`` exists and is not empty and ``--force`` was not given."""
    path = Path(out)
    if path.exists() and not force and (not path.is_dir() or any(path.iterdir())):
        p.error(f"--out {out} exists; pass --force to replace it (everything in it is deleted)")


def cpu_list(text: str) -> list[int]:
    """``"0"``, ``"0,2"``, ``"0-3"``, ``"0-1,4"`` (``taskset -c`` syntax) -> CPU ids."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cpus += range(int(low), int(high or low) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list like 0 / 0,1 / 0-3") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} names no CPU (ids are >= 0)")
    return cpus

