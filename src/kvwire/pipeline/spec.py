"""Pipeline descriptions: :class:`PipelineSpec`, read from a TOML file.

Example (``examples/code_review.toml``)::

    name = "code-review"
    system = "You are part of a small software team reviewing a pull request."
    input = "data/review_snippet.py"     # a file, relative to this TOML file
    input_label = "Code under review"    # heads the input in the first turn
    max_new_tokens = 32                  # default for every agent

    [[agents]]
    name = "analyst"                     # letters, digits, '-' and '_'
    role = "code analyst"                # optional: "You are the code analyst." opens its turn
    instruction = "Explain what the code does and list every bug you find."

    [[agents]]
    name = "fixer"
    instruction = "Suggest a concrete fix for each bug in the analysis."
    max_new_tokens = 48                  # optional, per agent
    system = "You fix bugs."             # optional: a private system prompt (splice mode's case)
    after = ["analyst"]                  # optional: the agents it reads (default: the one before it;
                                         #  [] for none: it starts the graph beside the first agent)
    input = "data/part2.md"              # optional: text of its own, heading its turn (input_label too)

All agents share one conversation: for each agent a user turn (its role and
instruction; the first one also carries the input) and its generated reply. Each
agent reads it under its system prompt: the pipeline's ``system``, or its own
private ``system`` (then prefix mode cannot apply: use splice). ``input_text = "..."``
may replace ``input`` for short inputs.

With ``after`` a pipeline is a graph: agents that read the same agent run in parallel
and a merging agent (several names in ``after``) reads every branch. The first agent
reads nothing, and so does any agent with ``after = []``: several such agents start the
graph in parallel, and the input is then a user message of its own that opens every
conversation (:meth:`PipelineSpec.opening`) instead of heading the first agent's turn.
No cycles (:class:`Graph` checks and orders it). Without ``after``
anywhere, the file is the usual chain and keeps its meaning.

**The graph** (:class:`Graph`): the shape of a pipeline graph: who reads whom, in which order, and what each agent's
conversation holds. Pure functions over agent names; no model, no store.

An agent reads the agents named in its ``after`` list (default: the agent before it in
the file, so a file without ``after`` is the usual chain). Agents that read nothing start
the graph (its *roots*): the first agent in the file always, and any other whose ``after``
is the empty list -- several specialists reading the same input in parallel. No cycles.
Agents may be listed in any order: the runner orders them in *layers* -- layer 0 holds
the roots, an agent's layer is one more than the deepest agent it reads -- and within a
layer by file order.

*The input.* With one root, the pipeline's input heads that agent's turn (as in a chain).
With several, it is a message of its own that opens every conversation, before any
turn (:meth:`PipelineSpec.opening`): the roots read the same opening, so
graph mode prefills it once for all of them, and a merging agent reads it once, not once
per branch.

Example (a review board)::

    names  = ["intake", "security", "style", "chair"]
    after  = [None, None, ["intake"], ["security", "style"]]
    -> upstream  [(), (0,), (0,), (1, 2)]
    -> layers    [[0], [1, 2], [3]]

    names  = ["security", "style", "chair"]               # two roots: both read the input
    after  = [None, [], ["security", "style"]]
    -> upstream  [(), (), (0, 1)]
    -> layers    [[0, 1], [2]]

*Conversations.* Each agent's turn adds two messages (its instruction as a user turn and
its answer); an agent's conversation is the list of turns it reads before its own, as
``(round, agent)`` items. A root reads nothing in round 0; in round r > 0 it
reads every *sink* of round r - 1 (the agents no one reads; one, the last agent, in a chain):
the last sink in layered order first, then the others as branches it merges. An
agent with one upstream ``u`` reads ``conversation(u) + [u]`` -- its context extends
``u``'s, which is what lets it receive ``u``'s cache as a prefix. A merging agent (several
upstreams ``u1, u2, ...``) reads the turns its branches share, then each branch's own
turns in ``after`` order (a turn two branches share appears once)::

    chair: [intake] + [security] + [style]       (common: [intake]; then each branch)
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import PipelineConfigError, reason

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_NEW_TOKENS_LIMIT = 4096
Item = tuple[int, int]  # (round, agent index): one agent's turn (its instruction and its answer)


def resolve(names: list[str], after: list[tuple[str, ...] | None]) -> tuple[tuple[int, ...], ...]:
    """Each agent's upstream agents as indices, defaults applied; raises :class:`PipelineConfigError`
    naming unknown or duplicated names, a first agent that reads others, or a cycle."""
    index = {name: i for i, name in enumerate(names)}
    upstream: list[tuple[int, ...]] = []
    for i, (name, reads) in enumerate(zip(names, after)):
        if reads is None:
            upstream.append(() if i == 0 else (i - 1,))
            continue
        unknown = [r for r in reads if r not in index]
        if unknown:
            raise PipelineConfigError(f"agent {name!r}: after names unknown agents {unknown}",
                                      f"agents are {', '.join(names)}")
        twice = sorted({r for r in reads if reads.count(r) > 1})
        if twice:
            raise PipelineConfigError(f"agent {name!r}: after lists {twice} more than once")
        if name in reads:
            raise PipelineConfigError(f"agent {name!r} reads itself (after = {list(reads)})")
        if i == 0 and reads:
            raise PipelineConfigError(f"the first agent {name!r} reads {list(reads)}; the first agent in the file "
                                      "starts the pipeline and reads nothing",
                                      "move an agent that starts the pipeline to the top of the file")
        upstream.append(tuple(index[r] for r in reads))
    cycle = _find_cycle(upstream)
    if cycle:
        raise PipelineConfigError("agents form a cycle: " + " -> ".join(names[i] for i in cycle),
                                  "a pipeline graph may not loop; use rounds (--rounds) to repeat it")
    return tuple(upstream)


def _find_cycle(upstream: list[tuple[int, ...]]) -> list[int]:
    """A cycle as a list of agents ``[a, b, ..., a]`` in reading order, or ``[]``. Iterative: a
    graph thousands of agents deep is checked without Python's recursion limit."""
    state = [0] * len(upstream)  # 0 unseen, 1 on the stack, 2 done
    for root in range(len(upstream)):
        if state[root]:
            continue
        stack: list[int] = [root]  # the path being walked; each node's next parent to try in `next_parent`
        next_parent = {root: 0}
        state[root] = 1
        while stack:
            node = stack[-1]
            parents = upstream[node]
            if next_parent[node] == len(parents):
                stack.pop()
                state[node] = 2
                continue
            parent = parents[next_parent[node]]
            next_parent[node] += 1
            if state[parent] == 1:
                loop = stack[stack.index(parent):] + [parent]
                return loop[::-1]  # reading order: parent is read by ...
            if state[parent] == 0:
                state[parent] = 1
                next_parent[parent] = 0
                stack.append(parent)
    return []


