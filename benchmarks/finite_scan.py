"""What the NaN/Inf scan costs at decode: decode with and without it, side by side.

    python benchmarks/finite_scan.py [--json] [--tokens 500 3000] [--encodings fp32 int8] [--repeats 15]

Packets have the default model's cache shape (SmolLM2-135M: 30 layers x 3 KV heads x
64, fp32; read from its config, no weights loaded) and random normal K/V: the scan is
one summing pass whose cost depends on the bytes, not on the values. For each size
and encoding it decodes the same bytes alternately with ``check_finite`` on and off
(torch limited to one thread, as agents decode), ``--repeats`` times each after a
warm-up, and reports the medians, the scan's share ``overhead = on / off - 1`` and the
scan alone over the decoded tensors. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvwire.wire import codec, quant
from kvwire import hf, models
from kvwire.wire.codec import CodecOptions
from kvwire.wire.checks import check_finite
from kvwire.wire.packet import Packet

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, positive, run_main  # noqa: E402


def random_packet(spec: Any, tokens: int) -> Packet:
    g = torch.Generator().manual_seed(tokens)
    shape = (1, spec.num_kv_heads, tokens, spec.head_dim)
    kv = [torch.randn(shape, generator=g) for _ in range(2 * spec.num_layers)]
    return Packet(spec=spec, keys=tuple(kv[0::2]), values=tuple(kv[1::2]),
                  token_ids=torch.randint(0, spec.vocab_size, (1, tokens), generator=g),
                  mask=torch.ones(1, tokens, dtype=torch.uint8))


def side_by_side(data: bytes, repeats: int) -> tuple[float, float]:
    """Median decode seconds with the scan and without, alternating so both see the same load."""
    on, off = CodecOptions(), CodecOptions(check_finite=False)
    codec.decode(data, options=on)
    codec.decode(data, options=off)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for scan, options in ((True, on), (False, off)):
            start = time.perf_counter()
            codec.decode(data, options=options)
            times[scan].append(time.perf_counter() - start)
    return statistics.median(times[True]), statistics.median(times[False])


def scan_alone(packet: Packet, encoding: str, repeats: int) -> float:
    def scan() -> None:
        for layer, (k, v) in enumerate(zip(packet.keys, packet.values)):
            check_finite(layer, "keys", k, encoding)
            check_finite(layer, "values", v, encoding)

    scan()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        scan()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--tokens", type=int, nargs="+", default=[500, 3000])
    parser.add_argument("--encodings", nargs="+", default=["fp32", "int8"], choices=quant.ENCODINGS)
    parser.add_argument("--repeats", type=positive, default=15)
    parser.add_argument("--threads", type=positive, default=1, help="torch threads while decoding")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = hf.spec_from_pretrained(models.resolve())
    rows = []
    for tokens in args.tokens:
        packet = random_packet(spec, tokens)
        for encoding in args.encodings:
            data = codec.encode(packet, options=CodecOptions(encoding=encoding))
            with_scan, without = side_by_side(data, args.repeats)
            alone = scan_alone(codec.decode(data, options=CodecOptions(check_finite=False)), encoding, args.repeats)
            row = {"tokens": tokens, "encoding": encoding, "bytes": len(data), "kv_bytes": spec.kv_bytes(tokens),
                   "decode_s": with_scan, "decode_unscanned_s": without, "scan_s": alone,
                   "overhead": with_scan / without - 1}
            rows.append(row)
            print(f"{tokens:5} tokens {encoding:5} {len(data) / 2**20:6.1f} MiB  decode {with_scan * 1e3:7.1f} ms, "
                  f"unscanned {without * 1e3:7.1f} ms (+{100 * row['overhead']:.0f}%); scan alone "
                  f"{alone * 1e3:.1f} ms ({spec.kv_bytes(tokens) / alone / 1e9:.1f} GB/s)",
                  file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"model": spec.architecture, "rows": rows, "machine": machine()}))


if __name__ == "__main__":
    run_main(main)
