"""Text environments: the ``TextEnv`` protocol and the adapters.

Adapters (name the factory in a config as ``data.init_args.env.class_path``; the benchmark ones import their package
only when built, so this package imports without them):

- ``lightning_opd.envs.textworld_env.TextWorldEnvFactory``: TextWorld games made by ``lightning-opd make-games``.
- ``lightning_opd.envs.search_qa.SearchQAEnvFactory``: Search-QA (``lightning-opd make-search-qa``).
- ``lightning_opd.envs.textworld_express.TextWorldExpressEnvFactory``: TextWorldExpress (CookingWorld, Coin, ...;
  ``make install-benchmarks``).
- ``lightning_opd.envs.scienceworld_env.ScienceWorldEnvFactory``: ScienceWorld (``make install-benchmarks``).
"""

from lightning_opd.envs.base import EnvFactory, StepResult, TextEnv

__all__ = ["TextEnv", "EnvFactory", "StepResult"]
