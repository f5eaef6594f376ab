"""Agents on separate network hosts over emulated links: what transfer really costs, and who wins where.

    python benchmarks/network.py --json                  # or: make bench-network (needs root: namespaces)
        [--profiles 10mbit,100mbit,1gbit,veth] [--pipelines document,support,three]
        [--modes text,prefix,int8,auto,auto-costs]
        [--max-new-tokens 16] [--repeats 3] [--runs 1] [--threads 2] [--out benchmarks/results] [--start cold]

Builds a LAN of network namespaces on this machine (``tests/support/netns.py``): ``redis-server`` on
host ``store``, agents on hosts ``h1``, ``h2``, ``h3`` (agent i on ``h{i % 3 + 1}``, so every hop
crosses two links), every link shaped by ``tc tbf`` to the profile's rate (``veth``: unshaped).
Then, for each link profile:

1. **Transfer, apart from compute.** The real packets of each pipeline (made once, in this
   process, by a prefix run of the real model; fp32 and re-encoded int8) are put by a
   long-lived process on the sender's host and got, as the receiver fetches its chain, by one
   on the receiver's host (``benchmarks/network_io.py``): median seconds of ``--repeats``.
   ``kvwire probe`` runs on ``h1`` against the shaped store; its put/get rates and latency
   predict each hop's transfer (``CostModel.transfer_s`` with the packets' exact bytes).
2. **Pipelines.** The document and support-conversation pipelines as ``kvwire agent``
   processes across the three hosts, in text, prefix (fp32 packets), int8 (prefix with
   ``KVWIRE_ENCODING=int8``), auto mode (every agent measures its own costs as a user's would: the
   bounded probe of :mod:`kvwire.pipeline.probe`, shared per host, refined by real transfers; the
   probe traffic of each agent is reported) and auto-costs (every agent decides with the costs
   ``kvwire probe`` saved: ``--costs``, so no probe shares the link with another). End-to-end (first turn's
   start to last turn's end), TTFT, bytes on the store host's interface (the kernel's counters:
   everything that crossed its link, TCP and Redis included), and per hop: what auto sent,
   its predicted costs and the actual ones (cache: the prefix run's measured put + get plus
   the codec measured here on the same packets; ids: the receiver's re-prefill, text-mode
   prefill minus prefix-mode prefill, measured in the same profile).
3. **Pictures.** A timeline per profile (text above prefix, auto and int8 below) and the
   break-even map (``kvwire.pipeline.breakeven`` with the codec rates measured here, for the default
   model and a Llama-3-8B-sized one), with the measured first hops on it.

4. **Cold start** (``--start cold``, pipelines only). Every agent process starts at once, as a user's command
   starts them, and each run is timed from their start to the last reply: model loading, and whatever auto
   measures, included (``benchmarks/network.py`` warm times auto from the first turn of processes already up).
   The store is emptied before every run, so no run reads what another measured. Auto is held to the better of
   text and prefix, and each of its hops' choices to the same hop's cost in the cold text and prefix runs (the
   sender's publish, the receiver's receive and prefill). Written to ``network-cold.json``.

The machine is shared and busy: prefill times vary with the load, so transfer is timed on its
own (1.) and every figure carries the load average. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # tests.support.netns: the namespace harness lives with the tests
from common import machine, positive, run_main  # noqa: E402
from tests.support.netns import PROFILES, Network, netns_unavailable, start_redis  # noqa: E402

import torch  # noqa: E402

from kvwire import PipelineSpec, hf, models  # noqa: E402
from kvwire.kv import chain  # noqa: E402
from kvwire.wire import codec  # noqa: E402
from kvwire.pipeline.breakeven import MODELS, Codec, geometric, sweep  # noqa: E402
from kvwire.wire.options import CodecOptions  # noqa: E402
from kvwire.pipeline.cost import CostModel, probe_codec  # noqa: E402
from kvwire.pipeline.handoff import Handoff, handoff_key  # noqa: E402
from kvwire.pipeline.linear import Pipeline  # noqa: E402
from kvwire.plots import break_even_map, timeline  # noqa: E402
from kvwire.store import MemoryStore  # noqa: E402

PIPELINES = {"document": ROOT / "examples" / "document_pipeline.toml",
             "support": ROOT / "examples" / "support_conversation.toml",
             "three": ROOT / "examples" / "three_agents.toml"}  # examples/network_hosts.sh's pipeline
# auto: every agent measures its own costs as a user's would (the bounded, shared probe); auto-costs: every
# agent decides with the costs `kvwire probe` saved on h1 (--costs), so no probe shares the link
MODES = {"text": ("text", None), "prefix": ("prefix", None), "int8": ("prefix", "int8"), "auto": ("auto", None),
         "auto-costs": ("auto", None)}
HOSTS = ["store", "h1", "h2", "h3"]
ENCODINGS = ("fp32", "int8")
TIE = 0.10  # choices whose measured costs differ by less than this share are both right


def host_of(index: int) -> str:
    return f"h{index % 3 + 1}"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the packets of each hop ------------------------------------------------------------------------


def build_hops(model: Any, tokenizer: Any, spec: Any, name: str, max_new_tokens: int, work: Path) -> list[dict]:
    """Run the pipeline once in prefix mode here and write each agent's packet, fp32 and int8, to files.

    Hop i goes from agent i to agent i + 1: agent i puts its own packet, agent i + 1 gets the chain
    of packets 0..i. Also times the codec on these packets (encode the delta; decode the chain and
    build the cache), which the actual cost of sending a cache includes."""
    pipeline_spec = PipelineSpec.from_toml(PIPELINES[name]).with_max_new_tokens(max_new_tokens)
    store = MemoryStore()
    result = Pipeline(model, tokenizer, pipeline_spec, store=store, model_spec=spec).run("prefix", session="s")
    hops = []
    for i, agent in enumerate(result.agents[:-1]):
        handoff = Handoff.from_bytes(store.get(handoff_key("s", i, agent.agent, 0)), "h")
        packets = chain.fetch_chain(store, handoff.packet, options=CodecOptions())
        hop: dict[str, Any] = {"hop": i, "sender": agent.agent, "receiver": result.agents[i + 1].agent,
                               "tokens": packets[-1].end, "delta_tokens": packets[-1].length, "links": len(packets),
                               "files": {}, "bytes": {}, "codec_s": {}}
        for encoding in ENCODINGS:
            options = CodecOptions(encoding=encoding)
            folder = work / name / encoding
            folder.mkdir(parents=True, exist_ok=True)
            blobs, encoded, parent = [], [], None
            for p in packets:  # each link pins its parent's checksum, which depends on the encoding
                p = replace(p, parent_checksum=parent.checksum if parent is not None else None, checksum=None)
                blobs.append(codec.encode(p, options=options))  # sets p.checksum
                encoded.append(p)
                parent = p
            files = []
            for j, blob in enumerate(blobs):
                path = folder / f"{j}.kvw"
                if not path.exists():
                    path.write_bytes(blob)
                files.append(str(path))
            hop["files"][encoding] = files
            hop["bytes"][encoding] = {"delta": len(blobs[-1]), "chain": sum(len(b) for b in blobs)}
            hop["codec_s"][encoding] = codec_seconds(model, spec, encoded[-1], blobs, options)
        hops.append(hop)
    return hops


def codec_seconds(model: Any, spec: Any, delta: Any, blobs: list[bytes], options: CodecOptions) -> float:
    """Median seconds to encode the delta packet, and to decode the chain, join it and build the cache."""
    from kvwire.wire.packet import join

    def once() -> float:
        start = time.perf_counter()
        codec.encode(delta, options=options)
        hf.build_cache(join([codec.decode(b, options=options) for b in blobs]), model, spec)
        return time.perf_counter() - start

    return statistics.median(once() for _ in range(3))


# -- processes on the hosts -------------------------------------------------------------------------


class IOWorker:
    """``benchmarks/network_io.py`` on one host: puts and gets on request, timed there."""

    def __init__(self, net: Network, host: str, url: str, env: dict[str, str]) -> None:
        self.host = host
        self.process = net.start(host, [sys.executable, str(ROOT / "benchmarks" / "network_io.py"), url],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **request: Any) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the io worker on {self.host} exited ({self.process.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.host}: {reply['error']}")
        return reply


def measure_transfer(workers: dict[str, IOWorker], hops: list[dict], encoding: str, repeats: int,
                     prefix: str) -> list[dict]:
    """Per hop: median seconds of the sender's put of its packet and of the receiver's get of the chain."""
    puts: list[list[float]] = [[] for _ in hops]
    gets: list[list[float]] = [[] for _ in hops]
    for repeat in range(repeats):
        keys = [f"bench/{prefix}/{encoding}/{repeat}/{j}" for j in range(len(hops))]
        for hop in hops:
            i = hop["hop"]
            puts[i].append(workers[host_of(i)].ask(op="put", key=keys[i], file=hop["files"][encoding][-1])["s"])
            gets[i].append(workers[host_of(i + 1)].ask(op="get", keys=keys[: i + 1])["s"])
        workers["h1"].ask(op="flush")
    return [{"put_s": statistics.median(p), "get_s": statistics.median(g), "s": statistics.median(p) +
             statistics.median(g)} for p, g in zip(puts, gets)]


def probe(net: Network, url: str, env: dict[str, str], work: Path, profile: str) -> tuple[CostModel, Path]:
    """``kvwire probe URL --json`` on h1 against the shaped store; the JSON is saved for ``--costs``."""
    large = "2MiB" if profile == "10mbit" else "16MiB"  # three rounds of 16 MiB would take 80 s at 10 Mbit
    done = net.run("h1", [sys.executable, "-m", "kvwire", "probe", url, "--json", "--large", large], env=env,
                   timeout=1200)
    if done.returncode:
        raise RuntimeError(f"kvwire probe failed: {done.stderr[-2000:]}")
    line = done.stdout.strip().splitlines()[-1]
    path = work / f"costs-{profile}.json"
    path.write_text(line + "\n")
    return CostModel.from_json(json.loads(line)), path


def run_pipeline(net: Network, url: str, name: str, mode: str, args: argparse.Namespace, env: dict[str, str],
                 work: Path, session: str, costs: Path | None, cold: bool = False) -> dict:
    """One run of pipeline ``name`` as ``kvwire agent`` processes on h1..h3; results and bytes on the wire.

    Warm (the default): the downstream agents load their models and wait before the first starts, and end to end
    runs from the first turn's start. ``cold``: every process starts at once, as a user's command starts them, and
    end to end runs from their start to the last reply (model loading, and whatever auto measures, included)."""
    turn_mode, encoding = MODES[mode]
    spec = PipelineSpec.from_toml(PIPELINES[name])
    agent_env = dict(env)
    if encoding:
        agent_env["KVWIRE_ENCODING"] = encoding
    procs = []
    order = list(range(len(spec.agents)))[::-1]  # downstream first: they load, then wait in the store
    launched = time.time()
    if cold:
        before = net.counters("store")
    for i in order:
        if i == 0 and not cold:  # the first agent starts once the others wait: loading does not slow its prefill
            for _, proc, err in procs:
                until_says(err, proc, "waiting for")
        out, err = work / f"{session}-{i}.out", work / f"{session}-{i}.err"
        argv = [sys.executable, "-m", "kvwire", "agent", str(PIPELINES[name]), "--name", spec.agents[i].name,
                "--session", session, "--store", url, "--mode", turn_mode, "--json",
                "--max-new-tokens", str(args.max_new_tokens), "--timeout", "3600"]
        if mode == "auto-costs":
            argv += ["--costs", str(costs)]
        if i == 0 and not cold:
            before = net.counters("store")
        with out.open("wb") as stdout, err.open("wb") as stderr:
            procs.append((i, net.start(host_of(i), argv, stdout=stdout, stderr=stderr, env=agent_env), err))
    results = {}
    for i, proc, err in procs:
        if proc.wait(7200) != 0:
            raise RuntimeError(f"agent {i} of {name} ({mode}) failed:\n{err.read_text()[-3000:]}")
        lines = [line for line in (work / f"{session}-{i}.out").read_text().splitlines() if line.startswith("{")]
        results[i] = json.loads(lines[-1])
    after = net.counters("store")
    agents = [results[i] for i in sorted(results)]
    start = launched if cold else min(a["started_at"] for a in agents)
    end = max(a["started_at"] + a["total_s"] for a in agents)
    return {"pipeline": name, "mode": mode, "end_to_end_s": end - start, "start": "cold" if cold else "warm",
            "ttft_s": [a["ttft_s"] for a in agents],
            "ttft_mean_2_n_s": statistics.mean(a["ttft_s"] for a in agents[1:]),
            "wire_bytes": (after["rx_bytes"] - before["rx_bytes"]) + (after["tx_bytes"] - before["tx_bytes"]),
            "packet_bytes": sum(a["packet_put_bytes"] + a["packet_get_bytes"] for a in agents),
            "probes": [(a.get("costs") or {}).get("probe") for a in agents],  # auto: what each agent's estimate cost
            "probe_bytes": sum(((a.get("costs") or {}).get("probe") or {}).get("bytes", 0) for a in agents),
            "output_ids": [a["output_ids"] for a in agents], "agents": [slim(a) for a in agents]}


def median_run(runs: list[dict]) -> dict:
    """The run with the median end-to-end time (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["end_to_end_s"])[(len(runs) - 1) // 2]


def slim(agent: dict) -> dict:
    keep = ("agent", "context_tokens", "cached_tokens", "new_tokens", "ttft_s", "prefill_s", "decode_s", "receive_s",
            "publish_s", "total_s", "started_at", "packet_bytes", "packet_put_s", "packet_get_s",
            "packet_put_bytes", "packet_get_bytes", "decision", "prediction", "events", "store_retries")
    return {k: agent.get(k) for k in keep}


def until_says(path: Path, proc: subprocess.Popen, text: str, timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in " ".join(path.read_text(errors="replace").split()):
        if proc.poll() is not None:
            raise RuntimeError(f"an agent exited early:\n{path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no '{text}' from an agent after {timeout:g} s")
        time.sleep(0.1)


# -- analysis ---------------------------------------------------------------------------------------


def hop_table(hops: list[dict], transfer: dict[str, list[dict]], runs: dict[str, dict], cost: CostModel) -> list[dict]:
    """Per hop: predicted vs measured transfer, measured cache and ids costs, and auto's choice."""
    rows = []
    for hop in hops:
        i = hop["hop"]
        row: dict[str, Any] = {k: hop[k] for k in ("hop", "sender", "receiver", "tokens", "delta_tokens", "links")}
        for encoding in ENCODINGS:
            sizes = hop["bytes"][encoding]
            predicted = cost.store.put_s(sizes["delta"]) + cost.store.get_s(sizes["chain"], operations=hop["links"])
            measured = transfer[encoding][i]["s"]
            row[encoding] = {"bytes": sizes, "predicted_transfer_s": predicted, "measured_transfer_s": measured,
                             "put_s": transfer[encoding][i]["put_s"], "get_s": transfer[encoding][i]["get_s"],
                             "ratio": predicted / measured, "codec_s": hop["codec_s"][encoding],
                             "cache_s": measured + hop["codec_s"][encoding]}
        if "text" in runs and "prefix" in runs:  # the receiver's re-prefill of the upstream tokens, measured
            text, prefix = runs["text"]["agents"][i + 1], runs["prefix"]["agents"][i + 1]
            row["ids_s"] = max(text["prefill_s"] - prefix["prefill_s"], 1e-6)
            row["prefill_rate"] = hop["tokens"] / row["ids_s"]
            costs = {"ids": row["ids_s"], "fp32": row["fp32"]["cache_s"], "int8": row["int8"]["cache_s"]}
            row["measured_winner"] = min(costs, key=costs.__getitem__)
            row["fp32_vs_ids"] = "cache" if costs["fp32"] < costs["ids"] else "ids"
            row["int8_vs_ids"] = "cache" if costs["int8"] < costs["ids"] else "ids"
        if "auto" in runs:
            prediction = runs["auto"]["agents"][i]["prediction"] or {}
            row["auto"] = {"choice": prediction.get("choice"), "predicted_cache_s": prediction.get("cache_s"),
                           "predicted_ids_s": prediction.get("ids_s"),
                           "predicted_transfer_s": prediction.get("transfer_s")}
            if "ids_s" in row:
                actual = {"cache": row["fp32"]["cache_s"], "ids": row["ids_s"]}
                best = min(actual, key=actual.__getitem__)
                close = abs(actual["cache"] - actual["ids"]) <= TIE * min(actual.values())
                row["auto"].update({"actual_cache_s": actual["cache"], "actual_ids_s": actual["ids"],
                                    "best": best, "right": prediction.get("choice") == best or close})
        rows.append(row)
    return rows


def auto_row(profile: str, name: str, runs: dict[str, dict], mode: str) -> dict[str, Any]:
    """Auto against the better of text and prefix (time), and against the mode it chose (bytes on the store link:
    at most that mode's plus 5 MB; a mix of choices is held to the larger of the two)."""
    text, prefix, auto = (runs[m]["end_to_end_s"] for m in ("text", "prefix", mode))
    best, worst = min(text, prefix), max(text, prefix)
    choices = {(a.get("prediction") or {}).get("choice") for a in runs[mode]["agents"][:-1]}
    chosen = "text" if choices == {"ids"} else "prefix" if choices == {"cache"} else None
    allowed = (runs[chosen]["wire_bytes"] if chosen else max(runs["text"]["wire_bytes"], runs["prefix"]["wire_bytes"]))
    return {"profile": profile, "pipeline": name, "mode": mode, "auto_s": auto, "text_s": text, "prefix_s": prefix,
            "vs_best": auto / best, "within_5pct_of_best": auto <= 1.05 * best,
            "faster_than_worst": (auto < worst) if worst > 1.2 * best else None,
            "each_s": {m: runs[m]["end_to_end_each_s"] for m in ("text", "prefix", mode)},
            "choices": sorted(c for c in choices if c), "wire_bytes": runs[mode]["wire_bytes"],
            "chosen_mode_bytes": allowed, "bytes_within_5mb": runs[mode]["wire_bytes"] <= allowed + 5e6,
            "probe_bytes": runs[mode].get("probe_bytes", 0), "probes": runs[mode].get("probes")}


def hop_cost(run: dict, hop: int) -> float:
    """What hop ``hop`` (agent ``hop`` to agent ``hop + 1``) cost in ``run``: the sender's publish, and the
    receiver's receive and prefill (an ids hop: the handoff, then re-prefilling; a cache hop: encode and put, then
    get, decode and the prefill of what the cache does not cover)."""
    sender, receiver = run["agents"][hop], run["agents"][hop + 1]
    return sender["publish_s"] + receiver["receive_s"] + receiver["prefill_s"]


def cold_row(profile: str, name: str, runs: dict[str, dict]) -> dict[str, Any]:
    """Auto from a cold start against the better of cold text and prefix (the median runs), and each of its hops'
    choices against the same hop's cost in those runs: right where the chosen way costs at most TIE more.

    The same hop in auto's situation: where auto sent ids on an earlier hop, that link's packet is not in the
    store, so a cache on this hop would have to put it too. The cache's cost is then the prefix run's hop plus
    the prefix run's publish of every such earlier link (``cache_s``; ``cache_hop_s`` is the hop alone)."""
    text, prefix, auto = (runs[m]["end_to_end_s"] for m in ("text", "prefix", "auto"))
    hops = []
    for hop, agent in enumerate(runs["auto"]["agents"][:-1]):
        choice = (agent.get("prediction") or {}).get("choice")
        unput = sum(runs["prefix"]["agents"][j]["publish_s"] for j in range(hop)
                    if not runs["auto"]["agents"][j].get("packet_put_bytes"))
        cost = {"ids": hop_cost(runs["text"], hop), "cache": hop_cost(runs["prefix"], hop) + unput}
        other = "ids" if choice == "cache" else "cache"
        hops.append({"hop": hop, "choice": choice, "ids_s": cost["ids"], "cache_s": cost["cache"],
                     "cache_hop_s": cost["cache"] - unput, "right": choice in cost and
                     cost[choice] <= (1 + TIE) * cost[other], "decision": agent.get("decision")})
    return {"profile": profile, "pipeline": name, "text_s": text, "prefix_s": prefix, "auto_s": auto,
            "vs_best": auto / min(text, prefix), "within_10pct_of_best": auto <= (1 + TIE) * min(text, prefix),
            "each_s": {m: runs[m]["end_to_end_each_s"] for m in ("text", "prefix", "auto")},
            "wire_bytes": {m: runs[m]["wire_bytes"] for m in ("text", "prefix", "auto")},
            "hops": hops, "hops_right": all(h["right"] for h in hops)}


def cold_main(args: argparse.Namespace, profiles: list, names: list[str], modes: list[str],
              env: dict[str, str], work: Path) -> dict[str, Any]:
    """``--start cold``: each pipeline from its processes' start, every mode ``--runs`` times (orders alternating,
    the store emptied between runs so that no run reads what another measured), medians; auto held to the better
    of text and prefix and each hop's choice to the same hop's cost in the cold text and prefix runs."""
    rows, report = [], {}
    with Network(HOSTS) as net:
        server = start_redis(net, "store", work / "redis")
        url = server.url()
        flusher = IOWorker(net, "h1", url, env)
        try:
            for profile in profiles:
                net.set_rates(profile.rate_bits)
                report[profile.name] = {}
                for name in names:
                    every: dict[str, list[dict]] = {m: [] for m in modes}
                    for repeat in range(args.runs):
                        for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                            log(f"{profile.name} {name}: {mode} from a cold start (run {repeat + 1})")
                            flusher.ask(op="flush")
                            every[mode].append(run_pipeline(net, url, name, mode, args, env, work,
                                                            f"cold-{profile.name}-{name}-{mode}-{repeat}", None,
                                                            cold=True))
                    runs = {m: {**{k: v for k, v in median_run(r).items() if k != "output_ids"},
                                "end_to_end_each_s": [x["end_to_end_s"] for x in r]} for m, r in every.items()}
                    same = [r["output_ids"] for m in every if m in ("text", "prefix", "auto") for r in every[m]]
                    report[profile.name][name] = {"runs": runs,
                                                  "outputs_identical": all(o == same[0] for o in same)}
                    if {"text", "prefix", "auto"} <= set(runs):
                        rows.append(cold_row(profile.name, name, runs))
                        r = rows[-1]
                        log(f"{profile.name} {name}: text {r['text_s']:.1f} s, prefix {r['prefix_s']:.1f} s, auto "
                            f"{r['auto_s']:.1f} s ({r['vs_best']:.3f} of the better), hops "
                            f"{[h['choice'] for h in r['hops']]} right: {r['hops_right']}")
        finally:
            flusher.process.stdin.close()
    return {"start": "cold", "profiles": report, "rows": rows,
            "targets": {"auto_within_10pct_of_best": all(r["within_10pct_of_best"] for r in rows),
                        "every_hop_right": all(r["hops_right"] for r in rows)}}


def targets(profiles: dict[str, dict]) -> dict[str, Any]:
    """The issue's targets, checked on every profile and pipeline measured."""
    auto_rows, transfer_ratios, flips = [], [], {}
    for profile, data in profiles.items():
        for name, pipe in data["pipelines"].items():
            runs = pipe["runs"]
            for auto_mode in ("auto", "auto-costs"):
                if {"text", "prefix", auto_mode} <= set(runs):
                    auto_rows.append(auto_row(profile, name, runs, auto_mode))
            for hop in pipe["hops"]:
                for encoding in ENCODINGS:
                    transfer_ratios.append({"profile": profile, "pipeline": name, "hop": hop["hop"],
                                            "encoding": encoding, "ratio": hop[encoding]["ratio"]})
                if profile == "100mbit" and "fp32_vs_ids" in hop:
                    flips.setdefault(name, []).append({"hop": hop["hop"], "fp32": hop["fp32_vs_ids"],
                                                       "int8": hop["int8_vs_ids"],
                                                       "flips": hop["fp32_vs_ids"] == "ids" and
                                                       hop["int8_vs_ids"] == "cache"})
    return {"auto": auto_rows,
            "auto_ok": all(r["within_5pct_of_best"] and r["faster_than_worst"] is not False for r in auto_rows),
            "auto_bytes_ok": all(r["bytes_within_5mb"] for r in auto_rows),
            "transfer": transfer_ratios,
            "transfer_within_25pct": all(abs(r["ratio"] - 1) <= 0.25 for r in transfer_ratios),
            "int8_flips_at_100mbit": flips}


# -- pictures ---------------------------------------------------------------------------------------


def quiet_codecs() -> dict[str, Codec]:
    """Encode and decode rates (fp32 K/V bytes per second) of the largest real packets in
    ``benchmarks/results/codec.json``, a run of ``benchmarks/codec.py`` on a quiet machine."""
    data = json.loads((ROOT / "benchmarks" / "results" / "codec.json").read_text())
    size = max((s for s in data["sizes"] if not s["synthetic"]), key=lambda s: s["tokens"])
    rows = {r["encoding"]: r for r in size["rows"]}
    return {e: Codec(size["kv_bytes_fp32"] / rows[e]["encode_s"], size["kv_bytes_fp32"] / rows[e]["decode_s"])
            for e in ENCODINGS}


def draw(profiles: dict[str, dict], codecs: dict[str, Codec], out: Path, tokens: int) -> dict[str, str]:
    drawn = {}
    for profile, data in profiles.items():
        doc = data["pipelines"].get("document") or next(iter(data["pipelines"].values()), None)
        if doc is None or not doc["runs"]:  # transfer only (--modes ""): nothing to lay out
            continue
        order = [m for m in ("text", "prefix", "int8", "auto") if m in doc["runs"]]
        label = {"text": "text", "prefix": "prefix (fp32)", "int8": "prefix (int8)", "auto": "auto"}
        path = timeline([(label[m], doc["runs"][m]["agents"]) for m in order], out / f"network-timeline-{profile}.png",
                        title=f"{doc['name']} across three hosts, {profile} links")
        drawn[profile] = str(path)
    links, rates = geometric(1e8, 1e11, 41), geometric(30, 1e5, 41)
    free = {e: Codec(1e18, 1e18) for e in codecs}  # the bound: encode and decode cost nothing (a GPU's own copy)
    panels = [(f"{shape.name}: {tokens}-token hop, {label}",
               [p.to_json() for p in sweep(shape, links, rates, c, tokens)])
              for label, c in (("codec of this CPU", codecs), ("transfer only (codec free)", free))
              for shape in MODELS.values()]
    measured = []
    for profile, data in profiles.items():
        for name, pipe in data["pipelines"].items():
            hop = pipe["hops"][0] if pipe["hops"] else None
            if hop is None or "measured_winner" not in hop:
                continue
            rate = PROFILES[profile].rate_bits or data["probe"]["store"]["put_rate"] * 8
            measured.append({"link_bits": rate, "prefill_rate": hop["prefill_rate"], "winner": hop["measured_winner"],
                             "label": f"{name} {profile}", "panel": 0})
    drawn["break_even"] = str(break_even_map(panels, out / "network-breakeven.png", measured,
                                             title="which wins: token ids, fp32 cache or int8 cache (one hop)"))
    return drawn


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="10mbit,100mbit,1gbit,veth")
    parser.add_argument("--pipelines", default="document,support")
    parser.add_argument("--modes", default="text,prefix,int8,auto")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=positive, default=3, help="transfer repeats per hop (medians)")
    parser.add_argument("--runs", type=int, default=1,
                        help="pipeline runs per mode, alternating the order of the modes (the median run is kept)")
    parser.add_argument("--threads", type=positive, default=2, help="torch threads of each agent process")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--map-codec", choices=["quiet", "measured"], default="quiet",
                        help="codec rates of the break-even map: from benchmarks/results/codec.json (a quiet run of "
                             "benchmarks/codec.py) or measured by this run (distorted on a busy machine)")
    parser.add_argument("--replot", type=Path, default=None,
                        help="only redraw the pictures from a saved JSON line of this script (no namespaces needed)")
    parser.add_argument("--start", choices=["warm", "cold"], default="warm",
                        help="warm: the downstream agents load and wait before the first starts, timed from the first "
                             "turn (transfer, probe and pictures too); cold: every process starts at once, as a "
                             "user's command starts them, timed from their start to the last reply (pipelines only)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.replot is not None:
        saved = json.loads(args.replot.read_text().strip().splitlines()[-1])
        tokens = max(h["tokens"] for p in saved["profiles"].values() for pipe in p["pipelines"].values()
                     for h in pipe["hops"])
        print(json.dumps(draw(saved["profiles"], quiet_codecs(), args.out, tokens)))
        return
    profiles = [PROFILES[p] for p in args.profiles.split(",")]
    names = args.pipelines.split(",")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES] + [n for n in names if n not in PIPELINES]
    if unknown:
        parser.error(f"unknown modes or pipelines: {unknown}")
    reason = netns_unavailable()
    if reason:
        sys.exit(f"error: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: namespaces go away

    torch.set_num_threads(args.threads)
    if args.start == "cold":
        cold_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                    "OMP_NUM_THREADS": str(args.threads), "COLUMNS": "250", "HF_HUB_OFFLINE": "1"}
        cold_env.pop("KVWIRE_ENCODING", None)
        models.resolve()  # converted once, before any timing
        work = Path(tempfile.mkdtemp(prefix="kvwire-network-"))
        try:
            payload = {**cold_main(args, profiles, names, modes, cold_env, work),
                       "max_new_tokens": args.max_new_tokens, "threads": args.threads, "machine": machine()}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "network-cold.json").write_text(json.dumps(payload) + "\n")
        if args.json:
            print(json.dumps(payload))
        return
    model, tokenizer = hf.load_model(models.resolve())
    spec = hf.model_spec(model)
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="kvwire-network-", dir=shm if os.access(shm, os.W_OK) else None))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(args.threads), "COLUMNS": "250", "HF_HUB_OFFLINE": "1"}
    env.pop("KVWIRE_ENCODING", None)
    report: dict[str, Any] = {}
    try:
        log("building each pipeline's packets (one prefix run each, in this process)")
        hops = {name: build_hops(model, tokenizer, spec, name, args.max_new_tokens, work) for name in names}
        codec_costs = {e: probe_codec(spec, CodecOptions(encoding=e), tokens=512) for e in ENCODINGS}
        measured_codecs = {e: Codec(c.encode_rate, c.decode_rate) for e, c in codec_costs.items()}
        codecs = quiet_codecs() if args.map_codec == "quiet" else measured_codecs
        with Network(HOSTS) as net:
            server = start_redis(net, "store", work / "redis")
            url = server.url()
            workers = {h: IOWorker(net, h, url, env) for h in ("h1", "h2", "h3")}
            for profile in profiles:
                net.set_rates(profile.rate_bits)
                log(f"{profile.name}: kvwire probe on h1")
                cost, costs_file = probe(net, url, env, work, profile.name)
                data: dict[str, Any] = {"rate_bits": profile.rate_bits, "probe": cost.to_json(), "pipelines": {}}
                for name in names:
                    log(f"{profile.name} {name}: transfer of real packets, {args.repeats} repeats")
                    transfer = {e: measure_transfer(workers, hops[name], e, args.repeats, f"{profile.name}-{name}")
                                for e in ENCODINGS}
                    every: dict[str, list[dict]] = {m: [] for m in modes}
                    for repeat in range(args.runs):  # alternating the order cancels drift in the machine's load
                        for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                            log(f"{profile.name} {name}: {mode} across three hosts (run {repeat + 1})")
                            every[mode].append(run_pipeline(net, url, name, mode, args, env, work,
                                                            f"{profile.name}-{name}-{mode}-{repeat}", costs_file))
                            workers["h1"].ask(op="flush")
                    runs = {m: median_run(r) for m, r in every.items()}
                    same = [r["output_ids"] for m in runs if m in ("text", "prefix", "auto") for r in every[m]]
                    data["pipelines"][name] = {
                        "name": name, "hops": hop_table(hops[name], transfer, runs, cost),
                        "outputs_identical_text_prefix_auto": all(o == same[0] for o in same),
                        "runs": {m: {**{k: v for k, v in r.items() if k != "output_ids"},
                                     "end_to_end_each_s": [x["end_to_end_s"] for x in every[m]]}
                                 for m, r in runs.items()}}
                report[profile.name] = data
                log(f"{profile.name}: " + json.dumps({n: {m: round(r["end_to_end_s"], 1) for m, r in
                                                          p["runs"].items()} for n, p in data["pipelines"].items()}))
            for worker in workers.values():
                worker.process.stdin.close()  # the worker exits at the end of its input
        tokens = max((h["tokens"] for hs in hops.values() for h in hs), default=2000)
        pictures = draw(report, codecs, args.out, tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    payload = {"profiles": report, "targets": targets(report),
               "codec": {"map": args.map_codec, "used": {e: vars(c) for e, c in codecs.items()},
                         "measured_here": {e: vars(c) for e, c in measured_codecs.items()}},
               "pictures": pictures, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
               "threads": args.threads, "machine": machine(),
               "note": "busy shared machine: prefill times vary with load; transfer is timed apart from compute"}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.json:
        print(json.dumps(payload))


if __name__ == "__main__":
    run_main(main)
