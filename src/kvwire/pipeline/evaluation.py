"""``kvwire eval``'s runner: a pipeline over a task set, in several modes, judged by the tasks' own checkers.

In: a pipeline file (:class:`~kvwire.pipeline.spec.PipelineSpec`), a task set
(:mod:`kvwire.evals.tasks`), a model, the modes. Out: one JSON line per finished (task, mode) in
``results.jsonl`` (:class:`Results`), which :mod:`kvwire.evals.report` turns into the summary, the
statistics and the plot. (It lives with the runners it drives; :mod:`kvwire.evals` imports no model code.)

For each task the pipeline's input is the task's input; text mode runs first (keeping its logits
when an approximate mode follows, so that mode's KL against it is measured), then every other
mode on the same task, so modes are timed side by side. The answer is the reply of the last agent
(or ``answer_from``); a task's tests run in :mod:`kvwire.evals.sandbox`.

**The results file.** Its first line is a header naming what the results belong to: the
pipeline file's digest, the task set's digest, the model's fingerprint, the weight format, the
recompute share and the reply limit. ``resume`` continues a file only when all of these match
(other modes may be added); a file is never overwritten. Each line is flushed as it is written,
so a run killed at any point keeps every finished task.

**Modes.** ``text`` runs any pipeline. A chain whose agents share one system prompt also runs
``prefix`` and ``auto`` (exact) and ``splice``; with private prompts, ``splice`` only. A graph
(``after = [...]``) runs ``graph``: its merges exact, as :class:`kvwire.pipeline.graph.GraphRunner` runs them by
default (prefilled after the first branch's chain); ``graph@R`` splices them at R where that is cheaper
(``merge="auto"``). A requested mode the pipeline cannot run is skipped with its reason (:func:`plan_modes`); the
others run. ``splice@R`` runs at its own recompute share, so one run sweeps R (each is a mode of the report, a
point of the plot).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from ..errors import KvwireError, PipelineConfigError, reason
from ..evals.sandbox import Limits
from ..evals.answers import judge
from ..evals.tasks import Task, TaskSet

log = logging.getLogger(__name__)

MODES = ("text", "prefix", "splice", "graph", "auto")
FORMAT = 1  # the results file's format version
#: the judge's version, in the header: 3 takes no empty fenced block for the code (a judge's ``Candidate: 1``, its
#: function unfenced, then a stray closing fence read as "holds no code" under 2); 2 judges a reply that defines the
#: entry point by its definitions alone (:func:`kvwire.evals.answers.definitions`); 1 (files without the key) ran
#: the reply's whole code block
JUDGE = 3

Progress = Callable[[dict[str, Any]], None]


APPROXIMATE = ("splice", "graph")  # the modes a recompute share R applies to


def parse_mode(mode: str) -> tuple[str, float | None]:
    """``"splice"`` -> ``("splice", None)`` (the run's R); ``"splice@0.05"`` -> ``("splice", 0.05)``: one
    approximate mode at its own R, so that one run sweeps R with text mode run once per task.

    Example: ``--mode text,splice@0,splice@0.15,splice@1`` -- three points on the curve of pass@1 against reuse.
    """
    base, at, share = mode.partition("@")
    if base not in MODES:
        raise KvwireError(f"unknown mode {mode!r}", f"use some of {', '.join(MODES)} (splice@R or graph@R for a "
                          "share R of their own)")
    if not at:
        return base, None
    if base not in APPROXIMATE:
        raise KvwireError(f"mode {mode!r}: {base} mode is exact and recomputes nothing, so it takes no R",
                          f"give an R to {' or '.join(APPROXIMATE)} only (splice@0.05)")
    try:
        fraction = float(share)
    except ValueError:
        fraction = -1.0
    if not 0.0 <= fraction <= 1.0:
        raise KvwireError(f"mode {mode!r}: R must be a number from 0 to 1, got {share!r}", "write splice@0.05")
    return base, fraction


def canonical_mode(mode: str) -> str:
    """A mode as the report names it: ``"splice@0.10"`` -> ``"splice@0.1"``, ``" text "`` -> ``"text"``."""
    base, fraction = parse_mode(mode.strip())
    return base if fraction is None else f"{base}@{fraction:g}"


def plan_modes(spec: Any, requested: tuple[str, ...] | None,
               recompute: float | None = None) -> tuple[list[str], dict[str, str]]:
    """``(modes to run, text first; {skipped mode: why})``. ``requested`` None: text and the cache mode that
    applies (prefix for a shared transcript, splice for private prompts, graph for a graph). A mode may carry
    its own R (:func:`parse_mode`); modes are named as :func:`canonical_mode` names them, once each, and
    ``splice@R`` beside ``splice`` at the run's ``recompute`` R is skipped as the same run."""
    graph = not spec.graph.is_linear
    default = "graph" if graph else ("prefix" if spec.shared_system else "splice")
    wanted = list(dict.fromkeys(canonical_mode(m) for m in requested)) if requested else ["text", default]
    skipped: dict[str, str] = {}
    for mode in wanted:
        base, fraction = parse_mode(mode)
        if graph and base not in ("text", "graph"):
            skipped[mode] = f"pipeline {spec.name!r} is a graph (agents name what they read): run graph"
        elif not graph and base == "graph":
            skipped[mode] = f"pipeline {spec.name!r} is a chain, not a graph: run prefix or splice"
        elif base in ("prefix", "auto", "graph") and not spec.shared_system:
            skipped[mode] = (f"pipeline {spec.name!r} gives agents private system prompts, so no agent's context "
                             "extends another's: run splice")
        elif fraction is not None and fraction == recompute and base in wanted and base != "graph":
            skipped[mode] = f"the same run as {base}, whose R is --recompute {recompute:g}"
    run = [m for m in dict.fromkeys(["text", *wanted]) if m not in skipped]
    return run, skipped


def file_digest(path: Path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()[:16]


@dataclass(frozen=True)
class Header:
    """What a results file belongs to; a resumed run must match it."""

    pipeline: str  # the pipeline's name
    pipeline_digest: str
    tasks: str
    tasks_digest: str
    model: str  # the model's name or path, as given
    fingerprint: str
    weights: str
    recompute: float
    max_new_tokens: int | None
    answer_from: str
    splice_when: str = "cheaper"
    judge: int = JUDGE
    select: str = "attention+start"  # how splice chose its recomputed share: kv.splice.Recompute.select (tested)
    guard: float = 0.0  # the fidelity guard's staleness bound: kv.splice.Recompute.guard (0: none)

    KEYS = ("pipeline_digest", "tasks_digest", "fingerprint", "weights", "recompute", "max_new_tokens", "answer_from",
            "splice_when", "judge", "select", "guard")
    # what a file from before a key was added meant
    OLD = {"splice_when": "cheaper", "judge": 1, "select": "attention+deviation", "guard": 0.0}

    def to_json(self) -> dict[str, Any]:
        return {"kvwire_eval": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Header:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: value for name, value in {**cls.OLD, **data}.items() if name in names})

    def mismatch(self, other: dict[str, Any], keys: tuple[str, ...] = KEYS) -> list[str]:
        """What of ``keys`` differs from ``other`` (a header read from a file), as ``name: theirs -> ours``."""
        ours, theirs = self.to_json(), {**self.OLD, **other}
        return [f"{key}: {theirs.get(key)!r} -> {ours[key]!r}" for key in keys if theirs.get(key) != ours[key]]


class Results:
    """A results file: its header, the records finished so far, and appending to it."""

    def __init__(self, path: Path, header: Header, resume: bool) -> None:
        self.path, self.header = path, header
        self.records: list[dict[str, Any]] = []
        if path.exists() and path.stat().st_size:
            if not resume:
                raise KvwireError(f"{path} already holds results", "add --resume to continue them, or give another "
                                  "--out")
            self._read()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as file:
                file.write(json.dumps(header.to_json()) + "\n")

    def _read(self) -> None:
        lines, first = read_header(self.path, "give another --out")
        differs = self.header.mismatch(first, tuple(key for key in Header.KEYS if key != "judge"))
        if differs:
            raise KvwireError(f"--resume: {self.path} holds results of another run ({'; '.join(differs)})",
                              "resume with the same pipeline, tasks, model, weights and settings, or give another "
                              "--out")
        if self.header.mismatch(first, ("judge",)):  # the same run, judged by an older judge
            raise KvwireError(f"--resume: {self.path} was judged by an older judge (version {first.get('judge', 1)}, "
                              f"now {JUDGE})", f"re-judge it first: kvwire eval {self.header.tasks} --rejudge "
                              f"--out {self.path.parent}")
        self.records = read_records(self.path, lines)

    def done(self) -> set[tuple[str, str]]:
        return {(r["task"], r["mode"]) for r in self.records}

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()
        self.records.append(record)


def read_header(path: Path, hint: str) -> tuple[list[str], dict[str, Any]]:
    """(the lines of the results file ``path``, its header as read); a file that is no results file is refused
    with ``hint``."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise KvwireError(f"cannot read results {path}: {reason(err)}", hint) from None
    try:
        first = json.loads(lines[0])
    except (json.JSONDecodeError, IndexError):
        first = None
    if not isinstance(first, dict) or first.get("kvwire_eval") != FORMAT:
        raise KvwireError(f"{path} is not a kvwire eval results file (its first line is no header)", hint)
    return lines, first


def read_records(path: Path, lines: list[str], repair: bool = True) -> list[dict[str, Any]]:
    """The records of a results file's ``lines`` (its header first). A last line cut by a kill mid-write is
    left out, and with ``repair`` cut from the file too, so that task runs again; any other line that is not JSON
    is an error."""
    records = []
    for number, line in enumerate(lines[1:], start=2):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines) and not repair:
                    log.warning("%s: line %d is incomplete (a killed run); left out", path, number)
                    break
                if number == len(lines):  # a line cut by a kill mid-write: dropped, and that task runs again
                    log.warning("%s: line %d is incomplete (a killed run); it runs again", path, number)
                    data = path.read_bytes()
                    end = 0
                    for _ in range(len(lines) - 1):
                        end = data.index(b"\n", end) + 1
                    with path.open("r+b") as file:
                        file.truncate(end)
                    break
                raise KvwireError(f"{path}:{number}: not JSON", "give another --out") from None
            if not isinstance(record, dict) or not {"task", "mode", "final"} <= set(record):
                raise KvwireError(f"{path}:{number}: not a result (no task, mode and final reply)",
                                  "give another --out")
            records.append(record)
    return records


def rejudge(path: Path, tasks: TaskSet, limits: Limits = Limits(),
            on_progress: Progress | None = None) -> tuple[Header, list[dict[str, Any]], list[dict[str, Any]]]:
    """Judge every stored final reply in the results file ``path`` again with today's judge (no model runs):
    ``(its header, the re-judged records, those whose verdict changed)``. The file is replaced atomically by one
    whose header names today's judge; the previous file is kept beside it as ``results.judgeN.jsonl`` (N its
    judge's version). ``tasks`` must be the set the results were judged on (its digest is checked)."""
    on_progress = on_progress or (lambda event: None)
    lines, first = read_header(path, "give the --out of a kvwire eval run")
    try:
        header = Header.from_json(first)
    except TypeError:
        raise KvwireError(f"{path}: its header lacks fields a results file has", "give the --out of a kvwire eval "
                          "run") from None
    if header.tasks_digest != tasks.digest:
        raise KvwireError(f"{path} holds results on task set {header.tasks!r} (digest {header.tasks_digest}), not on "
                          f"the {tasks.name!r} given (digest {tasks.digest})", "re-judge with the task set it ran")
    by_id = {task.id: task for task in tasks}
    records = read_records(path, lines, repair=False)  # the file is replaced below; the old one kept untouched
    unknown = sorted({r["task"] for r in records} - set(by_id))
    if unknown:
        raise KvwireError(f"{path} holds tasks the set {tasks.name!r} lacks: {', '.join(unknown[:5])}")
    changed, fresh = [], []
    for record in records:
        on_progress({"event": "task", "task": record["task"], "modes": [record["mode"]]})
        start = time.perf_counter()
        verdict = judge(by_id[record["task"]], record["final"], limits)
        new = {**record, "passed": verdict.passed, "reason": verdict.reason, "answer": verdict.answer,
               "judge_s": time.perf_counter() - start}
        if new["passed"] != record.get("passed"):
            changed.append({**new, "was": {"passed": record.get("passed"), "reason": record.get("reason")}})
        fresh.append(new)
        on_progress({"event": "done", "task": record["task"], "mode": record["mode"], "record": new})
    header = dataclasses.replace(header, judge=JUDGE)
    kept = path.with_name(f"{path.stem}.judge{first.get('judge', 1)}{path.suffix}")
    temporary = path.with_name(f".{path.name}.rejudged")
    with temporary.open("w", encoding="utf-8") as file:
        file.write("".join(json.dumps(r) + "\n" for r in [header.to_json(), *fresh]))
        file.flush()
        os.fsync(file.fileno())
    if not kept.exists():
        os.link(path, kept)
    os.replace(temporary, path)
    return header, fresh, changed


@dataclass
class Evaluation:
    """A pipeline over tasks on one model. ``recompute`` is splice's (and graph merges') R; ``kl`` measures the
    approximate modes' KL against text mode (one teacher-forced pass an agent, not timed); ``splice_when``
    ``"always"`` splices even upstream turns that are cheaper to prefill exactly."""

    model: Any
    tokenizer: Any
    spec: Any  # PipelineSpec
    model_spec: Any  # ModelSpec
    recompute: float = 0.15
    answer_from: str = ""
    kl: bool = True
    splice_when: str = "cheaper"  # splice: splice upstream turns only where estimated cheaper than prefilling them
    guard: float = 0.0  # splice and graph merges: recompute a segment whose staleness is over this (0: never)
    limits: Limits = dataclasses.field(default_factory=Limits)

    def __post_init__(self) -> None:
        names = [a.name for a in self.spec.agents]
        if self.answer_from and self.answer_from not in names:
            raise PipelineConfigError(f"--answer-from {self.answer_from!r}: pipeline {self.spec.name!r} has no such "
                                      "agent", f"agents are {', '.join(names)}")
        self.answer_from = self.answer_from or self._last_agent()

    def _last_agent(self) -> str:
        order = [i for layer in self.spec.graph.layers for i in layer]
        return self.spec.agents[order[-1]].name

    def run(self, tasks: TaskSet | tuple[Task, ...], modes: list[str], results: Results,
            on_progress: Progress | None = None) -> Iterator[dict[str, Any]]:
        """Run every (task, mode) not in ``results`` yet, appending each record as it finishes; yields them."""
        done = results.done()
        on_progress = on_progress or (lambda event: None)
        approximate = any(parse_mode(m)[0] in APPROXIMATE for m in modes)
        if approximate:  # the RoPE probe runs once per model: before the first timed turn, not inside it
            from .. import hf

            hf.rope_tables(self.model, self.model_spec)
            hf.measure_pass_cost(self.model)  # so is the pass cost that prices splice-or-prefill (remembered)
        for task in tasks:
            todo = [m for m in modes if (task.id, m) not in done]
            on_progress({"event": "task", "task": task.id, "modes": todo})
            reference = None
            for mode in todo:
                record, run = self.run_one(task, mode, reference if mode != "text" else None,
                                           keep_logits=mode == "text" and self.kl and approximate)
                if mode == "text":
                    reference = run
                results.append(record)
                on_progress({"event": "done", "task": task.id, "mode": mode, "record": record})
                yield record

    def run_one(self, task: Task, mode: str, reference: Any = None, keep_logits: bool = False
                ) -> tuple[dict[str, Any], Any]:
        """One task in one mode (``splice@0.05`` runs splice at R = 0.05): ``(its record, the PipelineResult)``."""
        from ..kv.splice import Recompute
        from .graph import GraphRunner
        from .linear import Pipeline

        spec = dataclasses.replace(self.spec, input_text=task.input)
        base, fraction = parse_mode(mode)
        recompute = Recompute(fraction=self.recompute if fraction is None else fraction, guard=self.guard)
        if spec.graph.is_linear:
            runner: Any = Pipeline(self.model, self.tokenizer, spec, model_spec=self.model_spec, recompute=recompute,
                                   splice_when=self.splice_when)  # type: ignore[arg-type]
        else:
            # graph: merges as users get them (exact); graph@R: merges spliced at R where that is cheaper
            runner = GraphRunner(self.model, self.tokenizer, spec, model_spec=self.model_spec, recompute=recompute,
                                 merge="prefill" if fraction is None else "auto")
        result = runner.run(base, reference=reference, keep_logits=keep_logits)
        final = [a for a in result.agents if a.agent == self.answer_from][-1].output_text
        start = time.perf_counter()
        verdict = judge(task, final, self.limits)
        later = result.agents[1:]
        kls = [a.fidelity.kl for a in later if a.fidelity is not None and a.fidelity.kl is not None]
        record = {
            "task": task.id, "mode": mode, "passed": verdict.passed, "reason": verdict.reason, "final": final,
            "answer": verdict.answer, "total_s": result.total_s, "judge_s": time.perf_counter() - start,
            "ttft_later_s": sum(a.ttft_s for a in later), "context_later": sum(a.context_tokens for a in later),
            "reused_later": sum(a.cached_tokens for a in later),
            "recomputed_later": sum(a.recomputed_tokens for a in later),
            "kl": sum(kls) / len(kls) if kls else None, "settings": result.settings, "rebuilds": result.rebuilds,
            # replies whose text tokenizes to other ids than the model wrote: text mode then reads other ids than a
            # cache mode, so even an exact mode's answer may differ (a small model's odd tokens do this)
            "retokenized_turns": sum(len(a.retokenized_turns) for a in result.agents),
            "agents": [{"agent": a.agent, "context_tokens": a.context_tokens, "cached_tokens": a.cached_tokens,
                        "recomputed_tokens": a.recomputed_tokens, "new_tokens": a.new_tokens, "ttft_s": a.ttft_s,
                        "receive_s": a.receive_s, "compute_s": a.compute_s, "select_s": a.select_s,
                        "prefill_s": a.prefill_s, "decode_s": a.decode_s, "publish_s": a.publish_s,
                        "staleness": a.staleness, "guarded_tokens": a.guarded_tokens,
                        "total_s": a.total_s, "finish_reason": a.finish_reason,
                        "kl": a.fidelity.kl if a.fidelity is not None else None} for a in result.agents],
        }
        return record, result
