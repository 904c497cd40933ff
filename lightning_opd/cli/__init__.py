"""Command line: ``lightning-opd fit|validate|test`` (LightningCLI) and a few helper commands.

    lightning-opd fit --config conf/textworld/opd.yaml            # train (LightningCLI)
    lightning-opd validate --config conf/textworld/opd.yaml       # held-out success of the student
    lightning-opd prepare-model [--out DIR]                       # SmolLM2-135M-Instruct, offline
    lightning-opd make-games [--out DIR --train N --eval N ...]   # TextWorld games, train/held-out
    lightning-opd merge-games DIR DIR ... --out DIR               # games of several quest lengths, one set
    lightning-opd make-search-qa [--out DIR --train N --eval N]  # Search-QA knowledge base + questions
    lightning-opd merge-adapter --adapter DIR --out DIR           # base + LoRA adapter -> HF directory
    lightning-opd results RUN_DIR...                              # table of val/success from TensorBoard
    lightning-opd report RUN_DIR [--out DIR]                      # report.png + report.html of one run
    lightning-opd evaluate --students PATH... --games DIR --out F # greedy success, Avg@k, teacher-trajectory KL
    lightning-opd compare [LABEL=]A.json [LABEL=]B.json ...       # paired bootstrap CIs: over runs, then tasks
    lightning-opd serve --model DIR [--port P] [-- vllm flags]    # a teacher/sampler `vllm serve`, foreground
    lightning-opd experiment EXPERIMENT.yaml [--summary]          # arms x seeds of fit + evaluate, resumable

The helper commands go through a thin dispatcher (:func:`main`) in front of LightningCLI (:mod:`.fit`; its
sub-commands are the Trainer's ``fit``, ``validate`` and ``test``; ``predict`` is refused: policies are evaluated by
playing episodes, with ``validate``, ``test`` or ``evaluate``). One module per group of helpers: :mod:`.artifacts`
(prepare-model, make-games, merge-games, make-search-qa, merge-adapter), :mod:`.analysis` (results, report, compare,
calibrate-freshness), :mod:`.evaluate`, :mod:`.serve`, :mod:`.experiment`; their shared argument types in
:mod:`.args`, the help table in :mod:`.commands`. Helpers check their arguments before any work and
never replace an existing output directory without ``--force``. Configs are composed from several
``--config`` files; ``parser_mode="omegaconf+"`` resolves ``${...}`` interpolation on the merged
configuration, after command-line overrides. Unknown keys are errors that name the key (F12); a config
error prints its innermost cause first, with the full key (``model.init_args.micro_batch_size: ...``).
When standard output is not a terminal (a log file, ``nohup``, SLURM), the progress bar is replaced by
one plain line per optimizer step (:class:`~lightning_opd.callbacks.progress.StepLinePrinter`).
Note: a YAML ``class_path`` can import any class, so configs are as trusted as code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from lightning_opd.cli.analysis import calibrate_freshness_command, compare_command, report_command, results_command
from lightning_opd.cli.artifacts import (make_games_command, make_search_qa_command, merge_adapter_command,
                                         merge_games_command, prepare_model_command)
from lightning_opd.cli.commands import HELPERS, UNSUPPORTED
from lightning_opd.cli.config_checks import cause_first
from lightning_opd.cli.evaluate import evaluate_command
from lightning_opd.cli.experiment import experiment_command
from lightning_opd.cli.fit import OPDCLI, init_parameters
from lightning_opd.cli.serve import serve_command

__all__ = ["COMMANDS", "HELPERS", "OPDCLI", "cause_first", "init_parameters", "main"]

COMMANDS: dict[str, Callable[[list[str]], object]] = {
    "prepare-model": prepare_model_command, "make-games": make_games_command, "merge-games": merge_games_command,
    "make-search-qa": make_search_qa_command,
    "merge-adapter": merge_adapter_command, "results": results_command, "report": report_command,
    "evaluate": evaluate_command, "compare": compare_command, "calibrate-freshness": calibrate_freshness_command,
    "serve": serve_command, "experiment": experiment_command}
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
