"""The offload stores: what is written is read back, files removed at close, clear failures; one
store per folder at a time, and what a killed one left cleaned up by the next."""

import logging
import multiprocessing
import os
import re
import socket

import pytest
import torch

from trainer_shard.offload.store import CpuStore, DiskStore, OffloadStoreError, check_disk_store


def test_disk_store_reads_what_it_wrote_and_removes_its_files(tmp_path):
    store = DiskStore({"0.master": 10_007, "1.master": 5}, tmp_path / "store", rank=1)
    data = torch.randn(10_007)
    store.write("0.master", 0, data)
    store.write("1.master", 2, torch.ones(3))
    assert torch.equal(store.read("0.master", 0, torch.empty(10_007)), data)
    assert torch.equal(store.read("0.master", 5000, torch.empty(7)), data[5000:5007])
    assert torch.equal(store.read("1.master", 0, torch.empty(5)), torch.tensor([0.0, 0, 1, 1, 1]))
    assert sorted(p.name for p in (tmp_path / "store" / "rank1").iterdir()) == [".lock", "0.master.f32", "1.master.f32"]
    store.close()
    assert not (tmp_path / "store").exists()  # files and the folder it made are gone


def test_disk_store_refuses_what_does_not_fit(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    with pytest.raises(OffloadStoreError, match=r"needs [\d,]+ bytes in .* but only [\d,]+ are free"):
        DiskStore({"master": free}, tmp_path / "store")
    assert not (tmp_path / "store").exists()  # nothing created


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_disk_store_refuses_an_unwritable_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OffloadStoreError, match="not writable|cannot create"):
        DiskStore({"master": 10}, locked / "store")


def test_disk_store_names_a_path_it_cannot_create(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OffloadStoreError, match="cannot create the disk store folder .*file/x/rank0"):
        DiskStore({"master": 10}, blocker / "x")


def test_the_errors_name_the_optimizer_store_and_its_key(tmp_path, monkeypatch):
    """The optimizer's store is the default role (ZeRO-3's parameter store words its own: test_param_store.py)."""
    from collections import namedtuple

    from trainer_shard.offload import store as store_module

    monkeypatch.setattr(store_module, "is_writable", lambda path: False)  # as root, chmod would not do
    with pytest.raises(OffloadStoreError) as raised:
        DiskStore({"master": 10}, tmp_path / "nvme")
    assert str(raised.value) == (f"the disk store folder '{tmp_path}/nvme/rank0' is not writable; set "
                                 "zero_optimization.offload_optimizer.nvme_path to a writable folder")  # fmt: skip
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(__import__("shutil"), "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(OffloadStoreError) as raised:
        check_disk_store(tmp_path / "other", 0, 4000)
    assert str(raised.value) == (f"the disk store needs 4,000 bytes in '{tmp_path}/other/rank0' but only 100 are free: "
                                 "its master weights and optimizer state do not fit; free some space or point "
                                 "nvme_path to a larger disk")  # fmt: skip


def test_close_removes_the_folders_it_made_and_only_those(tmp_path):
    (tmp_path / "mine").mkdir()
    store = DiskStore({"0.master": 10}, tmp_path / "mine" / "a" / "b", rank=3)
    store.close()
    assert os.listdir(tmp_path) == ["mine"] and os.listdir(tmp_path / "mine") == []  # a/ and b/ made, gone
    (tmp_path / "mine" / "a").mkdir()
    store = DiskStore({"0.master": 10}, tmp_path / "mine" / "a" / "b")
    (tmp_path / "mine" / "a" / "b" / "notes.txt").write_text("a file of the user's in a folder the store made")
    store.close()
    assert sorted(p.name for p in (tmp_path / "mine" / "a").rglob("*") if p.name != ".made-by-trainer_shard") == [
        "b", "notes.txt"]  # b/ stays while the user's file is in it (still marked as a store's)  # fmt: skip
    (tmp_path / "mine" / "a" / "b" / "notes.txt").unlink()
    DiskStore({"0.master": 10}, tmp_path / "mine" / "a" / "b").close()
    assert os.listdir(tmp_path / "mine" / "a") == []  # b/ gone now, a/ (the user's) kept


# ---- one store per folder: a lock per rank's folder (issue 17, item 1) --------------------------


def _hold(folder, ready, release):
    """A second process's store: open, written, held until `release` (or until killed)."""
    store = DiskStore({"0.master": 1000, "0.exp_avg": 1000}, folder)
    store.write("0.master", 0, torch.arange(1000.0))
    ready.set()
    release.wait(60)
    store.close()


@pytest.fixture
def other_process():
    """Start a forked process holding a store in a folder; it closes it when told."""
    ctx = multiprocessing.get_context("fork")
    started = []

    def start(folder):
        ready, release = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_hold, args=(folder, ready, release), daemon=True)
        proc.start()
        assert ready.wait(30), "the other process did not open its store"
        started.append(proc)
        return proc, release

    yield start
    for proc in started:
        proc.kill()
        proc.join()


