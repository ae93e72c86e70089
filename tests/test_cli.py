"""The `trainer-shard` command."""

import subprocess
import sys
from pathlib import Path

import pytest

from trainer_shard.cli import main


def test_usage_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "make-demo-data" in capsys.readouterr().out
    assert main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err
    assert main([]) == 2


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_make_demo_data_through_the_console_script(tmp_path):
    exe = Path(sys.executable).with_name("trainer-shard")  # installed beside the venv's python
    proc = subprocess.run(
        [exe, "make-demo-data", "--out_dir", str(tmp_path), "--n_train", "5", "--n_val", "2", "--n_test", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "train.source").read_text(encoding="utf-8").splitlines()) == 5
