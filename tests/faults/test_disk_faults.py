"""A full or read-only disk under --output_dir or the offload path: a clear error naming the path
and the bytes, at start where it can be known, else at the save; the partial checkpoint removed,
the earlier ones untouched.

Real filesystems, not mocks: each run gets a small tmpfs in a mount namespace of its own
(`unshare --user --map-root-user --mount`, no privileges needed where user namespaces are on;
skipped with the reason where they are not).
"""

import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_FLAGS, free_port, script_env
from fault_runs import INJECT, flags
from trainer_shard.checkpoint import manifest_problems

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _namespaces_work() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, text=True)  # fmt: skip
    return None if probe.returncode == 0 else f"no user mount namespaces here: {probe.stderr.strip()}"


WHY_NOT = _namespaces_work()
needs_namespaces = pytest.mark.skipif(WHY_NOT is not None, reason=f"a small tmpfs needs a mount namespace: {WHY_NOT}")


def on_tmpfs(mountpoint, size, commands, copy_to=None, read_only=False):
    """Run `commands` (argument lists) one after the other with a tmpfs of `size` mounted at
    `mountpoint`; copy what is left on it to `copy_to` (the mount goes with the namespace).
    Returns [(returncode, stdout + stderr)]."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    log = mountpoint.parent / "logs"
    log.mkdir(exist_ok=True)
    lines = [f"mount -t tmpfs -o size={size}{',ro' if read_only else ''} tmpfs {shlex.quote(str(mountpoint))}"]
    for i, command in enumerate(commands):
        lines.append(f"{shlex.join(map(str, command))} > {log}/{i}.log 2>&1; echo $? > {log}/{i}.rc")
    if copy_to is not None:
        lines.append(f"cp -a {shlex.quote(str(mountpoint))} {shlex.quote(str(copy_to))}")
    subprocess.run(["unshare", "-Urm", "sh", "-c", "\n".join(lines)], cwd=ROOT, env=script_env(), timeout=300, check=True)
    return [(int((log / f"{i}.rc").read_text()), (log / f"{i}.log").read_text()) for i in range(len(commands))]


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            *args]  # fmt: skip


@needs_namespaces
@pytest.mark.parametrize("fault, says, sharding", [
    ("fill_disk", "No space left on device", "zero_dp_2"), ("read_only", "read-only", "zero_dp_2"),
    # ZeRO-3: rank 0 fails while the ranks gather unit after unit for it; the others must not hang
    ("fill_disk", "No space left on device", "zero_dp_3 auto_wrap"),
])  # fmt: skip
def test_a_disk_that_fills_or_turns_read_only_mid_run(tiny_model, tiny_data, tmp_path, fault, says, sharding):
    mnt, after = tmp_path / "mnt", tmp_path / "after"
    out = mnt / "out"
    env = ["env", f"FAULT={fault}", "FAULT_STEP=3", "FAULT_RANK=0", f"FAULT_MOUNT={mnt}"]
    run = flags(tiny_model, tiny_data, out, "--sharded_ddp", sharding)
    [(code, log)] = on_tmpfs(mnt, "8m", [[*env, *torchrun(INJECT, *run)]], copy_to=after)
    assert code != 0
    errors = re.findall(r"finetune_trainer.py: error: (.*?--resume_from_checkpoint latest)", log)  # ranks' lines may run together
    assert len(errors) == 2, f"each rank should stop with the error\n{log[-4000:]}"
    message = errors[0]
    assert "checkpoint-4 was not saved" in message and says in message and str(out) in message, message
    assert f"{out / 'checkpoint-2'} (the last complete checkpoint) is untouched" in message, message
    assert not re.search(r"\[rank\d\]: Traceback", log), "a worker's traceback (torchrun's own is expected)"
    saved = after / "out"
    assert sorted(p.name for p in saved.glob("checkpoint-*")) == ["checkpoint-2"]
    assert manifest_problems(saved / "checkpoint-2") == []
    if fault == "fill_disk":  # the partial files are gone (a read-only disk got none)
        assert not (saved / ".checkpoint-staging").exists()
        assert not list(saved.rglob("*.tmp"))
    print(message)


@needs_namespaces
def test_a_disk_without_room_or_read_only_is_refused_at_start(tiny_model, tiny_data, tmp_path):
    mnt = tmp_path / "mnt"
    one = [sys.executable, str(ROOT / "scripts" / "finetune_trainer.py")]
    base = ["--model_name_or_path", tiny_model, "--data_dir", tiny_data, *TINY_FLAGS, "--do_train", "--max_steps", "2"]
    # no room for a checkpoint (the disk store's lack of room: test_offload.py)
    [(code, log)] = on_tmpfs(mnt, "64k", [[*one, *base, "--output_dir", mnt / "out", "--save_strategy", "steps",
                                           "--save_steps", "1"]])  # fmt: skip
    assert code == 2 and "--output_dir" in log and "are needed for a checkpoint of this run and" in log, log[-3000:]
    [(code2, log2)] = on_tmpfs(mnt, "8m", [[*one, *base, "--output_dir", mnt / "out"]], read_only=True)
    assert code2 == 2 and "read-only" in log2 and "--output_dir" in log2, log2[-3000:]
    for text in (log, log2):
        assert "Traceback" not in text
    print(next(line for line in log.splitlines() if "error:" in line))
    print(next(line for line in log2.splitlines() if "error:" in line))


def test_a_disk_store_that_fails_mid_run_names_the_file(tmp_path):
    """The store's files are reserved at start (posix_fallocate: no ENOSPC later), and Linux
    refuses to remount a disk read-only under files open for writing; an I/O error is still
    possible: here a file descriptor that cannot write, a real OSError from pwritev."""
    import os

    import torch

    from trainer_shard.offload.store import DiskStore, OffloadStoreError

    store = DiskStore({"0.master": 1000}, tmp_path / "nvme")
    path = store.folder / "0.master.f32"
    os.close(store._fds["0.master"])
    store._fds["0.master"] = os.open(path, os.O_RDONLY)
    with pytest.raises(OffloadStoreError, match=r"could not write 400 bytes at byte 40 of .*0\.master\.f32: Bad file"):
        store.write("0.master", 10, torch.ones(100))
    store.close()



SAVE_ON_A_FULL_DISK = """
import errno, os, sys, torch
from safetensors.torch import save_file
from trainer_shard.checkpoint import save_sharded
out = sys.argv[1]
os.makedirs(out)
save_sharded({"w": torch.full((64 * 1024,), 1.0)}, out, 10**9)  # 256 KiB
save_file({"ema": torch.ones(64 * 1024)}, os.path.join(out, "model_ema.safetensors"))  # a user's own, 256 KiB
try:
    save_sharded({"w": torch.full((320 * 1024,), 2.0)}, out, 10**9)  # 1.25 MiB: more than the disk
except OSError as e:
    print("save failed:", e)
    sys.exit(7 if e.errno == errno.ENOSPC else 1)
"""


@needs_namespaces
def test_a_save_on_a_full_disk_keeps_the_previous_model_and_the_users_files(tmp_path):
    """A real 1 MiB tmpfs: the new weights do not fit; the previous model and the user's
    model_ema.safetensors are still there, whole, with no temporary file beside them."""
    from safetensors.torch import load_file

    mnt, after = tmp_path / "mnt", tmp_path / "after"
    [(code, log)] = on_tmpfs(mnt, "1m", [[sys.executable, "-c", SAVE_ON_A_FULL_DISK, mnt / "out"]], copy_to=after)
    assert code == 7 and "No space left on device" in log, log[-3000:]
    out = after / "out"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "model_ema.safetensors"]
    assert load_file(out / "model.safetensors")["w"].eq(1.0).all()
    assert load_file(out / "model_ema.safetensors")["ema"].eq(1.0).all()
