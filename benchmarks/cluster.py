"""A five-agent pipeline over a Redis Cluster of three masters, next to one Redis server.

    python benchmarks/cluster.py [--json] [--repeats 3] [--pipeline examples/document_pipeline.toml]
                                 [--max-new-tokens N]

Starts its own servers on free loopback ports (``tests/support/redis_server.py``: one
``redis-server``, and three ``redis-server --cluster-enabled yes`` joined with
``redis-cli --cluster create``), then, in one process and on one model:

- ``store``: put + get of 64 B (latency) and of 16 MiB (bandwidth) on each store,
  median of ``--repeats * 5``. A cluster put takes four round trips (stage the chunks,
  lock and reserve in the metadata slot, publish in the key's slot, record) where one
  server takes two; a get takes three where one server takes two;
- ``pipeline``: the five-agent document pipeline in prefix mode over each store,
  ``--repeats`` times, alternating which store goes first; wall time, transfer time of
  all agents, and whether every agent's output is the same token ids on both.

Both stores run with a 2 GiB budget (the bookkeeping runs; nothing is evicted). All
servers share this machine's cores with the model, so this measures kvwire's own
overhead of the cluster layout, not the capacity a cluster adds across machines. The
last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # tests.support: the test suite's real-server helpers, one way to start Redis
from common import machine, positive, run_main  # noqa: E402
from tests.support.redis_server import RedisClusterNodes, RedisServer  # noqa: E402

from kvwire import PipelineSpec, hf, models, open_store  # noqa: E402
from kvwire.pipeline.linear import Pipeline  # noqa: E402

QUERY = "budget=2GiB&prefix=bench"


def put_get(store, data: bytes, repeats: int) -> float:
    """Median seconds of one put and one get of ``data`` (after a warm-up)."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        store.put("bench/value", data)
        got = store.get("bench/value")
        elapsed = time.perf_counter() - start
        if got is None or len(got) != len(data):
            raise RuntimeError(f"{store.url} lost the benchmark value")
        if i:
            times.append(elapsed)
    store.delete("bench/value")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--pipeline", type=Path, default=ROOT / "examples" / "document_pipeline.toml")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per agent (default: the file's)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the servers below
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    work = Path(tempfile.mkdtemp(prefix="kvwire-cluster-bench-"))
    single = RedisServer(work / "single").start()
    cluster = RedisClusterNodes(work / "cluster").start()
    try:
        urls = {"single": single.url(QUERY), "cluster": cluster.url(QUERY)}
        stores = {name: open_store(url) for name, url in urls.items()}
        small, big = os.urandom(64), os.urandom(16 << 20)
        store_rows = {}
        for name, store in stores.items():
            latency = put_get(store, small, 5 * args.repeats)
            heavy = put_get(store, big, args.repeats)
            store_rows[name] = {"latency_s": latency, "put_get_16MiB_s": heavy,
                                "bandwidth": len(big) / max(heavy - latency, 1e-9)}
            say(f"{name:8} put+get 64 B {latency * 1000:.2f} ms, 16 MiB {heavy * 1000:.1f} ms")
        for store in stores.values():
            store.close()

        model, tokenizer = hf.load_model(models.resolve())
        spec = hf.model_spec(model)
        workload = PipelineSpec.from_toml(args.pipeline)
        if args.max_new_tokens is not None:
            workload = workload.with_max_new_tokens(args.max_new_tokens)
        runs: dict[str, list] = {"single": [], "cluster": []}
        for repeat in range(args.repeats + 1):  # the first round warms both up and is not counted
            order = ("single", "cluster") if repeat % 2 == 0 else ("cluster", "single")
            for name in order:
                with open_store(urls[name]) as store:
                    pipeline = Pipeline(model, tokenizer, workload, store=store, model_spec=spec)
                    result = pipeline.run("prefix")
                    pipeline.release(result.session)
                if repeat:
                    runs[name].append(result)
                    say(f"{name:8} repeat {repeat}: {result.total_s:.2f} s, transfer "
                        f"{sum(a.transfer_s for a in result.agents):.3f} s")
        pipeline_rows = {}
        for name, results in runs.items():
            pipeline_rows[name] = {
                "total_s": statistics.median(r.total_s for r in results),
                "transfer_s": statistics.median(sum(a.transfer_s for a in r.agents) for r in results),
                "cached_tokens": [a.cached_tokens for a in results[0].agents],
                "packet_bytes": sum(a.packet_bytes for a in results[0].agents),
                "per_repeat_s": [r.total_s for r in results],
            }
        identical = all(a.output_ids == b.output_ids for r1, r2 in zip(runs["single"], runs["cluster"])
                        for a, b in zip(r1.agents, r2.agents))
        ratio = pipeline_rows["cluster"]["total_s"] / pipeline_rows["single"]["total_s"]
        say(f"pipeline ({len(workload.agents)} agents, prefix): single {pipeline_rows['single']['total_s']:.2f} s, "
            f"cluster {pipeline_rows['cluster']['total_s']:.2f} s (cluster / single {ratio:.3f}); "
            f"transfer {pipeline_rows['single']['transfer_s']:.3f} s vs {pipeline_rows['cluster']['transfer_s']:.3f} s;"
            f" outputs identical: {identical}")
    finally:
        cluster.stop()
        single.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"workload": workload.name, "agents": len(workload.agents), "repeats": args.repeats,
                          "max_new_tokens": args.max_new_tokens,
                          "store": store_rows, "pipeline": pipeline_rows, "cluster_over_single": ratio,
                          "transfer_cluster_over_single": pipeline_rows["cluster"]["transfer_s"]
                          / pipeline_rows["single"]["transfer_s"],
                          "identical": identical, "machine": machine()}))


if __name__ == "__main__":
    run_main(main)
