"""The offload stores: what is written is read back, files removed at close, clear failures."""

import os

import pytest
import torch

from trainer_shard.offload.store import CpuStore, DiskStore, OffloadStoreError


def test_disk_store_reads_what_it_wrote_and_removes_its_files(tmp_path):
    store = DiskStore({"0.master": 10_007, "1.master": 5}, tmp_path / "store", rank=1)
    data = torch.randn(10_007)
    store.write("0.master", 0, data)
    store.write("1.master", 2, torch.ones(3))
    assert torch.equal(store.read("0.master", 0, torch.empty(10_007)), data)
    assert torch.equal(store.read("0.master", 5000, torch.empty(7)), data[5000:5007])
    assert torch.equal(store.read("1.master", 0, torch.empty(5)), torch.tensor([0.0, 0, 1, 1, 1]))
    assert sorted(p.name for p in (tmp_path / "store" / "rank1").iterdir()) == ["0.master.f32", "1.master.f32"]
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
