"""``kvwire serve`` through the official ``openai`` client over a real socket, on the tiny llama.

Each server runs in this process on a thread (uvicorn on a loopback port the kernel
picks) and is ready when ``GET /health`` answers. The model does not matter here; what
is checked is the API, reuse (exact: identical answers with and without it), batching,
the bounded queue, disconnects and every kind of bad input.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import pytest

from kvwire.serve import ServeConfig
from tests.support.serve_utils import client, get_json, metric, request, wait_for

SYSTEM = "You are the analyst. Point out what is wrong or missing."
DOCUMENT = ("Incident report: checkout failed for 2 hours; 18,420 of 23,950 attempts failed. "
            "def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)")
TURNS = ["Summarize the document in three sentences.", "List the key numbers.", "Who owns each action?"]


def converse(api: openai.OpenAI, model: str, turns=TURNS, **options) -> list:
    """A conversation turn by turn, each request carrying the whole transcript so far (as frameworks do)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{DOCUMENT}\n\n{turns[0]}"}]
    answers = []
    for index in range(len(turns)):
        if index:
            messages.append({"role": "user", "content": turns[index]})
        answer = api.chat.completions.create(model=model, messages=messages, temperature=0, **options)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    return answers


def test_a_chat_completion_streamed_and_not(serve):
    with serve() as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        messages = [{"role": "user", "content": "List the bugs in the code."}]
        whole = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)
        assert whole.object == "chat.completion" and whole.model == model
        assert whole.choices[0].finish_reason in ("stop", "length") and whole.choices[0].message.role == "assistant"
        usage = whole.usage
        assert (usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
                and 1 <= usage.completion_tokens <= 12)
        assert usage.prompt_tokens_details.cached_tokens == 0  # nothing published yet

        chunks = list(api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                                  stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert [c.choices[0].finish_reason for c in finals] == [whole.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens
        # the same prompt again: everything but the last prompt token comes from the first request's cache
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_reuse_is_exact_and_reported(serve):
    """At temperature 0 every answer with reuse equals the answer without; cached tokens are reported."""
    with serve() as reusing, serve(reuse=False) as plain:
        api, baseline = client(reusing.url), client(plain.url)
        model = api.models.list().data[0].id
        with_reuse = converse(api, model, max_tokens=16)
        without = converse(baseline, model, max_tokens=16)
        branch = [TURNS[0], "Explain the root cause."]  # shares the document, then leaves the conversation
        with_reuse += converse(api, model, branch, max_tokens=16)  # its first request repeats the first turn
        without += converse(baseline, model, branch, max_tokens=16)
        for a, b in zip(with_reuse, without):
            assert a.choices[0].message.content == b.choices[0].message.content
            assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens,
                                                                         b.usage.completion_tokens)
            assert b.usage.prompt_tokens_details.cached_tokens == 0
        cached = [a.usage.prompt_tokens_details.cached_tokens for a in with_reuse]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
        # a turn extending the conversation reuses at least the whole previous request's prompt
        assert cached[1] >= with_reuse[0].usage.prompt_tokens
        assert cached[3] == with_reuse[3].usage.prompt_tokens - 1  # a repeated request: all but one token
        details = [a.model_extra["kvwire"] for a in with_reuse]
        assert all(d["cached_tokens"] == d["prefix_tokens"] == c for d, c in zip(details, cached))
        assert all(d["prefilled_tokens"] == a.usage.prompt_tokens - c for d, a, c in zip(details, with_reuse, cached))
        assert metric(reusing.root, "kvwire:prefix_cache_hits_total") == sum(cached)
        assert metric(reusing.root, "kvwire:prefix_cache_queries_total") == sum(a.usage.prompt_tokens
                                                                                 for a in with_reuse)
        assert metric(plain.root, "kvwire:prefix_cache_hits_total") == 0
        assert get_json(f"{plain.root}/health")["store_status"] == "off"


def test_concurrent_requests_decode_together(serve):
    """Requests sent together share decode steps, and each answer equals the request served alone."""
    prompts = [f"{DOCUMENT}\n\n{turn}" for turn in TURNS + ["Explain the root cause."]]
    with serve(max_batch=4) as server:
        api = client(server.url)
        model = api.models.list().data[0].id

        def ask(prompt):
            return api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
        alone = [ask(p).choices[0].message.content for p in prompts]
        results: dict[int, str] = {}
        barrier = threading.Barrier(len(prompts))

        def together(i):
            barrier.wait()
            results[i] = ask(prompts[i]).choices[0].message.content
        threads = [threading.Thread(target=together, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(len(prompts))] == alone
        steps = metric(server.root, "kvwire_batch_rows_count")
        single = metric(server.root, "kvwire_batch_rows_bucket", le="1.0")
        assert steps - single > 0, "no decode step ever held more than one sequence"


def test_a_long_prompt_joins_in_chunks_and_every_answer_stays_the_same(serve):
    """--prefill-chunk 8: prompts of ~60 tokens are prefilled 8 a step between the decode steps of the
    requests already streaming, into buffers reserved at start (--reserve-slots); every answer equals the
    one from a server that prefills whole prompts into buffers grown on demand."""
    prompts = [f"{DOCUMENT}\n\n{turn}" for turn in TURNS + ["Explain the root cause."]]
    with pytest.raises(ValueError, match="reserve_slots must be a slot count"):
        ServeConfig(reserve_slots=-1)
    with serve(max_batch=4, prefill_chunk=None, reuse=False) as whole, \
            serve(max_batch=4, prefill_chunk=8, reuse=False, reserve_slots=256) as chunked:
        model = client(whole.url).models.list().data[0].id

        def ask(server, prompt):
            return client(server.url).chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=30,
                extra_body={"ignore_eos": True}).choices[0].message.content
        reference = [ask(whole, p) for p in prompts]
        results: dict[int, str] = {}

        def staggered(i):
            time.sleep(0.05 * i)  # later ones arrive while earlier ones decode
            results[i] = ask(chunked, prompts[i])
        threads = [threading.Thread(target=staggered, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(len(prompts))] == reference


@pytest.mark.parametrize("where", ["sampling", "model step"])
def test_one_failing_request_fails_alone_and_the_others_finish_as_if_alone(serve, monkeypatch, where):
    """Fault injection: the request sent with seed 4242 makes its own work raise -- its sampler, or every
    forward pass it is part of (the batched step, then its retry alone). It gets a 500 with a message; the
    three decoded beside it finish with the tokens they produce alone, and the server goes on."""
    import kvwire.hf.engine as engine

    prompts = [f"{DOCUMENT}\n\n{turn}" for turn in TURNS + ["Explain the root cause."]]
    with serve(max_batch=4) as server:
        api = client(server.url)
        model = api.models.list().data[0].id

        def ask(prompt, **extra):
            return api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=24,
                                               extra_body={"ignore_eos": True, **extra})
        alone = [ask(p).choices[0].message.content for p in prompts[1:]]
        if where == "sampling":
            real_pick = engine.pick

            def pick(logits, sampling, generator):
                if sampling.seed == 4242:
                    raise ValueError("injected: this request's sampler failed")
                return real_pick(logits, sampling, generator)
            monkeypatch.setattr(engine, "pick", pick)
        else:
            real_forward = engine.Engine._forward

            def forward(self, parts):  # the buffer rows each part of the pass covers
                if any(row.request.sampling.seed == 4242 for part in parts for row in
                       self._active[part.plan.first_row:part.plan.first_row + part.plan.batch]):
                    raise RuntimeError("injected: this request breaks the model step")
                return real_forward(self, parts)
            monkeypatch.setattr(engine.Engine, "_forward", forward)
        results: dict[int, object] = {}
        barrier = threading.Barrier(len(prompts))

        def together(i):
            barrier.wait()
            try:
                results[i] = ask(prompts[i], **({"seed": 4242} if i == 0 else {})).choices[0].message.content
            except openai.APIError as err:
                results[i] = err
        threads = [threading.Thread(target=together, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert isinstance(results[0], openai.InternalServerError) and "failed to answer" in str(results[0])
        assert [results[i] for i in range(1, len(prompts))] == alone  # no collateral failure, same tokens
        assert metric(server.root, "kvwire_requests_total", status="500") == 1
        monkeypatch.undo()
        assert ask(prompts[0], seed=4242).choices[0].finish_reason == "length"  # the server goes on


def test_full_queue_answers_429_and_a_closed_stream_frees_its_slot(serve):
    with serve(max_batch=1, max_queue=0) as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        messages = [{"role": "user", "content": "Summarize the document."}]
        stream = api.chat.completions.create(model=model, messages=messages, max_tokens=800, stream=True,
                                             extra_body={"ignore_eos": True})
        next(iter(stream))  # the request is in the batch now
        wait_for(lambda: get_json(f"{server.root}/health")["running"] == 1, "the stream to hold the slot")
        with pytest.raises(openai.RateLimitError) as refused:
            api.chat.completions.create(model=model, messages=messages, max_tokens=4)
        assert refused.value.status_code == 429 and int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.code == "queue_full"
        stream.close()  # the client goes away mid-stream
        wait_for(lambda: get_json(f"{server.root}/health")["running"] == 0, "the slot to be freed")
        assert metric(server.root, "kvwire_cancelled_total") == 1
        assert metric(server.root, "kvwire:generation_tokens_total") < 800  # it stopped decoding at once
        after = api.chat.completions.create(model=model, messages=messages, max_tokens=4)
        assert after.usage.completion_tokens >= 1
        health = get_json(f"{server.root}/health")
        assert (health["running"], health["waiting"]) == (0, 0)


def test_a_client_gone_before_a_plain_response_is_cancelled(serve):
    with serve() as server:
        body = json.dumps({"model": get_json(f"{server.url}/models")["data"][0]["id"], "max_tokens": 800,
                           "ignore_eos": True, "messages": [{"role": "user", "content": "Summarize."}]}).encode()
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: get_json(f"{server.root}/health")["running"] == 1, "the request to start")
        wait_for(lambda: metric(server.root, "kvwire_cancelled_total") == 1, "the request to be cancelled")
        assert get_json(f"{server.root}/health")["running"] == 0
        assert metric(server.root, "kvwire:generation_tokens_total") < 800


def test_a_client_gone_while_sending_its_body_is_no_server_error(serve, caplog):
    with serve() as server:
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 5000\r\n\r\n{\"model\": \"tiny\", \"mess")
        wait_for(lambda: metric(server.root, "kvwire_requests_total", status="499") == 1, "the 499 to be counted")
        assert metric(server.root, "kvwire_requests_total", status="500") == 0
    assert "request failed" not in caplog.text


def test_openai_fields_at_their_defaults_are_accepted(serve):
    """Clients and frameworks send OpenAI's options at values that ask for nothing: those are fine."""
    with serve() as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        answer = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, response_format={"type": "text"},
            presence_penalty=0, frequency_penalty=0.0, logit_bias={}, tool_choice="none", seed=2**63 - 1,
            extra_body={"top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "modalities": ["text"], "best_of": 1})
        assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_shutdown_ends_running_streams_with_an_error_event(serve):
    """SIGTERM: uvicorn's grace period runs; one second before it ends, requests still decoding are ended
    with an error (Scheduler.abort), so a streaming client reads why instead of a cut connection."""
    with serve() as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        stream = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Go on."}],
                                             max_tokens=900, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        assert server.service.scheduler.abort("the server is shutting down") == 1
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        wait_for(lambda: get_json(f"{server.root}/health")["running"] == 0, "the aborted request to leave")
        with pytest.raises(openai.APIStatusError) as refused:  # no new requests once shutting down
            api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert refused.value.status_code == 503


def test_stop_sequences_and_lengths(serve):
    with serve() as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        messages = [{"role": "user", "content": "List the key numbers."}]
        full = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=30,
                                           extra_body={"ignore_eos": True})
        text = full.choices[0].message.content
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 30
        stop = text[len(text) // 2:len(text) // 2 + 2]
        cut = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=30, stop=[stop],
                                          extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.find(stop)]
        streamed = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=30,
                                               stop=stop, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[:text.find(stop)]


def test_a_request_cut_by_a_stop_string_still_publishes_its_cache(serve):
    """A stop string ends the row in the batched engine keeping its K/V (``Engine.finish``), so the
    prompt it read is published like any other: the same prompt again is served from cache."""
    messages = [{"role": "user", "content": "List the key numbers."}]
    with serve(reuse=False) as plain:
        api = client(plain.url)
        text = api.chat.completions.create(model=api.models.list().data[0].id, messages=messages, temperature=0,
                                           max_tokens=30, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    with serve() as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        cut = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=30, stop=[stop],
                                          extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.find(stop)]
        again = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=4)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_seeded_sampling_repeats_and_a_tiny_temperature_is_greedy(serve):
    """Some frameworks send a tiny temperature to mean greedy: it is answered as greedy (it was a 500 that
    failed every request decoding with it: logits / 1e-40 overflowed)."""
    with serve() as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        messages = [{"role": "user", "content": "Point out what is wrong."}]
        runs = [api.chat.completions.create(model=model, messages=messages, temperature=1.0, top_p=0.9, seed=7,
                                            max_tokens=16).choices[0].message.content for _ in range(2)]
        assert runs[0] == runs[1]
        greedy = [api.chat.completions.create(model=model, messages=messages, temperature=t, max_tokens=8,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
                  for t in (0, 1e-40)]
        assert greedy[0] == greedy[1]


def test_a_stream_that_fails_after_its_200_is_counted_as_a_stream_error(serve, monkeypatch):
    """A stream's status line goes out with its first chunk; a failure later reaches the client as an
    error event, and /metrics counts it (kvwire_stream_errors_total), not only as a 200."""
    import kvwire.hf.engine as engine

    calls = []

    def failing(logits, sampling, generator):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("a decode step failed")
        return int(logits.argmax())

    with serve() as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        monkeypatch.setattr(engine, "pick", failing)
        stream = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=8, stream=True, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="failed to answer"):
            for _ in stream:
                pass
        assert metric(server.root, "kvwire_stream_errors_total", status="500") == 1
        monkeypatch.undo()
        answer = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert answer.choices[0].finish_reason in ("stop", "length")  # the server goes on


BAD = [
    (b'{"model": "M", "messages": [', 400, None, None, "not valid JSON"),
    (b'[1, 2]', 400, None, None, "JSON object"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400, None,
     "temperature", "temperature"),
    (b'{"model": "M", "messages": [{"role": "user", "content": 5}]}', 400, None, "messages.0.content", "content"),
    (b'{"model": "M", "messages": []}', 400, None, "messages", "messages"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}',
     400, None, "stream_options", "only allowed when stream is true"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}, '
     b'{"role": "tool", "content": "42"}, {"role": "user", "content": "x"}]}', 400, None, "messages.1.content",
     "messages.1.content: Input should be a valid string; Input should be a valid array"),
    (b'{"model": "M", "messages": [{"role": "wizard", "content": "hi"}]}', 400, None, "messages.0.role", "role"),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found", "model",
     "gpt-9"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]}', 400,
     None, "messages", "system message after"),
    (b'{"model": "M", "messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}', 400,
     None, "messages", "before any user message"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}', 400,
     None, "messages", "last message"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}', 400,
     "context_length_exceeded", "max_tokens", "maximum context length"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, None, "max_tokens",
     "max_tokens"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, None, "n", "n=2"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "stop": [""]}', 400, None, "stop", "stop"),
    (b'{"model": "M", "messages": ["hi"]}', 400, None, "messages.0", "messages.0"),  # a field, not the body
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}', 400, None,
     "seed", "seed"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None,
     "temperature", "finite"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}',
     400, None, "response_format", "json_object"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}', 400, None,
     "presence_penalty", "presence_penalty"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"7": -100}}', 400, None,
     "logit_bias", "logit_bias"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}', 400, None,
     "tool_choice", "tool_choice"),
    # vLLM's and OpenAI's newer options: refused by name when they ask for something, never silently ignored
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_k": 40}', 400, None, "top_k", "top_k=40"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "min_p": 0.05}', 400, None, "min_p", "min_p"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.3}', 400, None,
     "repetition_penalty", "repetition_penalty=1.3"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}', 400, None,
     "modalities", "modalities"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "content", '
     b'"content": "x"}}', 400, None, "prediction", "prediction"),
    (b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     400, None, "messages.0.content", "part 0 is an 'image_url' part: kvwire serves text models"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "a \\ud800 b"}]}', 400, None, None,
     "half of a UTF-16 surrogate pair"),
]


