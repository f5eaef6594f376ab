"""A three-agent code review written with smolagents (Hugging Face's agent framework), against ``kvwire serve``.

Each agent is a smolagents model object with a role of its own; each one's answer is
handed to the next as a message, the way frameworks pass work between agents. Nothing
here imports kvwire: smolagents talks to the server through its OpenAI-compatible
model class, exactly as it would talk to any hosted model::

    pip install smolagents==1.26.0
    kvwire serve --port 8000 --splice 0.15 &
    python examples/smolagents_review.py --base-url http://127.0.0.1:8000/v1

With ``--splice R`` the server recognises each pasted answer as an earlier
completion and splices its cached K/V in (R of it recomputed) where that is cheaper
than prefilling it -- short answers like these 48-token ones are prefilled, exactly,
unless ``--splice-when always``; without ``--splice``, the answers are prefilled as
text while every repeated prefix is still reused.
smolagents' ``CodeAgent`` and ``ToolCallingAgent`` take the same ``model=`` object;
they need a model that follows their tool-call format, which the bundled 135M
model does not, so this example drives the models directly.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from smolagents import ChatMessage, MessageRole, OpenAIServerModel

SNIPPET = (Path(__file__).parent.parent / "src" / "kvwire" / "data" / "review_snippet.py").read_text()
ROLES = [
    ("analyst", "You are the analyst. List the bugs in the code you are shown, one line each."),
    ("fixer", "You are the fixer. For each bug reported to you, say how to fix it."),
    ("reviewer", "You are the reviewer. Say whether the fixes proposed to you are complete."),
]


def text(content: str) -> list[dict]:
    return [{"type": "text", "text": content}]


def review(base_url: str, api_key: str, max_tokens: int, code: str = SNIPPET) -> list[tuple[str, ChatMessage]]:
    probe = OpenAIServerModel(model_id="", api_base=base_url, api_key=api_key)
    model_id = probe.client.models.list().data[0].id
    answers: list[str] = []
    results = []
    for name, system in ROLES:
        model = OpenAIServerModel(model_id=model_id, api_base=base_url, api_key=api_key, temperature=0,
                                  max_tokens=max_tokens)
        messages = [ChatMessage(role=MessageRole.SYSTEM, content=text(system)),
                    ChatMessage(role=MessageRole.USER, content=text(f"The code:\n\n{code}"))]
        messages += [ChatMessage(role=MessageRole.USER, content=text(answer)) for answer in answers]
        messages.append(ChatMessage(role=MessageRole.USER, content=text("Your answer:")))
        reply = model.generate(messages)
        answers.append(reply.content)
        results.append((name, reply))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    for name, reply in review(args.base_url, args.api_key, args.max_tokens):
        usage = reply.raw.usage
        served = (reply.raw.model_extra or {}).get("kvwire", {})
        print(f"{name:>9}: {usage.prompt_tokens} prompt tokens, {usage.prompt_tokens_details.cached_tokens} from "
              f"cache ({served.get('spliced_tokens', 0)} spliced): {reply.content.strip()[:120]}")


if __name__ == "__main__":
    main()
