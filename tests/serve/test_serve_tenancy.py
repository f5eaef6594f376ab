"""Tenants never share caches: API keys and ``cache_salt`` are namespaces of the store.

Through the official ``openai`` client, on the tiny llama: the same long prompt sent by two
tenants is cold for the second (``cached_tokens == 0``) and warm for the same tenant again;
``cache_salt`` splits one tenant further; with ``--splice`` another tenant's completion is never
spliced in; two servers over one real Redis keep tenants apart the same way; bad keys files and
bad salts are refused with clear errors. Answers never depend on whose cache was found.
"""

from __future__ import annotations

import json

import pytest

from kvwire.errors import AuthenticationFailed, KvwireError
from kvwire.serve import ServeConfig
from kvwire.serve import tenancy
from kvwire.store import open_store
from tests.support.serve_utils import client, metric, request

DOCUMENT = ("Incident report: checkout failed for 2 hours; 18,420 of 23,950 attempts failed. "
            "def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)\n") * 3
MESSAGES = [{"role": "system", "content": "You are the analyst."},
            {"role": "user", "content": f"{DOCUMENT}\nList the bugs."}]


def ask(server, key: str, messages=MESSAGES, **extra):
    api = client(server.url, api_key=key)
    model = api.models.list().data[0].id
    answer = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                         extra_body=extra or None)
    return answer, answer.usage.prompt_tokens_details.cached_tokens


def test_two_tenants_sending_the_same_prompt_never_read_each_others_cache(serve):
    with serve(api_keys=("key-a", "key-b")) as server:
        first, cold = ask(server, "key-a")
        other, other_cached = ask(server, "key-b")
        again, warm = ask(server, "key-a")
        assert cold == 0 and other_cached == 0  # the second tenant starts cold, as if alone
        assert warm == first.usage.prompt_tokens - 1  # the same tenant gets its own cache
        b_again, b_warm = ask(server, "key-b")
        assert b_warm == first.usage.prompt_tokens - 1  # and so does the other, from its own publish
        texts = {a.choices[0].message.content for a in (first, other, again, b_again)}
        assert len(texts) == 1  # greedy: the same answer whoever's cache it came from
        assert metric(server.root, "kvwire:prefix_cache_hits_total") == warm + b_warm


def test_cache_salt_splits_a_tenant_and_no_salt_is_a_namespace_of_its_own(serve):
    with serve() as server:  # no keys: one tenant, salts still apply
        _, plain = ask(server, "none")
        _, salted = ask(server, "none", cache_salt="user-1")
        _, salted_again = ask(server, "none", cache_salt="user-1")
        _, other_salt = ask(server, "none", cache_salt="user-2")
        _, plain_again = ask(server, "none")
        assert plain == 0 and salted == 0 and other_salt == 0
        assert salted_again > 0 and plain_again > 0


def test_the_namespace_is_in_every_key_not_a_filter(serve):
    store = open_store("memory://tenancy-keys")
    try:
        with serve(store="memory://tenancy-keys", api_keys=("key-a",)) as server:
            ask(server, "key-a")
            ask(server, "key-a", cache_salt="s")
        keys = store.keys()
        assert keys and all(k.startswith("ns/") for k in keys)  # nothing of a tenant's in the root
        scopes = {k.split("/")[1] for k in keys}
        assert len(scopes) == 2  # with and without the salt
        assert "key-a" not in json.dumps(keys) and tenancy.tenant_of("key-a") not in json.dumps(keys)
    finally:
        for key in store.keys():
            store.delete(key)


def test_a_tenants_completion_is_never_spliced_into_another_tenants_context(serve):
    pasted = "The bugs are: a mutable default argument; a division by zero on an empty list."
    with serve(api_keys=("key-a", "key-b"), splice=1.0, splice_when="always") as server:
        api_a = client(server.url, api_key="key-a")
        model = api_a.models.list().data[0].id
        answer = api_a.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24,
                                               extra_body={"ignore_eos": True})
        text = answer.choices[0].message.content
        assert len(text) >= 32, text
        later = [{"role": "user", "content": f"Someone wrote:\n{text}\nIs that right? {pasted}"}]
        b_details = ask(server, "key-b", later)[0].model_extra["kvwire"]
        assert b_details["spliced_tokens"] == 0 and b_details["recomputed_tokens"] == 0
        a_details = ask(server, "key-a", later)[0].model_extra["kvwire"]
        assert a_details["spliced_tokens"] + a_details["recomputed_tokens"] > 0  # its own completion: found


