"""Run a list of shell commands from the README in order, each in a fresh process forked from this
one, which has imported torch, transformers and the scripts once (about 6 s on 2 cores, where a
whole run of the demo's tiny model takes 1 to 2 s): tests/test_readme_commands.py.

    cd SANDBOX && python tests/helpers/readme_launcher.py PLAN.json

PLAN.json: {"commands": [{"id", "kind", "argv", "nproc", "stdin", "path", "text"}], "timeout": s,
"results": path}. Kinds:

- "python": `python SCRIPT ARGS...`: one process runs SCRIPT as __main__ with sys.argv = argv;
- "torchrun": `torchrun --nproc_per_node N SCRIPT ARGS...`: N processes with the environment
  torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
  MASTER_ADDR, MASTER_PORT; rank 0 hosts the store); as torchrun does, the first rank to fail
  stops the others. (torchrun itself is run by tests/test_end_to_end.py and the fault tests.)
- "trainer-shard": `trainer-shard ARGS...`: trainer_shard.cli.main(argv);
- "accelerate": `accelerate launch FLAGS SCRIPT ARGS...`: the real accelerate CLI, exec'd in the
  forked process (it starts the script itself), with a free --main_process_port unless one is given;
- "write": `echo TEXT > PATH`.

"stdin" is what the command reads on its standard input (`echo TEXT | ...`). Each process's
output goes to `logs/<id>.rank<R>.log`; results: [{"id", "rc", "seconds"}], rc the first failing
rank's exit status (or 124 after `timeout` seconds, the command killed).
"""

import json
import os
import random
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

# What keeps a warm process single-threaded, so that the processes forked from it inherit no lock a
# thread of its held: numpy's OpenBLAS starts a thread server for more than one thread, and
# pyarrow's jemalloc (imported with `datasets`) a background purging thread.
FORK_SAFE_ENV = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}


def make_fork_safe() -> None:
    """Before the warm process imports anything: the environment that starts no thread."""
    os.environ.update(FORK_SAFE_ENV)


def assert_single_threaded() -> None:
    """After the imports: a warm process with a second thread would fork children that can deadlock
    on what that thread held (Linux, where /proc lists a process's threads)."""
    tasks = Path("/proc/self/task")
    if tasks.is_dir() and len(names := [(t / "comm").read_text().strip() for t in tasks.iterdir()]) > 1:
        raise RuntimeError(f"the warm process runs {len(names)} threads ({', '.join(sorted(names))}) before forking: "
                           "find what started them and stop it (FORK_SAFE_ENV)")  # fmt: skip


def preload(plan: dict) -> None:
    """Import what the commands will import, so that each forked process starts warm. Nothing
    here starts a thread or a process group: forking stays safe."""
    import torch  # noqa: F401
    import transformers.models.t5.modeling_t5  # noqa: F401

    from trainer_shard import cli

    for module_name, _, _ in cli.COMMANDS.values():
        __import__(module_name)
    for script in sorted({c["argv"][0] for c in plan["commands"] if c["kind"] in ("python", "torchrun")}):
        runpy.run_path(script, run_name="readme_preload")  # its imports and definitions, not its main


def free_port() -> int:
    """A free TCP port for rank 0's store, below the kernel's ephemeral range (32768 and up on
    Linux), in a range of this xdist worker's own. A port from bind(0) is an ephemeral one that the
    next outgoing connection of any process (gloo's, another worker's store client) may take between
    this check and rank 0's bind, and another worker's bind(0) may return it too: a rank of one job
    then joins the other's store."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = 20000 + 1500 * (int(worker) % 8 if worker.isdigit() else 0)
    for _ in range(100):
        port = random.randrange(low, low + 1500)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + 1499}")


def start(command: dict, rank: int, env: dict, log: Path) -> int:
    """Fork one process that runs `command` and exits with its status; returns its pid."""

    def body() -> int:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        read, write = os.pipe()
        os.write(write, (command.get("stdin") or "").encode())
        os.close(write)
        os.dup2(read, 0)
        return run(command)

    return fork_child(env, body)


def fork_child(env: dict, body) -> int:
    """Fork a process of its own group (a timeout kills what it started too), `env` added to its
    environment, that runs `body()` and exits with its status (`exit_child`); returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid

    def run_body() -> int:
        os.setpgid(0, 0)
        os.environ.update(env)
        return body()

    exit_child(run_body)


def exit_child(body) -> None:
    """In a forked process: run `body()` and end the process with its status as a normal exit
    would (SystemExit's code, 1 after an exception, the atexit finalizers run), never returning."""
    code = 1
    try:
        code = body()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # the finalizers a normal exit runs (stores, loggers)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run(command: dict) -> int:
    if command["kind"] == "trainer-shard":
        from trainer_shard import cli

        return cli.main(command["argv"])
    if command["kind"] == "accelerate":
        argv = list(command["argv"])
        if "--main_process_port" not in argv:
            argv[1:1] = ["--main_process_port", str(free_port())]
        accelerate = str(Path(sys.executable).with_name("accelerate"))
        os.execv(sys.executable, [sys.executable, accelerate, *argv])
    sys.argv = list(command["argv"])
    runpy.run_path(command["argv"][0], run_name="__main__")
    return 0


def wait(pids: list, timeout: float, stacks: list | None = None) -> int:
    """The first non-zero status among `pids` (the others then stopped, as torchrun stops them), or 0.
    After the timeout, each process still running has its Python and native stacks written to the
    matching path of `stacks` (py-spy, where installed) before it is killed."""
    deadline, status, alive = time.monotonic() + timeout, 0, set(pids)
    while alive:
        for pid in list(alive):
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                code = os.waitstatus_to_exitcode(raw)
                if code != 0 and status == 0:
                    status = code if code > 0 else 128 - code
                    stop(alive)
        if alive and time.monotonic() > deadline:
            status = 124
            for pid, path in zip(pids, stacks or []):
                if pid in alive:
                    dump_stacks(pid, path)
            stop(alive, signal.SIGKILL)
        time.sleep(0.05)
    return status


def dump_stacks(pid: int, path: Path) -> None:
    """`pid`'s threads' stacks into `path`: what a hung rank was waiting on."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        Path(path).write_text("(py-spy is not installed: no stacks)\n")
        return
    try:
        dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
        Path(path).write_text(dump.stdout + dump.stderr)
    except (OSError, subprocess.TimeoutExpired) as e:
        Path(path).write_text(f"py-spy dump failed: {e}\n")


def stop(pids, sig=signal.SIGTERM) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    make_fork_safe()
    preload(plan)
    assert_single_threaded()
    logs = Path("logs")
    logs.mkdir(exist_ok=True)
    results = []
    for command in plan["commands"]:
        started = time.monotonic()
        if command["kind"] == "write":
            Path(command["path"]).parent.mkdir(parents=True, exist_ok=True)
            Path(command["path"]).write_text(command["text"])
            rc = 0
        else:
            nproc = command.get("nproc", 1)
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            pids = []
            for rank in range(nproc):
                if command["kind"] == "torchrun":
                    env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                           "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc)}  # fmt: skip
                pids.append(start(command, rank, env, logs / f"{command['id']}.rank{rank}.log"))
            rc = wait(pids, plan["timeout"], [logs / f"{command['id']}.rank{r}.stack" for r in range(nproc)])
        results.append({"id": command["id"], "rc": rc, "seconds": round(time.monotonic() - started, 2)})
        Path(plan["results"]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
