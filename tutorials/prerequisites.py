"""What the TextWorld tutorials need on disk, and the check that names the ``make`` targets building it
(shared by tutorials 1 and 3; run them from anywhere, this folder is on ``sys.path`` of a script)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what a TextWorld run needs -> the Makefile target that builds it
TEXTWORLD_ARTIFACTS = {
    "artifacts/models/smollm2-135m/config.json": "model",
    "artifacts/games/quest3/manifest.json": "games",
    "artifacts/models/teacher-textworld/config.json": "teacher",
}


def check_artifacts(root: Path = ROOT, artifacts: dict[str, str] = TEXTWORLD_ARTIFACTS) -> None:
    """Exit with a message naming the ``make`` targets when a prerequisite under ``root`` is missing.

    Raises:
        SystemExit: one or more files are missing (the message lists each with its target).
    """
    missing = {path: target for path, target in artifacts.items() if not (Path(root) / path).exists()}
    if missing:
        targets = " ".join(dict.fromkeys(missing.values()))
        lines = "\n".join(f"  {path}  (make {target})" for path, target in missing.items())
        raise SystemExit(f"missing prerequisites:\n{lines}\nbuild them from the repository root with: make {targets}")
