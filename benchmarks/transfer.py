"""Moving packets: put + get per store backend and encoding, against a plain in-memory copy.

    python benchmarks/transfer.py [--json] [--tokens 512 2048 8192] [--repeats 5]
                                  [--redis-url redis://127.0.0.1:6379/0] [--skip-pipeline]

Packets hold real SmolLM2-135M K/V (up to 2048 tokens; 8192-token packets tile the
real 2048-token one, see benchmarks/codec.py). For each size, encoding and store:

- ``put_get_s``: store.put of the encoded bytes, then store.get and a read of every
  page of what came back (a mapped file counts as read only when touched), median;
- ``copy_s``: a plain in-memory copy of the same bytes into new memory (a fresh
  anonymous mapping: the page faults any new buffer pays, as a store's put does),
  and ``ratio`` = put_get_s / copy_s (targets: /dev/shm <= 3, Redis on loopback <= 10);
  ``memcpy_s``: the same copy into a warm, reused buffer (no page faults: a floor no
  store that hands out new buffers can reach, shown for scale);
- ``encode_s`` / ``decode_s`` of the codec for that encoding.

Then the five-agent document pipeline, prefix vs text, over ``memory://`` and over
Redis on loopback, and with int8 packets vs fp32 packets (greedy token agreement of
every agent's output). A redis-server is started on a free loopback port unless
``--redis-url`` is given. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvwire import PipelineSpec, hf, models, open_store
from kvwire.wire import codec
from kvwire.wire.codec import CodecOptions
from kvwire.evals.fidelity import token_agreement
from kvwire.pipeline.linear import Pipeline

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from codec import corpus_ids, prefill, tiled  # noqa: E402
from common import machine, median_time, positive, run_main  # noqa: E402

ENCODINGS = ("fp32", "fp16", "bf16", "int8", "int4")


def start_redis(workdir: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A redis-server on a free port (or on ``port``: the same server again after a kill)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server), or pass --redis-url")
    if port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--proto-max-bulk-len", "1gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("redis-server did not start") from None
            time.sleep(0.01)
    return proc, f"redis://127.0.0.1:{port}/0"


def fresh_copy(data: bytes) -> None:
    """Copy ``data`` into new memory: an anonymous mapping, so every page is faulted in fresh
    (malloc would sometimes reuse warm pages and sometimes not, which made this floor jump 5x)."""
    import mmap

    target = mmap.mmap(-1, len(data))
    target.write(data)
    target.close()


def touch(buffer) -> None:
    """Read every page of ``buffer`` (zero-copy views are only fetched when read)."""
    view = np.frombuffer(buffer, dtype=np.uint8)
    int(view[::4096].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=positive, default=5)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--skip-pipeline", action="store_true")
    args = parser.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    model, tokenizer = hf.load_model(models.resolve())
    spec = hf.model_spec(model)
    work = Path(tempfile.mkdtemp(prefix="kvwire-transfer-"))
    redis_proc = None
    redis_url = args.redis_url
    if redis_url is None:
        redis_proc, redis_url = start_redis(work)
    urls = {"memory": "memory://", "shm": f"file:///dev/shm/kvwire-transfer-{work.name}",
            "disk": f"file://{work}/store", "redis": redis_url}
    try:
        real_max = min(max(args.tokens), 2048)
        ids = corpus_ids(tokenizer, real_max)
        base = hf.extract(prefill(model, ids[:real_max]), spec, torch.tensor([ids[:real_max]]))
        sizes = []
        for tokens in args.tokens:
            packet = tiled(base, tokens) if tokens > real_max else (
                base if tokens == real_max else hf.extract(prefill(model, ids[:tokens]), spec,
                                                           torch.tensor([ids[:tokens]])))
            rows = []
            for encoding in ENCODINGS:
                options = CodecOptions(encoding=encoding)
                data = codec.encode(packet, options=options)
                encode_s = median_time(lambda: codec.encode(packet, options=options), max(2, args.repeats // 2))
                decode_s = median_time(lambda: codec.decode(data, options=options), max(2, args.repeats // 2))
                copy_s = median_time(lambda: fresh_copy(data), args.repeats)
                warm = np.empty(len(data), dtype=np.uint8)
                memcpy_s = median_time(lambda: np.copyto(warm, np.frombuffer(data, dtype=np.uint8)), args.repeats)
                row = {"encoding": encoding, "bytes": len(data), "encode_s": encode_s, "decode_s": decode_s,
                       "copy_s": copy_s, "memcpy_s": memcpy_s, "stores": {}}
                for name, url in urls.items():
                    with open_store(url) as store:
                        def put_get():
                            store.put("bench/packet", data)
                            touch(store.get("bench/packet"))

                        seconds = median_time(put_get, args.repeats)
                        store.delete("bench/packet")
                    row["stores"][name] = {"put_get_s": seconds, "ratio": seconds / copy_s}
                rows.append(row)
                say(f"{tokens:5} tokens {encoding:5} {len(data) / 2**20:7.1f} MiB copy {copy_s * 1000:6.1f} ms "
                    + " ".join(f"{n} {v['put_get_s'] * 1000:7.1f} ms ({v['ratio']:.1f}x)"
                               for n, v in row["stores"].items())
                    + f" | encode {encode_s * 1000:.0f} ms decode {decode_s * 1000:.0f} ms")
            sizes.append({"tokens": tokens, "synthetic": tokens > real_max, "rows": rows})

        pipelines = {}
        if not args.skip_pipeline:
            workload = PipelineSpec.from_toml(ROOT / "examples" / "document_pipeline.toml")
            for name in ("memory", "redis"):
                comparison = Pipeline(model, tokenizer, workload, store=urls[name], model_spec=spec).compare("prefix")
                pipelines[name] = {"speedup": comparison.speedup, "efficiency": comparison.efficiency,
                                   "ttft_speedup": comparison.ttft_speedup, "identical": comparison.identical,
                                   "transfer_s": sum(a.transfer_s for a in comparison.other.agents)}
                say(f"pipeline over {name}: {pipelines[name]}")
            runs = {}
            for encoding in ("fp32", "int8"):
                runs[encoding] = Pipeline(model, tokenizer, workload, model_spec=spec,
                                          codec_options=CodecOptions(encoding=encoding)).run("prefix")
            agreement = [token_agreement(a.output_ids, b.output_ids)[0]
                         for a, b in zip(runs["fp32"].agents, runs["int8"].agents)]
            pipelines["int8_vs_fp32"] = {"agreement": statistics.mean(agreement), "per_agent": agreement,
                                         "bytes_fp32": sum(a.packet_bytes for a in runs["fp32"].agents)}
            say(f"int8 vs fp32 packets, five agents: agreement {statistics.mean(agreement):.1%} {agreement}")
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=30)
        shutil.rmtree(urls["shm"].removeprefix("file://"), ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"sizes": sizes, "pipelines": pipelines, "machine": machine(), "repeats": args.repeats}))


if __name__ == "__main__":
    run_main(main)
