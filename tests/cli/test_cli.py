"""The command line: results on stdout, one clear error line and exit code 1 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import cli
from tests.support.helpers import packet, rewrite
from kvwire.wire import codec
from tests.wire.test_codec import reseal

ROOT = Path(__file__).parents[2]


def kvwire(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return cli.run(*args, cwd=cwd)  # the command line in this process (tests/support/cli.py)


def assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_the_in_process_command_line_answers_as_a_process_does(tmp_path):
    """Most command-line tests call ``kvwire`` in the test's process (tests/support/cli.py: a fresh interpreter
    spends ~7 s importing torch and transformers): for a refusal, a usage error and a result, it gives the
    exit status and output ``python -m kvwire`` gives."""
    loop = tmp_path / "loop.toml"
    loop.write_text('input_text = "x"\n[[agents]]\nname = "a"\ninstruction = "i"\nafter = ["a"]\n')
    saved = codec.save(packet(tokens=3), tmp_path / "p.kv")
    for args in (("run", str(loop)), ("run", str(loop), "--mode", "sideways"), ("inspect", str(saved), "--json")):
        process = subprocess.run([sys.executable, "-m", "kvwire", *args], capture_output=True, text=True, timeout=120)
        here = kvwire(*args)
        assert (here.returncode, here.stdout) == (process.returncode, process.stdout), args
        assert here.stderr == process.stderr, args


def test_inspect_prints_metadata(tmp_path):
    path = codec.save(packet(tokens=6), tmp_path / "p.kv")
    proc = kvwire("inspect", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["length"] == 6 and info["producer"] == "tester" and info["kv_bytes"] > 0
    table = kvwire("inspect", str(path))
    assert table.returncode == 0 and "spec.num_layers" in table.stdout


def test_run_options_are_checked_before_any_model_loads(tmp_path):
    example = str(ROOT / "examples" / "document_pipeline.toml")
    huge = kvwire("run", example, "--mode", "splice", "--positions", "99999999999999999999")
    assert huge.returncode == 2 and "--positions" in huge.stderr and "Traceback" not in huge.stderr
    drawing = kvwire("run", example, "--timeline", str(tmp_path / "out.txt"))
    assert drawing.returncode == 2 and ".png, .svg, .pdf" in drawing.stderr


def test_probe_sizes_are_usage_errors_checked_before_anything_is_allocated():
    """--large 100TiB was a MemoryError traceback from os.urandom; every bad size is now exit 2, one message."""
    for size, fragment in (("100TiB", "at most 512MiB"), ("0", "too small"), ("abc", "not a byte count")):
        proc = kvwire("probe", "memory://", "--large", size)
        assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, (size, proc)


def test_a_model_folder_with_truncated_weights_is_a_clear_error(tiny_folder, tmp_path):
    import shutil

    from kvwire import ModelError, hf

    broken = tmp_path / "broken"
    shutil.copytree(tiny_folder, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    with pytest.raises(ModelError, match="cannot load the model"):
        hf.load_model(broken)


def test_inspect_escapes_control_characters_from_the_packet(tmp_path):
    """A producer name is the sender's text: an escape sequence in it is shown, never sent to the terminal."""
    import dataclasses

    path = codec.save(dataclasses.replace(packet(tokens=3), producer="evil\x1b[31mRED"), tmp_path / "p.kv")
    table = kvwire("inspect", str(path))
    assert table.returncode == 0 and "\x1b" not in table.stdout and "evil\\x1b[31mRED" in table.stdout


@pytest.mark.parametrize("damage, fragment", [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:-5] + bytes([b[-5] ^ 1]) + b[-4:], "checksum mismatch"),
    (lambda b: b"", "empty"),
    (lambda b: b"hello, I am not a packet", "not a kvwire packet"),
])
def test_inspect_refuses_damaged_files(tmp_path, damage, fragment):
    path = tmp_path / "bad.kv"
    path.write_bytes(damage(codec.encode(packet(tokens=6))))
    assert_one_error_line(kvwire("inspect", str(path)), fragment)


def nan_packet():
    p = packet(tokens=6)
    p.keys = (p.keys[0], p.keys[1].clone().fill_(float("nan")))
    return codec.encode(p, options=codec.CodecOptions())