@pytest.mark.parametrize("body, status, code, param, fragment", BAD)
def test_bad_requests_get_openai_error_objects(serve, body, status, code, param, fragment):
    with serve() as server:
        model = get_json(f"{server.url}/models")["data"][0]["id"]
        got, _, raw = request("POST", f"{server.url}/chat/completions", body.replace(b'"M"', f'"{model}"'.encode()),
                              {"Content-Type": "application/json"})
        error = json.loads(raw)["error"]
        assert got == status and error["code"] == code and error["param"] == param, error
        assert fragment in error["message"] and error["type"] == "invalid_request_error"
        assert metric(server.root, "kvwire_requests_total", status=str(status)) == 1
        assert get_json(f"{server.root}/health")["running"] == 0


def test_a_prompt_longer_than_the_context(serve):
    with serve() as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model=model, messages=[{"role": "user", "content": DOCUMENT * 40}])
        assert refused.value.code == "context_length_exceeded" and "maximum context length is 1024" in str(
            refused.value)


def test_api_key(serve):
    with serve(api_key="s3cret-key") as server:
        model = get_json(f"{server.root}/health")["model"]
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError) as refused:
            client(server.url, api_key="wrong").chat.completions.create(model=model, messages=messages)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        body = json.dumps({"model": model, "messages": messages}).encode()
        status, _, raw = request("POST", f"{server.url}/chat/completions", body)  # no Authorization header
        assert status == 401 and "missing API key" in json.loads(raw)["error"]["message"]
        assert request("GET", f"{server.url}/models")[0] == 401
        answer = client(server.url, api_key="s3cret-key").chat.completions.create(model=model, messages=messages,
                                                                                 max_tokens=3)
        assert answer.usage.completion_tokens >= 1
        assert request("GET", f"{server.root}/health")[0] == 200  # health and metrics need no key
        assert request("GET", f"{server.root}/metrics")[0] == 200