def test_a_second_run_on_a_store_in_use_is_refused_naming_the_first(tmp_path, other_process):
    proc, release = other_process(tmp_path / "nvme")
    master = tmp_path / "nvme" / "rank0" / "0.master.f32"
    written = master.read_bytes()
    says = rf"'{tmp_path}/nvme/rank0' is in use by another run: process {proc.pid} on host {socket.gethostname()} "
    with pytest.raises(OffloadStoreError, match=says + r"holds its lock\. .*another nvme_path.* or wait for that run"):
        DiskStore({"0.master": 1000}, tmp_path / "nvme")
    with pytest.raises(OffloadStoreError, match=says):
        check_disk_store(tmp_path / "nvme", 0, 0, in_use=True)  # what a run checks at start (training/plan.py)
    assert master.read_bytes() == written  # refused before writing anything: the first run's weights intact
    release.set()
    proc.join(30)
    assert proc.exitcode == 0 and not (tmp_path / "nvme").exists()
    store = DiskStore({"0.master": 1000}, tmp_path / "nvme")  # free again once the first has closed
    store.close()
    assert not (tmp_path / "nvme").exists()


def test_a_second_store_of_the_same_process_is_refused_until_the_first_is_gone(tmp_path):
    first = DiskStore({"0.master": 10}, tmp_path / "nvme")
    with pytest.raises(OffloadStoreError, match=rf"in use by another store of this process \(pid {os.getpid()}\)"):
        DiskStore({"0.master": 10}, tmp_path / "nvme")
    first.close()
    second = DiskStore({"0.master": 10}, tmp_path / "nvme")
    second.cycle = second  # dropped without close(), in a reference cycle: only the garbage collector frees it
    del second
    third = DiskStore({"0.master": 10}, tmp_path / "nvme")  # collected on the way: its finalizer freed the folder
    third.close()
    assert not (tmp_path / "nvme").exists()


# ---- leftovers (issue 17, item 3) ----------------------------------------------------------------


def test_a_store_left_by_sigkill_is_cleaned_up_by_the_next_one_which_says_so(tmp_path, other_process, caplog):
    proc, _ = other_process(tmp_path / "nvme")
    proc.kill()  # SIGKILL: no handler, no finalizer runs
    proc.join(30)
    rank0 = tmp_path / "nvme" / "rank0"
    assert sorted(p.name for p in rank0.glob("*.f32")) == ["0.exp_avg.f32", "0.master.f32"]  # left behind
    with caplog.at_level(logging.WARNING, logger="trainer_shard.offload.store"):
        store = DiskStore({"0.master": 10}, tmp_path / "nvme")
    assert sorted(p.name for p in rank0.glob("*.f32")) == ["0.master.f32"]  # the killed run's moments are gone
    assert store.read("0.master", 0, torch.empty(10)).eq(0).all()  # nothing of its weights either
    said = caplog.text
    assert re.search(rf"removed a leftover disk store in {rank0}: 7.81 KiB freed \(2 files left by process "
                     rf"{proc.pid} on host {re.escape(socket.gethostname())},", said), said  # fmt: skip
    store.close()
    assert not (tmp_path / "nvme").exists()