@pytest.mark.parametrize("make, fragments", [
    # what a newcomer (or a forger) might hand to `kvwire inspect`
    (lambda d, tmp: reseal(d, lambda h, m: h["keys.0"].__setitem__("dtype", ["F32"])),
     ["dtype ['F32'] not allowed"]),
    (lambda d, tmp: rewrite(d, lambda h: h["keys.0"].__setitem__("dtype", {"a": 1})), ["not allowed"]),
    (lambda d, tmp: reseal(d, lambda h, m: m.__setitem__("created_at", 10**400)), ["'created_at'"]),
    (lambda d, tmp: d[:8] + b"\xff" * 64, ["truncated"]),
    (lambda d, tmp: nan_packet(), ["layer 1 keys hold", "non-finite values", "KVWIRE_CHECK_FINITE=0"]),
    (lambda d, tmp: tmp, ["is a directory"]),
    (lambda d, tmp: tmp / "missing.kv", ["no packet file"]),
])
def test_inspect_never_prints_a_traceback(tmp_path, make, fragments):
    made = make(codec.encode(packet(tokens=6), options=codec.CodecOptions()), tmp_path)
    if isinstance(made, bytes):
        path = tmp_path / "bad.kv"
        path.write_bytes(made)
    else:
        path = made
    assert_one_error_line(kvwire("inspect", str(path)), *fragments)


def test_inspect_prints_packet_strings_as_text_not_markup(tmp_path):
    """A producer name is the sender's to choose: "[/bold]" would be a rich markup error, "[red]" a style."""
    data = reseal(codec.encode(packet(tokens=6), options=codec.CodecOptions()),
                  lambda h, m: m.__setitem__("producer", "[/bold][red]mallory"))
    (tmp_path / "p.kv").write_bytes(data)
    proc = kvwire("inspect", str(tmp_path / "p.kv"))
    assert proc.returncode == 0 and "[/bold][red]mallory" in proc.stdout, proc.stderr


def test_other_commands_refuse_bad_input_in_one_line(tmp_path):
    (tmp_path / "rows.json").write_text('{"rows": [{"strategy": "R"}]}')
    assert_one_error_line(kvwire("plot", str(tmp_path / "rows.json")), "not the JSON output of benchmarks/splice.py")
    (tmp_path / "list.json").write_text("[1, 2]")
    assert_one_error_line(kvwire("plot", str(tmp_path / "list.json")), "not the JSON output")
    assert_one_error_line(kvwire("run", str(tmp_path)), "cannot read pipeline file")
    proc = kvwire("probe", "memory://", "--large", "0")  # a zero-byte probe divided by zero once
    assert proc.returncode == 2 and "too small" in proc.stderr and "Traceback" not in proc.stderr
    env_proc = subprocess.run([sys.executable, "-m", "kvwire", "inspect", str(tmp_path / "x.kv")], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "KVWIRE_CHECK_FINITE": "maybe"})
    assert_one_error_line(env_proc, "KVWIRE_CHECK_FINITE='maybe' is not a boolean")


def test_malformed_pipeline_file(tmp_path):
    (tmp_path / "p.toml").write_text("agents = [{name = 'a'}]")
    assert_one_error_line(kvwire("run", str(tmp_path / "p.toml")), "missing required key 'instruction'")


def test_unknown_store_url():
    proc = kvwire("run", str(ROOT / "examples" / "document_pipeline.toml"), "--store", "ftp://nowhere")
    assert_one_error_line(proc, "unknown store URL", "memory://")


def test_missing_model(tmp_path):
    proc = kvwire("run", str(ROOT / "examples" / "document_pipeline.toml"), "--model", str(tmp_path / "nope"))
    assert_one_error_line(proc, "no model at")


def test_bad_usage_exits_2():
    proc = kvwire("run", str(ROOT / "examples" / "document_pipeline.toml"), "--mode", "telepathy")
    assert proc.returncode == 2 and "Invalid value" in proc.stderr


