"""``lightning-opd`` front end (lightning_opd/cli/__init__.py, fit.py, config_checks.py): the help lists every command, ``predict`` is refused,
helpers check their arguments before any work and never replace output without ``--force``, config errors
name the key or file first, ``trainer.gradient_clip_val`` points to ``model.init_args.grad_clip_norm``,
``validate`` prints rounded metrics, ``fit`` says where the student went, the debug overlay keeps its own
output, and a non-terminal stdout gets the plain step printer."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

from lightning_opd.callbacks.progress import EpisodeProgressBar, StepLinePrinter
from lightning_opd.cli import COMMANDS, HELPERS, OPDCLI, cause_first, main
from tests.test_configs import BASE, CONF, build, games_dir, search_qa_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:No seed found")


# ------------------------------------------------------------------------------------------ --help
def test_main_help_lists_every_helper_and_no_predict(exits):
    code, out = exits(["--help"])
    assert code == 0
    assert set(HELPERS) == set(COMMANDS)
    for name in ("prepare-model", "make-games", "make-search-qa", "merge-adapter", "results", "report", "evaluate",
                 "compare", "fit", "validate", "test"):
        assert f"\n    {name}" in out or f"\n  {name}" in out, name
    assert "predict" not in out.split("helper commands")[0]  # not offered as a subcommand


def test_predict_is_refused_with_what_to_use(exits):
    code, out = exits(["predict", "--config", str(BASE)])
    assert code == 2
    assert "`lightning-opd predict` is not supported" in out and "lightning-opd evaluate" in out


# ------------------------------------------------------------------------------------- config errors
def test_cause_first_names_the_full_key():
    message = ('Parser key "model":\n  Does not validate against any of the Union subtypes\n  Subtypes: [A, B]\n'
               "  Errors:\n    - Problem with given class_path 'lightning_opd.learner.OPDModule':\n"
               '        Parser key "micro_batch_size":\n          Expected a <class \'int\'>. Got value: abc\n'
               "    - Expected a <class 'NoneType'>\n  Given value type: <class 'str'>\n  Given value: abc")
    first = cause_first(message).splitlines()[0]
    assert first == ("model.init_args.micro_batch_size: Expected a <class 'int'>. Got value: abc "
                     "(class lightning_opd.learner.OPDModule)")
    assert cause_first("plain message") == "plain message"


def test_config_error_shows_the_cause_first(exits, tmp_path):
    code, out = exits(["fit", "--config", str(BASE), "--model.init_args.micro_batch_size=abc",
                               f"--model.init_args.student={tmp_path / 'none'}"])
    assert code == 2
    assert out.startswith("error: model.init_args.micro_batch_size: Expected a <class 'int'>. Got value: abc")


def test_corrupt_yaml_config_names_the_file(exits, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: [1\n")
    code, out = exits(["fit", "--config", str(BASE), "--config", str(bad)])
    assert code == 2 and f"error: config file {bad} is not valid YAML" in out


def test_gradient_clip_val_points_to_grad_clip_norm(exits, tmp_path):
    code, out = exits(["fit", "--config", str(BASE), "--trainer.gradient_clip_val=0.5",
                               f"--model.init_args.student={tmp_path / 'none'}"])
    assert code == 2
    assert ("trainer.gradient_clip_val=0.5: OPDModule optimizes manually and clips the gradient norm itself; set "
            "model.init_args.grad_clip_norm=0.5 instead") in out


# --------------------------------------------------------------------------- linked arguments
def test_bad_max_turns_names_the_data_key_not_the_linked_copy(exits, games_dir, tmp_path):
    """``model.init_args.max_logged_turns`` is linked to ``data.init_args.max_turns`` (cli.LINKS), applied when
    the classes are built, DataModule first: the DataModule's own check reports the key the user typed."""
    code, out = exits(["fit", "--config", str(BASE), "--data.init_args.max_turns=-1",
                               f"--data.init_args.env.init_args.games_dir={games_dir}", "--trainer.logger=false",
                               f"--model.init_args.student={tmp_path / 'none'}"])
    assert code == 2
    assert out.startswith("error: data.init_args.max_turns=-1 must be >= 1 (building lightning_opd.data.RolloutDataModule)")
    assert "max_logged_turns" not in out and "Traceback" not in out


def test_print_config_has_no_frozen_copy_of_a_linked_value(exits):
    for files in ([BASE], [CONF / "textworld" / "turnopd.yaml"], [CONF / "search_qa" / "opd.yaml"]):
        code, out = exits(["fit", *[a for f in files for a in ("--config", str(f))],
                                   "--data.init_args.max_turns=5", "--print_config"])
        assert code in (0, None)
        cfg = yaml.safe_load(out)
        assert cfg["data"]["init_args"]["max_turns"] == 5
        assert "max_logged_turns" not in cfg["model"]["init_args"], files
    for path in [*CONF.rglob("*.yaml"), *(CONF.parent / "tutorials").rglob("*.yaml")]:
        assert not re.search(r"^\s*max_logged_turns\s*:", path.read_text(), re.M), f"{path}: the link sets it"


