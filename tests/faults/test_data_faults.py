"""Bad data files: each stops the script with exit 2, naming the file, the line and the fix, and
writing nothing; a line far longer than --max_source_length trains, cut, with a warning.

Every fault runs the script's own `run()` in this process (the same code as the command line,
without a process start-up per case); one fault and the long line also run as a user runs them.
"""

import json
import logging
import runpy
import shutil

import pytest

from conftest import SCRIPT, TINY_FLAGS, assert_ok, run_script
from trainer_shard.data import read_split
from trainer_shard.finetune import tokenize_splits


def replace_line(path, number: int, content: bytes) -> None:
    lines = path.read_bytes().split(b"\n")
    lines[number - 1] = content
    path.write_bytes(b"\n".join(lines))


def drop_last_line(path) -> None:
    lines = path.read_bytes().rstrip(b"\n").split(b"\n")
    path.write_bytes(b"\n".join(lines[:-1]) + b"\n")


def add_line(path, content: bytes) -> None:
    path.write_bytes(path.read_bytes() + content + b"\n")


def write_jsonl(path, lines) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


GOOD = json.dumps({"source": "one", "target": "unu"}).encode()

# (name, fault put into a copy of the tiny data set, extra flags, what stderr must say)
FAULTS = [
    ("invalid UTF-8", lambda d: replace_line(d / "train.source", 5, b"caf\xe9 au lait"), [],
     ["train.source' is not valid UTF-8: byte 0xe9 at line 5", "re-encode the file as UTF-8"]),
    ("a target missing", lambda d: drop_last_line(d / "val.target"), [],
     ["val.source' has 24 lines but", "val.target' has 23: line 24 of val.source has no target",
      "each source line needs its target on the same line number"]),
    ("a source missing", lambda d: add_line(d / "val.target", b"extra"), [],
     ["val.target' has 25: line 25 of val.target has no source"]),
    ("empty file", lambda d: (d / "test.source").write_bytes(b""), [],
     ["test.source' is empty; it needs one example per line"]),
    ("missing file", lambda d: (d / "test.target").unlink(), [],
     ["test.target' does not exist; check --data_dir (or the --*_file flags)"]),
    ("JSON lines: bad JSON", lambda d: write_jsonl(d / "train.jsonl", [GOOD, GOOD, b'{"source": "two", "target":']),
     ["--train_file", "{data}/train.jsonl"], ["train.jsonl' line 3 is not valid JSON", "one JSON object a line"]),
    ("JSON lines: wrong keys", lambda d: write_jsonl(d / "train.jsonl", [GOOD, b'{"src": "two", "tgt": "doi"}']),
     ["--train_file", "{data}/train.jsonl"],
     ["train.jsonl' line 2 has keys ['src', 'tgt']; expected {\"source\": ..., \"target\": ...} or "
      '{"translation": {"en": ..., "ro": ...}}']),
    ("JSON lines: no object", lambda d: write_jsonl(d / "train.jsonl", [GOOD, json.dumps("x" * 100_000).encode()]),
     ["--train_file", "{data}/train.jsonl"], ["train.jsonl' line 2 has a JSON string, not an object; expected"]),
    ("JSON lines: a 5,000-digit number", lambda d: write_jsonl(d / "train.jsonl", [b'{"source": ' + b"9" * 5000]),
     ["--train_file", "{data}/train.jsonl"], ["train.jsonl' line 1 holds a number too long or lists nested too deep"]),
    ("JSON lines: deep nesting", lambda d: write_jsonl(d / "train.jsonl", [GOOD, b"[" * 100_000]),
     ["--train_file", "{data}/train.jsonl"], ["train.jsonl' line 2 holds a number too long or lists nested too deep"]),
]  # fmt: skip


def faulty_copy(tiny_data, tmp_path, fault):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    fault(data)
    return data


def script_args(model, data, out, extra):
    return ["--model_name_or_path", str(model), "--data_dir", str(data), "--output_dir", str(out), *TINY_FLAGS,
            "--do_train", "--do_eval", "--do_predict", "--use_cpu",
            *[flag.format(data=data) for flag in extra]]  # fmt: skip