def test_graph_files_are_checked_before_any_model_loads(tmp_path):
    path = tmp_path / "loop.toml"
    path.write_text('input_text = "x"\n[[agents]]\nname = "a"\ninstruction = "i"\n'
                    '[[agents]]\nname = "b"\ninstruction = "j"\nafter = ["c"]\n'
                    '[[agents]]\nname = "c"\ninstruction = "k"\nafter = ["b"]\n')
    assert_one_error_line(kvwire("run", str(path)), "agents form a cycle")
    usage = kvwire("run", str(ROOT / "examples" / "review_board.toml"), "--mode", "prefix")
    assert usage.returncode == 2 and "is a graph" in usage.stderr
    private = tmp_path / "private.toml"
    private.write_text('input_text = "x"\n[[agents]]\nname = "a"\ninstruction = "i"\n'
                       '[[agents]]\nname = "b"\ninstruction = "j"\nsystem = "You are b."\n'
                       '[[agents]]\nname = "c"\ninstruction = "k"\nafter = ["a"]\n')
    for mode in ("graph", "compare"):  # text mode runs it (tests/pipeline/test_graph.py)
        assert_one_error_line(kvwire("run", str(private), "--mode", mode, "--model", str(tmp_path / "no-model")),
                              "agents b have private system prompts")


def test_the_graph_drawing_wraps_long_lines_instead_of_cropping_them(tmp_path):
    """The layered view is printed before the model loads; a merge of many branches is a long line."""
    names = [f"specialist_reviewer_{i}" for i in range(6)]
    lines = ['input_text = "x"', '[[agents]]', 'name = "root"', 'instruction = "i"']
    for name in names:
        lines += ['[[agents]]', f'name = "{name}"', 'instruction = "j"', 'after = ["root"]']
    lines += ['[[agents]]', 'name = "chair"', 'instruction = "k"', f"after = {json.dumps(names)}"]
    path = tmp_path / "wide.toml"
    path.write_text("\n".join(lines) + "\n")
    proc = kvwire("run", str(path), "--mode", "graph", "--merge", "auto", "--recompute", "0.15", "--model",
                  str(tmp_path / "no-model"))
    drawing = " ".join(proc.stdout.split())  # wrapped lines joined again
    assert "layer 1 (6 agents, one batch)" in drawing, proc.stdout
    assert (", ".join(names) in drawing.replace("│ ", "")
            and "(merge: spliced or prefilled, whichever is cheaper, R=0.15)" in drawing), proc.stdout
    forced = kvwire("run", str(path), "--mode", "graph", "--merge", "prefill", "--model", str(tmp_path / "no-model"))
    assert "(merge: prefilled after the first branch's chain)" in " ".join(forced.stdout.split()), forced.stdout
    linear = kvwire("run", str(ROOT / "examples" / "document_pipeline.toml"), "--merge", "splice")
    assert linear.returncode == 2 and "--merge is for graph files" in linear.stderr


