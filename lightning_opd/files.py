"""Files written whole or not at all (F16): exported models, generated data sets.

Shared by :mod:`lightning_opd.models` (model export), :mod:`lightning_opd.envs` (generated games and
knowledge bases) and every result file (:func:`write_text_atomic`: evaluation JSON, experiment records and summaries),
below all of them in the package layers.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def write_dir_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp_dir)`` into a temporary sibling folder, then rename it to ``path`` (replacing a
    previous one only once the new one is complete, F16). Returns the final path.

    Raises:
        whatever ``write`` raises; the temporary folder is removed first and ``path`` is left as it was.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp.", dir=final.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp creates 0700
        old = None
        if final.exists():
            old = final.parent / f".{final.name}.old"
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all: into a temporary sibling ``.<name>.<pid>.tmp``, flushed and
    ``fsync``-ed, then renamed over ``path`` (a reader sees the previous file or the new one, never half of one).
    Creates the parent folders. Returns ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the folder cannot be created or written; ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def json_safe(x):
    """``x`` with every non-finite float (NaN, +-inf, e.g. the KL of a turn without tokens) replaced by ``None``,
    recursing into dicts, lists and tuples (tuples become lists), so ``json.dumps`` writes strict JSON (``null``)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
