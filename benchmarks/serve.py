"""``kvwire serve`` end to end: reuse vs --no-reuse, across processes, after a restart, and batching.

    python benchmarks/serve.py [--json] [--max-tokens 32] [--threads 2] [--repeats 1]
                               [--redis-url redis://...] [--only pipeline restart throughput] [--quick]

Every server is its own process (``python -m kvwire serve --port 0``) on the default
model; clients are the official ``openai`` package (streaming, so time to first token
is measured where a user sees it). Each server gets one short warm-up request first.

1. pipeline: the five-agent example (examples/openai_agents.py, one shared transcript
   over the ~1500-token incident report) with reuse and with ``--no-reuse``, in the same
   process layout: ``memory://`` (one server), ``file:///dev/shm`` and Redis (two servers,
   the agents alternating between them, so every hop crosses processes). End-to-end and
   TTFT ratios, outputs compared at temperature 0, the share of each prompt that the
   *other* server served from cache, and ``kvwire run --mode prefix`` on the same
   workload in this process for reference.
2. restart: a ~3000-token conversation (examples/data/support_conversation.txt) asked
   cold of a server on a ``file://`` store on disk, then of a new server process on the
   same store: TTFT cold vs warm.
3. throughput: 4 and 8 concurrent requests with ~400-token prompts (``ignore_eos``, a
   fixed number of tokens each) decoded together vs the same requests one at a time,
   on a ``--no-reuse`` server: aggregate decode tokens/s (while all of them decode,
   timed from the streamed tokens) and end to end (prefills included); beside it, plain
   transformers batching the same prompts in this process (the targets' yardstick).

4. load: N concurrent clients (``--load-clients 4,16,64``) for ``--load-seconds`` each against one
   server (``--max-batch 8 --max-queue 32``, a ``memory://`` store with a 256 MiB budget), every
   client holding multi-turn conversations over three shared documents at temperature 0:
   requests/s, tokens/s, p50/p99 time to first token and inter-token latency, 429s (and the
   Retry-After they carried, which clients obey), 5xx (must be 0), the server's peak RSS and its
   RSS over the run (sampled), store evictions; then a sample of the completions is sent again
   one at a time and must come back identical.
5. tenants: a server with two API keys; the same ~3000-token prompt from tenant A (cold), A again,
   tenant B (its own namespace: cold), and A with a ``cache_salt`` twice: time to first token of each
   and the cached tokens reported. The second tenant's TTFT must be the cold one's.

Figures from a busy machine are preliminary. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import die_with_parent, machine, positive, run_main  # noqa: E402
from transfer import start_redis  # noqa: E402

_spec = importlib.util.spec_from_file_location("openai_agents", ROOT / "examples" / "openai_agents.py")
agents = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agents)

CONVERSATION = ROOT / "examples" / "data" / "support_conversation.txt"
WARMUP = [{"role": "user", "content": "Say hello."}]


class Server:
    """``kvwire serve`` in its own process, ready when ``GET /health`` answers."""

    def __init__(self, workdir: Path, *args: str, api_key: str = "none") -> None:
        self.log = workdir / f"serve-{time.time_ns()}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "kvwire", "serve", "--port", "0", *args],
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, cwd=ROOT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 300
        while not (found := re.search(r"listening on (http://[\d.]+:\d+)", self.log.read_text(errors="replace"))):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvwire serve did not start:\n{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        self.root = found.group(1)
        self.url = f"{self.root}/v1"
        while True:
            try:
                with urllib.request.urlopen(f"{self.root}/health", timeout=5):
                    break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"kvwire serve is not healthy:\n{self.log.read_text()[-3000:]}") from None
                time.sleep(0.05)
        client = OpenAI(base_url=self.url, api_key=api_key, max_retries=0)
        self.model = client.models.list().data[0].id
        client.chat.completions.create(model=self.model, messages=WARMUP, max_tokens=4, temperature=0)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def servers(workdir: Path, count: int, *args: str) -> list[Server]:
    return [Server(workdir, *args) for _ in range(count)]


def stop_all(running: list[Server]) -> None:
    for server in running:
        server.stop()


# -- 1. the five-agent pipeline --------------------------------------------------------------------


def pipeline_run(urls: list[str], max_tokens: int, report: str) -> dict:
    return agents.run(urls, max_tokens=max_tokens, report=report)


def compare_layout(name: str, store: str, count: int, workdir: Path, common: list[str], max_tokens: int,
                   repeats: int, report: str) -> tuple[dict, list[dict]]:
    runs = {}
    for mode in ("reuse", "no-reuse"):
        args = [*common, "--no-reuse"] if mode == "no-reuse" else [*common, "--store", store]
        totals, results = [], None
        for _ in range(repeats):
            if store.startswith("file://") and mode == "reuse":
                shutil.rmtree(store.removeprefix("file://").split("?")[0], ignore_errors=True)
            running = servers(workdir, count, *args)  # fresh servers and store each repeat: nothing cached before
            try:
                results = pipeline_run([s.url for s in running], max_tokens, report)
            finally:
                stop_all(running)
            totals.append(results["total_s"])
        runs[mode] = {**results, "total_s": statistics.median(totals)}
    reuse, plain = runs["reuse"], runs["no-reuse"]
    later = range(1, len(reuse["agents"]))
    ttft = statistics.mean(plain["agents"][i]["ttft_s"] / reuse["agents"][i]["ttft_s"] for i in later)
    shares = [reuse["agents"][i]["cached_tokens"] / reuse["agents"][i]["prompt_tokens"] for i in later]
    row = {"layout": name, "servers": count, "store": store,
           "reuse_s": reuse["total_s"], "no_reuse_s": plain["total_s"],
           "speedup": plain["total_s"] / reuse["total_s"], "ttft_speedup_agents_2_to_5": ttft,
           "cached_share_agents_2_to_5": shares, "min_cached_share": min(shares),
           "identical": [a["text"] for a in reuse["agents"]] == [a["text"] for a in plain["agents"]],
           "agents": [{k: a[k] for k in ("agent", "prompt_tokens", "cached_tokens", "ttft_s", "total_s")}
                      for a in reuse["agents"]]}
    print(f"{name:>7} ({count} server{'s' if count > 1 else ''}): reuse {row['reuse_s']:.1f}s vs no-reuse "
          f"{row['no_reuse_s']:.1f}s = {row['speedup']:.2f}x, TTFT agents 2..5 {ttft:.1f}x, cached share "
          f"min {min(shares):.0%}, identical {row['identical']}", file=sys.stderr)
    return row, reuse["agents"]


def prefix_reference(max_tokens: int, threads: int, report: str) -> dict:
    """``kvwire run --mode prefix`` on the same five agents, in this process."""
    import torch

    from kvwire import PipelineSpec, hf, models
    from kvwire.pipeline.linear import Pipeline

    torch.set_num_threads(threads)
    model, tokenizer = hf.load_model(models.resolve())
    spec = PipelineSpec.from_toml(ROOT / "examples" / "document_pipeline.toml").with_max_new_tokens(max_tokens)
    spec = dataclasses.replace(spec, input_text=report)  # exactly the report the server's agents read
    Pipeline(model, tokenizer, spec.with_max_new_tokens(2)).run("prefix")  # burn-in
    result = Pipeline(model, tokenizer, spec).run("prefix")
    return {"total_s": result.total_s, "outputs": [a.output_text for a in result.agents]}


# -- 2. a restart on a file:// store ---------------------------------------------------------------


def restart(workdir: Path, common: list[str], max_tokens: int) -> dict:
    store = f"file://{workdir / 'restart-store'}"
    messages = [{"role": "system", "content": "You are one of five assistants helping a support team. Be concise."},
                {"role": "user", "content": f"Support conversation:\n\n{CONVERSATION.read_text()}\n\n"
                                            "State the customer's problems and how urgent each one is."}]
    answers = []
    for phase in ("cold", "warm"):
        (server,) = servers(workdir, 1, *common, "--store", store)
        try:
            answers.append(agents.ask(OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600),
                                      server.model, messages, max_tokens))
        finally:
            server.stop()
    cold, warm = answers
    row = {"prompt_tokens": cold["prompt_tokens"], "cold_ttft_s": cold["ttft_s"], "warm_ttft_s": warm["ttft_s"],
           "ttft_speedup": cold["ttft_s"] / warm["ttft_s"], "warm_cached_tokens": warm["cached_tokens"],
           "identical": cold["text"] == warm["text"]}
    print(f"restart: {row['prompt_tokens']}-token conversation, TTFT cold {row['cold_ttft_s']:.2f}s, after a "
          f"restart {row['warm_ttft_s']:.3f}s = {row['ttft_speedup']:.1f}x", file=sys.stderr)
    return row


# -- 3. concurrent requests ------------------------------------------------------------------------


PROMPT_TOKENS = 400  # the "~400-token prompts", chat template included
ASK = "\n\nSummarize this in one sentence."


def tokenizer_only():
    """The default model's tokenizer, without loading its weights (the driver process holds no model)."""
    from transformers import AutoTokenizer

    from kvwire import models

    return AutoTokenizer.from_pretrained(str(models.resolve()))