def test_a_file_that_cannot_be_deleted_is_reported(tmp_path, monkeypatch, caplog):
    store = DiskStore({"0.master": 10, "0.exp_avg": 10}, tmp_path / "nvme")
    real = os.unlink

    def unlink(path, *args, **kwargs):
        if str(path).endswith("exp_avg.f32"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with caplog.at_level(logging.WARNING, logger="trainer_shard.offload.store"):
        store.close()
    left = tmp_path / "nvme" / "rank0" / "0.exp_avg.f32"
    assert left.exists() and not (tmp_path / "nvme" / "rank0" / "0.master.f32").exists()
    assert f"could not delete the disk store file {left} (40 bytes): Permission denied; delete it by hand" in caplog.text


# ---- what is not the store's stays untouched (issue 31, item 3) ---------------------------------


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("a file of the user's")
    rank0 = tmp_path / "shared" / "rank0"
    rank0.mkdir(parents=True)
    (rank0 / ".lock").symlink_to(victim)  # planted by another user of a shared folder
    says = rf"the lock file '{rank0}/.lock' of the disk store is a symbolic link"
    with pytest.raises(OffloadStoreError, match=says):
        DiskStore({"0.master": 10}, tmp_path / "shared")
    assert victim.read_text() == "a file of the user's" and (rank0 / ".lock").is_symlink()
    assert sorted(p.name for p in rank0.iterdir()) == [".lock"]  # nothing made


def test_a_symlinked_rank_folder_is_refused_and_what_it_points_to_untouched(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "0.master.f32").write_bytes(b"user data")
    (target / ".lock").write_text("1 host\n")  # even with what looks like a killed store's lock
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "rank0").symlink_to(target)
    says = rf"the disk store folder '{tmp_path}/shared/rank0' is a symbolic link"
    with pytest.raises(OffloadStoreError, match=says):
        DiskStore({"0.master": 10}, tmp_path / "shared")
    with pytest.raises(OffloadStoreError, match=says):
        check_disk_store(tmp_path / "shared", 0, 0, in_use=True)
    assert (target / "0.master.f32").read_bytes() == b"user data" and (target / ".lock").read_text() == "1 host\n"
    assert sorted(p.name for p in target.iterdir()) == [".lock", "0.master.f32"]


def test_files_like_a_stores_that_no_lock_names_are_refused_and_kept(tmp_path):
    rank0 = tmp_path / "nvme" / "rank0"
    rank0.mkdir(parents=True)
    for name in ("weights.f32", "0.master.f32", "emb.bf16"):
        (rank0 / name).write_bytes(b"the user's")
    with pytest.raises(OffloadStoreError, match=rf"the disk store folder '{rank0}' holds files that no store made "
                                                r".*: 0\.master\.f32, emb\.bf16, weights\.f32; the store neither"):
        DiskStore({"0.master": 10}, tmp_path / "nvme")
    assert sorted(p.name for p in rank0.iterdir()) == ["0.master.f32", "emb.bf16", "weights.f32"]  # lock gone too
    assert all((rank0 / name).read_bytes() == b"the user's" for name in ("weights.f32", "0.master.f32", "emb.bf16"))


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user's needs root")
def test_another_users_rank_folder_and_a_hard_linked_lock_are_refused(tmp_path):
    theirs = tmp_path / "theirs" / "rank0"
    theirs.mkdir(parents=True)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(OffloadStoreError, match=rf"'{theirs}' belongs to another user \(uid 65534\)"):
        DiskStore({"0.master": 10}, tmp_path / "theirs")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "mine" / "rank0").mkdir(parents=True)
    os.link(victim, tmp_path / "mine" / "rank0" / ".lock")
    with pytest.raises(OffloadStoreError, match=r"rank0/\.lock' of the disk store has 2 names"):
        DiskStore({"0.master": 10}, tmp_path / "mine")
    assert victim.read_text() == "keep me"


# ---- copy-on-write filesystems, SIGBUS, write-back errors (issue 31, item 4) --------------------


def test_copy_on_write_filesystems_are_told_by_their_mount(monkeypatch):
    from trainer_shard.offload import mapping

    assert mapping._mount_of("/proc/self")[1] == "proc"  # this machine's mountinfo, read
    mounts = {"/scratch": ("/scratch", "btrfs", "rw"), "/data": ("/data", "ext4", "rw"),
              "/ctr": ("/ctr", "overlay", "rw,lowerdir=/l,upperdir=/scratch/up,workdir=/scratch/w"),
              "/box": ("/box", "overlay", "rw,lowerdir=/l,upperdir=/nowhere/up")}  # fmt: skip
    monkeypatch.setattr(mapping, "_mount_of", lambda path: next(m for k, m in mounts.items() if path.startswith(k)))
    monkeypatch.setattr(os.path, "isdir", lambda path: str(path).startswith("/scratch"))
    assert mapping.copy_on_write("/scratch/nvme") == "'/scratch' is btrfs, a copy-on-write filesystem"
    assert mapping.copy_on_write("/data/nvme") is None
    assert mapping.copy_on_write("/ctr/nvme") == "'/scratch' is btrfs, a copy-on-write filesystem"  # its upper layer
    assert "overlay whose upper layer's filesystem is unknown" in mapping.copy_on_write("/box/nvme")


