"""Scoring multiple-choice questions (kvwire.hf.scoring): each method's score is what an
independent forward pass over prompt + answer gives, and scoring from a cache that covers part
of the prompt (how fuse mode scores with a fused cache) gives the same scores as from scratch."""

from __future__ import annotations

import pytest
import torch

from kvwire import hf
from kvwire.errors import PacketError, QuestionSetError
from kvwire.evals import load
from kvwire.evals.questions import Question
from kvwire.hf import scoring

QUESTION = Question.from_json({
    "id": "builtins-divmod", "topic": "builtins", "question": "Which built-in returns quotient and remainder?",
    "options": ["the fixer", "divmod", "the analyst reads", "sum"], "answer": "B", "note": "test item"})


def log_probs(model, ids):
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("method", scoring.METHODS)
def test_scores_are_the_log_probabilities_of_one_plain_forward(tiny_model, tiny_tokenizer, method):
    arch, model, spec = tiny_model
    prompt = scoring.build_prompt(tiny_tokenizer, QUESTION, method)
    result = scoring.score(model, tiny_tokenizer, QUESTION, method, prompt=prompt)
    n = len(prompt.ids)
    for index, got in enumerate(result.scores):
        if method == "letter":
            lp = log_probs(model, list(prompt.ids))[-1]
            want = float(torch.logsumexp(lp[list(prompt.letter_ids[index])], dim=0))
        else:
            option = prompt.option_ids[index]
            lp = log_probs(model, [*prompt.ids, *option])
            want = float(sum(lp[n - 1 + i, t] for i, t in enumerate(option)))
            want = want / len(option) if method in ("loglik_mean", "listed") else want
        assert got == pytest.approx(want, abs=1e-4), (arch, index)
    assert result.predicted == max(range(4), key=lambda i: result.scores[i])
    assert result.prompt_tokens == n and result.cached_tokens == 0 and result.seconds > 0


@pytest.mark.parametrize("method", ["letter", "loglik"])
def test_scoring_from_a_cache_over_the_prompt_prefix_matches(tiny_model, tiny_tokenizer, method):
    arch, model, spec = tiny_model
    prompt = scoring.build_prompt(tiny_tokenizer, QUESTION, method)
    plain = scoring.score(model, tiny_tokenizer, QUESTION, method, prompt=prompt)
    for covered in (1, len(prompt.ids) // 2, len(prompt.ids) - 1):
        cache = hf.new_cache(model)
        with torch.inference_mode():
            model(input_ids=torch.tensor([prompt.ids[:covered]]), past_key_values=cache, use_cache=True)
        cached = scoring.score(model, tiny_tokenizer, QUESTION, method, cache=cache, prompt=prompt)
        assert cached.cached_tokens == covered and cached.predicted == plain.predicted
        assert cached.scores == pytest.approx(plain.scores, abs=1e-4), (arch, covered)


def test_a_cache_over_the_whole_prompt_and_unknown_methods_are_refused(tiny_model, tiny_tokenizer):
    arch, model, spec = tiny_model
    prompt = scoring.build_prompt(tiny_tokenizer, QUESTION, "letter")
    cache = hf.new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt.ids]), past_key_values=cache, use_cache=True)
    with pytest.raises(PacketError, match="leave at least one prompt token uncached"):
        scoring.score(model, tiny_tokenizer, QUESTION, "letter", cache=cache, prompt=prompt)
    with pytest.raises(QuestionSetError, match="unknown scoring method"):
        scoring.build_prompt(tiny_tokenizer, QUESTION, "guess")


@pytest.mark.real_model
def test_the_default_model_scores_bundled_questions_from_a_packet(real_model):
    """A few bundled questions on SmolLM2: scores from a cache rebuilt out of a packet over the
    prompt (all but its last token) equal the scores from scratch."""
    model, tokenizer, spec = real_model
    for question in load()[:3]:
        prompt = scoring.build_prompt(tokenizer, question, "letter")
        plain = scoring.score(model, tokenizer, question, "letter", prompt=prompt)
        sender = hf.new_cache(model)
        head = torch.tensor([prompt.ids[:-1]])
        with torch.inference_mode():
            model(input_ids=head, past_key_values=sender, use_cache=True)
        cache = hf.build_cache(hf.extract(sender, spec, head), model, spec)
        cached = scoring.score(model, tokenizer, question, "letter", cache=cache, prompt=prompt)
        assert cached.predicted == plain.predicted and cached.scores == pytest.approx(plain.scores, abs=1e-3)