def test_a_request_body_over_the_limit_is_refused_before_it_is_read(serve):
    """A body over --max-request-bytes is a 413 from its Content-Length, or as soon as a chunked one passes the
    limit: it is never read in full, parsed or tokenized (a 30 MB prompt took 10-27 s of the server before)."""
    with serve(max_request_bytes=4096) as server:
        model = get_json(f"{server.url}/models")["data"][0]["id"]
        small = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        big = json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
        status, _, raw = request("POST", f"{server.url}/chat/completions", big, {"Content-Type": "application/json"})
        error = json.loads(raw)["error"]
        assert status == 413 and error["code"] == "request_too_large" and "5,0" in error["message"], error
        assert "--max-request-bytes" in error["message"]
        connection = http.client.HTTPConnection(server.host, server.port, timeout=60)  # chunked: no length given
        connection.request("POST", "/v1/chat/completions", body=iter([big[:3000], big[3000:]]), encode_chunked=True,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
        connection.close()
        assert request("POST", f"{server.url}/chat/completions", small.encode())[0] == 200  # the server goes on
        assert metric(server.root, "kvwire_requests_total", status="413") == 2
    with serve() as server:  # the default: 32 bytes a token of the context window (1,024 here), at least 1 MiB
        assert server.service.max_request_bytes == 2**20


def test_health_says_draining_during_a_shutdown_and_routes_say_their_methods(serve):
    with serve() as server:
        assert request("HEAD", f"{server.root}/health")[0] == 200
        status, headers, raw = request("DELETE", f"{server.root}/health")
        assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
        assert set(headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
        assert server.service.scheduler.drain(0.0)  # what SIGTERM starts: nothing in flight, so done at once
        status, _, raw = request("GET", f"{server.root}/health")
        assert status == 503 and json.loads(raw)["status"] == "draining"  # a load balancer stops sending


def test_models_health_metrics_and_unknown_routes(serve, tiny_folder):
    with serve(model_name="tiny") as server:
        models = client(server.url).models.list()
        assert [m.id for m in models.data] == ["tiny"]
        assert client(server.url).models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.NotFoundError):
            client(server.url).models.retrieve("gpt-9")
        health = get_json(f"{server.root}/health")
        assert health["status"] == "ok" and health["model"] == "tiny" and health["store"] == "memory://"
        assert len(health["fingerprint"]) == 64 and health["max_batch"] == 8
        assert (health["device"], health["weights"]) == ("cpu", "fp32")  # where and how the model runs
        assert health["prefill_chunk"] is None or health["prefill_chunk"] >= 192  # --prefill-chunk auto, resolved
        assert health["decoding"] == "batched"  # else "one request at a time: <why>"
        _, headers, body = request("GET", f"{server.root}/metrics")
        text = body.decode()
        assert headers["content-type"].startswith("text/plain")
        for name in ("kvwire:prefix_cache_queries_total", "kvwire:prefix_cache_hits_total", "kvwire_store_bytes",
                     "kvwire:time_to_first_token_seconds_bucket", "kvwire_prefill_seconds_saved_total"):
            assert name in text
        status, _, raw = request("GET", f"{server.root}/v1/nothing")
        assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"


def test_a_stopped_server_leaves_no_threads_behind(serve):
    before = {t.name for t in threading.enumerate()}
    with serve() as server:
        api = client(server.url)
        api.chat.completions.create(model=api.models.list().data[0].id, max_tokens=3,
                                    messages=[{"role": "user", "content": "hi"}])
        during = {t.name for t in threading.enumerate()}
        assert {"kvwire-model", "kvwire-io"} <= during
    assert {t.name for t in threading.enumerate() if t.is_alive()} <= before


def test_a_completion_cut_inside_a_character_ends_at_the_last_whole_one(tiny_tokenizer):
    """max_tokens can stop between the bytes of one character; the text (and the ids published with it
    for splicing) then end before it instead of with U+FFFD."""
    from kvwire.hf import whole_characters

    ids = tiny_tokenizer("ok 🌟🌟 fine", add_special_tokens=False)["input_ids"]
    cuts = [n for n in range(1, len(ids)) if tiny_tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert cuts, "the tokenizer splits the star into several tokens"
    for n in cuts:
        kept, text = whole_characters(tiny_tokenizer, ids[:n], tiny_tokenizer.decode(ids[:n]))
        assert text in ("ok ", "ok 🌟", "ok 🌟🌟") and tiny_tokenizer.decode(kept) == text
