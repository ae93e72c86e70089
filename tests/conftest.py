"""Shared fixtures: a tiny demo data set and model built once per session, offline."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "finetune_trainer.py"

# Nothing in the tests reaches the network, and gloo stays on loopback.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_EVALUATE_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "GLOO_SOCKET_IFNAME": "lo",
}
os.environ.update(OFFLINE_ENV)

TINY_MODEL = dict(vocab_size=300, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)

# Flags for end-to-end runs that take seconds on 2 cores.
TINY_FLAGS = [
    "--task", "translation_en_to_ro",
    "--max_source_length", "32", "--max_target_length", "32",
    "--val_max_target_length", "32", "--test_max_target_length", "32",
    "--learning_rate", "3e-3", "--report_to", "none", "--save_strategy", "no",
    "--logging_steps", "1", "--disable_tqdm", "true", "--seed", "7",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    from trainer_shard.demo import make_demo_data

    return make_demo_data(tmp_path_factory.mktemp("data"), n_train=256, n_val=24, n_test=20, seed=3)


@pytest.fixture(scope="session")
def tiny_model(tiny_data, tmp_path_factory) -> Path:
    from trainer_shard.demo import build_demo_model

    return build_demo_model(tiny_data, tmp_path_factory.mktemp("model"), **TINY_MODEL)


def script_env() -> dict:
    env = dict(os.environ, **OFFLINE_ENV, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    return env


def run_script(args, *, nproc: int = 1, script=SCRIPT, timeout: int = 300, env: dict | None = None,
               fork: bool | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Run a script as `python SCRIPT ARGS` would, or `torchrun --nproc_per_node N` when nproc > 1:
    in processes forked from a warm one (tests/helpers/fork_server.py: torch, transformers and the
    script's modules imported once, not 3-4 s of CPU a process) with the default environment; in
    new processes under the real torchrun with `env`, `fork=False`, for the tests under tests/faults
    (they test torchrun's own handling of signals and dead ranks), or with TRAINER_SHARD_TEST_FORK=0.
    stdout and stderr are the ranks' in order."""
    if fork is None:
        fork = f"tests{os.sep}faults{os.sep}" not in os.environ.get("PYTEST_CURRENT_TEST", "")
    if fork and not env and os.environ.get("TRAINER_SHARD_TEST_FORK", "1") != "0":
        return _forked([str(script), *map(str, args)], nproc, timeout)
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                    "--master_port", str(free_port())]  # fmt: skip
    else:
        launcher = [sys.executable]
    return subprocess.run(
        [*launcher, str(script), *map(str, args)],
        cwd=ROOT,
        env={**script_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_server = None  # this pytest process's fork server


def _forked(argv: list, nproc: int, timeout: int) -> subprocess.CompletedProcess:
    """`argv` run by this pytest process's fork server (started on first use, again if it died)."""
    import json
    import tempfile

    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "fork_server.py")], cwd=ROOT,
                                   env=script_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        while not json.loads(_server.stdout.readline() or '{"ready": false}').get("ready", False):
            if _server.poll() is not None:
                raise RuntimeError("tests/helpers/fork_server.py exited while starting")
    with tempfile.TemporaryDirectory(prefix="forked_") as out:
        _server.stdin.write(json.dumps({"argv": argv, "nproc": nproc, "timeout": timeout, "out": out}) + "\n")
        _server.stdin.flush()
        answer = json.loads(_server.stdout.readline() or '{"rc": 1, "error": "the fork server died"}')
        read = [(Path(out) / f"rank{r}.{kind}") for r in range(nproc) for kind in ("out", "err")]
        text = {p.name: p.read_text(errors="replace") if p.is_file() else "" for p in read}
        stacks = [(Path(out) / f"rank{r}.stack") for r in range(nproc)]
        stacks = {p.stem: p.read_text(errors="replace") for p in stacks if p.is_file()}
    stdout = "".join(text[f"rank{r}.out"] for r in range(nproc))
    stderr = "".join(text[f"rank{r}.err"] for r in range(nproc)) + answer.get("error", "")
    if answer["rc"] == 124:
        raise RanksTimedOut(argv, timeout, output=stdout, stderr=stderr, tails=text, stacks=stacks)
    return subprocess.CompletedProcess(argv, answer["rc"], stdout, stderr)


class RanksTimedOut(subprocess.TimeoutExpired):
    """A forked run past its timeout, its message with what each rank wrote last and, for each rank
    still running then, its stacks (the fork server's py-spy dump before the kill)."""

    def __init__(self, argv, timeout, *, output, stderr, tails: dict, stacks: dict):
        super().__init__(argv, timeout, output=output, stderr=stderr)
        self.tails, self.stacks = tails, stacks

    def __str__(self) -> str:
        parts = [super().__str__()]
        parts += [f"--- {name} (last 3000 characters)\n{body[-3000:]}" for name, body in self.tails.items() if body]
        parts += [f"--- {name}, still running at the timeout\n{body}" for name, body in self.stacks.items()]
        return "\n".join(parts)


def shared_run(name: str, tmp_path_factory, inputs, make) -> Path:
    """The output folder of a reference run that several test files compare against (plain DDP,
    the plain Trainer on one process), made once per `make test` rather than once per file:
    under xdist the workers share the session's base temp folder, and a file lock makes the
    second worker wait for the first's run instead of repeating it. `make(out)` runs it into
    `out`; the key holds a digest of `inputs` (the tiny model and data folders, built by each
    worker with fixed seeds), so a run is only ever reused for the same inputs. Read-only for
    the tests. A run that failed is not recorded: the next caller makes it again."""
    import hashlib
    import shutil

    from filelock import FileLock

    digest = hashlib.sha256()
    for folder in inputs:
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared_runs"
    root.mkdir(exist_ok=True)
    folder = root / f"{name}-{digest.hexdigest()[:16]}"
    with FileLock(str(folder) + ".lock"):
        if not (folder / "done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder / "out")
            (folder / "done").touch()
    return folder / "out"


sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from readme_launcher import free_port  # noqa: E402,F401  (the tests' ports: below the ephemeral range)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


# The longest files first. `make test` runs with --dist loadfile: each file is one unit of work,
# handed out in collection order, so a long file collected last would leave one worker running
# alone at the end. The order follows the slowest tests `--durations` reported in a full run (the
# ZeRO-3 Trainer runs, the longest file since issue 19; the README's commands, whose sandbox is a
# 2-rank demo run; the planner's t5-small `--sharded_ddp auto` run (its measured-peaks test is
# bench/planner_trainer.py now); then the multi-process checkpoint, launcher and
# fault files). Without the ZeRO-3 files here, a fresh-clone run took 15 min 18 s.
HEAVY_FIRST = ["test_zero3_trainer.py", "test_readme_commands.py", "test_planner.py", "test_checkpoint_resume.py",
               "test_rank_faults.py", "test_sharded_trainer.py", "test_end_to_end.py", "test_inference.py",
               "test_launchers.py", "test_offload_trainer.py", "test_multinode_checkpoint.py", "test_interrupt.py",
               "test_disk_faults.py", "test_zero3_optimizer.py", "test_zero3_offload_param.py",
               "test_zero3_offload_param_trainer.py", "test_zero3_offload_param_eval.py", "test_deepspeed_configs.py",
               "test_optimizer_shards.py", "test_zero3_core.py", "test_planner_offload_param.py"]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: the rest as collected
