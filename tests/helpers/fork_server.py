"""Run scripts for the tests in processes forked from this one, which imported torch, transformers,
PEFT and finetune_trainer.py's modules once: conftest.run_script's default (`make test` starts about
150 processes of the finetune script, and each spent 3-4 s of CPU importing, more than the tiny
run itself).

    python tests/helpers/fork_server.py        # started by conftest, one per pytest process

Reads one JSON request a line on stdin, {"argv": [SCRIPT, ARGS...], "nproc": N, "timeout": s,
"out": folder}, forks N processes with the environment torchrun gives its workers (N > 1; as
tests/helpers/readme_launcher.py does, whose `wait` stops the others when one fails, as torchrun
does), each running SCRIPT as __main__, its stdout and stderr in out/rank<R>.{out,err}; answers
{"rc": the first failing rank's status, 124 after the timeout, or 0}; after the timeout each rank
still running has its stacks in out/rank<R>.stack (py-spy) before it is killed. The environment is this
process's (conftest's script_env): a test that needs another one, and the fault tests (which test
torchrun's own handling of signals and dead ranks), start real processes instead.
"""

import json
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_launcher import assert_single_threaded, fork_child, free_port, make_fork_safe, wait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def preload() -> None:
    """What the scripts import, imported once; nothing here starts a thread (checked after): forking stays safe."""
    import torch  # noqa: F401
    import transformers.models.t5.modeling_t5  # noqa: F401

    try:
        import peft  # noqa: F401
    except ImportError:
        pass
    runpy.run_path(str(ROOT / "scripts" / "finetune_trainer.py"), run_name="fork_server_preload")


def start(argv: list, env: dict, out: Path, rank: int) -> int:
    """Fork one process running `argv` (SCRIPT ARGS...) as __main__; its pid."""

    def body() -> int:
        for fd, name in ((1, f"rank{rank}.out"), (2, f"rank{rank}.err")):
            os.dup2(os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        return 0

    return fork_child(env, body)


def serve(request: dict) -> int:
    out, nproc = Path(request["out"]), request.get("nproc", 1)
    out.mkdir(parents=True, exist_ok=True)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    pids = []
    for rank in range(nproc):
        if nproc > 1:
            env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
                   "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                   "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
        pids.append(start(request["argv"], env, out, rank))
    return wait(pids, request["timeout"], [out / f"rank{r}.stack" for r in range(nproc)])


def main() -> None:
    os.chdir(ROOT)
    make_fork_safe()
    preload()
    assert_single_threaded()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = {"rc": serve(json.loads(line))}
        except Exception as e:  # the request's problem, not the server's
            answer = {"rc": 1, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
