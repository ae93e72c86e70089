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