@dataclass(frozen=True)
class Graph:
    """Agents (by index into ``names``) and whom each reads."""

    names: tuple[str, ...]
    upstream: tuple[tuple[int, ...], ...]
    _memo: dict[Item, tuple[Item, ...]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, names: list[str], after: list[tuple[str, ...] | None]) -> Graph:
        return cls(tuple(names), resolve(names, after))

    @cached_property
    def layers(self) -> tuple[tuple[int, ...], ...]:
        depth: dict[int, int] = {}
        for root in range(len(self.names)):  # depth first, iteratively (graphs may be thousands deep)
            stack = [root]
            while stack:
                node = stack[-1]
                if node in depth:
                    stack.pop()
                    continue
                todo = [u for u in self.upstream[node] if u not in depth]
                if todo:
                    stack.extend(todo)
                    continue
                depth[node] = 1 + max((depth[u] for u in self.upstream[node]), default=-1)
                stack.pop()
        return tuple(tuple(n for n in range(len(self.names)) if depth[n] == d) for d in range(max(depth.values()) + 1))

    @property
    def order(self) -> tuple[int, ...]:
        """Every agent once, layer by layer (the order turns are taken and reported)."""
        return tuple(node for layer in self.layers for node in layer)

    @cached_property
    def roots(self) -> tuple[int, ...]:
        """The agents that read nothing (they start the graph), in file order."""
        return tuple(n for n, up in enumerate(self.upstream) if not up)

    @property
    def shares_input(self) -> bool:
        """Whether several agents start the graph: the input is then a message of its own they all read."""
        return len(self.roots) > 1

    @property
    def is_linear(self) -> bool:
        """Whether this is the plain chain 0 -> 1 -> ... -> n-1 (what ``after`` defaults to)."""
        return all(up == ((i - 1,) if i else ()) for i, up in enumerate(self.upstream))

    def downstream(self, node: int) -> tuple[int, ...]:
        return tuple(n for n in range(len(self.names)) if node in self.upstream[n])

    @cached_property
    def sinks(self) -> tuple[int, ...]:
        """The agents no agent reads, in layered order: the last of them ends a round."""
        read = {u for up in self.upstream for u in up}
        return tuple(n for n in self.order if n not in read)

    def reads(self, node: int, round: int = 0) -> tuple[Item, ...]:
        """The turns agent ``node`` reads directly in ``round`` (its upstream handoffs); a root (the
        first agent, or each of several) reads every sink of the round before in a later round, the
        last one first (its chain continues exactly; the others are merged after it)."""
        if self.upstream[node]:
            return tuple((round, u) for u in self.upstream[node])
        if round == 0:
            return ()
        last, *others = self.sinks[::-1]
        return ((round - 1, last), *((round - 1, u) for u in others[::-1]))

    def is_merge(self, node: int, round: int = 0) -> bool:
        """Whether agent ``node`` reads turns past its first upstream's conversation: several branches,
        not (say) ``after = ["b", "a"]`` where ``b`` already read ``a``, which is a plain chain."""
        reads = self.reads(node, round)
        if len(reads) < 2:
            return False
        (r, u) = reads[0]
        return len(self.conversation(node, round)) > len(self.conversation(u, r)) + 1

    def conversation(self, node: int, round: int = 0) -> tuple[Item, ...]:
        """The turns agent ``node`` reads before its own in ``round`` (see the module docstring).
        Computed upstream first, iteratively (no recursion limit on deep graphs), and remembered."""
        key = (round, node)
        stack = [key]
        while stack:
            r, n = stack[-1]
            if (r, n) in self._memo:
                stack.pop()
                continue
            reads = self.reads(n, r)
            todo = [(ru, u) for ru, u in reads if (ru, u) not in self._memo]
            if todo:
                stack.extend(todo)
                continue
            self._memo[(r, n)] = merge([self._memo[(ru, u)] + ((ru, u),) for ru, u in reads])
            stack.pop()
        return self._memo[key]