def prompts(count: int, tokenizer, tokens: int = PROMPT_TOKENS) -> list[list[dict]]:
    """``count`` different prompts of ``tokens`` tokens each (within a few: the chat template included),
    windows of the support conversation spread over its length."""
    from kvwire import hf

    ids = tokenizer(CONVERSATION.read_text(), add_special_tokens=False)["input_ids"]
    around = len(tokenizer(hf.render_chat(tokenizer, [{"role": "user", "content": ASK}]))["input_ids"])
    width = tokens - around
    step = max(1, (len(ids) - width) // max(1, count - 1))
    return [[{"role": "user", "content": tokenizer.decode(ids[i * step:i * step + width]).strip() + ASK}]
            for i in range(count)]


def timed(client: OpenAI, model: str, messages: list[dict], tokens: int) -> dict:
    """One streamed request; the arrival time of every chunk of text (one token each)."""
    start = time.perf_counter()
    stamps, parts = [], []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    return {"start": start, "stamps": stamps, "text": "".join(parts)}


def decode_rate_alone(results: list[dict]) -> float:
    """One request at a time: tokens after the first per second of decoding, over all requests."""
    return sum(len(r["stamps"]) - 1 for r in results) / sum(r["stamps"][-1] - r["stamps"][0] for r in results)


def decode_rate_together(results: list[dict]) -> float:
    """Requests decoded together: tokens per second while every one of them is decoding (from the last
    first token to the first last token), so that prefills of late joiners are not counted as decoding."""
    begin = max(r["stamps"][0] for r in results)
    end = min(r["stamps"][-1] for r in results)
    if end <= begin:
        return float("nan")
    produced = sum(sum(begin < t <= end for t in r["stamps"]) for r in results)
    return produced / (end - begin)


def concurrently(client: OpenAI, model: str, asks: list[list[dict]], tokens: int) -> tuple[list[dict], float]:
    """Every prompt of ``asks`` sent at once (a thread each, released together); results and wall seconds."""
    together: list[dict | None] = [None] * len(asks)
    barrier = threading.Barrier(len(asks))

    def one(i: int) -> None:
        barrier.wait()
        together[i] = timed(client, model, asks[i], tokens)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asks))]
    wall = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return together, time.perf_counter() - wall