def test_linked_value_follows_the_data(model_dirs, games_dir, search_qa_dir, tmp_path):
    data = {"games_dir": games_dir, "data_dir": search_qa_dir}
    cli, _, _ = build([BASE], model_dirs, data, tmp_path, extra=["--data.init_args.max_turns=5"])
    assert cli.datamodule.max_turns == cli.model.step_metrics.num_turns == 5


# ---------------------------------------------------------------------------------- hyper-parameters
def test_run_config_is_logged_as_hyperparameters(capsys, model_dirs, games_dir, tmp_path):
    """``hparams.yaml`` and TensorBoard's HPARAMS hold the parsed run config (not ``{}``), from
    :class:`~lightning_opd.cli.HparamsSaveConfigCallback` at setup; the Trainer logs no second, empty set."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    main(["validate", "--config", str(BASE), f"--model.init_args.student={model_dirs['student']}",
          f"--model.init_args.teacher={model_dirs['teacher']}", f"--data.init_args.env.init_args.games_dir={games_dir}",
          f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}", "--trainer.limit_val_batches=0",
          "--model.init_args.optimizer.init_args.lr=3e-5"])
    run = tmp_path / "logs" / "opd" / "version_0"
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["model"]["init_args"]["optimizer"]["init_args"]["lr"] == pytest.approx(3e-5)
    assert hparams["data"]["init_args"]["max_turns"] == 8 and hparams["trainer"]["max_steps"] == 20
    assert hparams["model"]["class_path"] == "lightning_opd.learner.OPDModule" and "config" not in hparams
    events = EventAccumulator(str(run), size_guidance={"tensors": 0}).Reload()
    starts = [e for e in events.summary_metadata if e == "_hparams_/session_start_info"]
    assert len(starts) == 1
    plugin = events.SummaryMetadata("_hparams_/session_start_info").plugin_data.content
    assert b"model/init_args/optimizer/init_args/lr" in plugin


# --------------------------------------------------------------------------------- debug overlay
def test_debug_overlay_keeps_its_own_export_and_logs(exits):
    """The README's 2-step smoke run must not overwrite the demo's student or write into its log folder."""
    code, out = exits(["fit", "--config", str(BASE), "--config", str(CONF / "debug/fast_dev_run.yaml"),
                               "--print_config"])
    assert code in (0, None)
    cfg = yaml.safe_load(out)
    assert cfg["model"]["init_args"]["export_dir"] == "artifacts/models/student-debug"
    assert cfg["trainer"]["logger"]["init_args"]["name"] == "debug"
    for path in sorted(CONF.rglob("*.yaml")):
        own = yaml.safe_load(path.read_text()) or {}
        if path.parent.name == "debug":
            continue
        assert ((own.get("model") or {}).get("init_args") or {}).get("export_dir") != "artifacts/models/student-debug"
        logger = (own.get("trainer") or {}).get("logger") or {}
        assert not isinstance(logger, dict) or (logger.get("init_args") or {}).get("name") != "debug", path


# ----------------------------------------------------------------------- printing after the commands
def test_validate_prints_metrics_rounded(capsys):
    fake = SimpleNamespace(subcommand="validate", trainer=SimpleNamespace(callback_metrics={
        "val/success": torch.tensor(0.9200000166893005), "val/episodes": torch.tensor(50.0),
        "train/kl": torch.tensor(0.123456)}))
    OPDCLI.after_validate(fake)
    assert capsys.readouterr().out == "val/episodes  50\nval/success   0.92\n"


def test_fit_says_where_the_student_was_exported(capsys, tmp_path):
    export = tmp_path / "student"
    fake = SimpleNamespace(model=SimpleNamespace(export_dir=str(export)), trainer=SimpleNamespace(interrupted=False))
    OPDCLI.after_fit(fake)
    assert capsys.readouterr().out == ""  # nothing exported, nothing claimed
    export.mkdir()
    (export / "config.json").write_text("{}")
    OPDCLI.after_fit(fake)
    assert capsys.readouterr().out == f"student exported to {export.resolve()}\n"


def test_progress_display_follows_the_terminal(model_dirs, games_dir, search_qa_dir, tmp_path, monkeypatch):
    data = {"games_dir": games_dir, "data_dir": search_qa_dir}
    cli, _, _ = build([BASE], model_dirs, data, tmp_path)  # pytest captures stdout: not a terminal
    assert isinstance(cli.trainer.progress_bar_callback, StepLinePrinter)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    cli, _, _ = build([BASE], model_dirs, data, tmp_path)
    assert type(cli.trainer.progress_bar_callback) is EpisodeProgressBar
    cli, _, _ = build([BASE], model_dirs, data, tmp_path, extra=["--trainer.enable_progress_bar=false"])
    assert cli.trainer.progress_bar_callback is None

