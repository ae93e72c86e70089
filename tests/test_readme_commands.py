"""Every command the READMEs show runs, as written, on the demo's model and data: a shipped example
cannot break unnoticed.

The ```bash blocks of README.md and configs/README.md are read when the tests are collected, so a
new example is picked up by itself; each command is one test (README.md:LINE). They run in order
in a sandbox folder laid out like the repository after `make demo`: scripts/ and configs/ are
the repository's, data/demo_en_ro and data/demo_t5 are the session's tiny data and model
(conftest.py), output/demo is what the demo's own command writes there, and every output/ path
lies in the sandbox. Each command is run as written, with these rules, said again in each test's
failure or skip message:

- DEMO SCALE: step counts are divided by 100 (`--max_steps`, `--save_steps`, `--eval_steps`,
  `--logging_steps`, `checkpoint-N` paths, rounded up), so checkpoints and resumes keep their
  order; a fine-tuning run without `--max_steps` gets `--max_steps 2`; evaluation and prediction
  take 4 examples, greedy, 8 tokens; generate.py 8 tokens; make-demo-data 200 pairs.
- A process per command, forked from one that imported torch and transformers once
  (tests/helpers/readme_launcher.py): `python SCRIPT` runs SCRIPT, `torchrun --nproc_per_node N`
  starts N ranks with torchrun's environment, `trainer-shard` runs its command; `accelerate launch`
  runs the real accelerate CLI (the script's arguments at DEMO SCALE) on a free --main_process_port.
- SKIPPED, visibly: `make` targets (they install, or run this suite inside itself; `make demo`'s
  command is the sandbox's setup); commands that name CUDA, on a machine without a GPU. A command
  of a kind not listed here fails its test, asking for a rule: nothing is left out silently.

The whole README costs about 22 s on 2 idle cores (measured: 5 s of imports in the launcher, then
0.2 to 2 s a command, 5.5 s for `--sharded_ddp auto`, whose memory probe is a process of its own),
and the `accelerate launch` example about 15 s more: it starts cold, through the real CLI.
"""

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from conftest import ROOT, script_env

READMES = ["README.md", "configs/README.md"]
LAUNCHER = ROOT / "tests" / "helpers" / "readme_launcher.py"
PROGRAMS = {".venv/bin/python": "python", ".venv/bin/torchrun": "torchrun", ".venv/bin/trainer-shard": "trainer-shard",
            ".venv/bin/accelerate": "accelerate"}  # fmt: skip
ACCELERATE_FLAGS = {"--cpu": 0, "--num_processes": 1, "--num_machines": 1, "--mixed_precision": 1,
                    "--dynamo_backend": 1, "--main_process_port": 1}  # flag: how many values follow it
STEP_FLAGS = ("--max_steps", "--save_steps", "--eval_steps", "--logging_steps")
FINETUNE_SHORT = ["--n_val", "4", "--n_test", "4", "--eval_beams", "1", "--val_max_target_length", "8",
                  "--test_max_target_length", "8"]  # fmt: skip
SHORTER = {"scripts/generate.py": ["--max_length", "8"], "make-demo-data": ["--n_train", "200", "--n_val", "10",
                                                                           "--n_test", "10"]}  # fmt: skip
MAKE_RULE = ("`make` targets are not run: `make test` would run this suite inside itself and the others install; "
             "`make demo`'s command (configs/demo.json on 2 ranks) is this sandbox's setup")  # fmt: skip
GPU_RULE = "names CUDA, and this machine has no GPU"


