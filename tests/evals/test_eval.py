"""``kvwire eval``: a pipeline over a task set in several modes, judged by the tasks' checkers.

The statistics are pure functions of the result lines (:mod:`kvwire.evals.report`); the runner
(:mod:`kvwire.pipeline.evaluation`) writes one line per finished (task, mode) after a header that a
resumed run must match. On a tiny random model the replies are noise, so the tests here check
the plumbing and the exactness of the exact modes (prefix's final answers equal text's on every
task); the pass rates of a model that can code are in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvwire import KvwireError, hf
from kvwire.evals import report
from kvwire.pipeline import evaluation as runner
from kvwire.evals.tasks import TaskSet, parse_tasks
from kvwire.pipeline.spec import PipelineSpec
from tests.support import cli, tiny

SHARED = {"name": "tiny-shared", "system": "You are a team.", "max_new_tokens": 6, "input_text": "x",
          "agents": [{"name": "coder", "instruction": "Write it."}, {"name": "fixer", "instruction": "Fix it."}]}
PRIVATE = {"name": "tiny-private", "max_new_tokens": 6, "input_text": "x",
           "agents": [{"name": "coder", "system": "You code.", "instruction": "Write it."},
                      {"name": "fixer", "system": "You fix.", "instruction": "Fix it."}]}
GRAPH = {"name": "tiny-graph", "system": "You are a team.", "max_new_tokens": 6, "input_text": "x",
         "agents": [{"name": "a", "instruction": "One way."}, {"name": "b", "instruction": "Another.", "after": []},
                    {"name": "judge", "instruction": "Pick one.", "after": ["a", "b"]}]}
TASKS = "\n".join(json.dumps(t) for t in [
    {"id": "t1", "input": "Say hello.", "checker": "answer", "answer": ".", "match": "regex"},
    {"id": "t2", "input": "Say 42.", "checker": "answer", "answer": "42"},
    {"id": "t3", "input": "Write f.", "checker": "tests", "tests": "assert f() == 1", "entry_point": "f"},
])


# -- statistics ---------------------------------------------------------------------------------------------------


def test_mcnemar_is_the_exact_two_sided_binomial_test_of_the_discordant_pairs():
    assert report.mcnemar_p(0, 0) == 1.0
    assert report.mcnemar_p(3, 3) == 1.0
    assert report.mcnemar_p(0, 5) == pytest.approx(0.0625)  # 2 * (1/2)^5
    assert report.mcnemar_p(1, 9) == pytest.approx(2 * 11 / 1024)
    assert report.mcnemar_p(9, 1) == report.mcnemar_p(1, 9)


def test_a_judge_names_its_candidate_in_any_of_the_usual_ways():
    assert report.chosen_candidate("Candidate: 2\n```python ...") == "2"
    assert report.chosen_candidate("I pick candidate #3 because") == "3"
    assert report.chosen_candidate("**Candidate 1** is right") == "1"
    assert report.chosen_candidate("no choice here") is None


def record(task, mode, passed, final, total=10.0, ttft=1.0, context=100, reused=0, kl=None):
    return {"task": task, "mode": mode, "passed": passed, "final": final, "total_s": total, "ttft_later_s": ttft,
            "context_later": context, "reused_later": reused, "kl": kl}


def test_the_summary_pairs_each_mode_with_text_task_by_task():
    records = [record("1", "text", True, "a"), record("2", "text", True, "b"), record("3", "text", False, "c"),
               record("1", "splice", True, "a", 5.0, 0.25, 100, 75, 0.01),
               record("2", "splice", False, "B", 5.0, 0.25, 100, 75, 0.03),
               record("3", "splice", True, "C", 5.0, 0.25, 110, 60, None)]  # a longer reply upstream
    text, splice = report.summarize(records)
    assert (text.mode, text.passed, text.tasks, text.gained) == ("text", 2, 3, None)
    assert (splice.passed, splice.gained, splice.lost, splice.mcnemar_p) == (2, 1, 1, 1.0)
    assert splice.consistency == pytest.approx(1 / 3)  # only task 1's final answer is text's
    assert splice.reuse == pytest.approx(210 / 310) and splice.kl == pytest.approx(0.02)
    assert splice.speedup == pytest.approx(2.0) and splice.ttft_speedup == pytest.approx(4.0)
    # text computed 300 context tokens, splice 25 + 25 + 50: the tokens alone allow 3x (it measured 4x)
    assert splice.ttft_bound == pytest.approx(3.0)
    assert splice.ci95[0] < 2 / 3 < splice.ci95[1]
    assert splice.guarded == 0
    records[4]["agents"] = [{"guarded_tokens": 0}, {"guarded_tokens": 40}]  # the guard recomputed a splice
    assert report.summarize(records)[1].guarded == 1


def test_a_mode_is_compared_on_the_tasks_text_also_finished():
    records = [record("1", "text", True, "a"), record("1", "prefix", True, "a"), record("2", "prefix", False, "b")]
    _, prefix = report.summarize(records)
    assert prefix.tasks == 2 and prefix.paired == 1 and prefix.consistency == 1.0 and prefix.lost == 0


# -- modes a pipeline can run -------------------------------------------------------------------------------------


def test_each_pipeline_shape_runs_its_modes_and_skips_the_others_with_the_reason():
    shared, private, graph = (PipelineSpec.from_dict(d) for d in (SHARED, PRIVATE, GRAPH))
    assert runner.plan_modes(shared, None) == (["text", "prefix"], {})
    assert runner.plan_modes(private, None) == (["text", "splice"], {})
    assert runner.plan_modes(graph, None) == (["text", "graph"], {})
    run, skipped = runner.plan_modes(private, ("prefix", "splice", "auto"))
    assert run == ["text", "splice"] and set(skipped) == {"prefix", "auto"}
    assert "private system prompts" in skipped["prefix"] and "splice" in skipped["prefix"]
    run, skipped = runner.plan_modes(graph, ("splice",))
    assert run == ["text"] and "is a graph" in skipped["splice"]
    with pytest.raises(KvwireError, match="unknown mode"):
        runner.plan_modes(shared, ("fast",))


def test_an_approximate_mode_may_carry_its_own_recompute_share():
    assert runner.parse_mode("splice") == ("splice", None) and runner.parse_mode("graph@0.3") == ("graph", 0.3)
    assert runner.parse_mode("splice@0") == ("splice", 0.0) and runner.parse_mode("splice@1") == ("splice", 1.0)
    for bad, message in (("prefix@0.1", "exact"), ("splice@1.5", "from 0 to 1"), ("splice@", "from 0 to 1"),
                         ("splice@x", "from 0 to 1"), ("fast@0.1", "unknown mode")):
        with pytest.raises(KvwireError, match=message):
            runner.parse_mode(bad)
    private = PipelineSpec.from_dict(PRIVATE)
    run, skipped = runner.plan_modes(private, ("splice@0", "splice@0.15", "prefix", "splice@1"))
    assert run == ["text", "splice@0", "splice@0.15", "splice@1"] and set(skipped) == {"prefix"}
    run, skipped = runner.plan_modes(private, ("splice", "splice@0.10", "splice@0.1", "splice@0.15"), 0.15)
    assert run == ["text", "splice", "splice@0.1"] and "same run as splice" in skipped["splice@0.15"]
    run, skipped = runner.plan_modes(PipelineSpec.from_dict(GRAPH), ("graph@0.05", "splice@0.05"))
    assert run == ["text", "graph@0.05"] and "is a graph" in skipped["splice@0.05"]


# -- the results file ---------------------------------------------------------------------------------------------


def header(**changes):
    fields = dict(pipeline="p", pipeline_digest="d1", tasks="t", tasks_digest="d2", model="m", fingerprint="f",
                  weights="int8", recompute=0.15, max_new_tokens=None, answer_from="")
    return runner.Header(**{**fields, **changes})


def test_a_results_file_is_never_overwritten_and_resumes_only_the_same_run(tmp_path):
    path = tmp_path / "out" / "results.jsonl"
    results = runner.Results(path, header(), resume=False)
    results.append(record("1", "text", True, "a"))
    with pytest.raises(KvwireError, match="already holds results") as caught:
        runner.Results(path, header(), resume=False)
    assert "--resume" in caught.value.hint
    assert runner.Results(path, header(), resume=True).done() == {("1", "text")}
    for change in ({"weights": "fp32"}, {"fingerprint": "other"}, {"pipeline_digest": "x"}, {"recompute": 0.3},
                   {"select": "kv-deviation"}, {"guard": 0.02}):
        with pytest.raises(KvwireError, match=f"another run.*{next(iter(change))}"):
            runner.Results(path, header(**change), resume=True)


def test_results_from_before_a_setting_was_recorded_mean_what_it_was_then(tmp_path):
    """A header key added later reads, in an older file, as what that file's run did: splice chose by K/V
    deviation before ``attention+start`` became the default, so such a file resumes only under that selection."""
    from kvwire.kv.splice import Recompute

    assert header().select == Recompute.select  # the header records the selection a run uses
    path = tmp_path / "results.jsonl"
    older = {k: v for k, v in header().to_json().items() if k != "select"}
    path.write_text(json.dumps(older) + "\n" + json.dumps(record("1", "text", True, "a")) + "\n")
    with pytest.raises(KvwireError, match="another run.*select: 'attention\\+deviation' -> 'attention\\+start'"):
        runner.Results(path, header(), resume=True)
    assert runner.Results(path, header(select="attention+deviation"), resume=True).done() == {("1", "text")}


def test_a_line_cut_by_a_kill_runs_again_and_the_rest_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    runner.Results(path, header(), resume=False).append(record("1", "text", True, "a"))
    with path.open("a") as file:
        file.write('{"task": "2", "mo')  # killed mid-write
    resumed = runner.Results(path, header(), resume=True)
    assert resumed.done() == {("1", "text")}
    resumed.append(record("2", "text", False, "b"))  # on a line of its own: the cut line is gone
    assert runner.Results(path, header(), resume=True).done() == {("1", "text"), ("2", "text")}
    (tmp_path / "other.jsonl").write_text("not a results file\n")
    with pytest.raises(KvwireError, match="not a kvwire eval results file"):
        runner.Results(tmp_path / "other.jsonl", header(), resume=True)


SELF_TESTED = "```python\ndef f():\n    return 1\n\nassert f() == 2  # the model's own wrong test\n```"


def judged_by_version_1(tmp_path):
    """A results file as the first judge wrote it (no judge in its header): the right f with a wrong self-test
    failed, as that judge ran the reply's whole block."""
    tasks = TaskSet("mine", parse_tasks(TASKS, "mine.jsonl"))
    path = tmp_path / "out" / "results.jsonl"
    old = {k: v for k, v in header(tasks_digest=tasks.digest).to_json().items() if k != "judge"}
    lines = [old, {**record("t3", "text", False, SELF_TESTED), "reason": "AssertionError"},
             {**record("t3", "splice", True, "```python\ndef f():\n    return 1\n```"), "reason": "passed"},
             {**record("t2", "text", True, "42"), "reason": "the reply is the answer"}]
    path.parent.mkdir()
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return tasks, path