def test_two_servers_over_one_redis_keep_tenants_apart(serve, redis_server):
    url = redis_server.url("prefix=tenancy")
    with serve(store=url, api_keys=("key-a", "key-b")) as one, serve(store=url, api_keys=("key-a", "key-b")) as two:
        first, cold = ask(one, "key-a")
        _, same_tenant = ask(two, "key-a")  # the other server finds tenant a's cache in Redis
        _, other_tenant = ask(two, "key-b")
        assert cold == 0 and same_tenant == first.usage.prompt_tokens - 1 and other_tenant == 0


@pytest.mark.parametrize("salt, fragment", [(5, "cache_salt"), ("", "cache_salt"), ("x" * 257, "cache_salt"),
                                            (["a"], "cache_salt")])
def test_a_bad_cache_salt_is_a_clear_400_and_counted(serve, salt, fragment):
    with serve() as server:
        body = json.dumps({"model": "M", "messages": MESSAGES, "cache_salt": salt}).encode()
        status, _, raw = request("POST", f"{server.url}/chat/completions", body,
                                 {"Content-Type": "application/json"})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "cache_salt" and fragment in error["message"], error
        assert metric(server.root, "kvwire_requests_total", status="400") == 1


def test_keys_files_and_key_lists(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-a\n\n  key-b  \n")
    assert tenancy.load_keys(keys) == ("key-a", "key-b")
    for text, message in [("key-a\nkey-a\n", "repeats key #1"), ("# none\n\n", "holds no key"),
                          ("key a\n", "printable ASCII")]:
        keys.write_text(text)
        with pytest.raises(KvwireError, match=message):
            tenancy.load_keys(keys)
    with pytest.raises(KvwireError, match="cannot read the API keys file") as missing:
        tenancy.load_keys(tmp_path / "missing")
    assert str(missing.value).count(str(tmp_path)) == 1 and "Errno" not in str(missing.value)  # the path said once
    keys.write_bytes(b"key-a\n\xffkey-b\n")
    with pytest.raises(KvwireError, match=r"not UTF-8 text \(byte 0xff at offset 6\)"):
        tenancy.load_keys(keys)
    with pytest.raises(ValueError, match="repeats key"):
        ServeConfig(api_key="k", api_keys=("k",))
    assert ServeConfig(api_key="k", api_keys=("j",)).keys == ("k", "j")


def test_a_tenant_is_a_hash_of_its_key_and_namespaces_differ_by_salt():
    assert tenancy.authenticate((), "") is None
    a = tenancy.authenticate(("key-a", "key-b"), "Bearer key-a")
    b = tenancy.authenticate(("key-a", "key-b"), "bearer key-b")
    assert a == tenancy.tenant_of("key-a") and a != b and "key-a" not in a
    for header in ("", "Bearer key-c", "Basic key-a"):
        with pytest.raises(AuthenticationFailed):
            tenancy.authenticate(("key-a",), header)
    spaces = {tenancy.namespace(t, s) for t in (None, a, b) for s in (None, "", "x")} - {""}
    assert len(spaces) == 8 and tenancy.namespace(None, None) == ""


def test_the_cli_refuses_bad_keys_before_loading_a_model(tmp_path):
    from tests.cli.test_cli import assert_one_error_line, kvwire

    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-a\n")
    assert_one_error_line(kvwire("serve", "--api-keys-file", str(keys)), "key #2 repeats key #1")
    twice = kvwire("serve", "--api-key", "k", "--api-key", "k")  # a usage error: click's exit 2
    assert twice.returncode == 2 and "repeats key #1" in twice.stderr and "Traceback" not in twice.stderr
    assert_one_error_line(kvwire("serve", "--api-keys-file", str(tmp_path / "nope")), "cannot read the API keys file")
