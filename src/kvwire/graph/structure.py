"""The shape of a pipeline graph: who reads whom, in which order, and what each agent's
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
turn (:meth:`kvwire.pipefile.PipelineSpec.opening`): the roots read the same opening, so
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

from dataclasses import dataclass, field
from functools import cached_property

from ..errors import PipelineConfigError

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
