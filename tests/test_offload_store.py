"""The offload stores and the chunked AdamW step: same result as in memory, RAM bounded, clear failures."""

import os

import pytest
import torch

from trainer_shard.offload.store import CpuStore, DiskStore, OffloadStoreError
from trainer_shard.offload.stream import ChunkedAdamW


def reference_steps(master, grads, **hyper):
    param = master.clone().requires_grad_()
    adam = torch.optim.AdamW([param], fused=True, **hyper)
    for g in grads:
        param.grad = g.clone()
        adam.step()
    return param.detach(), adam.state[param]


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("chunk", [1000, 4096, 10_000])
def test_chunked_steps_equal_one_adamw(tmp_path, kind, chunk):
    torch.manual_seed(0)
    numel = 10_007
    master = torch.randn(numel)
    grads = [torch.randn(numel) for _ in range(3)]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    store = CpuStore(["master", "exp_avg", "exp_avg_sq"], numel) if kind == "cpu" else \
        DiskStore(["master", "exp_avg", "exp_avg_sq"], numel, tmp_path / "store", rank=1)  # fmt: skip
    store.write("master", 0, master)
    adam = ChunkedAdamW(store, chunk_numel=chunk, buffer_count=2)
    params = torch.zeros(numel, dtype=torch.bfloat16)
    for g in grads:
        adam.step(g, on_chunk=lambda s, m: params[s : s + m.numel()].copy_(m), **hyper)
    expected, state = reference_steps(master, grads, **hyper)
    for name, want in (("master", expected), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
        got = store.read(name, 0, torch.empty(numel))
        assert torch.equal(got, want), name
    assert torch.equal(params, expected.to(torch.bfloat16))  # every updated chunk reached the parameters
    adam.close()
    if kind == "disk":
        assert not (tmp_path / "store").exists()  # files and the folder it made are gone


def test_disk_store_refuses_what_does_not_fit(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    with pytest.raises(OffloadStoreError, match=r"needs [\d,]+ bytes in .* but only [\d,]+ are free"):
        DiskStore(["master"], free, tmp_path / "store")
    assert not (tmp_path / "store").exists()  # nothing created


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_disk_store_refuses_an_unwritable_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OffloadStoreError, match="not writable|cannot create"):
        DiskStore(["master"], 10, locked / "store")


def test_disk_store_names_a_path_it_cannot_create(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OffloadStoreError, match="cannot create the disk store folder .*file/x/rank0"):
        DiskStore(["master"], 10, blocker / "x")
