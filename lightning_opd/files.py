"""Files written whole or not at all (F16): exported models, generated data sets.

Shared by :mod:`lightning_opd.models` (model export) and :mod:`lightning_opd.envs` (generated games and
knowledge bases), below both in the package layers.
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
