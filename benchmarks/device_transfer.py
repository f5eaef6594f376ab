"""A model's cache between its device, the host and a store: the rates that set a cache's break-even link speed.

    python benchmarks/device_transfer.py [--json] [--tokens 2048] [--repeats 5]
        [--random-weights benchmarks/configs/llama-2-7b.json --device cuda --dtype fp16]

For ``--tokens`` of the model's K/V (a real prefill's cache, extracted as a packet):

- **device -> host, host -> device, device -> device**: the cache's tensors copied whole (pinned host memory
  where the device is an accelerator; on a CPU only the copy within memory);
- **a packet through a store**: extract from the cache (device -> host), encode, put, get, decode, build the cache
  on the device again, through ``memory://`` and ``file:///dev/shm``, each stage timed;
- **the arithmetic**: the cache's bytes against the seed's 1.07 GB for 2,048 tokens of Llama-2-7B in fp16, and
  the break-even link for this cache: the link speed at which getting it costs as long as re-prefilling its tokens
  (``--tokens`` / the prefill measured here).

Medians of ``--repeats`` after one warm-up. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import RANDOM_WEIGHTS_HELP, add_model_options, load_model, machine, positive, run_main  # noqa: E402

SEED_BYTES = 1.07e9  # the seed: Llama-2-7B's fp16 K/V for 2,048 tokens


def timed(fn, repeats: int, sync) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up, the device synchronized around each."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=RANDOM_WEIGHTS_HELP)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--tokens", type=positive, default=2048)
    parser.add_argument("--repeats", type=positive, default=5)
    add_model_options(parser)
    args = parser.parse_args()

    from kvwire import hf, open_store
    from kvwire.wire import codec

    model, _, what = load_model(args)
    spec = hf.model_spec(model)
    device = hf.model_device(model)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out = sys.stderr if args.json else sys.stdout
    ids = torch.randint(3, min(10000, spec.vocab_size), (1, args.tokens), generator=torch.Generator().manual_seed(0))

    def prefill():
        cache = hf.new_cache(model)
        with torch.inference_mode():
            model(input_ids=ids.to(device), past_key_values=cache, use_cache=True)
        return cache

    prefill_s = timed(prefill, args.repeats, sync)
    cache = prefill()
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rates: dict[str, float] = {}
    if device.type != "cpu":
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        rates["device_to_host"] = nbytes / timed(lambda: [h.copy_(t, non_blocking=True) for h, t in zip(host, tensors)],
                                                 args.repeats, sync)
        rates["host_to_device"] = nbytes / timed(lambda: [t.copy_(h, non_blocking=True) for h, t in zip(host, tensors)],
                                                 args.repeats, sync)
    copies = [torch.empty_like(t) for t in tensors]
    rates["device_to_device" if device.type != "cpu" else "copy_in_memory"] = nbytes / timed(
        lambda: [c.copy_(t) for c, t in zip(copies, tensors)], args.repeats, sync)

    stores = {}
    shm = Path(tempfile.mkdtemp(prefix="kvwire-device-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        for url in ("memory://", f"file://{shm}"):
            store = open_store(url)
            stages: dict[str, list[float]] = {s: [] for s in ("extract", "encode", "put", "get", "decode", "build")}
            for repeat in range(args.repeats + 1):
                clock = {}
                sync()
                start = time.perf_counter()
                packet = hf.extract(cache, spec, ids)
                clock["extract"] = time.perf_counter() - start
                start = time.perf_counter()
                data = codec.encode(packet)
                clock["encode"] = time.perf_counter() - start
                start = time.perf_counter()
                store.put("bench", data)
                clock["put"] = time.perf_counter() - start
                start = time.perf_counter()
                got = store.get("bench")
                clock["get"] = time.perf_counter() - start
                start = time.perf_counter()
                decoded = codec.decode(got)
                clock["decode"] = time.perf_counter() - start
                start = time.perf_counter()
                hf.build_cache(decoded, model, spec)
                sync()
                clock["build"] = time.perf_counter() - start
                if repeat:  # the first is the warm-up
                    for stage, seconds in clock.items():
                        stages[stage].append(seconds)
            store.delete("bench")
            store.close()
            medians = {stage: statistics.median(s) for stage, s in stages.items()}
            stores[url.split(":")[0]] = {**medians, "total_s": sum(medians.values()), "packet_bytes": len(data)}
    finally:
        shutil.rmtree(shm, ignore_errors=True)

    get_s = stores["memory"]["total_s"]
    result = {"tokens": args.tokens, "kv_bytes": nbytes, "spec_kv_bytes": spec.kv_bytes(args.tokens),
              "seed_bytes_2048_fp16": SEED_BYTES, "prefill_s": prefill_s,
              "prefill_tokens_per_s": args.tokens / prefill_s,
              "rates_bytes_per_s": rates, "stores": stores,
              # the link at which moving the packet (beside the codec's own time) costs what re-prefilling does
              "break_even_link_bits_per_s": (8 * stores["memory"]["packet_bytes"] / (prefill_s - get_s)
                                             if prefill_s > get_s else None),
              "model": what, "machine": machine()}
    print(f"{args.tokens} tokens of K/V: {nbytes / 1e9:.3f} GB in {spec.dtype} (the seed: {SEED_BYTES / 1e9:.2f} GB "
          f"for 2,048 tokens of Llama-2-7B in fp16); prefill {prefill_s * 1000:.1f} ms "
          f"({args.tokens / prefill_s:,.0f} tokens/s)", file=out)
    for name, rate in rates.items():
        print(f"{name:18} {rate / 1e9:8.1f} GB/s", file=out)
    for name, row in stores.items():
        stages = ", ".join(f"{s} {row[s] * 1000:.1f}" for s in ("extract", "encode", "put", "get", "decode", "build"))
        print(f"through {name:7} {row['total_s'] * 1000:8.1f} ms ({stages} ms)", file=out)
    link = result["break_even_link_bits_per_s"]
    print("break-even link: " + (f"{link / 1e6:,.0f} Mbit/s (slower links: re-prefill the ids)" if link else
                                 "none (the packet's own handling costs more than the prefill)"), file=out)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    run_main(main)
