"""Shared helpers for the benchmark scripts: resumable result files, artifact arguments, markdown tables
(the roofline probes live in :mod:`benchmarks.roofline`)."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_opd.files import write_text_atomic

RESULTS = Path(__file__).resolve().parent / "results"


class ResultFile:
    """A JSON dict of finished measurements; a rerun skips keys already there (resumable)."""

    def __init__(self, name: str) -> None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.path = RESULTS / f"{name}.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def __getitem__(self, key: str):
        return self.data[key]

    def put(self, key: str, value) -> None:
        self.data[key] = value
        write_text_atomic(self.path, json.dumps(self.data, indent=1, sort_keys=True))  # a crash leaves the previous file


def add_artifact_args(parser, games: str = "artifacts/games/quest3") -> None:
    """``--model``, ``--teacher`` and ``--games``: the directories ``make prepare teacher`` creates."""
    parser.add_argument("--model", default="artifacts/models/smollm2-135m")
    parser.add_argument("--teacher", default="artifacts/models/teacher-textworld")
    parser.add_argument("--games", default=games)


def markdown_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)
