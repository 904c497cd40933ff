"""``data.init_args.generator``: ``auto`` samples with vLLM when it imports and with HF otherwise (one log line
says which and why), an explicit generator wins, and the vLLM choice plays under the same context limit and in
the policy's dtype. vLLM's import is replaced here: these tests run with or without vLLM installed."""

from __future__ import annotations

import types

import pytest

import lightning_opd.rollout.session as session
import lightning_opd.rollout.vllm as vllm_backend
from lightning_opd.data import RolloutDataModule
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.vllm import VLLMGenerator
from tests.helpers import KeywordEnvFactory
from tests.test_configs import games_dir, search_qa_dir  # noqa: F401 - fixtures


@pytest.fixture
def info_lines(monkeypatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(session, "rank_zero_info", lines.append)
    return lines


def vllm_imports(monkeypatch) -> None:
    monkeypatch.setattr(vllm_backend, "_import_vllm", lambda: types.SimpleNamespace(__version__="9.9.9"))


def vllm_missing(monkeypatch) -> None:
    def fail():
        try:
            raise ModuleNotFoundError("No module named 'vllm'")
        except ImportError as err:
            raise ImportError("VLLMGenerator needs vLLM: ...") from err

    monkeypatch.setattr(vllm_backend, "_import_vllm", fail)


def test_auto_picks_vllm_when_it_imports(real_auto_generator, monkeypatch, info_lines):
    vllm_imports(monkeypatch)
    dm = RolloutDataModule(KeywordEnvFactory(), generator="auto", max_context_tokens=300)
    gen = dm.generator
    assert isinstance(gen, VLLMGenerator) and gen.llm is None  # the engine starts at the first rollout
    assert gen.max_model_len == 300 and gen.context_limit.tokens == 300  # HF's limit too (F24)
    assert gen.dtype is None and gen.follow_policy  # the policy's dtype; sync: pushes the student every step
    assert info_lines == ["data.init_args.generator=auto: sampling with vLLM (vllm 9.9.9 imports)"]


def test_auto_falls_back_to_hf_when_vllm_does_not_import(real_auto_generator, monkeypatch, info_lines):
    vllm_missing(monkeypatch)
    dm = RolloutDataModule(KeywordEnvFactory(), generator="auto")
    assert type(dm.generator) is HFGenerator and dm.generator.reuse_kv_cache
    assert info_lines == ["data.init_args.generator=auto: sampling with HF generate (vLLM does not import "
                          "(ModuleNotFoundError: No module named 'vllm'))"]


def test_auto_treats_a_broken_install_as_not_importable(real_auto_generator, monkeypatch, info_lines):
    def broken():
        raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setattr(vllm_backend, "_import_vllm", broken)
    assert type(RolloutDataModule(KeywordEnvFactory(), generator="auto").generator) is HFGenerator
    assert info_lines[0].endswith("(vLLM does not import (RuntimeError: operator torchvision::nms does not exist))")


def test_tests_pin_auto_to_hf(monkeypatch, info_lines):
    """tests/conftest.py: without ``real_auto_generator``, ``auto`` is HF even where vLLM imports."""
    vllm_imports(monkeypatch)
    assert type(RolloutDataModule(KeywordEnvFactory(), generator="auto").generator) is HFGenerator
    assert info_lines == ["data.init_args.generator=auto: sampling with HF generate (tests pin HF: tests/conftest.py)"]


def test_explicit_choices_win(real_auto_generator, monkeypatch, info_lines):
    vllm_imports(monkeypatch)
    own = HFGenerator(reuse_kv_cache=False)
    assert RolloutDataModule(KeywordEnvFactory(), generator=own).generator is own
    assert type(RolloutDataModule(KeywordEnvFactory()).generator) is HFGenerator  # the constructor default
    assert type(RolloutDataModule(KeywordEnvFactory(), generator="hf").generator) is HFGenerator
    vllm_missing(monkeypatch)  # "vllm" is asked for, not decided: no import check at construction
    assert isinstance(RolloutDataModule(KeywordEnvFactory(), generator="vllm").generator, VLLMGenerator)
    assert info_lines == []


def test_unknown_generator_name_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"data.init_args.generator='vlm': use auto, vllm, hf or a Generator"):
        RolloutDataModule(KeywordEnvFactory(), generator="vlm")


@pytest.mark.parametrize(("dtype", "policy_dtype", "engine"), [(None, "bf16", "bfloat16"), (None, None, "float32"),
                                                               ("float32", "bf16", "float32")])
def test_vllm_engine_dtype_follows_the_policy_unless_set(dtype, policy_dtype, engine):
    gen = VLLMGenerator(dtype=dtype)
    gen._policy = types.SimpleNamespace(policy_version=0, dtype_name=policy_dtype)
    assert gen.engine_dtype == engine


# --------------------------------------------------------------------------- the shipped main-job config
def test_shipped_opd_config_asks_for_auto_and_an_explicit_override_wins(real_auto_generator, monkeypatch, isolate,
                                                                        model_dirs, games_dir, search_qa_dir, tmp_path):
    """``conf/textworld/opd.yaml`` (``make demo``'s fit) samples with vLLM where it imports; a command-line or
    overlay generator replaces the choice."""
    from tests.test_configs import BASE, CONF, build

    vllm_imports(monkeypatch)
    data = {"games_dir": games_dir, "data_dir": search_qa_dir}
    cli, merged, _ = build([BASE], model_dirs, data, tmp_path)
    assert merged["data"]["init_args"]["generator"] == "auto"
    assert isinstance(cli.datamodule.generator, VLLMGenerator) and cli.datamodule.generator.max_model_len == 2048
    cli, _, _ = build([BASE], model_dirs, data, tmp_path, extra=["--data.init_args.generator=hf"])
    assert type(cli.datamodule.generator) is HFGenerator
    cli, _, _ = build([BASE, CONF / "data" / "textworld.yaml"], model_dirs, data, tmp_path)
    assert type(cli.datamodule.generator) is HFGenerator and cli.datamodule.generator.reuse_kv_cache
