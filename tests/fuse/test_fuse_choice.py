"""The decision objective (kvwire.fuse.choice): choice questions from the standard library, each option
scored as a response to the fused question, trained towards the right one where the sharer knows it."""

from __future__ import annotations

import json

import pytest
import torch

from kvwire.errors import FuserDataError, FuserError
from kvwire.fuse import choice, dense, gain
from kvwire.fuse.stdlib_qa import Example, load, save
from tests.fuse.test_fuser import pair, trainer  # noqa: F401  (the tiny receiver/sharer pair fixture)

QUESTIONS = [Example(f"Which option does the analyst pick in round {n}?", ["red", "green", "blue"][n % 3],
                     "text", f"mod{n % 5}.name{n}", ("red", "green", "blue")) for n in range(12)]


def test_a_lettered_question_becomes_the_question_alone_with_its_options():
    lettered = Example("Which module defines `Counter`?\n\nA. heapq\nB. collections\nC. bisect\nD. json\n\n"
                       "Answer with the letter of the correct option only.", "B", "module", "collections.Counter")
    q = choice.from_letters(lettered)
    assert q.prompt == "Which module defines `Counter`?"
    assert q.options == ("heapq", "collections", "bisect", "json") and q.answer == "collections"
    assert choice.answer_index(q) == 1
    assert [e.answer for e in choice.option_examples(q)] == list(q.options)
    assert all(e.prompt == q.prompt and not e.options for e in choice.option_examples(q))
    with pytest.raises(FuserDataError, match="not a lettered"):
        choice.from_letters(Example("What is 2 + 2?", "4"))


def test_the_dataset_is_split_by_module_and_never_asks_about_the_benchmarks_modules():
    train, val = choice.dataset()
    assert len(train) > 1000 and len(val) > 100
    assert all(len(q.options) == 4 and q.answer in q.options for q in (*train, *val))
    assert all(not q.prompt.endswith("only.") for q in train)  # the options are not listed
    train_modules = {dense.module_of(q) for q in train}
    assert not train_modules & {dense.module_of(q) for q in val}
    assert not train_modules & dense.benchmark_modules()


def test_choice_questions_round_trip_through_jsonl_and_bad_options_are_refused(tmp_path):
    path = save(QUESTIONS[:3], tmp_path / "q.jsonl")
    assert load(path) == QUESTIONS[:3]
    plain = Example("Say hi", "hi")
    assert "options" not in plain.to_json()  # response examples are written as before
    for options in (["only"], ["a", "a"], ["x", "y"], "abc", [1, 2]):
        with pytest.raises(FuserDataError, match="'options' must be"):
            Example.from_json({"prompt": "p", "answer": "a", "options": options})


def test_option_log_probs_are_a_softmax_over_mean_log_likelihoods():
    """What the benchmark ranks by (gain.option_scores), as a differentiable distribution."""
    torch.manual_seed(0)
    tails = [torch.tensor([5, 1, 2, 9]), torch.tensor([5, 3, 9])]  # last prompt token, option, end of turn
    logits = [torch.randn(4, 12, requires_grad=True), torch.randn(3, 12, requires_grad=True)]

    class Record:
        def __init__(self, tail):
            self.tail_ids = tail

    expected = torch.log_softmax(torch.tensor(gain.option_scores([lg.detach() for lg in logits],
                                                                   [Record(t) for t in tails])), dim=0)
    got = choice.option_log_probs(logits, tails)
    assert torch.allclose(got, expected, atol=1e-6)
    got[0].backward()
    assert logits[0].grad is not None and logits[0].grad[2:].abs().sum() == 0  # the end of turn is not scored


def test_picks_are_measured_once_and_kept(tmp_path):
    calls = []

    def score(q):
        calls.append(q.prompt)
        return choice.answer_index(q) if "1" in q.prompt else 0

    path = tmp_path / "picks.json"
    picks = choice.picks(score, QUESTIONS, path, "model")
    assert len(calls) == len(QUESTIONS) and path.is_file()
    assert choice.picks(score, QUESTIONS, path, "model") == picks and len(calls) == len(QUESTIONS)
    kept = choice.keep(QUESTIONS, "sharer-right", picks)
    assert kept == [q for q in QUESTIONS if picks[choice.key(q)] == choice.answer_index(q)]
    assert choice.keep(QUESTIONS, "none", picks) == QUESTIONS
    path.write_text(json.dumps({f"model:{choice.key(QUESTIONS[0])}": 7}))
    with pytest.raises(FuserDataError, match="not an option index"):
        choice.picks(score, QUESTIONS[:1], path, "model")
    with pytest.raises(FuserDataError, match="unknown choice filter"):
        choice.keep(QUESTIONS, "sharer-wrong", picks)


def test_the_choice_objective_trains_the_options_and_measures_held_out_choices(pair, tmp_path):  # noqa: F811
    run = trainer(pair, tmp_path, examples=QUESTIONS, objective="choice", steps=8, eval_every=4,
                  checkpoint_every=8, control_share=0.25)
    assert len(run.options) == 7 and all(len(records) == 3 for records, _ in run.options)
    result = run.run()
    first = result.evals[0]
    assert first.loss == pytest.approx(first.baseline_loss)  # an untrained fuser is the receiver alone
    assert first.accuracy == first.baseline_accuracy == first.control_accuracy  # held-out choices, all three paths
    assert all(e.accuracy is not None and e.control_accuracy is not None for e in result.evals)
    losses = [s.loss for s in result.steps]
    assert all(torch.isfinite(torch.tensor(losses)))
    recorded = json.loads((result.checkpoint / "config.json").read_text())["training"]
    assert recorded["config"]["objective"] == "choice"
    assert {"heldout_choice_accuracy", "heldout_choice_alone", "heldout_choice_control"} <= set(recorded["gain"])


def test_an_untrained_fusers_control_rows_cost_nothing_under_the_choice_objective(pair, tmp_path):  # noqa: F811
    run = trainer(pair, tmp_path, examples=QUESTIONS, objective="choice")
    other = run._other(run.train, 0)
    loss = run._choice_loss([0, 1], [other, other])
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)
    assert float(run._choice_loss([0], [None]).detach()) > 0


def test_the_choice_objective_needs_choice_questions_and_takes_no_gap_filter(pair, tmp_path):  # noqa: F811
    with pytest.raises(FuserError, match="needs choice questions"):
        trainer(pair, tmp_path, objective="choice")
    with pytest.raises(FuserError, match="takes no --min-gap"):
        trainer(pair, tmp_path, examples=QUESTIONS, objective="choice", min_gap=0.0)