def throughput(workdir: Path, common: list[str], tokens: int, counts: tuple[int, ...], repeats: int = 1) -> list[dict]:
    """Decode throughput of ``count`` concurrent requests against the same requests one at a time, after a
    warm-up (the server's first requests pay one-off costs: allocator, thread pools); with ``repeats``, alone
    and together alternate and the medians are reported."""
    tokenizer = tokenizer_only()
    (server,) = servers(workdir, 1, *common, "--no-reuse", "--max-batch", str(max(counts)))
    rows = []
    try:
        client = OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=900)
        warm = prompts(max(counts), tokenizer)
        timed(client, server.model, warm[0], 8)
        concurrently(client, server.model, warm, 8)
        for count in counts:
            asks = prompts(count, tokenizer)
            runs = []
            for _ in range(repeats):
                alone = [timed(client, server.model, m, tokens) for m in asks]
                together, wall = concurrently(client, server.model, asks, tokens)
                alone_wall = sum(r["stamps"][-1] - r["start"] for r in alone)
                batched, single = decode_rate_together(together), decode_rate_alone(alone)
                runs.append({"decode_speedup": batched / single, "end_to_end_speedup": alone_wall / wall,
                             "decode_tokens_per_s_batched": batched, "decode_tokens_per_s_alone": single,
                             "identical": [r["text"] for r in together] == [r["text"] for r in alone]})
            row = {"requests": count, "tokens_each": tokens, "repeats": repeats,
                   **{key: statistics.median(r[key] for r in runs)
                      for key in ("decode_speedup", "end_to_end_speedup", "decode_tokens_per_s_batched",
                                  "decode_tokens_per_s_alone")},
                   "decode_speedups": [r["decode_speedup"] for r in runs],
                   "identical": all(r["identical"] for r in runs)}
            print(f"throughput: {count} requests together vs one at a time: decode {row['decode_speedup']:.2f}x "
                  f"(runs: {', '.join(f'{x:.2f}' for x in row['decode_speedups'])}), "
                  f"end to end {row['end_to_end_speedup']:.2f}x, identical {row['identical']}", file=sys.stderr)
            rows.append(row)
    finally:
        server.stop()
    return rows


