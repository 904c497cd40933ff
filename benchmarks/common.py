"""Shared helpers for the benchmark scripts: resumable result files, the machine every result names, artifact
arguments, markdown tables (the roofline probes live in :mod:`benchmarks.roofline`).

Every results JSON a benchmark writes names the machine that measured it (issue 61): :meth:`ResultFile.put` stamps
each dict entry with :func:`machine` (the CPU model, ``cpu_name()``, and the cores this process may run on), and
:func:`write_json` does the same for the scripts that write one JSON document of their own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_opd.cpu_isa import cpu_name
from lightning_opd.files import write_text_atomic

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """The machine a measurement ran on: ``{"cpu": cpu_name(), "cores": n}``, the CPU model as ``/proc/cpuinfo``
    names it (e.g. ``"GenuineIntel Intel(R) Xeon(R) Processor"``, never ``"x86_64"``; :func:`lightning_opd.cpu_isa.
    cpu_name`) and ``n`` the CPUs this process may run on (``os.sched_getaffinity``: what a container or ``taskset``
    grants, not the host's count)."""
    return {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0))}


def with_machine(record: dict) -> dict:
    """``record`` with :func:`machine`'s ``cpu`` and ``cores`` added where it has none (a record that already names
    its machine, e.g. one measured earlier and rewritten now, keeps it)."""
    return {**machine(), **record}


def write_json(path: str | Path, record: dict) -> None:
    """Write ``record`` (a dict) as indented JSON to ``path`` whole or not at all (its folders created), stamped by
    :func:`with_machine`."""
    write_text_atomic(path, json.dumps(with_machine(record), indent=1) + "\n")


class ResultFile:
    """A JSON dict of finished measurements; a rerun skips keys already there (resumable). Each dict value is
    stamped with the machine that measured it (:func:`with_machine`)."""

    def __init__(self, name: str) -> None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.path = RESULTS / f"{name}.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def __getitem__(self, key: str):
        return self.data[key]

    def put(self, key: str, value) -> None:
        self.data[key] = with_machine(value) if isinstance(value, dict) else value
        # atomic: a crash leaves the previous file
        write_text_atomic(self.path, json.dumps(self.data, indent=1, sort_keys=True))


def add_artifact_args(parser, games: str = "artifacts/games/quest3") -> None:
    """``--model``, ``--teacher`` and ``--games``: the directories ``make prepare teacher`` creates."""
    parser.add_argument("--model", default="artifacts/models/smollm2-135m")
    parser.add_argument("--teacher", default="artifacts/models/teacher-textworld")
    parser.add_argument("--games", default=games)


def markdown_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)
