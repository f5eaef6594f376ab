"""kvwire train-fuser and kvwire fuser-data from the command line, on tiny models saved as folders."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import cli, tiny
from tests.fuse.test_fuser import tiny_sharer
from kvwire.fuse import checkpoint, stdlib_qa


# Fuse mode is blocked (no fuser trained here helps: docs/fuse.md); training through the command line takes
# 17-21 s a test, so those run with `make test-slow` and the trainer itself is tested in tests/fuse/test_fuser.py
SLOW = pytest.mark.slow


def kvwire(*args: str) -> subprocess.CompletedProcess:
    return cli.run(*args)  # the command line in this process (tests/support/cli.py)


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny receiver and sharer saved as HF model folders, and a small JSONL data file."""
    root = tmp_path_factory.mktemp("models")
    r_tok, s_tok = tiny.tokenizer(), tiny.tokenizer(300)
    tiny.model("llama", len(r_tok), r_tok.eos_token_id).save_pretrained(root / "receiver")
    r_tok.save_pretrained(root / "receiver")
    tiny_sharer(len(s_tok), s_tok.eos_token_id).save_pretrained(root / "sharer")
    s_tok.save_pretrained(root / "sharer")
    examples = [stdlib_qa.Example(f"Which of these lists {n} bugs?", "ABCD"[n % 4], "text") for n in range(8)]
    stdlib_qa.save(examples, root / "data.jsonl")
    return root


@SLOW
def test_train_fuser_trains_checkpoints_plots_and_resumes(folders, tmp_path):
    common = ["train-fuser", "--sharer", str(folders / "sharer"), "--receiver", str(folders / "receiver"),
              "--data", str(folders / "data.jsonl"), "--batch", "2", "--hidden", "8", "--blocks", "0",
              "--out", str(tmp_path / "out"), "--sharer-cache", str(tmp_path / "kv"), "--eval-examples", "2",
              "--eval-every", "2", "--checkpoint-every", "2", "--precompute", "--eval-questions", "2", "--json"]
    proc = kvwire(*common, "--steps", "4")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["parameters"] > 0 and summary["eval"]["examples"] == 1
    config, _ = checkpoint.read_config(summary["checkpoint"])
    assert config.kind == "fuser" and config.receiver.name.endswith("receiver")
    assert (tmp_path / "out" / "loss.png").is_file()
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    one_error_line(kvwire(*common, "--steps", "2"), "already holds a training run", "--resume")  # not overwritten

    resumed = kvwire(*common, "--steps", "6", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr and json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == 6
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()
             if "eval" not in json.loads(line)]
    assert steps == [1, 2, 3, 4, 5, 6]


@SLOW
def test_a_fuser_that_does_not_help_is_refused_by_kvwire_fuse(folders, tmp_path):
    """Trained with a learning rate too small to learn anything, the best checkpoint is the untrained
    fuser (the receiver alone): its recorded gain is 0, and kvwire fuse refuses it with the figures."""
    proc = kvwire("train-fuser", "--sharer", str(folders / "sharer"), "--receiver", str(folders / "receiver"),
                  "--data", str(folders / "data.jsonl"), "--batch", "2", "--hidden", "8", "--blocks", "0",
                  "--out", str(tmp_path / "out"), "--sharer-cache", str(tmp_path / "kv"), "--eval-examples", "2",
                  "--eval-questions", "2", "--steps", "2", "--eval-every", "2", "--lr", "1e-9",
                  "--precompute")
    assert proc.returncode == 0, proc.stderr
    fuse = ["fuse", "Which option?", "--sharer", str(folders / "sharer"), "--receiver", str(folders / "receiver"),
            "--projector", str(tmp_path / "out" / "fuser"), "--max-new-tokens", "2", "--hint-tokens", "2"]
    one_error_line(kvwire(*fuse), "does not make the receiver better", "questions +0.0 points", "--allow-worse")
    allowed = kvwire(*fuse, "--allow-worse")
    assert allowed.returncode == 0, allowed.stderr


def test_train_fuser_says_what_is_missing(folders, tmp_path):
    one_error_line(kvwire("train-fuser", "--receiver", str(folders / "receiver"), "--steps", "1"), "--sharer")
    one_error_line(kvwire("train-fuser", "--sharer", str(folders / "sharer"), "--receiver", str(folders / "receiver"),
                          "--data", str(tmp_path / "nothing.jsonl")), "no data file")
    one_error_line(kvwire("train-fuser", "--sharer", str(folders / "sharer"), "--receiver", str(folders / "receiver"),
                          "--data", str(folders / "data.jsonl"), "--out", str(tmp_path / "fresh"), "--resume"),
                   "no checkpoint to resume")  # said before any model is loaded
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00bad")
    one_error_line(kvwire("train-fuser", "--sharer", str(folders / "sharer"), "--receiver", str(folders / "receiver"),
                          "--data", str(tmp_path / "binary.jsonl")), "not UTF-8 text")
    for option, value in (("--lr", "nan"), ("--sharer-temperature", "inf"), ("--seed", str(2**70))):
        refused = kvwire("train-fuser", "--sharer", str(folders / "sharer"), option, value)
        assert refused.returncode == 2 and option in refused.stderr and "Traceback" not in refused.stderr


