"""RolloutDataModule refuses bad arguments at construction, naming the key as the user types it."""

from __future__ import annotations

import pytest

from lightning_opd.data import RolloutDataModule
from tests.helpers import KeywordEnvFactory


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(producer_lead=-1), r"data.init_args.producer_lead=-1 must be >= 0"),  # sync mode: was accepted silently
    (dict(mode="async", producer_lead=0), r"data.init_args.producer_lead=0 must be >= 1 in async mode"),
    (dict(mode="lazy"), r"data.init_args.mode='lazy'"),
    (dict(eval_max_turns=0), r"data.init_args.eval_max_turns=0 must be >= 1"),  # was silently max_turns
    (dict(max_env_error_rate=1.5), r"data.init_args.max_env_error_rate=1.5 must be in \[0, 1\]"),
    (dict(max_env_error_rate=-0.1), r"data.init_args.max_env_error_rate=-0.1 must be in \[0, 1\]"),
    (dict(max_turns=0), r"data.init_args.max_turns=0 must be >= 1"),
    (dict(episodes_per_step=3, group_size=2), r"data.init_args.episodes_per_step=3 must be a multiple of "
                                              r"data.init_args.group_size=2"),
])
def test_bad_arguments_name_their_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutDataModule(env=KeywordEnvFactory(), **kwargs)


def test_edge_values_are_accepted():
    dm = RolloutDataModule(env=KeywordEnvFactory(), producer_lead=0, eval_max_turns=1, max_env_error_rate=1.0)
    assert (dm.lead_in_use, dm.eval_max_turns, dm.session.max_env_error_rate, dm.max_allowed_lag) == (0, 1, 1.0, 0)
    async_dm = RolloutDataModule(env=KeywordEnvFactory(), mode="async", producer_lead=2, weight_sync_interval=2)
    assert (async_dm.producer_lead, async_dm.max_allowed_lag) == (2, 3)  # producer lead vs the largest lag of a batch
