"""Tiny HF-format Qwen3 / Qwen3-MoE models for the trainer tests (OMP_NUM_THREADS=1)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from trainer_support import make_model, reference_trace  # noqa: E402


@pytest.fixture(scope="session", params=["qwen3", "qwen3-moe"])
def model_dir(request, tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("dense"), "qwen3")


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("moe"), "qwen3-moe")


@pytest.fixture(scope="session")
def dense_trace(dense_dir, tmp_path_factory) -> Path:
    return reference_trace(dense_dir, tmp_path_factory.mktemp("traces") / "dense")


@pytest.fixture(scope="session")
def moe_trace(moe_dir, tmp_path_factory) -> Path:
    return reference_trace(moe_dir, tmp_path_factory.mktemp("traces") / "moe")
