"""``--splice R``: a message whose text is an earlier completion gets that completion's cached K/V.

Agent A answers; agent B, with a system prompt of its own, pastes A's answer into its
conversation as a message (what frameworks do). B's server finds the answer by its
text, re-rotates A's K/V to where the message sits and recomputes the share R of it.
At R = 1 that is a full prefill of the same ids (exact); at R = 0 every token of the
answer is served from cache, and its approximation is never published as an exact
prefix for servers that do not splice. By default (``--splice-when cheaper``) a server
splices only where :func:`kvwire.kv.splice.estimate` finds it cheaper than prefilling the
answers -- these tests' answers are short, so most of them force ``always``.

A request's own user messages are published the same way: a team whose agents each read the
pipeline's input after their own system prompt splices the first agent's K/V of it.
"""

from __future__ import annotations


from kvwire import hf
from kvwire.serve.prefix_index import PrefixIndex
from kvwire.serve.prompt import Substitution, encode, message_spans, pieces, prompt_ids
from kvwire.store import open_store
from tests.support.serve_utils import client, get_json

ANALYST = [{"role": "system", "content": "You are the analyst. List the bugs."},
           {"role": "user", "content": "def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)"}]
FIXER_SYSTEM = "You are the fixer. Suggest a fix for each bug."
INPUT = ("def export(rows, totals={}):\n    for r in rows:\n        totals[r[0]] = totals.get(r[0], 0) + r[2]\n"
         "    return sum(r[2] for r in rows) / len(rows)")


def two_agents(server, store_name, tokenizer):
    """A answers; B pastes A's answer into its own conversation. Returns (B's messages, B's answer,
    the ids B's context is made of, the completion's generated ids)."""
    api = client(server.url)
    model = api.models.list().data[0].id
    a = api.chat.completions.create(model=model, messages=ANALYST, temperature=0, max_tokens=24,
                                    extra_body={"ignore_eos": True})
    text = a.choices[0].message.content
    messages = [{"role": "system", "content": FIXER_SYSTEM}, {"role": "user", "content": text},
                {"role": "user", "content": "Fix the bugs listed above."}]
    b = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                    extra_body={"ignore_eos": True})
    generated = completion_ids(server, store_name, text)
    built = pieces(tokenizer, messages, [Substitution(1, 0, len(text), tuple(generated))])
    return messages, b, built, generated


def completion_ids(server, store_name, text):
    """The ids a completion was generated as, from the server's completion index."""
    index = PrefixIndex(get_json(f"{server.root}/health")["fingerprint"], 4)
    entries = index.parse_completions(open_store(store_name).get(index.completion_key(text)))
    return next(e["ids"] for e in entries if index.matches(e, text, 0))


def test_splice_at_r1_is_an_exact_prefill_of_the_same_ids(serve, tiny_served):
    model, tokenizer = tiny_served
    with serve(store="memory://splice-r1", splice=1.0, splice_when="always") as server:
        _, b, built, generated = two_agents(server, "memory://splice-r1", tokenizer)
        details = b.model_extra["kvwire"]
        segment = len(generated) - 1  # the cache covers every generated token but the last
        assert details["spliced_tokens"] == 0 and details["recomputed_tokens"] == segment
        exact = hf.generate(model, built.ids, max_new_tokens=12, eos_ids=frozenset())
        assert b.choices[0].message.content == tokenizer.decode(exact.tokens, skip_special_tokens=True)


def test_splice_at_r0_serves_the_answer_from_cache_and_publishes_no_approximation(serve, tiny_served):
    model, tokenizer = tiny_served
    with serve(store="memory://splice-r0", splice=0.0, splice_when="always") as server, \
            serve(store="memory://splice-r0") as exact_server, serve(reuse=False) as plain:
        messages, b, built, generated = two_agents(server, "memory://splice-r0", tokenizer)
        details = b.model_extra["kvwire"]
        assert details["spliced_tokens"] == len(generated) - 1 and details["recomputed_tokens"] == 0
        assert b.usage.prompt_tokens_details.cached_tokens == details["prefix_tokens"] + details["spliced_tokens"]
        # an exact server on the same store reads B's conversation: never B's spliced K/V
        api = client(exact_server.url)
        model_name = api.models.list().data[0].id
        again = api.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=12,
                                            extra_body={"ignore_eos": True})
        offset = built.spans[0][0]
        assert again.usage.prompt_tokens_details.cached_tokens <= offset
        baseline = client(plain.url).chat.completions.create(model=model_name, messages=messages, temperature=0,
                                                              max_tokens=12, extra_body={"ignore_eos": True})
        assert again.choices[0].message.content == baseline.choices[0].message.content


