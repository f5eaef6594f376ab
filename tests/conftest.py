"""Shared fixtures: tiny random models (fast, for exactness), the real default model, a real Redis."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# two threads on the 2-core CI machine; OMP_NUM_THREADS=1 keeps several test runs from oversubscribing it
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(2, os.cpu_count() or 1))))

from tests.support import tiny  # noqa: E402
from tests.support.redis_server import RedisClusterNodes, RedisServer  # noqa: E402


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


@pytest.fixture(scope="session")
def second_model():
    """(model, tokenizer, spec) of Qwen2.5-Coder-0.5B-Instruct (`make models` downloads and converts it once).
    Tests using it are marked ``second_model`` and run by `make test-fuse`."""
    from kvwire import hf, models

    model, tokenizer = hf.load_model(models.resolve("qwen2.5-coder-0.5b"))
    return model, tokenizer, hf.model_spec(model)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free loopback port for the whole session (KEYS disabled: kvwire uses SCAN).
    Skipped without redis-server installed; a failure instead under KVWIRE_REQUIRE_REDIS=1."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, tiny_tokenizer):
    """The tiny llama saved as a model folder (what ``kvwire serve --model DIR`` loads)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_served(tiny_folder):
    """(model, tokenizer) loaded from :func:`tiny_folder`, as a server process would load them."""
    from kvwire import hf

    return hf.load_model(tiny_folder)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A real Redis Cluster of three masters on free loopback ports, started once for the whole session
    (about 3 s). Skipped without redis-server and redis-cli; a failure instead under KVWIRE_REQUIRE_REDIS=1."""
    cluster = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()
