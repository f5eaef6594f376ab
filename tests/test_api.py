"""The public surface survives the reshape: ``from kvwire import ...`` for every name 0.1 exported,
and the old flat module names for one release, each with a DeprecationWarning naming its new place."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

import kvwire
from kvwire import _moved

EXPORTED_IN_0_1 = [
    "AgentSpec", "ChainError", "ChecksumError", "CorruptPacketError", "FileStore", "KvwireError", "MemoryStore",
    "ContextTooLong", "ModelError", "ModelMismatchError", "ModelSpec", "Packet", "PacketError", "Pipeline",
    "PipelineConfigError", "PipelineSpec", "Store", "StoreError", "TranscriptError", "UnknownStoreError", "codec",
    "fetch_chain", "join", "open_store", "publish", "receive", "RedisStore", "VersionConflict", "OverBudget",
    "PacketTooLargeError", "SignatureError", "CodecOptionsError", "CodecOptions", "EngineError", "NonFiniteError",
    "UnsupportedRopeError", "StoreUnavailable", "StoreConfigError", "StoreAccessDenied",
]


def test_every_name_exported_before_is_exported_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in EXPORTED_IN_0_1:
            assert getattr(kvwire, name) is not None, name
        from kvwire.pipeline import Pipeline
    assert set(EXPORTED_IN_0_1) <= set(kvwire.__all__)
    assert kvwire.codec is importlib.import_module("kvwire.wire.codec")
    assert Pipeline is kvwire.Pipeline is importlib.import_module("kvwire.pipeline.linear").Pipeline


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_module_name_imports_the_same_module_and_says_where_it_went(old):
    new = _moved.MOVED[old]
    sys.modules.pop(old, None)  # an earlier test may have imported it already
    if old.rpartition(".")[0] in _moved.PACKAGES:  # kvwire.graph.runner: the old package first, its warning aside
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module(old.rpartition(".")[0])
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == module.__spec__.name == new  # the alias leaves the module's own spec alone


def test_the_warning_points_at_the_importing_line():
    sys.modules.pop("kvwire.chain", None)
    with pytest.warns(DeprecationWarning, match="kvwire.chain moved to kvwire.kv.chain") as record:
        from kvwire.chain import receive
    assert receive is kvwire.receive
    assert record[0].filename == __file__


def test_old_names_as_attributes_and_the_old_graph_package():
    vars(kvwire).pop("splice", None)  # importing kvwire.splice, above, set it
    with pytest.warns(DeprecationWarning, match="kvwire.splice moved to kvwire.kv.splice") as record:
        assert kvwire.splice is importlib.import_module("kvwire.kv.splice")
    assert record[0].filename == __file__
    for name in ("kvwire.graph", "kvwire.graph.runner", "kvwire.graph.merge"):
        sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning, match="kvwire.graph moved to kvwire.pipeline.graph"):
        from kvwire.graph import GraphRunner
    with pytest.warns(DeprecationWarning, match="kvwire.graph.merge moved to kvwire.pipeline.merge"):
        import kvwire.graph.merge as merge
    assert GraphRunner is importlib.import_module("kvwire.pipeline.graph").GraphRunner
    assert merge is importlib.import_module("kvwire.pipeline.merge")
    with pytest.raises(AttributeError, match="has no attribute 'nonesuch'"):
        kvwire.nonesuch  # noqa: B018


# issue 22 moved these names; the old paths are plain re-exports (no warning): old module -> (new module, names)
REEXPORTED = {
    "kvwire.pipeline.worker": ("kvwire.store.retrying", ["Backoff", "Retry", "RetryingStore", "retrying"]),
    "kvwire.serve.reuse": ("kvwire.store.retrying", ["StoreDown", "StoreState"]),
    "kvwire.serve.local_packets": ("kvwire.store.local", ["LocalPackets", "PACKETS"]),
}


@pytest.mark.parametrize("old", sorted(REEXPORTED))
def test_names_moved_within_the_package_keep_their_old_import_paths(old):
    new, names = REEXPORTED[old]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), f"{old}.{name}"


def test_one_error_for_a_context_past_the_window():
    from kvwire.errors import ContextLengthExceeded, ContextTooLong, InvalidRequest

    error = ContextLengthExceeded("the prompt is 9,000 tokens", "shorten it", param="messages")
    assert isinstance(error, ContextTooLong) and isinstance(error, InvalidRequest)
    assert str(error) == "the prompt is 9,000 tokens (shorten it)" and error.param == "messages"


def test_import_kvwire_and_the_command_line_s_usage_errors_need_no_torch():
    """``import kvwire`` and ``import kvwire.cli`` stay clear of torch (~2.5 s to import on a 2-core CPU): the
    package's names load on first use, and a command imports the library when it runs, so ``--help`` and a usage
    error answer at once. A name used then is the same object as before."""
    import subprocess

    probe = ("import sys, kvwire, kvwire.cli; assert 'torch' not in sys.modules, 'torch'; "
             "from kvwire import Packet, codec; assert 'torch' in sys.modules; "
             "from kvwire.wire.packet import Packet as P; assert P is Packet and codec.Packet is Packet")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    usage = subprocess.run([sys.executable, "-m", "kvwire", "run", "x.toml", "--weights", "int3"], capture_output=True,
                           text=True, timeout=120)
    assert usage.returncode == 2 and "'int3' is not one of" in usage.stderr
