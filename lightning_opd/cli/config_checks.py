"""Checks of a ``fit``/``validate``/``test`` command line before and while jsonargparse parses it: config errors
shown cause first with the full key (:func:`cause_first`), ``--config`` files that are not YAML named
(:func:`check_config_files`), renamed keys refused with their new names (:func:`check_renamed_keys`), and errors
raised while the module or DataModule is built shown with the key as typed (:func:`instantiation_error`)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

# ------------------------------------------------------------------------------------ config errors
_STRUCTURAL = re.compile(r"^\s*(- )?(Parser key |Does not validate against|Subtypes:|Errors:|Problem with given class_path"
                         r"|Given value|Not a valid subclass|Expected a <class 'NoneType'>)")
_KEY = re.compile(r'^(\s*)(?:- )?Parser key "([^"]+)":')
_CLASS = re.compile(r"^(\s*)- Problem with given class_path '([^']+)':")


def cause_first(message: str) -> str:
    """Reorder a jsonargparse error so the innermost cause comes first, with its full dotted key.

    ``Parser key "model": Does not validate against any of the Union subtypes ... - Problem with given
    class_path 'X': Parser key "micro_batch_size": Expected a <class 'int'>. Got value: abc`` becomes
    ``model.init_args.micro_batch_size: Expected a <class 'int'>. Got value: abc (in X)`` followed by the
    original message. Messages without nesting are returned unchanged."""
    lines = message.splitlines()
    causes = [(len(ln) - len(ln.lstrip()), i) for i, ln in enumerate(lines) if ln.strip() and not _STRUCTURAL.match(ln)]
    if not causes or len(lines) < 3:
        return message
    indent, at = max(causes, key=lambda c: (c[0], -c[1]))  # deepest, first among equals
    keys: list[str] = []
    classes: list[str] = []
    level = indent
    for ln in reversed(lines[:at]):
        depth = len(ln) - len(ln.lstrip())
        if depth >= level:
            continue
        m, c = _KEY.match(ln), _CLASS.match(ln)
        if c:
            keys.append("init_args")
            classes.append(c.group(2))
            level = depth
        elif m:
            keys.append(m.group(2))
            level = depth
    if not keys:
        return message
    key = ".".join(reversed(keys)).replace(".init_args.init_args.", ".init_args.")
    where = f" (class {classes[0]})" if classes else ""
    cause = " ".join(ln.strip() for ln in lines[at:at + 1])
    if cause.startswith("- "):  # an alternative of an optional knob (``int | None``): say what was given
        given = next((ln.strip()[13:] for ln in lines[at:] if ln.strip().startswith("Given value: ")), None)
        cause = cause[2:] + (f". Got value: {given}" if given is not None else "")
    return f"{key}: {cause}{where}\n\nfull parser message:\n{message}"


def _config_paths(args: list[str]) -> list[str]:
    """The paths given to ``--config`` / ``-c`` / ``--config=`` in ``args``, in order."""
    paths = []
    for i, a in enumerate(args):
        if a in ("--config", "-c") and i + 1 < len(args):
            paths.append(args[i + 1])
        elif a.startswith("--config="):
            paths.append(a.split("=", 1)[1])
    return paths


def check_config_files(args: list[str]) -> None:
    """Exit with an error naming the file when a ``--config`` file is missing or not valid YAML (the parser's
    own message says only ``<unicode string>``)."""
    import yaml

    for path in _config_paths(args):
        p = Path(path)
        if not p.is_file():
            continue  # jsonargparse names missing files itself (and may read inline YAML)
        try:
            yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            sys.stderr.write(f"error: config file {path} is not valid YAML:\n{err}\n")
            raise SystemExit(2) from None


# ------------------------------------------------------------------------------------ renamed keys
#: the ``StalenessMonitor`` knobs grouped in ``init_args.freshness`` (``FreshnessConfig``) by issue 40
_FRESHNESS_KEYS = ("lag_cap", "tau_rho", "tau_chi", "alpha", "beta", "lag_weight", "rho_weight", "chi_weight", "score",
                   "weighting", "filtering", "min_freshness", "truncated_ratio", "ratio_cap")
#: the one table of renamed keys (issue 40: one name per lag quantity, docs/design.md "Three lag quantities"):
#: where -> {old key: new key}. ``"data"``: under ``data.init_args``; a class name: under the ``init_args`` of a
#: ``trainer.callbacks`` entry of that class. Checked before parsing by :func:`check_renamed_keys`.
RENAMED_KEYS: dict[str, dict[str, str]] = {
    "data": {"max_lag": "producer_lead"},
    "StalenessMonitor": {"max_lag": "initial_lag_bound", **{k: f"freshness.{k}" for k in _FRESHNESS_KEYS}},
}
_SUBCOMMANDS = ("fit", "validate", "test")


def _renamed_in_config(config, source: str) -> list[str]:
    """The renamed keys (:data:`RENAMED_KEYS`) used in one parsed config (a ``--config`` file's YAML, or a dict
    given to the CLI), each as ``'<old> (in <source>): use <new>'``."""
    found: list[str] = []
    if not isinstance(config, dict):
        return found
    roots = [config] + [config[c] for c in _SUBCOMMANDS if isinstance(config.get(c), dict)]
    for root in roots:
        data = root.get("data")
        if isinstance(data, dict):
            for node, prefix in ((data.get("init_args"), "data.init_args."), (data, "data.")):
                for old, new in RENAMED_KEYS["data"].items():
                    if isinstance(node, dict) and old in node:
                        found.append(f"{prefix}{old} (in {source}): use data.init_args.{new}")
        trainer = root.get("trainer")
        for key in ("callbacks", "callbacks+"):
            entries = trainer.get(key) if isinstance(trainer, dict) else None
            for entry in entries if isinstance(entries, list) else [entries]:
                if not isinstance(entry, dict) or not isinstance(entry.get("class_path"), str):
                    continue
                name = entry["class_path"].rpartition(".")[2]
                init = entry.get("init_args") if isinstance(entry.get("init_args"), dict) else {}
                for old, new in RENAMED_KEYS.get(name, {}).items():
                    if old in init or old in entry:
                        found.append(f"trainer.{key}[{name}].init_args.{old} (in {source}): use init_args.{new}")
    return found


def _renamed_on_command_line(args: list[str], monitor_named: bool) -> list[str]:
    """The renamed keys given as ``--key[=value]`` options: ``--data[.init_args].<old>`` and, when a callback of a
    class in :data:`RENAMED_KEYS` is named (``monitor_named``), ``--trainer.callbacks[.init_args].<old>``."""
    found: list[str] = []
    for arg in args:
        if not arg.startswith("--"):
            continue
        key = arg[2:].split("=", 1)[0]
        for prefix in ("data.init_args.", "data."):
            old = key[len(prefix):] if key.startswith(prefix) else None
            if old in RENAMED_KEYS["data"]:
                found.append(f"--{key} (command line): use --data.init_args.{RENAMED_KEYS['data'][old]}")
                break
        for prefix in ("trainer.callbacks.init_args.", "trainer.callbacks."):
            old = key[len(prefix):] if key.startswith(prefix) else None
            if monitor_named and old in RENAMED_KEYS["StalenessMonitor"]:
                found.append(f"--{key} (command line): use --trainer.callbacks.init_args."
                             f"{RENAMED_KEYS['StalenessMonitor'][old]} (StalenessMonitor)")
                break
    return found


def check_renamed_keys(args, error: Callable[[str], object]) -> None:
    """Refuse every renamed key (:data:`RENAMED_KEYS`) in the ``--config`` files, a config dict, or the
    command-line options, before jsonargparse parses them: ``error`` (the parser's) gets one line per key, each
    naming the new key. Config files that are missing or not YAML are left to :func:`check_config_files`."""
    import yaml

    if isinstance(args, dict):
        found = _renamed_in_config(args, "the given config")
        monitor_named = False
    else:
        found, texts = [], []
        for path in _config_paths(args):
            p = Path(path)
            if not p.is_file():
                continue
            try:
                texts.append(p.read_text())
                found += _renamed_in_config(yaml.safe_load(texts[-1]), path)
            except yaml.YAMLError:
                continue
        monitor_named = any("StalenessMonitor" in t for t in texts + list(args))
        found += _renamed_on_command_line(list(args), monitor_named)
    if found:
        error("renamed keys (issue 40: one name per lag quantity, docs/design.md \"Three lag quantities\"):\n  "
              + "\n  ".join(found))


_UNION = ("Does not validate against any of the Union subtypes", "Problem with given class_path")
_SECTION_KEY = re.compile(r"\b(model|data)\.(?!init_args\b|class_path\b)(?=\w)")
_CLASS_PATH = re.compile(r"class_path='([\w.]+)'")


def instantiation_error(err: BaseException) -> str | None:
    """The message to show for an error raised while jsonargparse builds the module or the DataModule: the
    innermost cause first, keys as the user types them (``data.max_turns=-1`` -> ``data.init_args.max_turns=-1``)
    and the class being built. ``None`` when ``err`` is not jsonargparse's wrapper (then it is re-raised)."""
    if not any(str(err).startswith(u) for u in _UNION):
        return None
    classes, cause = _CLASS_PATH.findall(str(err))[:1], err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause) if cause is not err else str(err).splitlines()[0]
    where = f" (building {classes[0]})" if classes else ""
    return (f"{_SECTION_KEY.sub(lambda m: m.group(1) + '.init_args.', text)}{where}\n"
            "(set JSONARGPARSE_DEBUG=1 for the full traceback)")
