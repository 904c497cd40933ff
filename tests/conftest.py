from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import make_model, make_tokenizer, save_model_dir

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines in tests
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


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
