"""`accelerate launch --cpu --num_processes 2` runs the job `torchrun --nproc_per_node 2` runs.

accelerate starts a script on CPUs as one plain process (its simple launcher: ACCELERATE_USE_CPU,
MASTER_ADDR and MASTER_PORT, no RANK or WORLD_SIZE; several processes only through mpirun), so
finetune_trainer.py starts the ranks itself with torchrun's launcher, and any other script with
ShardedTrainer stops with an error (trainer_shard/training/guard.py). Pure tests of the detection
first, then both launchers on the same tiny job.
"""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SCRIPT, TINY_FLAGS, assert_ok, free_port, run_script, script_env
from trainer_shard.errors import ArgumentError, DistributedSetupError
from trainer_shard.training import guard

ACCELERATE = Path(sys.executable).with_name("accelerate")
ACCELERATE_ENV = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
LAUNCH = ["launch", "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
          "--dynamo_backend", "no"]  # fmt: skip


def launcher(*argv):
    """The command line of an `accelerate launch` process, as /proc shows it."""
    return [sys.executable, str(ACCELERATE), *argv]


@pytest.mark.parametrize(
    "argv",
    [launcher(*LAUNCH, "s.py", "--x", "1"), [sys.executable, "-m", "accelerate.commands.launch", *LAUNCH[1:], "s.py"],
     launcher("launch", "--cpu", "--num_processes=4", "s.py")],  # fmt: skip
)
def test_accelerate_cpu_launch_is_recognised(argv):
    launch = guard.accelerate_cpu_launch(argv, "s.py", env=ACCELERATE_ENV)
    assert launch is not None and launch.num_processes in (2, 4) and launch.num_machines in (None, 1)


@pytest.mark.parametrize(
    "argv, script, env",
    [
        (launcher(*LAUNCH, "s.py"), "s.py", dict(ACCELERATE_ENV, WORLD_SIZE="2")),  # a rank of a launched group
        (launcher(*LAUNCH, "s.py"), "s.py", {}),  # not accelerate's child
        (launcher(*LAUNCH, "s.py"), "other.py", ACCELERATE_ENV),  # accelerate started another script
        (launcher("launch", "--cpu", "s.py"), "s.py", ACCELERATE_ENV),  # one process asked for
        (launcher("launch", "--cpu", "--num_processes", "2", "--mpirun_hostfile", "h", "s.py"), "s.py",
         ACCELERATE_ENV),  # several processes through mpirun
        (launcher("launch", "--multi_gpu", "--num_processes", "2", "s.py"), "s.py", ACCELERATE_ENV),
        ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "s.py"], "s.py", ACCELERATE_ENV),
        ([], "s.py", ACCELERATE_ENV),  # no /proc
    ],
)
def test_other_launches_are_left_alone(argv, script, env):
    assert guard.accelerate_cpu_launch(argv, script, env=env) is None


def test_a_script_of_ones_own_under_accelerate_cpu_is_refused(monkeypatch):
    """No relaunch outside finetune_trainer.py: the guard names the launchers that work."""
    monkeypatch.setattr(guard, "launcher_argv", lambda: launcher(*LAUNCH, "mine.py"))
    monkeypatch.setattr(sys, "argv", ["mine.py"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key, value in ACCELERATE_ENV.items():
        monkeypatch.setenv(key, value)
    args = SimpleNamespace(bf16=False, fp16=False, mixed_precision="no")
    with pytest.raises(DistributedSetupError, match=r"one process.*torchrun --nproc_per_node 2.*--multi_gpu"):
        guard.check_distributed_setup(args)


@pytest.mark.parametrize("bf16, fp16, launcher_precision, refused", [
    (False, False, "no", False), (True, False, "bf16", False), (False, True, "fp16", False),
    (False, False, "bf16", True), (False, False, "fp16", True),
])  # fmt: skip
def test_accelerate_mixed_precision_must_match_the_flags(bf16, fp16, launcher_precision, refused):
    """TrainingArguments read ACCELERATE_MIXED_PRECISION into `mixed_precision` unless --bf16/--fp16
    is given: autocast over fp32 parameters, which trainer_shard does not manage."""
    args = SimpleNamespace(bf16=bf16, fp16=fp16, mixed_precision=launcher_precision)
    if refused:
        with pytest.raises(ArgumentError, match=f"pass --{launcher_precision} to the script"):
            guard.check_launcher_precision(args)
    else:
        guard.check_launcher_precision(args)


def test_the_readme_rule_runs_accelerate_launch_as_written():
    from test_readme_commands import parse

    text = ".venv/bin/accelerate launch --cpu --num_processes 2 scripts/finetune_trainer.py a.json --max_steps 300"
    command = parse("x", text, text.split())
    assert (command.kind, command.nproc, command.problem) == ("accelerate", 1, "")
    assert command.argv[:6] == ["launch", "--cpu", "--num_processes", "2", "scripts/finetune_trainer.py", "a.json"]
    assert command.argv[6:8] == ["--max_steps", "3"]  # DEMO SCALE on the script's arguments
    assert "no rule for accelerate launch's --config_file" in parse("x", "a", [".venv/bin/accelerate", "launch",
                                                                             "--config_file", "c", "s.py"]).problem


def checkpoint_files(out: Path) -> list:
    [checkpoint] = out.glob("checkpoint-*")
    return sorted(p.relative_to(out).as_posix() for p in checkpoint.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.multiproc
def test_accelerate_launch_cpu_trains_as_torchrun_does(tiny_model, tiny_data, tmp_path):
    """Same world size, sharded optimizer shards per rank, checkpoint files and final weights."""
    def flags(out):
        return ["--model_name_or_path", tiny_model, "--data_dir", tiny_data, "--output_dir", out, *TINY_FLAGS,
                "--do_train", "--max_steps", "4", "--per_device_train_batch_size", "8", "--sharded_ddp", "zero_dp_2",
                "--save_strategy", "steps", "--save_steps", "4", "--log_level", "info"]  # fmt: skip

    torchrun = run_script(flags(tmp_path / "torchrun"), nproc=2, timeout=120)
    assert_ok(torchrun)
    port = str(free_port())
    accelerate = subprocess.run(
        [str(ACCELERATE), *LAUNCH, "--main_process_port", port, str(SCRIPT), *map(str, flags(tmp_path / "acc"))],
        cwd=ROOT, env=dict(script_env(), HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf")),  # no user config
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_ok(accelerate)

    for proc in (torchrun, accelerate):
        assert "process rank 0 of 2, device cpu" in proc.stdout, proc.stdout[-3000:]
    assert checkpoint_files(tmp_path / "acc") == checkpoint_files(tmp_path / "torchrun")
    shards = [p.name for p in (tmp_path / "acc" / "checkpoint-4" / "optimizer_shards").glob("rank-*")]
    assert sorted(shards) == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    ours = load_file(tmp_path / "acc" / "model.safetensors")
    theirs = load_file(tmp_path / "torchrun" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(t.dtype == torch.float32 for t in ours.values())
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)