def test_a_fit_never_empties_a_folder_that_is_not_a_checkpoint(folders, tmp_path):
    """``fit-ridge --out`` at a user's project folder: refused before the fit, the folder untouched."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("important")
    one_error_line(kvwire("fit-ridge", "--sharer", str(folders / "sharer"), "--receiver", str(folders / "receiver"),
                          "--samples", "2", "--chars", "100", "--out", str(project)), "not a kvwire checkpoint")
    assert (project / "README.md").read_text() == "important" and (project / "src").is_dir()


def test_fuser_data_writes_dense_pairs_split_by_module(tmp_path):
    from kvwire.fuse import dense

    proc = kvwire("fuser-data", str(tmp_path / "dense"))
    assert proc.returncode == 0, proc.stderr
    train = stdlib_qa.load(tmp_path / "dense" / "train.jsonl")
    val = stdlib_qa.load(tmp_path / "dense" / "val.jsonl")
    assert set(dense.mix(train)) == set(dense.KINDS) and len(train) > 1000 and len(val) > 100
    assert dense.check_disjoint(train, val)  # whole modules are held out
    assert not {dense.module_of(ex) for ex in train + val} & dense.benchmark_modules()


def test_fuser_data_writes_decontaminated_questions(tmp_path):
    proc = kvwire("fuser-data", str(tmp_path / "data"), "--kind", "questions")
    assert proc.returncode == 0, proc.stderr
    train = stdlib_qa.load(tmp_path / "data" / "train.jsonl")
    val = stdlib_qa.load(tmp_path / "data" / "val.jsonl")
    assert len(train) > 1000 and len(val) > 100
    modules = lambda examples: {ex.subject.rsplit(".", 1)[0] for ex in examples}  # noqa: E731
    assert not modules(train) & modules(val)  # whole modules are held out
    assert not any(ex.subject == "builtins.divmod" for ex in train + val)  # a benchmark item's subject
    none_held = kvwire("fuser-data", str(tmp_path / "data"), "--kind", "questions", "--held-out", "0")
    assert none_held.returncode == 0 and "0 validation" in none_held.stdout
    assert not (tmp_path / "data" / "val.jsonl").exists()  # no empty file train-fuser would refuse
    assert "train-fuser needs held-out modules" in none_held.stderr
    # ... and train-fuser refuses such data before a model loads: a fuser without a recorded gain would be refused
    untrainable = kvwire("train-fuser", "--data", str(tmp_path / "data"), "--sharer", "qwen2.5-coder-0.5b",
                         "--out", str(tmp_path / "fuser"))
    assert untrainable.returncode == 1 and "no validation examples" in untrainable.stderr
    assert "--held-out 0.15" in untrainable.stderr and not (tmp_path / "fuser").exists()


def test_fuser_data_distills_the_training_answers_and_keeps_the_truth_for_validation(tmp_path, tiny_folder):
    from kvwire.fuse import dense

    truth = kvwire("fuser-data", str(tmp_path / "truth"), "--examples", "12")
    proc = kvwire("fuser-data", str(tmp_path / "sharer"), "--examples", "12", "--distill", str(tiny_folder),
                  "--distill-tokens", "4")
    assert truth.returncode == 0 and proc.returncode == 0, proc.stderr
    before = stdlib_qa.load(tmp_path / "truth" / "train.jsonl")
    after = stdlib_qa.load(tmp_path / "sharer" / "train.jsonl")
    info = json.loads((tmp_path / "sharer" / "distill.json").read_text())
    assert len(before) == 12 and info["max_new_tokens"] == 4 and (tmp_path / "sharer" / "distill-cache.jsonl").is_file()
    truth_of = {b.prompt: b.answer for b in before}
    assert {ex.prompt for ex in after} <= set(truth_of)  # the same questions (an empty answer drops one)
    # continuations keep the truth; knowledge answers are the sharer's (a tiny random model's: not the truth)
    assert all(ex.answer == truth_of[ex.prompt] for ex in after if ex.kind not in dense.KNOWLEDGE_KINDS)
    differ = sum(ex.answer != truth_of[ex.prompt] for ex in after if ex.kind in dense.KNOWLEDGE_KINDS)
    assert differ == info["differs_from_truth"] > 0
    assert (tmp_path / "sharer" / "val.jsonl").read_text() == (tmp_path / "truth" / "val.jsonl").read_text()
    refused = kvwire("fuser-data", str(tmp_path / "q"), "--kind", "questions", "--distill", str(tiny_folder))
    assert refused.returncode == 2 and "--distill writes sharer answers to dense examples" in refused.stderr
