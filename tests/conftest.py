"""Shared fixtures: tiny random models (fast, for exactness) and the real default model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return tiny.tokenizer()


@pytest.fixture(scope="session", params=tiny.ARCHS)
def tiny_model(request, tiny_tokenizer):
    """(arch, model, spec) for each tiny architecture."""
    from kvwire import hf

    model = tiny.model(request.param, len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    return request.param, model, hf.model_spec(model)


@pytest.fixture(scope="session")
def real_model():
    """(model, tokenizer, spec) of the bundled SmolLM2-135M-Instruct (converted on first use)."""
    from kvwire import hf, models

    model, tokenizer = hf.load_model(models.resolve())
    return model, tokenizer, hf.model_spec(model)