def test_on_a_copy_on_write_filesystem_map_gives_copies_that_unmap_writes(tmp_path, monkeypatch, caplog):
    """A full btrfs/ZFS would make a write to a mapped page a SIGBUS: there `map` reads a copy and
    `unmap` writes it (a full disk is then an OffloadStoreError naming the file)."""
    import mmap

    from trainer_shard.offload import store as store_module

    monkeypatch.setattr(store_module, "copy_on_write", lambda path: "'/scratch' is btrfs, a copy-on-write filesystem")
    store = DiskStore({"0.master": 2048}, tmp_path / "nvme")
    store.write("0.master", 1024, torch.ones(1024))
    with caplog.at_level(logging.INFO, logger="trainer_shard.offload.store"):
        tensor, mapping = store.map("0.master", 1024, 1024)
    assert not isinstance(mapping, mmap.mmap) and tensor.eq(1).all()
    tensor.mul_(3)
    del tensor
    store.unmap(mapping)
    stored = store.read("0.master", 0, torch.empty(2048))
    assert stored[:1024].eq(0).all() and stored[1024:].eq(3).all()
    said = caplog.text
    assert f"the disk store in {store.folder} reads and writes copies, not mapped pages: '/scratch' is btrfs" in said
    store.close()


def test_without_a_sigbus_handler_map_gives_copies(tmp_path, monkeypatch, caplog):
    """No C compiler to build the handler with: a fault on a mapped page would be a bare SIGBUS, so
    the store does not map."""
    import mmap

    from trainer_shard.offload import mapping
    from trainer_shard.offload import store as store_module

    monkeypatch.setattr(store_module, "copy_on_write", lambda path: None)
    monkeypatch.setattr(mapping, "guard", lambda: None)
    store = DiskStore({"0.master": 1024}, tmp_path / "nvme")
    with caplog.at_level(logging.INFO, logger="trainer_shard.offload.store"):
        tensor, mapping_ = store.map("0.master", 0, 1024)
    assert not isinstance(mapping_, mmap.mmap)
    tensor.fill_(2.0)
    del tensor
    store.unmap(mapping_)
    assert store.read("0.master", 0, torch.empty(1024)).eq(2).all()
    assert "reads and writes copies, not mapped pages: no SIGBUS handler could be built" in caplog.text
    store.close()