def plain_batching(tokens: int, counts: tuple[int, ...], threads: int) -> dict:
    """The issue's yardstick, on this machine: plain transformers decoding the same prompts as one
    batch (a ``DynamicCache`` of every row, no padding: the prompts are cut to one length) vs one at
    a time, in this process while no server runs. Tokens/s of decode steps only."""
    import torch

    from kvwire import hf, models

    torch.set_num_threads(threads)
    model, tokenizer = hf.load_model(models.resolve())
    asks = [tokenizer(hf.render_chat(tokenizer, m))["input_ids"] for m in prompts(max(counts), tokenizer)]
    width = min(len(ids) for ids in asks)

    def rate(rows: int) -> float:
        ids = torch.tensor([a[:width] for a in asks[:rows]])
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(tokens - 1):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
        return rows * (tokens - 1) / (time.perf_counter() - start)

    rate(2)  # warm-up
    single = rate(1)
    return {"prompt_tokens": width, "tokens_per_s_alone": single,
            **{f"decode_speedup_{n}": rate(n) / single for n in counts}}


# -- 5. tenants -------------------------------------------------------------------------------------


def tenants(workdir: Path, common: list[str], repeats: int = 3) -> dict:
    """The same ~3000-token prompt from tenant A (cold), A again (its cache), then tenant B (its own namespace:
    cold again), and with cache_salt: TTFT of each, and the cached tokens the server reported."""
    keys = workdir / "keys"
    keys.write_text("tenant-a\ntenant-b\n")
    server = Server(workdir, *common, "--api-keys-file", str(keys), "--store", "memory://?budget=2GiB",
                    api_key="tenant-a")
    try:
        words = CONVERSATION.read_text().split()
        rows = []
        for r in range(repeats):
            text = " ".join(words[r * 7:]) + "\n\nSummarize the customer's problem."  # a new prompt each repeat
            messages = [{"role": "user", "content": text}]

            def ask(key: str, **extra) -> tuple[float, int]:
                client = OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=600)
                start = time.perf_counter()
                ttft, cached = None, 0
                for chunk in client.chat.completions.create(model=server.model, messages=messages, max_tokens=4,
                                                            temperature=0, stream=True, extra_body=extra or None,
                                                            stream_options={"include_usage": True}):
                    if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                        ttft = time.perf_counter() - start
                    if chunk.usage is not None:
                        cached = chunk.usage.prompt_tokens_details.cached_tokens
                return ttft, cached
            row = {"a_cold": ask("tenant-a"), "a_again": ask("tenant-a"), "b_same_prompt": ask("tenant-b"),
                   "a_salted": ask("tenant-a", cache_salt="s1"), "a_salted_again": ask("tenant-a", cache_salt="s1")}
            rows.append(row)
            print("tenants: " + ", ".join(f"{k} TTFT {v[0]:.2f} s ({v[1]} cached)" for k, v in row.items()),
                  file=sys.stderr)
        return {"runs": rows, "median_ttft_s": {k: statistics.median(r[k][0] for r in rows) for k in rows[0]},
                "cached_tokens": {k: [r[k][1] for r in rows] for k in rows[0]}}
    finally:
        server.stop()