def test_stored_replies_are_judged_again_without_a_model_and_the_old_file_is_kept(tmp_path):
    tasks, path = judged_by_version_1(tmp_path)
    before = path.read_text()
    with pytest.raises(KvwireError, match="older judge") as caught:  # resuming it first asks for a re-judge
        runner.Results(path, header(tasks_digest=tasks.digest), resume=True)
    assert "--rejudge" in caught.value.hint
    rejudged, records, changed = runner.rejudge(path, tasks)
    assert rejudged.judge == runner.JUDGE == 3 and [r["passed"] for r in records] == [True, True, True]
    assert [(c["task"], c["mode"], c["was"]["passed"]) for c in changed] == [("t3", "text", False)]
    assert (tmp_path / "out" / "results.judge1.jsonl").read_text() == before  # nothing lost
    assert runner.Results(path, header(tasks_digest=tasks.digest), resume=True).done() == {
        ("t3", "text"), ("t3", "splice"), ("t2", "text")}
    other = TaskSet("mine", parse_tasks(TASKS.replace("f() == 1", "f() == 3"), "mine.jsonl"))
    with pytest.raises(KvwireError, match="not on the 'mine' given"):
        runner.rejudge(path, other)


def test_an_older_judges_file_of_another_run_is_refused_as_another_run(tmp_path):
    """Resuming is refused for what differs: another run is said first, whatever judge judged it."""
    tasks, path = judged_by_version_1(tmp_path)
    with pytest.raises(KvwireError, match="another run.*weights") as caught:
        runner.Results(path, header(tasks_digest=tasks.digest, weights="fp32"), resume=True)
    assert "older judge" not in str(caught.value)