def _write_faults(tensor) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor.add_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not hasattr(__import__("mmap").mmap, "madvise"), reason="no madvise on this platform")
def test_map_faults_the_pages_in_writable_and_falls_back_where_the_kernel_refuses(tmp_path, monkeypatch):
    """The step writes every page it maps: `map` populates them writable (MADV_POPULATE_WRITE), so
    the step's writes do not trap once a page to mark it dirty; a kernel that refuses the advice
    (before Linux 5.14) gets MAP_POPULATE, and the writes fault as they did."""
    from trainer_shard.offload import store as store_module

    monkeypatch.setattr(store_module, "copy_on_write", lambda path: None)
    monkeypatch.setattr(store_module, "_populate_write", [True])
    pages = 1024  # 4 MiB of fp32
    store = DiskStore({"0.master": pages * 1024}, tmp_path / "nvme")
    for page in range(pages):  # a page at a time: page-sized folios, as the step's chunks leave them
        store.write("0.master", page * 1024, torch.full((1024,), 2.0))

    def mapped_clean():  # written back: a shared mapping's first write to a clean page traps, to dirty it
        fd = os.open(store.folder / "0.master.f32", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return store.map("0.master", 0, pages * 1024)

    tensor, mapping = mapped_clean()
    populated = _write_faults(tensor)
    del tensor
    store.unmap(mapping)
    monkeypatch.setattr(store_module, "_MADV_POPULATE_WRITE", 1_000_003)  # advice no kernel knows: EINVAL
    tensor, mapping = mapped_clean()
    assert store_module._populate_write == [False]  # refused once: MAP_POPULATE from now on
    faulted = _write_faults(tensor)
    del tensor
    store.unmap(mapping)
    assert populated < pages // 10 and faulted > pages // 2, (populated, faulted)
    assert store.read("0.master", 0, torch.empty(pages * 1024)).eq(4.0).all()  # both writes reached the file
    store.close()


SIGBUS_ON_A_MAPPED_PAGE = """
import os, sys, torch
from trainer_shard.offload import store
store.copy_on_write = lambda path: None  # map for real, whatever the filesystem here
disk = store.DiskStore({"0.master": 4096, "0.exp_avg": 4096}, sys.argv[1])
tensor, mapping = disk.map("0.master", 0, 4096)
os.truncate(disk.folder / "0.master.f32", 0)  # the pages under the mapping are gone: touching one is a SIGBUS
print("touching", flush=True)
print(float(tensor.sum()))
"""


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_a_sigbus_on_a_mapped_page_names_the_file_and_the_cause_and_deletes_the_store(tmp_path):
    import signal
    import subprocess
    import sys

    from conftest import ROOT, script_env

    done = subprocess.run([sys.executable, "-c", SIGBUS_ON_A_MAPPED_PAGE, str(tmp_path / "nvme")], cwd=ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.stdout == "touching\n" and done.returncode == -signal.SIGBUS, (done.returncode, done.stderr)
    assert (f"trainer_shard: SIGBUS (bus error) on a mapped page of the disk store file {tmp_path}/nvme/rank0/"
            "0.master.f32 (bytes 0 to 16,384): the filesystem could not back a write to the page (disk full on a "
            "copy-on-write filesystem?) or read it in") in done.stderr, done.stderr  # fmt: skip
    assert "set TRAINER_SHARD_NO_MMAP=1" in done.stderr
    assert [p.name for p in (tmp_path / "nvme").rglob("*")] == [".made-by-trainer_shard"]  # files, lock, rank0/ gone


def test_a_write_back_error_is_raised_naming_the_file(tmp_path, monkeypatch):
    """An I/O error (or no room) met writing dirty pages back is seen: by `flush`, by the store's
    next call after it (the engine flushes on a thread of its own), and by a read of the file."""
    import ctypes
    import errno

    from trainer_shard.offload import store as store_module

    def fails(flags_failing):
        def sync_file_range(fd, offset, nbytes, flags):
            if flags & flags_failing:
                ctypes.set_errno(errno.EIO)
                return -1
            return 0

        return sync_file_range

    store = DiskStore({"0.master": 1024}, tmp_path / "nvme")
    store.write("0.master", 0, torch.ones(1024))
    monkeypatch.setattr(store_module, "_sync_file_range", fails(2))  # SYNC_FILE_RANGE_WRITE
    says = r"could not write back 4,096 bytes at byte 0 of .*nvme/rank0/0\.master\.f32: Input/output error"
    with pytest.raises(OffloadStoreError, match=says):
        store.flush("0.master", 0, 1024)
    with pytest.raises(OffloadStoreError, match=says):
        store.write("0.master", 0, torch.ones(4))
    store.close()
    store = DiskStore({"0.master": 1024}, tmp_path / "nvme")
    monkeypatch.setattr(store_module, "_sync_file_range", fails(1))  # SYNC_FILE_RANGE_WAIT_BEFORE: what read checks
    with pytest.raises(OffloadStoreError, match=r"could not write back 40 bytes at byte 0 of .*Input/output error"):
        store.read("0.master", 0, torch.empty(10))
    store.close()


# ---- tensors that are not one contiguous CPU block of the file's dtype (issue 31, item 7) -------


def test_non_contiguous_tensors_are_written_and_read_element_by_element(tmp_path):
    store = DiskStore({"0.master": 1000}, tmp_path / "nvme")
    data = torch.arange(2000.0).view(1000, 2)[:, 1]  # every second element: not contiguous
    store.write("0.master", 0, data)
    assert torch.equal(store.read("0.master", 0, torch.empty(1000)), data)
    base = torch.zeros(10, 3)
    assert store.read("0.master", 5, base[:, 1]) is not None  # a strided out: column 1 only
    assert torch.equal(base[:, 1], data[5:15]) and base[:, 0].eq(0).all() and base[:, 2].eq(0).all()
    with pytest.raises(ValueError, match=r"cannot write from a torch.bfloat16 tensor on cpu: 0.master .*float32"):
        store.write("0.master", 0, torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"cannot read into a torch.float64 tensor"):
        store.read("0.master", 0, torch.empty(4, dtype=torch.float64))
    assert torch.equal(store.read("0.master", 0, torch.empty(1000)), data)  # nothing written by the refusals
    store.close()
