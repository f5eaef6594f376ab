"""Packet encodings on the real default model: bytes, encode/decode time and fidelity.

    python benchmarks/codec.py [--json] [--tokens 512 2048 8192] [--real-max 2048]
                               [--repeats 5] [--new-tokens 16] [--encodings fp32 fp16 bf16 int8 int4]

K/V come from running the model over real text (the example documents, then the
README and the package sources). Packets longer than ``--real-max`` tokens are built
by tiling the real ``--real-max``-token packet's tensors (a full 8192-token prefill
takes ~3 minutes on a 2-core CPU); their rows say ``"synthetic": true``, and their
fidelity is measured on that tiled cache. For each size and encoding:

- ``bytes`` of the encoded packet and ``ratio`` = fp32 bytes / bytes;
- ``encode_s`` / ``decode_s``: median of ``--repeats`` runs after a warm-up, unsigned,
  and ``encode_signed_s`` / ``decode_signed_s`` with an HMAC key, with torch limited to
  ``--codec-threads`` threads (default 1: the work is memory-bound, and on a shared
  2-core machine two OpenMP threads spin-waiting against other processes made the
  same element-wise ops up to 80x slower);
- fidelity against the fp32 packet, continuing with the real next token:
  ``agreement`` = share of the ``--new-tokens`` greedy tokens equal to the fp32
  continuation's at the same position; ``first_divergence`` (None: none);
  under teacher forcing on the fp32 continuation, ``tf_top1`` = share of positions
  whose argmax matches and ``kl_mean`` = mean KL(fp32 || encoded) of the next-token
  distributions (nats).

The last stdout line is one JSON object: {"sizes": [{"tokens", "synthetic", "rows": [...]}], ...}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvwire.wire import codec, quant
from kvwire import hf, models
from kvwire.wire.codec import CodecOptions
from kvwire.wire.packet import Packet

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, median_time, positive, run_main  # noqa: E402
TEXTS = ["examples/data/incident_report.md", "examples/data/support_conversation.txt", "README.md",
         "src/kvwire/data/review_snippet.py"]
KEY = b"benchmark-signing-key-0123456789"
log = logging.getLogger("benchmarks.codec")


def corpus_ids(tokenizer: Any, needed: int) -> list[int]:
    """Token ids of the example texts, then the package sources, at least ``needed`` + 1 of them."""
    files = [ROOT / f for f in TEXTS] + sorted((ROOT / "src" / "kvwire").glob("*.py"))
    ids: list[int] = []
    for path in files:
        ids += tokenizer(path.read_text() + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) > needed:
            return ids
    raise SystemExit(f"the corpus has only {len(ids)} tokens, {needed + 1} needed")


@torch.inference_mode()
def prefill(model: Any, ids: list[int], chunk: int = 1024) -> Any:
    cache = hf.new_cache(model)
    for start in range(0, len(ids), chunk):
        model(input_ids=torch.tensor([ids[start : start + chunk]]), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
    return cache


def tiled(packet: Packet, tokens: int) -> Packet:
    """A packet of ``tokens`` tokens made by repeating ``packet``'s tensors along T."""
    reps = -(-tokens // packet.length)

    def tile(t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([t] * reps, dim=dim).narrow(dim, 0, tokens).contiguous()

    return replace(packet, keys=tuple(tile(k, 2) for k in packet.keys), values=tuple(tile(v, 2) for v in packet.values),
                   token_ids=tile(packet.token_ids, 1), mask=tile(packet.mask, 1), checksum=None)


@torch.inference_mode()
def continuation(model: Any, spec: Any, packet: Packet, next_id: int, new_tokens: int,
                 forced: list[int] | None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after ``packet`` + ``next_id``, and fp32 log-probs under teacher forcing
    on ``forced`` (or on the greedy tokens themselves)."""
    ids = packet.token_ids[0].tolist() + [next_id]
    greedy = hf.generate(model, ids, cache=hf.build_cache(packet, model, spec), max_new_tokens=new_tokens,
                         eos_ids=frozenset()).tokens
    forced = greedy if forced is None else forced
    cache = hf.build_cache(packet, model, spec)
    logits = model(input_ids=torch.tensor([[next_id, *forced[:-1]]]), past_key_values=cache, use_cache=True).logits
    return greedy, torch.log_softmax(logits[0].float(), dim=-1)  # (new_tokens, V)


def timed(fn: Any, repeats: int, threads: int) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return median_time(fn, repeats)
    finally:
        torch.set_num_threads(before)


def measure(model: Any, spec: Any, packet: Packet, next_id: int, encodings: list[str], repeats: int,
            new_tokens: int, threads: int) -> list[dict[str, Any]]:
    plain, signed = CodecOptions(), CodecOptions(key=KEY)
    reference, ref_logp = continuation(model, spec, packet, next_id, new_tokens, None)
    fp32_bytes = len(codec.encode(packet, options=replace(plain, encoding="fp32")))
    rows = []
    for encoding in encodings:
        options, signed_options = replace(plain, encoding=encoding), replace(signed, encoding=encoding)
        data = codec.encode(packet, options=options)
        signed_data = codec.encode(packet, options=signed_options)
        row: dict[str, Any] = {
            "encoding": encoding,
            "bytes": len(data),
            "ratio": fp32_bytes / len(data),
            "encode_s": timed(lambda: codec.encode(packet, options=options), repeats, threads),
            "decode_s": timed(lambda: codec.decode(data, options=plain), repeats, threads),
            "encode_signed_s": timed(lambda: codec.encode(packet, options=signed_options), repeats, threads),
            "decode_signed_s": timed(lambda: codec.decode(signed_data, options=signed), repeats, threads),
        }
        decoded = codec.decode(data, options=plain)
        greedy, logp = continuation(model, spec, decoded, next_id, new_tokens, reference)
        matches = [a == b for a, b in zip(greedy, reference)]
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)  # (new_tokens,)
        row.update({
            "agreement": sum(matches) / len(reference),
            "first_divergence": matches.index(False) if not all(matches) else None,
            "tf_top1": float((logp.argmax(dim=-1) == torch.tensor(reference)).float().mean()),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
        })
        rows.append(row)
        log.info("%6d tokens %-5s %11d bytes %5.2fx  enc %.3fs dec %.4fs (signed %.3fs / %.4fs)  "
                 "agree %3.0f%% tf %3.0f%% kl %.2e", packet.length, encoding, row["bytes"], row["ratio"],
                 row["encode_s"], row["decode_s"], row["encode_signed_s"], row["decode_signed_s"],
                 100 * row["agreement"], 100 * row["tf_top1"], row["kl_mean"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--real-max", type=int, default=2048, help="longest packet prefilled from real text")
    parser.add_argument("--repeats", type=positive, default=5)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--codec-threads", type=positive, default=1, help="torch threads while timing the codec")
    parser.add_argument("--encodings", nargs="+", default=list(quant.ENCODINGS), choices=quant.ENCODINGS)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    model, tokenizer = hf.load_model(models.resolve(args.model))
    spec = hf.model_spec(model)
    real = min(args.real_max, max(args.tokens))
    ids = corpus_ids(tokenizer, max(args.tokens))
    start = time.perf_counter()
    full = hf.extract(prefill(model, ids[:real]), spec, torch.tensor([ids[:real]]), producer="bench")
    log.info("prefilled %d real tokens in %.1fs (load average %.1f)", real, time.perf_counter() - start,
             os.getloadavg()[0])

    sizes = []
    for tokens in args.tokens:
        synthetic = tokens > real
        if synthetic:
            packet = tiled(full, tokens)
        else:  # causal attention: the first n tokens' K/V do not depend on what follows
            packet = replace(full, keys=tuple(k[:, :, :tokens].contiguous() for k in full.keys),
                             values=tuple(v[:, :, :tokens].contiguous() for v in full.values),
                             token_ids=full.token_ids[:, :tokens], mask=full.mask[:, :tokens], checksum=None)
        rows = measure(model, spec, packet, ids[tokens], args.encodings, args.repeats, args.new_tokens,
                       args.codec_threads)
        sizes.append({"tokens": tokens, "synthetic": synthetic, "kv_bytes_fp32": packet.nbytes, "rows": rows})
    if args.json:
        print(json.dumps({"model": spec.architecture, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads,
                          "head_dim": spec.head_dim, "real_max": real, "repeats": args.repeats,
                          "new_tokens": args.new_tokens, "codec_threads": args.codec_threads,
                          "int4_key_group": quant.INT4_KEY_GROUP,
                          "sizes": sizes, "machine": machine()}))


if __name__ == "__main__":
    run_main(main)