def test_a_spliced_request_says_how_far_each_segment_moved_and_what_the_guard_recomputed(serve, tiny_served):
    """``usage.kvwire.staleness``: per spliced segment, the mean relative change of its recomputed share's K/V from
    what it brought; ``--splice-guard G`` recomputes a segment over G exactly, and ``guarded_tokens`` counts it."""
    model, tokenizer = tiny_served
    with serve(store="memory://splice-stale", splice=0.5, splice_when="always") as server:
        _, b, _, generated = two_agents(server, "memory://splice-stale", tokenizer)
        details = b.model_extra["kvwire"]
        assert details["spliced_tokens"] > 0 and details["guarded_tokens"] == 0
        [staleness] = details["staleness"]  # one segment: A's answer
        assert staleness > 0
    with serve(store="memory://splice-guarded", splice=0.5, splice_when="always",
               splice_guard=staleness / 2) as server:
        _, guarded, built, _ = two_agents(server, "memory://splice-guarded", tokenizer)
        details = guarded.model_extra["kvwire"]
        assert details["guarded_tokens"] > 0 and details["spliced_tokens"] == 0  # the segment recomputed whole
        exact = hf.generate(model, built.ids, max_new_tokens=12, eos_ids=frozenset())
        assert guarded.choices[0].message.content == tokenizer.decode(exact.tokens, skip_special_tokens=True)


def test_a_short_answer_is_prefilled_exactly_when_that_is_cheaper_than_splicing_it(serve, tiny_served):
    """--splice-when cheaper (the default): a 24-token answer costs more to splice (the selection and
    recompute passes, cache copies) than to prefill, so the server prefills it -- exact -- and says so."""
    model, tokenizer = tiny_served
    with serve(store="memory://splice-cheaper", splice=0.15) as server:
        _, b, built, _ = two_agents(server, "memory://splice-cheaper", tokenizer)
        details = b.model_extra["kvwire"]
        assert details["spliced_tokens"] == 0 and details["recomputed_tokens"] == 0
        assert details["splice"].startswith("prefilled") and "est." in details["splice"]
        exact = hf.generate(model, built.ids, max_new_tokens=12, eos_ids=frozenset())
        assert b.choices[0].message.content == tokenizer.decode(exact.tokens, skip_special_tokens=True)
    with serve(store="memory://splice-forced", splice=0.15, splice_when="always") as server:
        _, forced, _, _ = two_agents(server, "memory://splice-forced", tokenizer)
        assert forced.model_extra["kvwire"]["splice"].startswith("spliced 1 segment")


def test_without_splice_an_earlier_completion_is_prefilled(serve, tiny_served):
    _, tokenizer = tiny_served
    with serve(store="memory://no-splice") as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        a = api.chat.completions.create(model=model, messages=ANALYST, temperature=0, max_tokens=24,
                                        extra_body={"ignore_eos": True})
        messages = [{"role": "system", "content": FIXER_SYSTEM},
                    {"role": "user", "content": a.choices[0].message.content}, {"role": "user", "content": "Fix it."}]
        b = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=4)
        assert b.model_extra["kvwire"]["spliced_tokens"] == 0
        assert not [k for k in open_store("memory://no-splice").keys() if "/completions/" in k]


def test_an_answer_pasted_inside_a_larger_message_is_found(serve):
    """Frameworks paste answers into messages of their own (smolagents joins consecutive messages with a
    newline): an answer that starts a line of a message is spliced too."""
    with serve(store="memory://splice-inside", splice=0.0, splice_when="always") as server:
        api = client(server.url)
        model = api.models.list().data[0].id
        a = api.chat.completions.create(model=model, messages=ANALYST, temperature=0, max_tokens=24,
                                        extra_body={"ignore_eos": True})
        text = a.choices[0].message.content
        generated = completion_ids(server, "memory://splice-inside", text)
        pasted = f"The analyst wrote:\n{text}\nFix the bugs listed above."
        b = api.chat.completions.create(model=model, temperature=0, max_tokens=4,
                                        messages=[{"role": "system", "content": FIXER_SYSTEM},
                                                  {"role": "user", "content": pasted}])
        assert b.model_extra["kvwire"]["spliced_tokens"] == len(generated) - 1


