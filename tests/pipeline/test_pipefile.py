"""Pipeline files: the examples parse; malformed files fail with a message that names the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwire import AgentSpec, PipelineConfigError, PipelineSpec

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path):
    spec = PipelineSpec.from_toml(path)
    assert len(spec.agents) >= 2 and spec.input_text
    input_message = f"{spec.input_label}:\n\n{spec.input_text}"
    if spec.graph.shares_input:  # several agents start the graph: the input opens every conversation
        assert spec.opening(0)[-1] == {"role": "user", "content": input_message}
        assert input_message not in spec.turn(0) and spec.turn(0).endswith(spec.agents[0].instruction)
    else:  # one: it heads the first agent's turn
        assert spec.turn(0).startswith(f"{spec.input_label}:\n\n") and spec.turn(0).endswith(spec.agents[0].instruction)


def test_two_examples_ship():
    assert {p.name for p in EXAMPLES} >= {"document_pipeline.toml", "support_conversation.toml"}


def test_roles_and_limits():
    spec = PipelineSpec.from_dict({"name": "p", "input_text": "x", "max_new_tokens": 7, "agents": [
        {"name": "a", "instruction": "Do A.", "role": "writer"},
        {"name": "b", "instruction": "Do B.", "max_new_tokens": 3}]})
    assert spec.turn(1) == "Do B." and spec.agents[0].turn() == "You are the writer. Do A."
    assert [spec.new_tokens(0), spec.new_tokens(1)] == [7, 3]
    assert [spec.with_max_new_tokens(2).new_tokens(i) for i in (0, 1)] == [2, 2]


@pytest.mark.parametrize("text, message", [
    ("name = 'x'", "missing required key 'agents'"),
    ("agents = []", "has no agents"),
    ("agents = [{name = 'a'}]", "missing required key 'instruction'"),
    ("agents = [{name = 'a b', instruction = 'i'}]", "name 'a b'"),
    ("agents = [{name = 'a', instruction = 'i'}, {name = 'a', instruction = 'j'}]", "duplicate agent names"),
    ("agents = [{name = 'a', instruction = 'i', temperature = 2}]", "unknown keys \\['temperature'\\]"),
    ("max_new_tokens = 0\nagents = [{name = 'a', instruction = 'i'}]", "max_new_tokens must be"),
    ("max_new_tokens = 'many'\nagents = [{name = 'a', instruction = 'i'}]", "must be a int"),
    ("input = 'nope.txt'\nagents = [{name = 'a', instruction = 'i'}]", "cannot read input file"),
    ("agents = [", "not valid TOML"),
    ("agents = ['a']", "must be a table"),
])
def test_malformed_files_are_named(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PipelineConfigError, match=message):
        PipelineSpec.from_toml(path)


def test_missing_file(tmp_path):
    with pytest.raises(PipelineConfigError, match="no pipeline file"):
        PipelineSpec.from_toml(tmp_path / "absent.toml")


# -- graphs: after = [...] ---------------------------------------------------------------------------


def graph_file(*agents):
    return {"name": "g", "input_text": "x", "agents": [
        {"name": name, "instruction": "Do it.", **({"after": after} if after is not None else {})}
        for name, after in agents]}


def test_without_after_a_file_is_the_usual_chain():
    spec = PipelineSpec.from_dict(graph_file(("a", None), ("b", None), ("c", None)))
    assert spec.graph.is_linear and spec.graph.layers == ((0,), (1,), (2,))


def test_after_makes_a_graph_in_layers_whatever_the_file_order():
    spec = PipelineSpec.from_dict(graph_file(("start", None), ("merge", ["left", "right"]), ("left", ["start"]),
                                             ("right", ["start"])))
    assert spec.graph.upstream == ((), (2, 3), (0,), (0,))
    assert spec.graph.layers == ((0,), (2, 3), (1,)) and not spec.graph.is_linear


@pytest.mark.parametrize("agents, message", [
    ((("a", None), ("b", ["a", "zed"])), r"agent 'b': after names unknown agents \['zed'\]"),
    ((("a", None), ("b", ["a", "a"])), r"agent 'b': after lists \['a'\] more than once"),
    ((("a", None), ("b", ["b"])), "agent 'b' reads itself"),
    ((("a", ["b"]), ("b", None)), "the first agent 'a' reads \\['b'\\]"),
    ((("a", None), ("b", ["c"]), ("c", ["b"])), "agents form a cycle: (b -> c -> b|c -> b -> c)"),
    ((("a", None), ("b", "a")), "'after' must be a list"),
    ((("a", None), ("b", [1])), "'after' must be a list of agent names"),
])
def test_bad_graphs_are_named(agents, message):
    with pytest.raises(PipelineConfigError, match=message):
        PipelineSpec.from_dict(graph_file(*agents))


def test_after_empty_starts_the_graph_beside_the_first_agent():
    """``after = []``: the agent reads nothing and runs in the first layer. With several such agents the
    input is a user message of its own opening every conversation, not the head of the first turn."""
    spec = PipelineSpec.from_dict({**graph_file(("a", None), ("b", []), ("c", ["a", "b"])), "input_text": "Doc."})
    assert spec.graph.upstream == ((), (), (0, 1)) and spec.graph.layers == ((0, 1), (2,))
    assert spec.turn(0) == "Do it." and spec.opening(2)[-1] == {"role": "user", "content": "Input:\n\nDoc."}


def test_an_agent_may_bring_its_own_input(tmp_path):
    (tmp_path / "part.md").write_text("Chunk two.")
    (tmp_path / "p.toml").write_text('input_text = "All."\n[[agents]]\nname = "a"\ninstruction = "Read."\n'
                                     '[[agents]]\nname = "b"\ninstruction = "Sum up."\ninput = "part.md"\n'
                                     'input_label = "Part"\n')
    spec = PipelineSpec.from_toml(tmp_path / "p.toml")
    assert spec.turn(1) == "Part:\n\nChunk two.\n\nSum up." and spec.turn(0) == "Input:\n\nAll.\n\nRead."


def test_an_input_that_is_no_regular_file_or_too_large_is_refused(tmp_path, monkeypatch):
    """A pipeline's input is read whole: a pipe, a device or a huge file is refused instead of hanging or
    exhausting memory."""
    import os

    import kvwire.pipeline.spec

    toml = tmp_path / "p.toml"
    os.mkfifo(tmp_path / "pipe")
    for target in ("pipe", "/dev/zero", str(tmp_path)):
        toml.write_text(f'input = "{target}"\n[[agents]]\nname = "a"\ninstruction = "Read it."\n')
        with pytest.raises(PipelineConfigError, match="not a regular file"):
            PipelineSpec.from_toml(toml)
    (tmp_path / "big.txt").write_text("x" * 2000)
    monkeypatch.setattr(kvwire.pipeline.spec, "MAX_INPUT_BYTES", 1000)
    toml.write_text('input = "big.txt"\n[[agents]]\nname = "a"\ninstruction = "Read it."\n')
    with pytest.raises(PipelineConfigError, match="2,000 bytes, over the 1,000-byte limit"):
        PipelineSpec.from_toml(toml)
    (tmp_path / "empty.txt").write_text(" \n")
    toml.write_text('input = "empty.txt"\n[[agents]]\nname = "a"\ninstruction = "Read it."\n')
    with pytest.raises(PipelineConfigError, match="is empty"):
        PipelineSpec.from_toml(toml)


@pytest.mark.parametrize("make, message", [
    (lambda: AgentSpec("c", "Merge.", after="ab"), "'after' must be a list of agent names, got 'ab'"),
    (lambda: AgentSpec("c", "Merge.", after=("a", 3)), "'after' must be a list of agent names"),
    (lambda: AgentSpec("b", "Go.", max_new_tokens=0), r"agent 'b': max_new_tokens must be an integer in 1\.\.4096"),
    (lambda: AgentSpec("", "Go."), "name '' must be 1-64 letters"),
    (lambda: AgentSpec("x/../y", "Go."), "name 'x/../y' must be 1-64 letters"),
    (lambda: AgentSpec("b", "  "), "agent 'b': instruction is empty"),
    (lambda: AgentSpec("b", "Go.", input_text=" \n "), "agent 'b': input_text is blank"),
    (lambda: PipelineSpec("p", (AgentSpec("a", "Go."),), input_text="   "), "pipeline 'p': input_text is blank"),
    (lambda: PipelineSpec("p", (AgentSpec("a", "Go."),), max_new_tokens=0), "pipeline 'p': max_new_tokens must be"),
])
def test_specs_built_in_python_are_checked_as_files_are(make, message):
    """The Python API refuses what a pipeline file may not say, when the spec is built (not mid-run);
    a string for ``after`` is not read one character at a time."""
    with pytest.raises(PipelineConfigError, match=message):
        make()


def test_after_may_be_a_list_in_python_and_a_blank_input_in_a_file_is_refused():
    assert AgentSpec("b", "Go.", after=["a"]).after == ("a",)
    with pytest.raises(PipelineConfigError, match=r"agent #2: input_text is blank"):
        PipelineSpec.from_dict({"input_text": "x", "agents": [{"name": "a", "instruction": "Go."},
                                                             {"name": "b", "instruction": "Go.", "input_text": " "}]})
