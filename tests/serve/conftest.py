"""What the server tests share: ``serve(**config)``, a server on the tiny llama in this process."""

from __future__ import annotations

import pytest

from kvwire.serve import ServeConfig, Service
from tests.support.serve_utils import in_process


@pytest.fixture
def serve(tiny_served, tiny_folder):
    """``serve(**config)``: a context manager running a Service on the tiny llama with that config
    (``block_size`` 4 unless given), served from a thread of this process."""
    model, tokenizer = tiny_served

    def make(**config):
        return in_process(Service(ServeConfig(model=str(tiny_folder), **{"block_size": 4, **config}), model,
                                  tokenizer))
    return make