def test_the_rope_probe_runs_when_the_server_starts_not_in_the_first_spliced_request(tiny_served, tiny_folder,
                                                                                     monkeypatch):
    """The probe takes seconds on a real model (5 s for the coder in int8): with ``--splice`` a server measures it
    before it serves, so no request's TTFT pays it. A model it cannot re-rotate is said once at start and refused
    per request without measuring again."""
    from kvwire.errors import UnsupportedRopeError
    from kvwire.serve.config import ServeConfig
    from kvwire.serve.service import Service

    model, tokenizer = tiny_served
    service = Service(ServeConfig(model=str(tiny_folder), block_size=4, splice=0.15), model, tokenizer)
    assert service.reuse._tables is not None and len(service.reuse._tables) == hf.model_spec(model).num_layers
    plain = Service(ServeConfig(model=str(tiny_folder), block_size=4), model, tokenizer)
    assert plain.reuse._tables is None  # no --splice: nothing measured
    service.close()
    plain.close()

    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise UnsupportedRopeError("this model's RoPE is not one kvwire reproduces")

    monkeypatch.setattr(hf, "rope_tables", refuse)
    refusing = Service(ServeConfig(model=str(tiny_folder), block_size=4, splice=0.15), model, tokenizer)
    for _ in range(2):
        try:
            refusing.reuse._rope_tables()
        except UnsupportedRopeError as err:
            assert "not one kvwire reproduces" in str(err)
        else:
            raise AssertionError("a model that cannot be re-rotated was not refused")
    assert calls == [1]
    refusing.close()


def test_message_spans_say_where_each_user_message_stands_in_the_ids(tiny_served):
    _, tokenizer = tiny_served
    messages = [{"role": "system", "content": FIXER_SYSTEM}, {"role": "user", "content": INPUT},
                {"role": "assistant", "content": "The default dict is shared between calls."},
                {"role": "user", "content": "Fix it."}]
    ids = prompt_ids(tokenizer, messages)
    spans = message_spans(tokenizer, messages, [], ids, min_tokens=8, min_chars=32)
    assert [span.text for span in spans] == [INPUT]  # not the system prompt, the reply, or a short message
    span = spans[0]
    assert ids[span.start:span.start + len(span.ids)] == list(span.ids) == encode(tokenizer, INPUT)
    assert message_spans(tokenizer, messages, [], ids[:-1], min_tokens=8, min_chars=32) == []  # not these ids


def test_an_input_read_after_another_system_prompt_is_spliced_from_the_first_agents_request(serve, tiny_served):
    """Each agent of a team reads the pipeline's input after its own system prompt (KVCOMM's shared input): the
    first agent's request publishes its user message's K/V, and the next agent's request splices it. At R = 0
    every token of it comes from cache; at R = 1 every one is recomputed, and the answer is a plain prefill's."""
    model, tokenizer = tiny_served
    first = [{"role": "system", "content": "You are the analyst. List the bugs."}, {"role": "user", "content": INPUT}]
    second = [{"role": "system", "content": FIXER_SYSTEM}, {"role": "user", "content": INPUT},
              {"role": "user", "content": "Fix the bugs."}]
    input_ids = encode(tokenizer, INPUT)
    for share in (0.0, 1.0):
        name = f"memory://splice-input-{share}"
        with serve(store=name, splice=share, splice_when="always") as server:
            api = client(server.url)
            model_name = api.models.list().data[0].id
            api.chat.completions.create(model=model_name, messages=first, temperature=0, max_tokens=4,
                                        extra_body={"ignore_eos": True})
            assert completion_ids(server, name, INPUT) == input_ids  # indexed by its text, as completions are
            b = api.chat.completions.create(model=model_name, messages=second, temperature=0, max_tokens=8,
                                            extra_body={"ignore_eos": True})
            details = b.model_extra["kvwire"]
            assert details["splice"].startswith("spliced 1 segment")
            if share == 0.0:
                assert details["spliced_tokens"] == len(input_ids) and details["recomputed_tokens"] == 0
            else:
                assert details["spliced_tokens"] == 0 and details["recomputed_tokens"] == len(input_ids)
                built = pieces(tokenizer, second, [Substitution(1, 0, len(INPUT), tuple(input_ids))])
                exact = hf.generate(model, built.ids, max_new_tokens=8, eos_ids=frozenset())
                assert b.choices[0].message.content == tokenizer.decode(exact.tokens, skip_special_tokens=True)
