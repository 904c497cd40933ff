"""``lightning-opd fit|validate|test``: :class:`OPDCLI`, LightningCLI with subclass mode, ``omegaconf+`` parsing,
the checks of :mod:`lightning_opd.cli.config_checks`, linked DataModule values (:data:`LINKS`) and the parsed config
logged as the run's hyper-parameters (:class:`HparamsSaveConfigCallback`)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_opd.cli.commands import EPILOG
from lightning_opd.cli.config_checks import cause_first, check_config_files, check_renamed_keys, instantiation_error
from lightning_opd.cli.precision import allow_auto_precision, resolve_config_precision


class _Formatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help formatter keeping the epilog's line breaks (the helper table)."""


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


class HparamsSaveConfigCallback(SaveConfigCallback):
    """LightningCLI's config saver that also logs the parsed run config as the run's hyper-parameters, so
    TensorBoard's HPARAMS tab and ``hparams.yaml`` show every key (``model/init_args/optimizer/init_args/lr``).

    Runs on rank 0 at ``setup``, before the Trainer's own hyper-parameter logging, which it then turns off
    (``trainer.enable_autolog_hparams``) so an empty module ``hparams`` does not log a second, empty set;
    hyper-parameters the module or DataModule saved themselves (``save_hyperparameters``) are logged with
    the config under their own names. ``precision_choice`` (what ``trainer.precision: auto`` picked, given by
    :class:`OPDCLI`) is logged as ``precision_choice/...`` (the pick, the probe's GFLOP/s per dtype and shape, the CPU,
    the reason) and, on a TensorBoard logger, as the text ``precision``."""

    def __init__(self, *args, precision_choice=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.precision_choice = precision_choice

    def save_config(self, trainer, pl_module, stage: str) -> None:
        import yaml

        params = yaml.safe_load(self.parser.dump(self.config, skip_none=False)) or {}
        params.pop("config", None)  # the --config file paths: the values themselves are logged
        datamodule = getattr(trainer, "datamodule", None)
        params.update(pl_module.hparams_initial)
        if datamodule is not None:
            params.update(datamodule.hparams_initial)
        params.pop("_class_path", None)
        if self.precision_choice is not None:
            params["precision_choice"] = self.precision_choice.as_dict()
        for logger in trainer.loggers:
            logger.log_hyperparams(params)
            if self.precision_choice is not None and hasattr(getattr(logger, "experiment", None), "add_text"):
                logger.experiment.add_text("precision", self.precision_choice.reason, 0)
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
    cause first, with the key as typed; ``trainer.precision`` also takes ``auto``, resolved before the Trainer is
    built (:mod:`lightning_opd.cli.precision`; the pick is :attr:`precision_choice`)."""

    def __init__(self, args=None, run: bool = True, **kwargs) -> None:
        #: what ``trainer.precision: auto`` resolved to (``None``: not asked)
        self.precision_choice = None
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("save_config_callback", HparamsSaveConfigCallback)
        kwargs.setdefault("parser_class", OPDArgumentParser)
        super().__init__(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         parser_kwargs={"parser_mode": "omegaconf+", "epilog": EPILOG, "formatter_class": _Formatter,
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
        classes are built, DataModule first; modules without the parameter are left alone); accept
        ``trainer.precision: auto`` (:func:`~lightning_opd.cli.precision.allow_auto_precision`)."""
        allow_auto_precision(parser)
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
        self._resolve_precision(config)

    def _resolve_precision(self, config) -> None:
        """``trainer.precision: auto`` -> the pick (:func:`~lightning_opd.cli.precision.resolve_config_precision`),
        kept as :attr:`precision_choice` and handed to the hparams logger; an error is the parser's, naming the key."""
        try:
            self.precision_choice = resolve_config_precision(config)
        except ValueError as err:
            self._parser(self.subcommand).error(str(err))
        if self.precision_choice is not None:
            self.save_config_kwargs = {**self.save_config_kwargs, "precision_choice": self.precision_choice}

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

        if self.precision_choice is not None and "precision" not in kwargs:  # trainer.precision: auto, resolved
            kwargs["precision"] = self.precision_choice.trainer_precision
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