def test_rejudging_leaves_a_line_cut_by_a_kill_in_the_kept_file(tmp_path):
    tasks, path = judged_by_version_1(tmp_path)
    with path.open("a") as file:
        file.write('{"task": "t2", "mo')  # killed mid-write
    before = path.read_text()
    _, records, _ = runner.rejudge(path, tasks)
    assert len(records) == 3 and (tmp_path / "out" / "results.judge1.jsonl").read_text() == before
    assert runner.Results(path, header(tasks_digest=tasks.digest), resume=True).done() == {
        ("t3", "text"), ("t3", "splice"), ("t2", "text")}


# -- runs on a tiny model -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tiny_tokenizer):
    model = tiny.model("llama", len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    return model, tiny_tokenizer, hf.model_spec(model)


def evaluation(tiny_llama, spec_dict, **options):
    model, tokenizer, spec = tiny_llama
    return runner.Evaluation(model, tokenizer, PipelineSpec.from_dict(spec_dict), spec, **options)


def test_every_task_runs_in_every_mode_and_resumes_where_it_stopped(tiny_llama, tmp_path):
    tasks = TaskSet("tiny", parse_tasks(TASKS, "tiny.jsonl"))
    results = runner.Results(tmp_path / "results.jsonl", header(), resume=False)
    records = list(evaluation(tiny_llama, SHARED).run(tasks, ["text", "prefix"], results))
    assert [(r["task"], r["mode"]) for r in records] == [(t, m) for t in ("t1", "t2", "t3") for m in ("text", "prefix")]
    text, prefix = report.summarize(records)
    assert 0.5 < prefix.reuse < 1 and text.reuse == 0 and prefix.paired == 3
    assert all(isinstance(r["passed"], bool) and r["reason"] for r in records)
    assert next(r for r in records if r["task"] == "t3")["passed"] is False  # noise is not code
    again = runner.Results(tmp_path / "results.jsonl", header(), resume=True)
    assert list(evaluation(tiny_llama, SHARED).run(tasks, ["text", "prefix"], again)) == []  # all done


@pytest.mark.real_model
def test_prefix_mode_gives_text_modes_final_answer_on_every_task(real_model, tmp_path):
    """The exact mode is held to text mode task by task on the default model: identical final replies, the same
    verdicts, the later agents' context served from the received cache. (A random tiny model's replies can
    tokenize to other ids than it wrote, so text mode would read other ids: ``retokenized_turns`` says so.)"""
    model, tokenizer, spec = real_model
    tasks = TaskSet("tiny", parse_tasks(TASKS, "tiny.jsonl"))
    results = runner.Results(tmp_path / "results.jsonl", header(), resume=False)
    ev = runner.Evaluation(model, tokenizer, PipelineSpec.from_dict(SHARED), spec)
    records = list(ev.run(tasks, ["text", "prefix", "auto"], results))
    assert all(r["retokenized_turns"] == 0 for r in records)
    text, prefix, auto = report.summarize(records)
    for exact in (prefix, auto):
        assert exact.consistency == 1.0 and exact.gained == exact.lost == 0 and exact.passed == text.passed
    assert 0.5 < prefix.reuse < 1 and text.reuse == 0


def test_splice_runs_private_prompts_with_its_kl_against_text(tiny_llama, tmp_path):
    tasks = TaskSet("tiny", parse_tasks(TASKS, "tiny.jsonl")[:2])
    results = runner.Results(tmp_path / "results.jsonl", header(), resume=False)
    ev = evaluation(tiny_llama, PRIVATE, recompute=0.0, answer_from="coder", splice_when="always")
    records = list(ev.run(tasks, ["text", "splice"], results))
    splice = [r for r in records if r["mode"] == "splice"]
    assert [(r["settings"], r["kl"] is not None and r["kl"] >= 0) for r in splice] == [("R=0", True)] * 2
    assert all(r["reused_later"] > 0 for r in splice)
    # the answer is the coder's: the first agent, which receives nothing, so splice cannot change it
    assert [r["final"] for r in splice] == [r["final"] for r in records if r["mode"] == "text"]


def test_one_run_sweeps_r_with_text_run_once_per_task(tiny_llama, tmp_path):
    """``splice@R`` modes are points of one curve: each at its own R, each compared with the same text run.
    R = 1 recomputes every received token, which is text mode's computation: the KL falls to rounding."""
    tasks = TaskSet("tiny", parse_tasks(TASKS, "tiny.jsonl")[:2])
    results = runner.Results(tmp_path / "results.jsonl", header(), resume=False)
    ev = evaluation(tiny_llama, PRIVATE, recompute=0.15, splice_when="always")
    records = list(ev.run(tasks, ["text", "splice@0", "splice", "splice@1"], results))
    assert [r["mode"] for r in records] == ["text", "splice@0", "splice", "splice@1"] * 2
    assert [r["settings"] for r in records[1:4]] == ["R=0", "R=0.15", "R=1"]
    text, none, default, every = report.summarize(records)
    assert [r["recomputed_later"] for r in records if r["mode"] == "splice@0"] == [0, 0]
    assert all(r["recomputed_later"] > 0 for r in records if r["mode"] in ("splice", "splice@1"))
    assert every.reuse == 0 < default.reuse < none.reuse  # R = 1 keeps nothing as received
    assert every.kl < 1e-6 < none.kl and every.consistency == 1.0
    stale = [a["staleness"] for r in records if r["mode"] == "splice" for a in r["agents"][1:]]
    assert stale and all(s and all(v > 0 for v in s if v is not None) for s in stale)  # each spliced segment's


def test_an_unknown_answering_agent_is_refused(tiny_llama):
    with pytest.raises(KvwireError, match="no such agent") as caught:
        evaluation(tiny_llama, SHARED, answer_from="judge")
    assert "coder, fixer" in caught.value.hint


# -- the command --------------------------------------------------------------------------------------------------


def kvwire(*args, cwd):
    return cli.run(*args, cwd=cwd)  # the command line in this process (tests/support/cli.py)


def test_the_command_runs_resumes_and_refuses_another_run(tiny_folder, tmp_path):
    (tmp_path / "tasks.jsonl").write_text(TASKS.split("\n")[0] + "\n")
    (tmp_path / "p.toml").write_text('name = "p"\nsystem = "s"\nmax_new_tokens = 4\n'
                                     '[[agents]]\nname = "a"\ninstruction = "Go."\n'
                                     '[[agents]]\nname = "b"\ninstruction = "On."\n')
    args = ["eval", "tasks.jsonl", "--pipeline", "p.toml", "--model", str(tiny_folder), "--out", "out", "--json"]
    first = kvwire(*args, "--mode", "text,prefix,splice,graph", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert [m["mode"] for m in summary["modes"]] == ["text", "prefix", "splice"]
    assert "chain, not a graph" in summary["skipped"]["graph"] and "skipping mode graph" in first.stderr
    assert 0 <= summary["modes"][1]["consistency"] <= 1 and (tmp_path / "out" / "eval.png").stat().st_size > 0
    again = kvwire(*args, cwd=tmp_path)
    assert again.returncode == 1 and again.stderr.count("error:") == 1 and "--resume" in again.stderr
    other = kvwire(*args, "--resume", "--weights", "bf16", cwd=tmp_path)
    assert other.returncode == 1 and "another run" in other.stderr and "weights" in other.stderr
    resumed = kvwire(*args, "--resume", "--mode", "text,prefix", cwd=tmp_path)
    assert resumed.returncode == 0 and json.loads(resumed.stdout.strip().splitlines()[-1])["modes"][0]["tasks"] == 1


def test_the_command_rejudges_stored_replies_with_no_model_or_pipeline(tmp_path):
    tasks, _ = judged_by_version_1(tmp_path)
    (tmp_path / "mine.jsonl").write_text(TASKS)
    result = kvwire("eval", "mine.jsonl", "--rejudge", "--out", "out", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "t3 text: failed -> passed" in result.stderr and "1 verdicts changed" in result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["header"]["judge"] == 3 and [m["passed"] for m in summary["modes"]] == [2, 1]
    missing = kvwire("eval", "mine.jsonl", "--rejudge", cwd=tmp_path)
    assert missing.returncode == 2 and "--rejudge needs --out" in missing.stderr


@pytest.mark.parametrize("content, extra, message", [
    ('{"id": "a", "input": "x", "checker": "answer"}\n', [], r"tasks.jsonl:1"),
    ('{"id": "a", "input": "x", "checker": "answer", "answer": "1"}\n' * 2, [], r"tasks.jsonl:2.*line 1"),
    (b'{"id": "a", "input": "\xff"}\n', [], "not UTF-8"),
    ('{"id": "a", "input": "x", "checker": "answer", "answer": "1"}\n', ["--shard", "5/4"], "shard"),
])
def test_bad_input_is_one_error_line_before_any_model_loads(tiny_folder, tmp_path, content, extra, message):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    (tmp_path / "p.toml").write_text('name = "p"\n[[agents]]\nname = "a"\ninstruction = "Go."\n')
    result = kvwire("eval", "tasks.jsonl", "--pipeline", "p.toml", "--model", str(tiny_folder), *extra, cwd=tmp_path)
    assert result.returncode == 1 and result.stderr.count("error:") == 1, result.stderr
    assert "Traceback" not in result.stderr and __import__("re").search(message, result.stderr), result.stderr
    assert not (tmp_path / "eval-results").exists()


def test_ctrl_c_keeps_the_finished_tasks_and_resume_continues(tiny_folder, tmp_path):
    import os
    import signal
    import time

    tasks = [{"id": f"t{i}", "input": f"Count to {i}.", "checker": "answer", "answer": "x"} for i in range(40)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (tmp_path / "p.toml").write_text('name = "p"\nsystem = "s"\nmax_new_tokens = 4\n'
                                     '[[agents]]\nname = "a"\ninstruction = "Go."\n'
                                     '[[agents]]\nname = "b"\ninstruction = "On."\n')
    args = [sys.executable, "-m", "kvwire", "eval", "tasks.jsonl", "--pipeline", "p.toml", "--model",
            str(tiny_folder), "--out", "out"]
    results = tmp_path / "out" / "results.jsonl"
    # a shell without job control starts its background commands with SIGINT ignored, and a child inherits that
    # (Python then never raises KeyboardInterrupt): the command gets the default disposition, as from a terminal
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:  # until a few tasks are finished
        if results.exists() and len(results.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "--resume" in stderr and "Traceback" not in stderr
    kept = len(results.read_text().splitlines()) - 1
    assert 4 <= kept < 80
    finished = subprocess.run(args + ["--resume", "--json"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
    assert finished.returncode == 0, finished.stderr
    summary = json.loads(finished.stdout.strip().splitlines()[-1])
    assert [m["tasks"] for m in summary["modes"]] == [40, 40]
    records = [json.loads(line) for line in results.read_text().splitlines()[1:]]
    assert len({(r["task"], r["mode"]) for r in records}) == len(records) == 80  # nothing twice, nothing lost


def test_an_unknown_answering_agent_is_refused_before_any_model_loads(tmp_path):
    (tmp_path / "tasks.jsonl").write_text(TASKS.split("\n")[0] + "\n")
    (tmp_path / "p.toml").write_text('name = "p"\n[[agents]]\nname = "a"\ninstruction = "Go."\n')
    result = kvwire("eval", "tasks.jsonl", "--pipeline", "p.toml", "--model", str(tmp_path / "no-such-model"),
                    "--answer-from", "judge", cwd=tmp_path)
    assert result.returncode == 2 and "no agent 'judge'" in result.stderr and "agents: a" in result.stderr
