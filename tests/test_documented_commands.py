"""Every command the documentation tells a user to type parses, and the Trainer commands build.

Sources: every ``Use:`` / ``Run:`` line and every comment line that starts with a command in ``conf/**/*.yaml``
and ``tutorials/**`` (YAML, sbatch, the tutorials' ``Run::`` docstring blocks), and every command line in
the fenced code blocks of ``README.md``, ``docs/*.md`` and ``tutorials/*.md``; shell continuation lines
(``\\``) are joined.

How each is checked (no artifacts needed):

* ``lightning-opd fit|validate|test ...`` (also through ``python -m lightning_opd``, ``torchrun``, ``srun``):
  built in-process by ``OPDCLI`` exactly as written (the config files in the order given, the line's own
  overrides), then model and data paths pointed at the tiny fixtures of ``tests/test_configs.py``, loggers
  and exports at ``tmp_path`` and GPU settings at one CPU device; the Trainer method is stubbed out. Building
  the Trainer catches what parsing alone does not (two callbacks with one state key).
  ``--print_config`` / ``--help`` / ``--X.help`` lines run as written and must exit 0.
* Helper commands (``make-games``, ``results``, ...) and tutorial scripts: their own argparse parser parses
  the line, and nothing runs.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from lightning_opd.cli import COMMANDS, main
from tests.test_configs import games_dir, load_yaml, merge, overrides, search_qa_dir  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]
TRAINER_COMMANDS = ("fit", "validate", "test")
pytestmark = pytest.mark.filterwarnings("ignore:No seed found")

_LABEL = re.compile(r"^(?:Use|Run|Watch|Base|Resume)::?\s*")
_OPTIONAL = re.compile(r"\[(--[\w-]+)\]")  # `[--tiny]`: an optional flag, tested as given
_STARTS = re.compile(r"^(?:\S*lightning-opd\s|\S*python\S*\s+(?:-m\s+lightning_opd\s|tutorials/)|srun\s|torchrun\s)")


def _comment_free(line: str) -> str:
    """A shell line without its trailing ``# comment`` and a trailing ``(explanation)``."""
    line = re.sub(r"\s+#.*$", "", line)
    line = re.sub(r"\s{2,}\(.*\)\s*$", "", line)
    return line.rstrip()