# -- 4. load ---------------------------------------------------------------------------------------


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory now (``VmRSS``) or at its peak so far (``VmHWM``), in bytes; 0 if unknown."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def metric(root: str, name: str) -> float:
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")


def load_client(url: str, model: str, documents: list[str], deadline: float, tokens: int, seed: int,
                out: dict, disconnect: float = 0.0) -> None:
    """Conversations of three turns over the documents, until ``deadline``: each request streamed. With
    ``disconnect`` > 0, that share of requests hang up after 1-3 streamed tokens (a seeded draw)."""
    import random

    import openai

    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    turns = ["Summarize it in one sentence.", "List the key numbers.", "What should be done first?"]
    draw = random.Random(seed)
    n = seed
    while time.perf_counter() < deadline:
        messages = [{"role": "user", "content": f"{documents[n % len(documents)]}\n\n{turns[0]}"}]
        for turn in range(3):
            if turn:
                messages = messages + [{"role": "user", "content": turns[turn]}]
            start = time.perf_counter()
            hang_up = draw.randint(1, 3) if draw.random() < disconnect else None
            try:
                stamps, parts, finish = [], [], None
                stream = client.chat.completions.create(model=model, messages=messages, max_tokens=tokens,
                                                        temperature=0, stream=True)
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        stamps.append(time.perf_counter())
                        parts.append(chunk.choices[0].delta.content)
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    if hang_up is not None and len(stamps) >= hang_up:
                        stream.close()  # the client goes away mid-stream
                        break
            except openai.RateLimitError as err:
                out["429"].append(float(err.response.headers.get("retry-after", "1")))
                time.sleep(min(5.0, out["429"][-1]))
                break
            except openai.APIStatusError as err:
                if err.status_code == 503 and "retry-after" in err.response.headers:  # the server is stopping
                    out["503"].append(float(err.response.headers["retry-after"]))
                    return
                out["5xx" if err.status_code >= 500 else "other"].append(err.status_code)
                break
            except openai.APIConnectionError:  # nobody listens any more: the server has exited
                out["refused"].append(time.perf_counter())
                return
            text = "".join(parts)
            if hang_up is not None:
                out["disconnected"].append(len(stamps))
                break
            if finish is None:  # the stream ended without saying why: an answer lost
                out["unfinished"].append(len(stamps))
                break
            out["requests"].append({"ttft": stamps[0] - start if stamps else None, "end": time.perf_counter(),
                                    "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": len(stamps),
                                    "messages": messages, "text": text})
            messages = messages + [{"role": "assistant", "content": text}]
            if time.perf_counter() >= deadline:
                break
        n += 1


def fault_event(server: Server, at_s: float, event: str) -> dict:
    """What a fault did, read from the server's metrics at that moment: prefix-cache hits so far, and
    whether it serves without its store."""
    return {"at_s": at_s, "event": event, "hits": metric(server.root, "kvwire:prefix_cache_hits_total"),
            "degraded": metric(server.root, "kvwire_store_degraded")}