def merge(branches: list[tuple[Item, ...]]) -> tuple[Item, ...]:
    """The items the branches share (their longest common prefix), then each branch's others in order.

    Example: [(a, b), (a, c), (a, b, d)] -> (a, b, c, d).
    """
    if not branches:
        return ()
    common = 0
    while all(len(b) > common and b[common] == branches[0][common] for b in branches):
        common += 1
    merged = list(branches[0][:common])
    seen = set(merged)
    for branch in branches:
        for item in branch[common:]:
            if item not in seen:
                merged.append(item)
                seen.add(item)
    return tuple(merged)


@dataclass(frozen=True)
class AgentSpec:
    name: str
    instruction: str
    role: str = ""
    max_new_tokens: int | None = None  # None: the pipeline's default
    system: str | None = None  # a private system prompt; None: the pipeline's shared one
    after: tuple[str, ...] | None = None  # the agents it reads; None: the one before it (none for the first)
    input_text: str = ""  # text of its own heading its turn (e.g. one chunk of a document)
    input_label: str = "Input"

    def __post_init__(self) -> None:
        """The same checks whether the agent comes from a file or from Python."""
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise PipelineConfigError(f"name {self.name!r} must be 1-64 letters, digits, '-' or '_'")
        if not isinstance(self.instruction, str) or not self.instruction.strip():
            raise PipelineConfigError(f"agent {self.name!r}: instruction is empty")
        if self.max_new_tokens is not None:
            _check_tokens(self.max_new_tokens, f"agent {self.name!r}: max_new_tokens")
        if self.after is not None:
            if isinstance(self.after, (str, bytes)) or not isinstance(self.after, (tuple, list)) or \
                    not all(isinstance(a, str) for a in self.after):
                raise PipelineConfigError(f"agent {self.name!r}: 'after' must be a list of agent names, got "
                                          f"{self.after!r}", 'e.g. after = ["intake"] (a list, even of one name)')
            object.__setattr__(self, "after", tuple(self.after))
        _check_text(self.input_text, f"agent {self.name!r}: input_text")

    def turn(self) -> str:
        """The user message this agent appends to the transcript."""
        turn = f"You are the {self.role}. {self.instruction}" if self.role else self.instruction
        return f"{self.input_label}:\n\n{self.input_text}\n\n{turn}" if self.input_text else turn


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    agents: tuple[AgentSpec, ...]
    input_text: str = ""
    input_label: str = "Input"
    system: str = ""
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        if not self.agents:
            raise PipelineConfigError(f"pipeline {self.name!r} has no agents", "add at least one [[agents]] table")
        if not all(isinstance(agent, AgentSpec) for agent in self.agents):
            raise PipelineConfigError(f"pipeline {self.name!r}: agents must be AgentSpec objects")
        _check_tokens(self.max_new_tokens, f"pipeline {self.name!r}: max_new_tokens")
        _check_text(self.input_text, f"pipeline {self.name!r}: input_text")
        names = [agent.name for agent in self.agents]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise PipelineConfigError(f"pipeline {self.name!r} has duplicate agent names {duplicates}")
        object.__setattr__(self, "graph", Graph.build(names, [agent.after for agent in self.agents]))

    graph: Graph = field(init=False, repr=False, compare=False)  # who reads whom (checked, ordered)

    def turn(self, index: int) -> str:
        """The user message agent ``index`` appends; the first one carries the input, unless several
        agents start the graph (then the input is a message of its own: :meth:`opening`)."""
        turn = self.agents[index].turn()
        if index == 0 and self.input_text and not self.graph.shares_input:
            return f"{self.input_label}:\n\n{self.input_text}\n\n{turn}"
        return turn

    def opening(self, index: int) -> list[dict[str, str]]:
        """The messages agent ``index``'s conversation opens with, before any agent's turn: its system
        prompt, and -- when several agents start the graph (``after = []``) -- the pipeline's input as a
        user message of its own, which all of them read (so a cache of it is shared, and a merging
        agent reads the input once, not once per branch)."""
        system = self.system_for(index)
        messages = [{"role": "system", "content": system}] if system else []
        if self.input_text and self.graph.shares_input:
            messages.append({"role": "user", "content": f"{self.input_label}:\n\n{self.input_text}"})
        return messages

    def system_for(self, index: int) -> str:
        """Agent ``index``'s system prompt: its private one, else the pipeline's shared one."""
        private = self.agents[index].system
        return self.system if private is None else private

    @property
    def shared_system(self) -> bool:
        """Whether every agent sees the same system prompt (required by prefix mode)."""
        return len({self.system_for(i) for i in range(len(self.agents))}) == 1

    def new_tokens(self, index: int) -> int:
        limit = self.agents[index].max_new_tokens
        return self.max_new_tokens if limit is None else limit

    def with_max_new_tokens(self, tokens: int) -> PipelineSpec:
        """The same pipeline with every agent limited to ``tokens`` new tokens."""
        _check_tokens(tokens, "max_new_tokens")
        agents = tuple(replace(a, max_new_tokens=None) for a in self.agents)
        return PipelineSpec(self.name, agents, self.input_text, self.input_label, self.system, tokens)

    # -- reading -----------------------------------------------------------------------------------

    @classmethod
    def from_toml(cls, path: str | Path) -> PipelineSpec:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PipelineConfigError(f"no pipeline file at {path}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise PipelineConfigError(f"cannot read pipeline file {path}: {reason(err)}") from None
        except tomllib.TOMLDecodeError as err:
            raise PipelineConfigError(f"{path} is not valid TOML: {err}") from None
        return cls.from_dict(data, base_dir=path.parent, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: Path = Path("."), source: str = "pipeline") -> PipelineSpec:
        fields = {"name": str, "system": str, "input": str, "input_text": str, "input_label": str,
                  "max_new_tokens": int, "agents": list}
        _check_keys(data, fields, source, required=("agents",))
        input_text = _input(data, base_dir, source)
        max_new_tokens = data.get("max_new_tokens", 32)
        _check_tokens(max_new_tokens, f"{source}: max_new_tokens")
        agents = []
        for number, entry in enumerate(data["agents"], 1):
            where = f"{source}: agent #{number}"
            if not isinstance(entry, dict):
                raise PipelineConfigError(f"{where} must be a table ([[agents]])")
            _check_keys(entry, {"name": str, "instruction": str, "role": str, "max_new_tokens": int, "system": str,
                                "after": list, "input": str, "input_text": str, "input_label": str},
                        where, required=("name", "instruction"))
            try:
                agents.append(AgentSpec(entry["name"], entry["instruction"], entry.get("role", ""),
                                        entry.get("max_new_tokens"), entry.get("system"), entry.get("after"),
                                        _input(entry, base_dir, where), entry.get("input_label", "Input")))
            except PipelineConfigError as err:  # say where in the file, not which agent object
                if err.message.startswith(where):
                    raise
                message = err.message.removeprefix(f"agent {entry['name']!r}: ")
                raise PipelineConfigError(f"{where}: {message}", err.hint) from None
        return cls(
            name=data.get("name", Path(source).stem),
            agents=tuple(agents),
            input_text=input_text,
            input_label=data.get("input_label", "Input"),
            system=data.get("system", ""),
            max_new_tokens=max_new_tokens,
        )


MAX_INPUT_BYTES = 16 * 2**20  # far past any supported model's context window (about 4 bytes a token)


def _input(data: dict[str, Any], base_dir: Path, where: str) -> str:
    """The text of ``input`` (a file, relative to the pipeline file) or ``input_text``."""
    if "input" in data and "input_text" in data:
        raise PipelineConfigError(f"{where}: give either 'input' (a file) or 'input_text', not both")
    if "input" not in data:
        return data.get("input_text", "")
    input_path = (base_dir / data["input"]).resolve()
    try:
        if input_path.exists() and not input_path.is_file():
            raise PipelineConfigError(f"{where}: input {input_path} is not a regular file",
                                      "give a text file (not a directory, device or pipe)")
        size = input_path.stat().st_size
        if size > MAX_INPUT_BYTES:
            raise PipelineConfigError(f"{where}: input file {input_path} is {size:,} bytes, over the "
                                      f"{MAX_INPUT_BYTES:,}-byte limit for a pipeline input",
                                      "no model here reads that much: cut the document")
        text = input_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PipelineConfigError(f"{where}: cannot read input file {input_path}: "
                                  f"{getattr(err, 'strerror', None) or err}",
                                  "paths are relative to the pipeline file") from None
    if not text.strip():
        raise PipelineConfigError(f"{where}: input file {input_path} is empty",
                                  "point input at the document the agents should read (or drop 'input')")
    return text


def _check_text(text: Any, where: str) -> None:
    """An input text is a string, empty (none) or with something in it: blank text is refused,
    as a blank input file is."""
    if not isinstance(text, str):
        raise PipelineConfigError(f"{where} must be text, got {type(text).__name__}")
    if text and not text.strip():
        raise PipelineConfigError(f"{where} is blank (only whitespace)",
                                  "give the text the agents should read, or leave it out")


def _check_keys(data: dict[str, Any], fields: dict[str, type], where: str, required: tuple[str, ...]) -> None:
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise PipelineConfigError(f"{where}: unknown keys {unknown}", f"allowed keys: {', '.join(fields)}")
    for key in required:
        if key not in data:
            raise PipelineConfigError(f"{where}: missing required key {key!r}")
    for key, value in data.items():
        typ = fields[key]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise PipelineConfigError(f"{where}: {key!r} must be a {typ.__name__}, got {type(value).__name__}")


def _check_tokens(value: Any, where: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_NEW_TOKENS_LIMIT:
        raise PipelineConfigError(f"{where} must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}, got {value!r}")