def _candidates(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of the lines that may hold a command, comment markers and labels removed."""
    text = path.read_text().splitlines()
    out = []
    if path.suffix == ".md":
        fenced = False
        for i, line in enumerate(text, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced:
                out.append((i, line.strip()))
        return out
    if path.suffix == ".py":  # the module docstring only (the code below it may print commands)
        text = text[:ast.parse(path.read_text()).body[0].end_lineno]
    for i, line in enumerate(text, 1):
        s = line.strip()
        if path.suffix in (".yaml", ".yml"):
            if not s.startswith("#"):
                continue
            s = s.lstrip("#").strip()
        out.append((i, _LABEL.sub("", s)))
    return out


def documented_commands(path: Path) -> list[tuple[str, str]]:
    """``(id, command)`` for every command in ``path``; continuation lines are joined."""
    found, lines, i = [], _candidates(path), 0
    while i < len(lines):
        number, text = lines[i]
        i += 1
        if not _STARTS.match(text):
            continue
        parts = [text]
        while parts[-1].rstrip().endswith("\\") and i < len(lines):  # `\` (or `\\` in a Python docstring)
            parts[-1] = parts[-1].rstrip().rstrip("\\").rstrip()
            parts.append(lines[i][1])
            i += 1
        found.append((f"{path.relative_to(ROOT)}:{number}", _comment_free(" ".join(parts))))
    return found


SOURCES = sorted([*ROOT.glob("conf/**/*.yaml"), *ROOT.glob("tutorials/**/*.yaml"), *ROOT.glob("tutorials/**/*.sbatch"),
                  *ROOT.glob("tutorials/*.py"), *ROOT.glob("tutorials/*.md"), ROOT / "README.md",
                  *ROOT.glob("docs/*.md")])
COMMANDS_FOUND = [c for p in SOURCES for c in documented_commands(p)]


def lopd_args(command: str) -> list[str] | None:
    """The arguments after ``lightning-opd`` / ``-m lightning_opd``, or None for a tutorial script."""
    words = shlex.split(_OPTIONAL.sub(r"\1", command))
    for j, w in enumerate(words):
        if w.endswith("lightning-opd"):
            return words[j + 1:]
        if w == "lightning_opd" and j > 0 and words[j - 1] == "-m":
            return words[j + 1:]
    return None


class _Parsed(Exception):
    """Raised by the patched ``ArgumentParser.parse_args`` once the real parser accepted the line."""


def parse_only(monkeypatch, fn, argv: list[str]) -> argparse.Namespace:
    """Run ``fn(argv)`` up to its first ``argparse`` parse: the real parser checks the line, nothing runs."""
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    with pytest.raises(_Parsed) as got:
        fn(argv)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", real)
    return got.value.args[0]


def _absolute(args: list[str]) -> list[str]:
    """``--config PATH`` relative to the repository root (the test runs in a temporary directory)."""
    out = list(args)
    for j, a in enumerate(out):
        if a in ("--config", "-c") and j + 1 < len(out) and not Path(out[j + 1]).is_absolute():
            out[j + 1] = str(ROOT / out[j + 1])
        elif a.startswith("--config=") and not Path(a[9:]).is_absolute():
            out[j] = "--config=" + str(ROOT / a[9:])
    return out


def build_trainer_command(args: list[str], model_dirs, data_dirs, tmp: Path) -> None:
    """Build ``lightning-opd <args>`` in-process as written, plus the overrides that make it buildable here."""
    args = _absolute(args)
    files = [args[j + 1] for j, a in enumerate(args) if a in ("--config", "-c")]
    files += [a[9:] for a in args if a.startswith("--config=")]
    merged = {}
    for f in files:
        merged = merge(merged, load_yaml(Path(f)) if Path(f).is_file() else {})  # a missing one: the CLI says so
    extra, _ = overrides(merged, model_dirs, data_dirs, tmp)
    # whatever the files or the line say (GPU, FSDP, several devices or nodes): one CPU device here
    extra += ["--trainer.accelerator=cpu", "--trainer.strategy=auto", "--trainer.devices=1", "--trainer.num_nodes=1"]
    if "16" in str((merged.get("trainer") or {}).get("precision", "")) or any("precision" in a for a in args):
        extra.append("--trainer.precision=32-true")
    stubs = {name: getattr(Trainer, name) for name in TRAINER_COMMANDS}
    for name, fn in stubs.items():  # wraps: the CLI reads the method's signature (ckpt_path, verbose, ...)
        setattr(Trainer, name, functools.wraps(fn)(lambda *a, **k: None))
    try:
        main(args + extra)
    finally:
        for name, fn in stubs.items():
            setattr(Trainer, name, fn)


def check_command(command: str, monkeypatch, model_dirs, data_dirs, tmp: Path) -> None:
    """Raise (or exit non-zero) when ``command`` is not accepted as documented."""
    args = lopd_args(command)
    if args is None:  # a tutorial script: .venv/bin/python tutorials/NN_name.py [options]
        words = shlex.split(_OPTIONAL.sub(r"\1", command))
        script = next(w for w in words if w.startswith("tutorials/") and w.endswith(".py"))
        argv = words[words.index(script) + 1:]
        monkeypatch.syspath_prepend(str(ROOT / "tutorials"))
        module = runpy.run_path(str(ROOT / script), run_name="tutorial")
        parse_only(monkeypatch, module["main"], argv)
        return
    assert args, f"no subcommand in {command!r}"
    if args[0] in COMMANDS:
        parse_only(monkeypatch, main, args)
        return
    if args[0] not in TRAINER_COMMANDS:  # predict or a typo: the CLI must refuse it
        main(_absolute(args))
        raise AssertionError(f"{command!r}: subcommand {args[0]!r} was accepted")
    if any(a in ("--print_config", "--help", "-h") or a.startswith("--print_config=") or a.endswith(".help")
           for a in args):
        with pytest.raises(SystemExit) as exc:
            main(_absolute(args))
        assert exc.value.code in (0, None), f"{command!r} exited {exc.value.code}"
        return
    build_trainer_command(args, model_dirs, data_dirs, tmp)


@pytest.fixture
def checker(monkeypatch, model_dirs, games_dir, search_qa_dir, tmp_path, isolate):  # noqa: F811 (fixtures)
    data_dirs = {"games_dir": games_dir, "data_dir": search_qa_dir}
    return lambda command: check_command(command, monkeypatch, model_dirs, data_dirs, tmp_path)


# --------------------------------------------------------------------------------------------- tests
def test_every_use_and_run_line_is_found():
    """No documented line is silently skipped: each ``Use:``/``Run:`` label in conf/ and tutorials/ yields a
    command, and the README's code blocks hold the Trainer commands and helper commands it shows."""
    ids = {cid for cid, _ in COMMANDS_FOUND}
    for path in SOURCES:
        if path.name == "README.md" or path.suffix == ".md":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            label = re.search(r"\b(?:Use|Run)::?\s*(\S*)", line)
            if label and label.group(1):  # a label followed by a command on the same line
                assert f"{path.relative_to(ROOT)}:{number}" in ids, f"{path.relative_to(ROOT)}:{number}: {line!r}"
    readme = [c for cid, c in COMMANDS_FOUND if cid.startswith("README.md")]
    assert len(readme) >= 6 and any(" validate " in c for c in readme) and any(" evaluate " in c for c in readme)
    for page in ("usage", "methods", "scaling"):  # the chapters moved out of the README keep their commands
        assert sum(cid.startswith(f"docs/{page}.md:") for cid, _ in COMMANDS_FOUND) >= 4, page
    assert len(COMMANDS_FOUND) >= 60


@pytest.mark.parametrize("command", [c for _, c in COMMANDS_FOUND], ids=[cid for cid, _ in COMMANDS_FOUND])
def test_documented_command_is_accepted(command, checker):
    checker(command)


# ------------------------------------------------------------------- the check catches broken lines
BROKEN = [
    # the Use: line staleness_monitor.yaml had: a second StalenessMonitor with the same state key
    ("lightning-opd fit --config conf/textworld/fopd_async.yaml --config conf/callbacks/staleness_monitor.yaml",
     RuntimeError, "more than one stateful callback"),
    ("lightning-opd fit --config conf/textworld/opd.yaml --model.init_args.micro_batch_sise=2", SystemExit, None),
    ("lightning-opd fit --config conf/textworld/no_such.yaml", SystemExit, None),
    ("lightning-opd make-games --out x --train -3", SystemExit, None),
    ("lightning-opd results --metrik val/success runs/x", SystemExit, None),
    (".venv/bin/python tutorials/01_quickstart.py --tinny", SystemExit, None),
    ("lightning-opd predict --config conf/textworld/opd.yaml", SystemExit, None),
]


@pytest.mark.parametrize(("command", "error", "match"), BROKEN, ids=[b[0].split(" ", 1)[1][:60] for b in BROKEN])
def test_broken_command_is_caught(command, error, match, checker):
    with pytest.raises(error, match=match) as exc:
        checker(command)
    if error is SystemExit:
        assert exc.value.code not in (0, None)


def test_extraction_joins_continuations_and_drops_comments(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    doc = tmp_path / "x.yaml"
    doc.write_text("# Run:   lightning-opd fit --config a.yaml \\\n#       --config b.yaml   # the second\n"
                   "# Use: lightning-opd results A=runs/a       (a note)\n# not a command: lightning-opd fit\nk: 1\n")
    assert documented_commands(doc) == [("x.yaml:1", "lightning-opd fit --config a.yaml --config b.yaml"),
                                        ("x.yaml:3", "lightning-opd results A=runs/a")]
