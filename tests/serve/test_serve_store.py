"""What ``kvwire serve`` does when the store holds something it must not serve, or goes away.

A corrupt or foreign packet is refused, counted and recomputed: the answer is the one
a server without reuse gives. An unreachable store (a real redis-server, killed or
never started) never fails a request: the server serves without reuse, says so in
``/health`` and in one log line, and uses the store again once it is back.
"""

from __future__ import annotations

import logging

import torch

from kvwire.kv import chain
from kvwire import hf
from kvwire.serve.prefix_index import PrefixIndex
from kvwire.store import open_store
from tests.support.serve_utils import client, get_json, metric, wait_for

QUESTION = [{"role": "system", "content": "You are the fixer."},
            {"role": "user", "content": "def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)"}]


def ask(server, messages=QUESTION):
    api = client(server.url)
    return api.chat.completions.create(model=api.models.list().data[0].id, messages=messages, temperature=0,
                                       max_tokens=12)


def follow_up(answer):
    return QUESTION + [{"role": "assistant", "content": answer.choices[0].message.content},
                       {"role": "user", "content": "Now fix it."}]


def test_corrupt_packets_are_refused_counted_and_recomputed(serve):
    with serve(store="memory://serve-corrupt") as server, serve(reuse=False) as plain:
        first = ask(server)
        store = open_store("memory://serve-corrupt")
        packets = store.keys("packets/")
        assert packets
        for key in packets:  # flip one byte of K/V data in every published packet
            data = bytearray(store.get(key))
            data[-3] ^= 0xFF
            store.put(key, bytes(data))
        second = ask(server, follow_up(first))
        assert second.choices[0].message.content == ask(plain, follow_up(first)).choices[0].message.content
        assert second.usage.prompt_tokens_details.cached_tokens == 0
        rebuilds = second.model_extra["kvwire"]["rebuilds"]
        assert len(rebuilds) == 1 and rebuilds[0].startswith("corrupt: ") and "checksum" in rebuilds[0]
        assert metric(server.root, "kvwire_rebuilds_total", reason="corrupt") == 1
        # the recomputed request published a good copy: the next one reuses it again
        again = ask(server, follow_up(first))
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_a_foreign_packet_is_never_served(serve, tiny_tokenizer, tiny_served):
    """The index names a valid packet of the same tokens made by other weights: refused as foreign."""
    from tests.support import tiny

    with serve(store="memory://serve-foreign") as server, serve(reuse=False) as plain:
        first = ask(server)
        store = open_store("memory://serve-foreign")
        fingerprint = get_json(f"{server.root}/health")["fingerprint"]
        index = PrefixIndex(fingerprint, 4)
        entries = store.keys(f"{index.namespace}/prefix/")
        head = bytes(store.get(entries[0])).decode()
        ours = chain.receive(store, head, hf.model_spec(tiny_served[0])).context
        other = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=1)
        cache = hf.new_cache(other)
        with torch.inference_mode():
            other(input_ids=ours.token_ids, past_key_values=cache, use_cache=True)
        foreign = chain.publish(store, hf.extract(cache, hf.model_spec(other), ours.token_ids), options=None)
        for key in entries:
            store.put(key, foreign.encode())
        second = ask(server, follow_up(first))
        assert second.choices[0].message.content == ask(plain, follow_up(first)).choices[0].message.content
        assert second.usage.prompt_tokens_details.cached_tokens == 0
        assert second.model_extra["kvwire"]["rebuilds"][0].startswith("foreign: ")
        assert metric(server.root, "kvwire_rebuilds_total", reason="foreign") == 1


def test_a_corrupt_index_entry_is_refused(serve):
    with serve(store="memory://serve-bad-index") as server:
        first = ask(server)
        store = open_store("memory://serve-bad-index")
        for key in store.keys("serve/"):
            store.put(key, b"not a packet id")
        second = ask(server, follow_up(first))
        assert second.usage.prompt_tokens_details.cached_tokens == 0
        assert second.model_extra["kvwire"]["rebuilds"][0].startswith("corrupt: ")


def test_redis_down_at_start_then_back(serve, tmp_path, caplog):
    from tests.support.redis_server import RedisServer

    redis = RedisServer(tmp_path / "redis")  # chooses a free port; nothing listens there yet
    url = redis.url("connect_timeout=0.5&timeout=2")
    caplog.set_level(logging.WARNING, logger="kvwire.serve")
    with serve(store=url, store_retry_s=0.2) as server, serve(reuse=False) as plain:
        health = get_json(f"{server.root}/health")
        assert health["status"] == "degraded" and health["store_status"] == "degraded"
        assert "connection refused" in health["store_error"]
        answers = [ask(server), ask(server)]
        assert all(a.usage.prompt_tokens_details.cached_tokens == 0 for a in answers)
        assert answers[0].model_extra["kvwire"]["store"] == "degraded"
        assert answers[0].choices[0].message.content == ask(plain).choices[0].message.content
        unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(unreachable) == 1 and "serving without reuse" in unreachable[0].getMessage()
        assert metric(server.root, "kvwire_store_degraded") == 1
        redis.start()
        try:
            wait_for(lambda: get_json(f"{server.root}/health")["status"] == "ok", "the store to be back")
            assert any("reachable again" in r.getMessage() for r in caplog.records)
            first = ask(server)
            assert ask(server, follow_up(first)).usage.prompt_tokens_details.cached_tokens > 0
        finally:
            redis.stop()


def test_redis_lost_mid_conversation(serve, tmp_path):
    from tests.support.redis_server import RedisServer

    redis = RedisServer(tmp_path / "redis").start()
    try:
        with serve(store=redis.url("connect_timeout=0.5&timeout=2"), store_retry_s=0.2) as server, \
                serve(reuse=False) as plain:
            first = ask(server)
            redis.kill()
            second = ask(server, follow_up(first))  # served, without reuse
            assert second.choices[0].message.content == ask(plain, follow_up(first)).choices[0].message.content
            assert second.usage.prompt_tokens_details.cached_tokens == 0
            assert second.model_extra["kvwire"]["rebuilds"][0].startswith("store-unreachable: ")
            assert get_json(f"{server.root}/health")["status"] == "degraded"
            redis.start()
            wait_for(lambda: get_json(f"{server.root}/health")["status"] == "ok", "the store to be back")
            third = ask(server, follow_up(first))  # the store lost everything (no persistence): published anew
            assert ask(server, follow_up(first)).usage.prompt_tokens_details.cached_tokens == \
                third.usage.prompt_tokens - 1
    finally:
        redis.stop()


def test_packets_read_again_come_from_this_process():
    """In front of a remote store, packet bytes this process put or got are read back locally; other keys
    always go to the store, and the local copies stay within their byte bound."""
    from kvwire.store.local import LocalPackets
    from kvwire.store import MemoryStore

    remote = MemoryStore()
    local = LocalPackets(remote, max_bytes=100)
    local.put("packets/a", b"x" * 60)
    remote.put("packets/b", b"y" * 30)
    assert local.get("packets/b") == b"y" * 30 and local.hits == 0  # fetched, and kept
    remote.delete("packets/a")
    remote.delete("packets/b")
    assert local.get("packets/a") == b"x" * 60 and local.get("packets/b") == b"y" * 30 and local.hits == 2
    local.put("serve/index", b"1")
    remote.delete("serve/index")
    assert local.get("serve/index") is None  # never kept: indexes change
    local.put("packets/c", b"z" * 50)  # over 100 bytes held: the least recently used goes
    assert local.get("packets/a") is None and local.get("packets/c") == b"z" * 50
