"""The store side of ``benchmarks/network.py``: a process on one host that puts and gets what it is told.

Runs inside a host's network namespace (``ip netns exec NS python benchmarks/network_io.py URL``)
and answers one JSON line per request read from stdin, so a transfer is timed without the
start of a process, the model or the codec in it:

- ``{"op": "put", "key": K, "file": F}``          put the bytes of file F under K -> ``{"s": seconds, "bytes": n}``
- ``{"op": "get", "keys": [K, ...]}``             get each key in order (as a receiver fetches a chain)
                                                  -> ``{"s": seconds, "bytes": n}``
- ``{"op": "probe", "large": N}``                 :func:`kvwire.pipeline.cost.probe_store` -> its StoreCost as JSON
- ``{"op": "flush"}``                             delete every key of the store -> ``{"deleted": n}``
- ``{"op": "quit"}``                              exit

A failed request answers ``{"error": "..."}``; the process exits when stdin closes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvwire import open_store
from kvwire.pipeline.cost import probe_store
from kvwire.errors import KvwireError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_main  # noqa: E402


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python benchmarks/network_io.py STORE_URL  (requests as JSON lines on stdin; "
                 "benchmarks/network.py starts it on each host)")
    store = open_store(sys.argv[1])
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = handle(store, request)
        except KvwireError as err:
            reply = {"error": str(err)}
        if reply is None:
            break
        print(json.dumps(reply), flush=True)
    store.close()


def handle(store, request: dict) -> dict | None:
    op = request["op"]
    if op == "put":
        data = Path(request["file"]).read_bytes()
        start = time.perf_counter()
        store.put(request["key"], data)
        return {"s": time.perf_counter() - start, "bytes": len(data)}
    if op == "get":
        start, total = time.perf_counter(), 0
        for key in request["keys"]:
            value = store.get(key)
            if value is None:
                return {"error": f"{key} is not in {store.url}"}
            total += len(value)
        return {"s": time.perf_counter() - start, "bytes": total}
    if op == "probe":
        cost = probe_store(store, large=int(request.get("large", 16 << 20)))
        return {"latency_s": cost.latency_s, "put_rate": cost.put_rate, "get_rate": cost.get_rate}
    if op == "flush":
        keys = store.keys()
        for key in keys:
            store.delete(key)
        return {"deleted": len(keys)}
    if op == "quit":
        return None
    return {"error": f"unknown op {op!r}"}


if __name__ == "__main__":
    run_main(main)
