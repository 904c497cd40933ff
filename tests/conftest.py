from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from tests.helpers import make_model, make_tokenizer, save_model_dir

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines in tests
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _auto_generator_is_hf(request, monkeypatch):
    """``data.init_args.generator: auto`` (conf/textworld/opd.yaml) resolves to HF in tests whether or not vLLM is
    installed, so fits built from the shipped configs keep their speed and their samples; tests of the choice
    itself request ``real_auto_generator``."""
    if "real_auto_generator" not in request.fixturenames:
        import lightning_opd.rollout.vllm as backend

        monkeypatch.setattr(backend, "vllm_importable", lambda: (False, "tests pin HF: tests/conftest.py"))


@pytest.fixture(autouse=True)
def _auto_precision_is_fp32(request, monkeypatch):
    """``trainer.precision: auto`` (conf/textworld/*.yaml) resolves to ``32-true`` in tests without a probe, so fits
    built from the shipped configs keep their exact fp32 values on every machine; tests of the choice itself request
    ``real_auto_precision``."""
    import lightning_opd.cli.precision as cli_precision

    monkeypatch.setenv(cli_precision.PICK_ENV, "")  # restored (unset) after the test: no pick leaks into the next
    if "real_auto_precision" not in request.fixturenames:
        import torch

        from lightning_opd.models.precision import PrecisionChoice

        import lightning_opd.models.precision as precision

        pinned = PrecisionChoice("32-true", torch.float32, {}, "tests pin auto to 32-true: tests/conftest.py")
        monkeypatch.setattr(cli_precision, "auto_precision", lambda config: pinned)
        # the experiment runner's pick (lightning_opd/experiments/runner.py), passed to its fit processes
        monkeypatch.setattr(precision, "resolve_student_precision", lambda *args, **kwargs: pinned)


@pytest.fixture
def real_auto_precision():
    """Opt out of ``_auto_precision_is_fp32``: ``trainer.precision: auto`` probes this machine."""


@pytest.fixture(scope="session")
def served_model_dirs(tmp_path_factory, tokenizer):
    """Student and teacher directories like ``model_dirs`` (same tokenizer, different weights) with a head size vLLM's
    CPU attention supports (64; the 2-layer models of ``model_dirs`` have 8), for ``vllm serve`` tests
    (:func:`tests.servers.served`)."""
    from tests.helpers import make_model

    root = tmp_path_factory.mktemp("served_models")
    out = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        model = make_model(tokenizer, seed=seed, hidden=128, heads=2, kv_heads=1)
        model.save_pretrained(str(root / name))
        tokenizer.save_pretrained(str(root / name))
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module", autouse=True)
def _stop_vllm_servers():
    """Stop the ``vllm serve`` processes a test module started through :func:`tests.servers.served` when the module
    ends. Kept for the whole session they added up (each 1-2.5 GB resident) until the CI machine (24 GB) killed
    pytest at test 1263 of 1272 (stop 48's CI)."""
    yield
    from tests.servers import stop_all

    stop_all()


@pytest.fixture
def real_auto_generator():
    """Opt out of ``_auto_generator_is_hf``: ``generator: auto`` decides by the real import."""


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return make_model(tokenizer, seed=0)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """Student and teacher directories (different random weights, same tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    return {"student": str(save_model_dir(root / "student", tokenizer, seed=0)),
            "teacher": str(save_model_dir(root / "teacher", tokenizer, seed=1))}


@pytest.fixture
def isolate(monkeypatch, tmp_path):
    """For tests that run LightningCLI in-process: relative paths resolve under ``tmp_path`` (yielded),
    ``sys.argv`` is pytest-free, and the seed environment and RNG states that ``seed_everything`` sets are
    restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-opd"])  # LightningCLI warns when pytest's argv is there
    saved = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    torch_state, py_state = torch.random.get_rng_state(), random.getstate()
    yield tmp_path
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch.random.set_rng_state(torch_state)
    random.setstate(py_state)
