"""Five agents review one incident report, written only against the official ``openai`` client.

Nothing here imports kvwire: point it at any OpenAI-compatible server. Against
``kvwire serve`` the agents reuse each other's caches without knowing it::

    kvwire serve --port 8000 &
    python examples/openai_agents.py --base-url http://127.0.0.1:8000/v1

Two ways agents pass work on, as frameworks do:

- shared transcript (default): every agent sends the whole conversation so far plus
  its own instruction, under one system prompt. Each request extends the previous
  one, so the server serves all of it but the new turn from cache (exact);
- ``--private``: every agent has its own system prompt and gets the report and the
  earlier agents' answers as messages of its own. The answers are earlier
  completions: a server started with ``--splice R`` splices their cached K/V in
  (where that beats prefilling them: ``--splice-when``).

Each agent streams its answer (so time to first token is measured here, on the
client) and reports ``usage.prompt_tokens_details.cached_tokens``. ``--json`` prints
one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from openai import OpenAI

SYSTEM = "You are one of five specialists in an incident-review team. Answer in a few short sentences."
AGENTS = [  # (name, role, instruction): the agents of examples/document_pipeline.toml
    ("summarizer", "summarizer", "Summarize the incident in three sentences."),
    ("extractor", "fact extractor", "List the key numbers: duration, failed checkouts, revenue impact and tickets."),
    ("analyst", "root-cause analyst", "Explain the root cause and the two most important contributing factors."),
    ("critic", "reviewer", "Point out anything the summary or analysis above got wrong or left out."),
    ("planner", "action planner", "Name the three action items that matter most and who owns them."),
]
REPORT = Path(__file__).parent / "data" / "incident_report.md"


def ask(client: OpenAI, model: str, messages: list[dict], max_tokens: int, **extra) -> dict:
    """One streamed chat completion: its text, time to first token, total time and usage."""
    start = time.perf_counter()
    first = None
    parts, usage = [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    details = usage.prompt_tokens_details if usage is not None else None
    return {"text": "".join(parts), "ttft_s": (first or end) - start, "total_s": end - start,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": details.cached_tokens if details is not None else None}


def shared_transcript(clients: list[OpenAI], model: str, report: str, max_tokens: int, agents: int = 5,
                      **extra) -> list[dict]:
    """Agent i asks ``clients[i % len(clients)]``: agents may run against different servers."""
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for index, (name, role, instruction) in enumerate(AGENTS[:agents]):
        turn = f"You are the {role}. {instruction}"
        if index == 0:
            turn = f"Incident report:\n\n{report}\n\n{turn}"
        messages.append({"role": "user", "content": turn})
        result = ask(clients[index % len(clients)], model, messages, max_tokens, **extra)
        messages.append({"role": "assistant", "content": result["text"]})
        results.append({"agent": name, **result})
    return results


def private_prompts(clients: list[OpenAI], model: str, report: str, max_tokens: int, agents: int = 5,
                    **extra) -> list[dict]:
    answers: list[str] = []
    results = []
    for index, (name, role, instruction) in enumerate(AGENTS[:agents]):
        messages = [{"role": "system", "content": f"You are the {role} of an incident-review team. "
                                                  "Answer in a few short sentences."},
                    {"role": "user", "content": f"Incident report:\n\n{report}"}]
        messages += [{"role": "user", "content": answer} for answer in answers]  # the earlier agents' answers
        messages.append({"role": "user", "content": instruction})
        result = ask(clients[index % len(clients)], model, messages, max_tokens, **extra)
        answers.append(result["text"])
        results.append({"agent": name, **result})
    return results


def run(base_url: str | list[str], *, model: str | None = None, private: bool = False, max_tokens: int = 32,
        api_key: str = "none", report: str | None = None, agents: int = 5, **extra) -> dict:
    """Run the agents once (agent i on ``base_url[i % n]`` when several servers are given); returns
    per-agent results and the end-to-end time."""
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    clients = [OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=600) for url in urls]
    model = model or clients[0].models.list().data[0].id
    report = report if report is not None else REPORT.read_text()
    start = time.perf_counter()
    results = (private_prompts if private else shared_transcript)(clients, model, report, max_tokens, agents,
                                                                  **extra)
    return {"model": model, "pattern": "private" if private else "shared", "agents": results,
            "total_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", nargs="+", default=["http://127.0.0.1:8000/v1"],
                        help="one server, or several: agent i asks the (i mod n)-th")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--private", action="store_true", help="private system prompts; answers passed as messages")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    result = run(args.base_url, model=args.model, private=args.private, max_tokens=args.max_tokens,
                 api_key=args.api_key)
    for agent in result["agents"]:
        print(f"{agent['agent']:>10}: {agent['prompt_tokens']} prompt tokens, {agent['cached_tokens']} from cache, "
              f"TTFT {agent['ttft_s']:.2f}s, {agent['total_s']:.2f}s: {agent['text'].strip()[:100]}")
    print(f"end to end: {result['total_s']:.2f}s")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
