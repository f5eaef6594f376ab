"""``kvwire serve`` holds no state per request once a request is over (marker ``soak``: ``make test-soak``).

The hour-long soak (``python benchmarks/serve.py --only load --load-clients 16 --load-seconds 3600``,
BENCHMARKS.md section 6) shows whether RSS plateaus; this is its short guard, ~10 s on 2 cores: a tiny
model served in this process meets round after round of requests of every kind -- conversations whose
turns reuse published caches, streams the client drops mid-reply, requests refused (unknown model,
over-long prompt) -- and between rounds, once the server is idle, nothing a request created may remain:
no job, no engine row, no waiting entry, and the objects the garbage collector tracks may not keep growing
with the rounds (a job kept per request, tried by hand, adds ~330 a round). The store is bounded
(``memory://?budget=``), and its bytes are not such objects.
"""

from __future__ import annotations

import collections
import gc
import threading

import openai
import pytest

from kvwire import hf
from kvwire.serve import ServeConfig, Service
from tests.serve.test_serve import DOCUMENT, SYSTEM, TURNS
from tests.support.serve_utils import client, in_process, wait_for

pytestmark = pytest.mark.soak

ROUNDS = 8
SESSIONS = 4  # concurrent conversations a round


def one_round(api: openai.OpenAI, model: str, index: int) -> None:
    """SESSIONS conversations at once (each turn carries the transcript: later turns reuse earlier caches),
    one dropped stream and two refused requests."""
    def converse(session: int) -> None:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Round {index}, reader {session}.\n{DOCUMENT}\n\n{TURNS[0]}"}]
        for turn in TURNS[1:3]:
            answer = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=6)
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": turn}]

    threads = [threading.Thread(target=converse, args=(s,)) for s in range(SESSIONS)]
    for thread in threads:
        thread.start()
    stream = api.chat.completions.create(model=model, stream=True, max_tokens=40, temperature=0,
                                         messages=[{"role": "user", "content": f"Round {index}: {DOCUMENT}"}])
    next(iter(stream))
    stream.close()  # the client hangs up mid-reply
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=model, max_tokens=4,
                                    messages=[{"role": "user", "content": DOCUMENT * 200}])  # past the context
    for thread in threads:
        thread.join()


def per_request_state(service: Service) -> dict[str, int]:
    """What the scheduler and the decoder hold for requests (all of it must be empty when idle)."""
    scheduler = service.scheduler
    decoder = scheduler.decoder
    held = {"ready": len(scheduler._ready), "running": len(scheduler._running), "in_flight": scheduler._in_flight}
    for name in ("waiting", "rows", "keys"):
        if isinstance(getattr(decoder, name, None), dict):
            held[f"decoder.{name}"] = len(getattr(decoder, name))
    engine = getattr(decoder, "engine", None)
    if engine is not None:
        held["engine.busy"] = int(engine.busy)
    return held


def live_objects() -> collections.Counter:
    """The objects the garbage collector tracks, by type (what a request would leave behind: its job, its
    dicts and lists, its futures and buffers' wrappers). Bytes and strings are not tracked, so a store's
    contents, bounded by its own budget (tests/store/test_store.py), are not counted."""
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def test_per_request_state_does_not_grow_with_requests(tiny_folder):
    model, tokenizer = hf.load_model(tiny_folder)
    service = Service(ServeConfig(model=str(tiny_folder), block_size=4, store="memory://soak?budget=4MiB",
                                  max_batch=4), model, tokenizer)
    counts = []
    with in_process(service) as server:
        api = client(server.url)
        name = api.models.list().data[0].id
        for index in range(ROUNDS):
            one_round(api, name, index)
            wait_for(lambda: not any(per_request_state(service).values()), "the server to hold no request",
                     timeout=60)
            counts.append(live_objects())
        held = per_request_state(service)
    totals = [sum(c.values()) for c in counts]
    grown = counts[-1] - counts[-5]  # by type, over the last four rounds (the first rounds warm up)
    print("objects after each round:", totals, "grown over the last four:", grown.most_common(8))
    # 11 requests a round; between rounds the count moves by up to ~110 objects either way (connections,
    # threads' frames). A request's job kept is tens of objects: hundreds over the last four rounds
    assert totals[-1] - totals[-5] < 150, (totals, grown.most_common(8))
    assert held == {key: 0 for key in held}