def load(workdir: Path, common: list[str], counts: tuple[int, ...], seconds: float, tokens: int,
         check: int, faults: frozenset[str] = frozenset(), disconnect: float = 0.2) -> list[dict]:
    """N clients for a fixed time; ``faults``: ``redis`` (the store is a Redis killed a third of the way in
    and restarted at two thirds, on the same port), ``disconnect`` (a share of requests hang up mid-stream),
    ``sigterm`` (the server is sent SIGTERM two thirds of the way in: the requests it holds must finish, new
    ones get 503 with Retry-After, and it must exit 0 within its shutdown grace)."""
    text = agents.REPORT.read_text()
    documents = [text[i * 1200:(i + 1) * 1200] for i in range(3)]  # ~300 tokens each, shared by the clients
    rows = []
    for count in counts:
        redis_proc = None
        store = "memory://?budget=256MiB"
        if "redis" in faults:
            redis_proc, store = start_redis(workdir)
        server = Server(workdir, *common, "--store", store, "--max-batch", "8", "--max-queue", "32")
        fault_log: list[dict] = []
        try:
            out: dict = {"requests": [], "429": [], "5xx": [], "other": [], "disconnected": [], "503": [],
                         "refused": [], "unfinished": []}
            signalled: float | None = None
            rss: list[tuple[float, int]] = []
            start = time.perf_counter()
            deadline = start + seconds
            share = disconnect if "disconnect" in faults else 0.0
            threads = [threading.Thread(target=load_client, args=(server.url, server.model, documents, deadline,
                                                                  tokens, i, out, share)) for i in range(count)]
            for t in threads:
                t.start()
            stage = 0
            while any(t.is_alive() for t in threads):
                now = time.perf_counter() - start
                if server.process.poll() is None:  # (after a SIGTERM it exits while clients still wind down)
                    rss.append((now, rss_bytes(server.process.pid)))
                if redis_proc is not None and stage < 2 and now >= seconds * (stage + 1) / 3:
                    fault_log.append(fault_event(server, now, "redis killed" if stage == 0 else "redis restarted"))
                    if stage == 0:
                        redis_proc.kill()
                        redis_proc.wait()
                    else:
                        redis_proc, _ = start_redis(workdir, int(store.rsplit(":", 1)[1].split("/")[0]))
                    stage += 1
                if "sigterm" in faults and signalled is None and now >= seconds * 2 / 3:
                    fault_log.append(fault_event(server, now, "SIGTERM"))
                    server.process.send_signal(signal.SIGTERM)
                    signalled = time.perf_counter()
                time.sleep(0.5)
            wall = time.perf_counter() - start
            exit_code, exit_s = None, None
            if signalled is not None:
                exit_code = server.process.wait(timeout=120)
                exit_s = time.perf_counter() - signalled  # an upper bound: polled every half second above
                print(f"  SIGTERM at {signalled - start:.0f} s: {len(out['503'])} new requests answered 503 with "
                      f"Retry-After {sorted(set(out['503']))}, {len(out['refused'])} refused after it exited, "
                      f"{len(out['unfinished'])} streams ended unanswered; exit code {exit_code} within "
                      f"{exit_s:.1f} s", file=sys.stderr)
            elif fault_log:
                fault_log.append(fault_event(server, wall, "end"))
            done = out["requests"]
            itl = [x for r in done for x in r["itl"]]
            ttft = [r["ttft"] for r in done if r["ttft"] is not None]
            sample = done[:: max(1, len(done) // check)][:check]
            checker = server
            if signalled is not None:  # it is gone: the answers it finished in its grace, checked by a fresh one
                sample = [r for r in done if r["end"] >= signalled][:check]
                checker = Server(workdir, *common, "--store", "memory://", "--max-batch", "8")
            try:
                client = OpenAI(base_url=checker.url, api_key="none", max_retries=0, timeout=600)
                differing = sum(client.chat.completions.create(
                    model=checker.model, messages=r["messages"], max_tokens=tokens, temperature=0
                ).choices[0].message.content != r["text"] for r in sample)
            finally:
                if checker is not server:
                    checker.stop()
            after = (lambda name: metric(server.root, name)) if signalled is None else (lambda name: None)
            third = [b for t, b in rss if t >= wall / 3] or [0]
            row = {"clients": count, "seconds": wall, "requests": len(done), "requests_per_s": len(done) / wall,
                   "tokens_per_s": sum(r["tokens"] for r in done) / wall,
                   "ttft_p50_s": statistics.median(ttft) if ttft else None,
                   "ttft_p99_s": sorted(ttft)[int(0.99 * (len(ttft) - 1))] if ttft else None,
                   "itl_p50_ms": 1000 * statistics.median(itl) if itl else None,
                   "itl_p99_ms": 1000 * sorted(itl)[int(0.99 * (len(itl) - 1))] if itl else None,
                   "429": len(out["429"]), "retry_after_s": sorted(set(out["429"])), "5xx": len(out["5xx"]),
                   "other_errors": out["other"], "checked_alone": len(sample), "differing_alone": differing,
                   "peak_rss_mb": max(b for _, b in rss) / 2**20 if rss else None,
                   "rss_after_first_third_mb": [min(third) / 2**20, max(third) / 2**20],
                   # the peak of each third: flat after warm-up is the last third's no higher than the second's
                   "rss_peak_by_third_mb": [max([b for t, b in rss if k * wall / 3 <= t < (k + 1) * wall / 3] or [0])
                                            / 2**20 for k in range(3)],
                   # the soak's target (issue 42): the second half's peak at most 1.05x the first half's
                   "rss_peak_by_half_mb": [max([b for t, b in rss if k * wall / 2 <= t < (k + 1) * wall / 2] or [0])
                                           / 2**20 for k in range(2)],
                   "rss_series_mb": [[round(t, 1), round(b / 2**20, 1)] for t, b in rss[::20]],
                   "evictions": after("kvwire_store_evictions"),
                   "faults": sorted(faults), "fault_log": fault_log, "disconnected": len(out["disconnected"]),
                   "cancelled_metric": after("kvwire_cancelled_total"),
                   "running_after": after("kvwire:num_requests_running"),
                   "unfinished": len(out["unfinished"]), "503_on_shutdown": len(out["503"]),
                   "refused_after_exit": len(out["refused"]), "exit_code": exit_code, "exit_within_s": exit_s}
            rows.append(row)
            for event in fault_log:
                print(f"  {event['event']} at {event['at_s']:.0f} s: prefix-cache hits so far {event['hits']:.0f}, "
                      f"store degraded {event['degraded']:.0f}", file=sys.stderr)
            if "disconnect" in faults:
                print(f"  {row['disconnected']} requests hung up mid-stream; kvwire_cancelled "
                      f"{row['cancelled_metric']:.0f}; running after the run {row['running_after']:.0f}",
                      file=sys.stderr)
            print(f"load {count} clients: {row['requests_per_s']:.2f} req/s, {row['tokens_per_s']:.1f} tok/s, "
                  f"TTFT p50 {row['ttft_p50_s'] or 0:.2f} s p99 {row['ttft_p99_s'] or 0:.2f} s, "
                  f"ITL p50 {row['itl_p50_ms'] or 0:.0f} ms p99 {row['itl_p99_ms'] or 0:.0f} ms, 429s {row['429']}, "
                  f"5xx {row['5xx']}, differing alone {differing}/{len(sample)}, "
                  f"peak RSS {row['peak_rss_mb'] or 0:.0f} MB (each third's peak "
                  f"{' / '.join(f'{x:.0f}' for x in row['rss_peak_by_third_mb'])} MB; each half's "
                  f"{' / '.join(f'{x:.0f}' for x in row['rss_peak_by_half_mb'])} MB)", file=sys.stderr)
        finally:
            server.stop()
            if redis_proc is not None:
                redis_proc.kill()
                redis_proc.wait()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per agent (pipeline, restart)")
    parser.add_argument("--throughput-tokens", type=int, default=48, help="tokens per concurrent request")
    parser.add_argument("--threads", type=positive, default=2, help="torch threads of every server")
    parser.add_argument("--repeats", type=positive, default=1,
                        help="pipeline runs per layout and mode, and throughput runs per count (median)")
    parser.add_argument("--redis-url", default=None, help="default: a redis-server started on a free port")
    parser.add_argument("--only", nargs="*", default=None,
                        choices=["pipeline", "restart", "throughput", "load", "tenants"])
    parser.add_argument("--load-clients", default=(4, 16, 64), type=lambda text: tuple(positive(c) for c in
                        text.split(",")), help="concurrent clients of each load run, comma-separated (4,16,64)")
    parser.add_argument("--load-seconds", type=float, default=60.0, help="how long each load run sends requests")
    parser.add_argument("--load-tokens", type=int, default=16, help="tokens per load request")
    parser.add_argument("--load-check", type=int, default=20, help="completions sent again alone to compare")
    parser.add_argument("--load-faults", default="", help="comma-separated, while the load runs: redis (the store "
                        "is a Redis killed and restarted), disconnect (a share of clients hang up mid-stream), "
                        "sigterm (the server is stopped two thirds of the way in)")
    parser.add_argument("--load-disconnect", type=float, default=0.2, help="share of requests that hang up")
    parser.add_argument("--quick", action="store_true", help="fewer tokens: a smoke run, not figures")
    parser.add_argument("--malloc-arenas", type=int, default=None,
                        help="every server's --malloc-arenas (default: the server's own, 2; 0: glibc's default)")
    parser.add_argument("--malloc-trim", type=float, default=None,
                        help="every server's --malloc-trim seconds (default: the server's own, 30; 0: never)")
    args = parser.parse_args()
    report = agents.REPORT.read_text()
    if args.quick:
        args.max_tokens, args.throughput_tokens, report = 8, 12, report[:1500]
    chosen = set(args.only or ["pipeline", "restart", "throughput", "load", "tenants"])
    workdir = Path(tempfile.mkdtemp(prefix="kvwire-serve-bench-"))
    shm = Path("/dev/shm") / workdir.name
    common = ["--threads", str(args.threads), "--block-size", "16"]
    if args.malloc_arenas is not None:
        common += ["--malloc-arenas", str(args.malloc_arenas)]
    if args.malloc_trim is not None:
        common += ["--malloc-trim", str(args.malloc_trim)]
    payload: dict = {"max_tokens": args.max_tokens, "threads": args.threads}
    redis_proc = None
    try:
        if "pipeline" in chosen:
            redis_url = args.redis_url
            if redis_url is None:
                redis_proc, redis_url = start_redis(workdir)
            layouts = [("memory", "memory://?budget=4GiB", 1), ("shm", f"file://{shm}?budget=4GiB", 2),
                       ("redis", redis_url, 2)]
            rows, outputs = [], []
            for name, store, count in layouts:
                row, agent_runs = compare_layout(name, store, count, workdir, common, args.max_tokens, args.repeats,
                                                 report)
                rows.append(row)
                outputs.append([a["text"] for a in agent_runs])
            reference = prefix_reference(args.max_tokens, args.threads, report)
            for row in rows:
                row["vs_kvwire_run_prefix"] = reference["total_s"] / row["reuse_s"]  # >= 0.9: within 10%
            payload["pipeline"] = {"layouts": rows, "kvwire_run_prefix_s": reference["total_s"],
                                   "identical_across_layouts": all(o == outputs[0] for o in outputs),
                                   "same_outputs_as_kvwire_run": outputs[0] == reference["outputs"]}
            print(f"kvwire run --mode prefix: {reference['total_s']:.1f}s; server with reuse vs it: "
                  + ", ".join(f"{r['layout']} {r['vs_kvwire_run_prefix']:.2f}x" for r in rows), file=sys.stderr)
        if "restart" in chosen:
            payload["restart"] = restart(workdir, common, args.max_tokens)
        if "throughput" in chosen:
            payload["throughput"] = throughput(workdir, common, args.throughput_tokens, (4, 8), args.repeats)
            payload["plain_transformers_batching"] = plain = plain_batching(args.throughput_tokens, (4, 8),
                                                                            args.threads)
            print(f"plain transformers batching, same prompts, in process: 4 rows {plain['decode_speedup_4']:.2f}x, "
                  f"8 rows {plain['decode_speedup_8']:.2f}x one at a time", file=sys.stderr)
        if "tenants" in chosen:
            payload["tenants"] = tenants(workdir, common)
        if "load" in chosen:
            payload["load"] = load(workdir, common, args.load_clients,
                                   args.load_seconds, args.load_tokens, args.load_check,
                                   frozenset(f for f in args.load_faults.split(",") if f), args.load_disconnect)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    payload["machine"] = machine()
    if args.json:
        print(json.dumps(payload))


if __name__ == "__main__":
    run_main(main)