@pytest.fixture(scope="module")
def script():
    return runpy.run_path(str(SCRIPT))


@pytest.fixture
def run_in_process(script):
    """The script's run(), with the logging set-up it makes undone afterwards."""
    import transformers

    handlers, verbosity = logging.root.handlers[:], transformers.logging.get_verbosity()
    levels = {name: logging.getLogger(name).level for name in ("trainer_shard", "finetune_trainer")}
    yield script["run"]
    logging.root.handlers[:] = handlers
    transformers.logging.set_verbosity(verbosity)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("name, fault, extra, expected", FAULTS, ids=[f[0] for f in FAULTS])
def test_bad_data_stops_the_run(run_in_process, tiny_model, tiny_data, tmp_path, capsys, name, fault, extra, expected):
    data, out = faulty_copy(tiny_data, tmp_path, fault), tmp_path / "out"
    assert run_in_process(script_args(tiny_model, data, out, extra)) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("finetune_trainer.py: error: "), stderr
    for fragment in expected:
        assert fragment in stderr, stderr
    assert str(data) in stderr  # the full path, not just the name
    assert "Traceback" not in stderr and len(stderr) < 1000
    assert not out.exists(), "a run stopped by its data wrote to --output_dir"


@pytest.mark.slow
def test_bad_data_from_the_command_line(tiny_model, tiny_data, tmp_path):
    """The exit status and message a user sees, in a process of its own."""
    name, fault, extra, expected = FAULTS[0]
    data, out = faulty_copy(tiny_data, tmp_path, fault), tmp_path / "out"
    proc = run_script(script_args(tiny_model, data, out, extra))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert all(fragment in proc.stderr for fragment in expected), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists()


def test_texts_at_the_limit_are_counted(tiny_model, tmp_path, caplog):
    from transformers import AutoTokenizer

    (tmp_path / "train.source").write_text("one\n" + "two hundred " * 50 + "\nthree\n")
    (tmp_path / "train.target").write_text("unu\ndouă sute\n" + "trei " * 50 + "\n")
    data_args = type("DataArgs", (), {"max_source_length": 8, "max_target_length": 8})()
    with caplog.at_level(logging.WARNING, logger="trainer_shard"):
        dataset = tokenize_splits({"train": read_split(tmp_path, "train")}, AutoTokenizer.from_pretrained(tiny_model),
                                  data_args, prefix="")["train"]  # fmt: skip
    assert dataset.at_limit() == (1, 1) and len(dataset[1]["input_ids"]) == 8
    assert ("1 of 3 train sources reached --max_source_length 8 tokens and 1 targets --max_target_length 8; "
            "longer texts were cut there") in caplog.text  # fmt: skip


def test_nothing_at_the_limit_no_warning(tiny_model, tmp_path, caplog):
    from transformers import AutoTokenizer

    (tmp_path / "val.source").write_text("one\n")
    (tmp_path / "val.target").write_text("unu\n")
    data_args = type("DataArgs", (), {"max_source_length": 8, "val_max_target_length": 8})()
    with caplog.at_level(logging.WARNING, logger="trainer_shard"):
        tokenize_splits({"val": read_split(tmp_path, "val")}, AutoTokenizer.from_pretrained(tiny_model), data_args, "")
    assert "reached" not in caplog.text


@pytest.mark.slow
def test_a_line_far_longer_than_max_source_length_trains(tiny_model, tiny_data, tmp_path):
    data = faulty_copy(tiny_data, tmp_path, lambda d: replace_line(d / "train.source", 1, b"seven " * 33_334))
    out = tmp_path / "out"
    assert len((data / "train.source").read_bytes().split(b"\n")[0]) >= 200_000
    proc = run_script(["--model_name_or_path", tiny_model, "--data_dir", data, "--output_dir", out, *TINY_FLAGS,
                       "--do_train", "--use_cpu", "--max_steps", "2", "--per_device_train_batch_size", "4"])  # fmt: skip
    assert_ok(proc)
    assert "of 256 train sources reached --max_source_length 32 tokens" in proc.stdout + proc.stderr
    assert (out / "train_results.json").is_file()