def demo_recipe() -> str:
    """The command of the Makefile's `demo` target: it writes output/demo, the model the README's
    later examples use (run first, at DEMO SCALE)."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1).strip()
    assert "\n" not in recipe, f"the Makefile's demo recipe is one command, not {recipe!r}"
    return recipe.replace("$(VENV)", ".venv")


DEMO = demo_recipe()


@dataclass
class Command:
    where: str  # README.md:LINE
    text: str  # as the README writes it
    kind: str = ""  # python | torchrun | trainer-shard | write; "" with `skip` or `problem`
    argv: list = field(default_factory=list)
    nproc: int = 1
    stdin: str | None = None
    path: str = ""  # write: the file
    write: str = ""  # write: its text
    skip: str = ""  # why it is not run
    problem: str = ""  # why it cannot be run: the test fails

    @property
    def id(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.where)


def bash_commands(readme: str) -> list:
    """Every command of the ```bash blocks of `readme`, continuation lines joined, comments removed."""
    text = (ROOT / readme).read_text()
    commands = []
    for block in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S):
        line = text[: block.start(1)].count("\n") + 1
        for offset, raw in _logical_lines(block.group(1)):
            tokens = shlex.split(raw, comments=True)
            if tokens:
                commands.append(parse(f"{readme}:{line + offset}", raw.strip(), tokens))
    return commands


def _logical_lines(block: str):
    start, pending = 0, ""
    for i, line in enumerate(block.split("\n")):
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def parse(where: str, text: str, tokens: list) -> Command:
    command = Command(where, text)
    if tokens[0] == "make":
        command.skip = MAKE_RULE
        return command
    if "cuda" in text.lower() and not torch.cuda.is_available():
        command.skip = GPU_RULE
        return command
    if "|" in tokens:
        left, tokens = tokens[: tokens.index("|")], tokens[tokens.index("|") + 1 :]
        if left[0] != "echo" or len(left) != 2:
            command.problem = f"a pipe from {left[0]!r}: only `echo TEXT | COMMAND` has a rule"
            return command
        command.stdin = left[1] + "\n"
    if ">" in tokens:
        if tokens[0] != "echo" or len(tokens) != 4 or tokens[2] != ">":
            command.problem = "a redirection other than `echo TEXT > FILE`"
            return command
        command.kind, command.path, command.write = "write", tokens[3], tokens[1] + "\n"
        return command
    program = PROGRAMS.get(tokens[0])
    if program is None:
        command.problem = f"no rule to run {tokens[0]!r} (known: {', '.join(PROGRAMS)}, make, echo)"
        return command
    args = tokens[1:]
    if program == "torchrun":
        args = _torchrun_args(command, args)
        if command.problem:
            return command
    if program == "accelerate":
        launcher, args = _accelerate_args(command, args)
        if command.problem:
            return command
        command.kind, command.argv = program, ["launch", *launcher, *demo_scale("python", args)]
        return command
    command.kind, command.argv = program, demo_scale(program, args)
    return command


def _accelerate_args(command: Command, args: list) -> tuple:
    """`accelerate launch`'s own flags (those in ACCELERATE_FLAGS), and the script with its arguments."""
    if args[:1] != ["launch"]:
        command.problem = f"no rule for accelerate's {args[0] if args else 'no command'!r}"
        return [], []
    launcher, args = [], args[1:]
    while args and args[0].startswith("--"):
        if args[0] not in ACCELERATE_FLAGS:
            command.problem = f"no rule for accelerate launch's {args[0]}"
            return [], []
        n = 1 + ACCELERATE_FLAGS[args[0]]
        launcher, args = launcher + args[:n], args[n:]
    return launcher, args


def _torchrun_args(command: Command, args: list) -> list:
    """The script and its arguments; --nproc_per_node into `nproc` (--standalone: one node anyway)."""
    while args and args[0].startswith("--"):
        if args[0] == "--standalone":
            args = args[1:]
        elif args[0] == "--nproc_per_node" and len(args) > 1:
            command.nproc, args = int(args[1]), args[2:]
        else:
            command.problem = f"no rule for torchrun's {args[0]}"
            return []
    return args


def demo_scale(program: str, args: list) -> list:
    """DEMO SCALE (see the module docstring)."""
    out = []
    for i, arg in enumerate(args):
        if i and args[i - 1] in STEP_FLAGS:
            arg = str(math.ceil(int(arg) / 100))
        out.append(re.sub(r"checkpoint-(\d+)", lambda m: f"checkpoint-{math.ceil(int(m.group(1)) / 100)}", arg))
    name = out[0] if out else ""
    if name == "scripts/finetune_trainer.py":
        out += FINETUNE_SHORT + ([] if "--max_steps" in out else ["--max_steps", "2"])
    return out + SHORTER.get(name, [])


ALL = [c for readme in READMES for c in bash_commands(readme)]


@pytest.fixture(scope="module")
def readme_run(tiny_model, tiny_data, tmp_path_factory):
    """Every runnable command, in order, in one sandbox: {id: (rc, log text, seconds)}."""
    sandbox = tmp_path_factory.mktemp("readme")
    for name in ("scripts", "configs"):
        (sandbox / name).symlink_to(ROOT / name)
    shutil.copytree(tiny_data, sandbox / "data" / "demo_en_ro")
    shutil.copytree(tiny_model, sandbox / "data" / "demo_t5")
    demo = parse("Makefile:demo", DEMO, shlex.split(DEMO))
    runnable = [demo, *(c for c in ALL if c.kind)]
    plan = {"timeout": 240, "results": str(sandbox / "results.json"),
            "commands": [{"id": c.id, "kind": c.kind, "argv": c.argv, "nproc": c.nproc, "stdin": c.stdin,
                          "path": c.path, "text": c.write} for c in runnable]}  # fmt: skip
    (sandbox / "plan.json").write_text(json.dumps(plan))
    proc = subprocess.run([sys.executable, str(LAUNCHER), "plan.json"], cwd=sandbox, env=script_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1200)  # fmt: skip
    results = json.loads((sandbox / "results.json").read_text()) if (sandbox / "results.json").is_file() else []
    if proc.returncode != 0 or len(results) != len(runnable):
        pytest.fail(f"the launcher stopped (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = {}
    for result in results:
        logs = sorted((sandbox / "logs").glob(f"{result['id']}.rank*.log"))
        logs += sorted((sandbox / "logs").glob(f"{result['id']}.rank*.stack"))  # a rank's stacks at the timeout
        out[result["id"]] = (result["rc"], "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs),
                             result["seconds"])  # fmt: skip
    demo_rc, demo_log, _ = out[demo.id]
    assert demo_rc == 0, f"the demo's own command ({DEMO}) failed, so the README's examples cannot run:\n{demo_log}"
    return out


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("command", ALL, ids=[c.id for c in ALL])
def test_readme_command_runs(command, request):
    if command.skip:
        pytest.skip(f"{command.where}: {command.text!r}: {command.skip}")
    assert not command.problem, (
        f"{command.where}: {command.text!r}: {command.problem}. Teach tests/test_readme_commands.py to run it, or "
        "give it an explicit skip rule there"
    )
    rc, log, seconds = request.getfixturevalue("readme_run")[command.id]
    assert rc == 0, f"{command.where}: {command.text!r} run as {command.kind} {shlex.join(command.argv)} exit {rc} " \
                    f"after {seconds} s:\n{log}"  # fmt: skip


def test_the_readme_commands_are_found():
    """The parser sees the examples: a change of fence or launcher would otherwise empty the list."""
    assert {"python", "torchrun", "trainer-shard"} <= {c.kind for c in ALL}
    assert not [c for c in ALL if c.problem], [(c.where, c.problem) for c in ALL if c.problem]


def test_demo_scale_keeps_checkpoints_and_resumes_in_step():
    def parsed(text):
        return parse("x", text, shlex.split(text, comments=True))

    block = (".venv/bin/torchrun --standalone --nproc_per_node 2 scripts/finetune_trainer.py a.json \\\n"
             "    --save_steps 100 --max_steps 250 --save_on_interrupt  # a comment\n")  # fmt: skip
    [text] = [text for _, text in _logical_lines(block) if text.strip()]
    train = parsed(text)
    assert (train.kind, train.nproc) == ("torchrun", 2)
    assert train.argv[:6] == ["scripts/finetune_trainer.py", "a.json", "--save_steps", "1", "--max_steps", "3"]
    assert parsed(".venv/bin/python scripts/finetune_trainer.py a.json").argv[-2:] == ["--max_steps", "2"]
    assert parsed(".venv/bin/trainer-shard consolidate out/checkpoint-300 plain").argv[1] == "out/checkpoint-3"
    piped = parsed('echo "one two" | .venv/bin/python scripts/generate.py --model_name_or_path m')
    assert (piped.kind, piped.stdin, piped.argv[-2:]) == ("python", "one two\n", ["--max_length", "8"])
    assert parsed("make demo").skip == MAKE_RULE
    assert "no rule to run 'docker'" in parsed("docker run x").problem
    assert "no rule for torchrun's --nnodes" in parsed(".venv/bin/torchrun --nnodes 2 s.py").problem


def test_readme_python_blocks_name_what_the_package_exports():
    """The ```python blocks are fragments (they use a model and data of the reader's), so they are
    not run; each one parses, and every name they import from trainer_shard exists."""
    import ast
    import importlib

    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    assert blocks
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainer_shard":
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"README.md imports {missing} from {node.module}, which has no such name"
