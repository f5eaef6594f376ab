"""Servers that share a store, a restart, and the command line.

The shared servers are ``python -m kvwire serve --port 0`` processes on the tiny llama's
folder, ready when ``GET /health`` answers: two of them on one real redis-server reuse
each other's caches. A new server on a ``file://`` store still has its predecessor's.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from kvwire.serve import ServeConfig, Service
from tests.support.serve_utils import ROOT, ServerProcess, client, get_json, in_process

QUESTION = [{"role": "system", "content": "You are one of five specialists in an incident-review team."},
            {"role": "user", "content": "Incident report: checkout failed for 2 hours; 18,420 of 23,950 attempts "
                                        "failed. Summarize the incident in three sentences."}]


def ask(url, messages=QUESTION, max_tokens=12):
    api = client(url)
    return api.chat.completions.create(model=api.models.list().data[0].id, messages=messages, temperature=0,
                                       max_tokens=max_tokens, extra_body={"ignore_eos": True})


def follow_up(answer):
    return QUESTION + [{"role": "assistant", "content": answer.choices[0].message.content},
                       {"role": "user", "content": "List the key numbers."}]


def test_two_servers_on_one_redis_reuse_each_others_caches(tiny_folder, redis_server, tmp_path):
    url = redis_server.url("prefix=serve-two")
    args = ("--model", str(tiny_folder), "--store", url, "--block-size", "4")
    with ServerProcess(tmp_path, *args) as a, ServerProcess(tmp_path, *args) as b:
        assert get_json(f"{a.root}/health")["fingerprint"] == get_json(f"{b.root}/health")["fingerprint"]
        first = ask(a.url)
        second = ask(b.url, follow_up(first))  # B continues the conversation A served
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens, (cached, second.usage)
        assert ask(a.url, follow_up(first)).usage.prompt_tokens_details.cached_tokens == \
            second.usage.prompt_tokens - 1  # and A reuses what B published
    assert a.stopped_cleanly() and b.stopped_cleanly()


def test_a_restarted_server_still_has_its_caches_on_a_file_store(tiny_served, tiny_folder, tmp_path):
    """A new server on the same file:// store (in this process; benchmarks/serve.py restarts the process)."""
    model, tokenizer = tiny_served
    config = ServeConfig(model=str(tiny_folder), store=f"file://{tmp_path / 'store'}", block_size=4)
    with in_process(Service(config, model, tokenizer)) as before:
        cold = ask(before.url)
    with in_process(Service(config, model, tokenizer)) as after:
        warm = ask(after.url)
    assert warm.usage.prompt_tokens_details.cached_tokens == cold.usage.prompt_tokens - 1
    assert warm.choices[0].message.content == cold.choices[0].message.content


def kvwire(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvwire", "serve", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_command_line_errors(tiny_folder, tmp_path):
    assert_one_error_line(kvwire("--model", str(tiny_folder), "--store", "ftp://nowhere"), "unknown store URL")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert_one_error_line(kvwire("--model", str(tiny_folder), "--port", str(taken.getsockname()[1])),
                              "cannot listen on 127.0.0.1")
    usage = kvwire("--no-reuse", "--splice", "0.2")
    assert usage.returncode == 2 and "--splice" in usage.stderr
    when = kvwire("--splice-when", "always")
    assert when.returncode == 2 and "needs --splice R" in when.stderr
    key = kvwire("--model", str(tiny_folder), "--api-key", "clé")  # no client could send it in a header
    assert key.returncode == 2 and "printable ASCII" in key.stderr
    chunk = kvwire("--prefill-chunk", "0")
    assert chunk.returncode == 2 and "'0' is not a token count >= 1, auto or none" in chunk.stderr


def test_sigterm_drains_503_to_new_requests_running_ones_finish_exit_0(tiny_folder, tmp_path):
    """SIGTERM under load: the server keeps listening and answers new requests 503 with Retry-After,
    the request already streaming finishes whole (within --shutdown-grace), and the process exits 0."""
    import json
    import threading
    import time

    from tests.support.serve_utils import request

    server = ServerProcess(tmp_path, "--model", str(tiny_folder), "--shutdown-grace", "60", "--no-reuse").start()
    try:
        api = client(server.url)
        model = api.models.list().data[0].id
        stream = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=900, stream=True,
                                             extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        finished = {}
        reader = threading.Thread(target=lambda: finished.update(
            reason=[c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]))
        reader.start()
        server.process.terminate()  # SIGTERM while it streams
        time.sleep(0.2)
        body = json.dumps({"model": model, "messages": QUESTION, "max_tokens": 2}).encode()
        status, headers, raw = request("POST", f"{server.url}/chat/completions", body,
                                       {"Content-Type": "application/json"})
        retry_after = {k.lower(): v for k, v in headers.items()}.get("retry-after")
        assert status == 503 and retry_after is not None and int(retry_after) >= 1, (status, headers, raw)
        assert "shutting down" in json.loads(raw)["error"]["message"]
        reader.join(timeout=120)
        assert finished["reason"] == ["length"]  # the running request finished whole, not cut
        assert server.process.wait(timeout=60) == 0
        assert "Traceback" not in server.output()
    finally:
        server.stop()