@pytest.mark.real_model
def test_run_prints_the_graph_and_compares_it_with_text(tmp_path):
    path = tmp_path / "board.toml"
    path.write_text('system = "Be brief."\ninput_text = "def f(x): return x / 0"\n'
                    '[[agents]]\nname = "intake"\ninstruction = "Say what f does."\n'
                    '[[agents]]\nname = "bugs"\ninstruction = "Name the bug."\nafter = ["intake"]\n'
                    '[[agents]]\nname = "fix"\ninstruction = "Fix it."\nafter = ["intake"]\n'
                    '[[agents]]\nname = "chair"\ninstruction = "Merge."\nafter = ["bugs", "fix"]\n')
    proc = kvwire("run", str(path), "--mode", "compare", "--max-new-tokens", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "layer 1 (2 agents, one batch)" in proc.stderr and "chair reads bugs, fix (merge" in proc.stderr
    payload = json.loads(proc.stdout.strip().splitlines()[-1])
    assert payload["mode"] == "graph" and [a["agent"] for a in payload["agents"]] == ["intake", "bugs", "fix", "chair"]
    assert payload["runs"][1]["batches"] == [1, 2, 1]


def test_a_compare_that_is_not_exact_under_compact_weights_says_why():
    """A prefix run that differs from its recomputation is reported as NOT exact; under int8 or int4 weights
    the report adds why (the formats are not batch-invariant) and the way to an exact run; under fp32 it
    does not excuse anything."""
    from types import SimpleNamespace

    from rich.console import Console

    from kvwire.cli.pipeline import _print_exactness

    agent = SimpleNamespace(agent="fixer", identical=False, same_context=True, note="DIFFERENT output", exact=False)
    runs = [SimpleNamespace(mode=mode, agents=[SimpleNamespace(output_text=f"{mode} reply", lossy_encoding=None)])
            for mode in ("text", "prefix")]
    differing = SimpleNamespace(identical=False, exact=False, speedup=1.5, agents=[agent], approximate=[],
                                text=runs[0], other=runs[1])
    exact = SimpleNamespace(identical=True, exact=True, speedup=1.5, agents=[], approximate=[])

    def printed(comparison, weights):
        console = Console(record=True, width=200)
        _print_exactness(console, [comparison], weights)
        return console.export_text()

    for fmt in ("int8", "int4", "bf16"):
        text = printed(differing, fmt)
        assert "NOT identical" in text and "prefix exact vs recomputation: NO" in text
        assert f"{fmt} weights are not batch-invariant" in text and "--weights fp32" in text
    fp32 = printed(differing, "fp32")
    assert "NOT identical" in fp32 and "batch-invariant" not in fp32
    assert "text: text reply" in fp32 and "prefix: prefix reply" in fp32  # both replies, to read the difference
    assert "batch-invariant" not in printed(exact, "int8")
    # caches sent as int4 packets: identical greedy output is no proof of exactness, and the report says so
    close = SimpleNamespace(agent="fixer", identical=True, same_context=True, exact=None,
                            note="approximate: its cache came as int4 packets (lossy); output identical")
    lossy = SimpleNamespace(identical=True, exact=True, speedup=1.5, agents=[close], approximate=["fixer"],
                            text=runs[0], other=SimpleNamespace(mode="prefix", agents=[
                                SimpleNamespace(output_text="same", lossy_encoding="int4")]))
    text = printed(lossy, "fp32")
    assert "prefix exact vs recomputation: not claimed for fixer: caches travel as int4 packets" in text
    assert "exact vs recomputation: yes" not in text and "int4 packets (lossy)" in text


def test_the_timing_table_has_a_round_column_when_agents_take_several_turns():
    from types import SimpleNamespace

    from rich.console import Console

    from kvwire.cli.pipeline import timing_table

    def turn(name, round):
        return SimpleNamespace(agent=name, round=round, mode="prefix", context_tokens=10, cached_tokens=5,
                               new_tokens=3, ttft_s=0.1, prefill_s=0.1, decode_s=0.2, transfer_s=0.0, total_s=0.3,
                               compute_s=0.0)

    def drawn(*turns):
        console = Console(record=True, width=200)
        console.print(timing_table("t", [SimpleNamespace(mode="prefix", agents=list(turns), total_s=9.0)]))
        return console.export_text().splitlines()

    lines = drawn(turn("critic", 0), turn("critic", 1))
    header = next(line for line in lines if "agent" in line)
    assert "round" in header and any("critic" in line and "│     2 │" in line for line in lines)
    total = next(line for line in lines if "│ all" in line)
    assert total.rstrip().endswith("9.00s │")  # the total stays under "total"
    assert "round" not in next(line for line in drawn(turn("critic", 0)) if "agent" in line)


def test_a_pipeline_without_a_system_prompt_is_told_the_template_writes_its_own(real_model, capsys):
    from kvwire import AgentSpec, PipelineSpec
    from kvwire.cli.pipeline import _warn_if_the_template_adds_a_system_prompt

    _, tokenizer, _ = real_model
    bare = PipelineSpec(name="bare", system="", input_text="x", agents=(AgentSpec("a", "Say hi."),))
    _warn_if_the_template_adds_a_system_prompt(bare, tokenizer)
    assert "every agent has no system prompt" in capsys.readouterr().err
    _warn_if_the_template_adds_a_system_prompt(bare.__class__(name="s", system="Be brief.", input_text="x",
                                                              agents=bare.agents), tokenizer)
    assert capsys.readouterr().err == ""
