"""ZeRO-3's parameter store on disk (`offload_param` nvme): its errors name its own config key and
what it holds, not the optimizer store's; closing it leaves nothing it made behind, and nothing
the user made or another store still uses is removed."""

import json
import multiprocessing
import os
import shutil
import socket
from collections import namedtuple

import pytest
import torch

from trainer_shard import ArgumentError, ShardedSeq2SeqTrainingArguments
from trainer_shard.offload import store as store_module
from trainer_shard.offload.param_store import PARAM_FOLDER, PARAMS, ParamOffloadSpec, ParamStore
from trainer_shard.offload.store import DiskStore, OffloadStoreError, check_disk_store
from trainer_shard.training import plan

KEY = "zero_optimization.offload_param.nvme_path"
SIZES = {"0.param": (1000, torch.bfloat16), "1.param": (10, torch.float32)}


def param_store(nvme_path, rank=0, sizes=SIZES):
    """Every shard on disk (max_in_cpu=0)."""
    return ParamStore(ParamOffloadSpec("nvme", nvme_path=str(nvme_path), max_in_cpu=0), sizes, rank=rank)


def never_the_optimizer_store(text):
    assert "offload_optimizer" not in text and "master weights" not in text and "disk store" not in text, text


# ---- its errors -----------------------------------------------------------------------------------


def test_an_unwritable_folder_names_offload_param(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "is_writable", lambda path: False)  # as root, chmod would not do
    rank0 = tmp_path / "nvme" / PARAM_FOLDER / "rank0"
    with pytest.raises(OffloadStoreError) as raised:
        check_disk_store(tmp_path / "nvme" / PARAM_FOLDER, 0, 0, role=PARAMS)  # the check at start
    assert str(raised.value) == (f"cannot create the parameter store folder '{rank0}': '{tmp_path}' is not writable; "
                                 f"set {KEY} to a writable folder")  # fmt: skip
    with pytest.raises(OffloadStoreError) as raised:
        param_store(tmp_path / "nvme")
    assert str(raised.value) == f"the parameter store folder '{rank0}' is not writable; set {KEY} to a writable folder"


def test_a_path_it_cannot_create_names_offload_param(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OffloadStoreError) as raised:
        param_store(blocker / "nvme")
    text = str(raised.value)
    assert text.startswith(f"cannot create the parameter store folder '{blocker}/nvme/{PARAM_FOLDER}/rank0': "), text
    assert text.endswith(f"; set {KEY} to a writable folder"), text
    never_the_optimizer_store(text)


def test_the_config_check_names_offload_param(tmp_path):
    """args.py, when the --offload config is read: the parameter store's folder, in its own words."""
    config = tmp_path / "c.json"
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "nvme", "nvme_path": "/dev/null/p"}}  # fmt: skip
    config.write_text(json.dumps({"zero_optimization": zero}))
    with pytest.raises(ArgumentError) as raised:
        ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none",
                                        offload=str(config))  # fmt: skip
    text = str(raised.value)
    assert (f"offload_param: cannot create the parameter store folder '/dev/null/p/{PARAM_FOLDER}/rank0': "
            f"'/dev/null' is not a folder; set {KEY} to a writable folder") in text, text  # fmt: skip
    assert "offload_optimizer.nvme_path" not in text, text


def test_not_enough_room_names_offload_param_and_the_shards(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(OffloadStoreError) as raised:
        param_store(tmp_path / "nvme")
    assert str(raised.value) == (
        f"the parameter store needs 2,040 bytes in '{tmp_path}/nvme/{PARAM_FOLDER}/rank0' but only 100 are free: its "
        "parameter and gradient shards do not fit; free some space or point offload_param.nvme_path to a larger disk"
    )
    assert not (tmp_path / "nvme").exists()  # nothing made
    with pytest.raises(OffloadStoreError, match=r"the parameter store needs 5,000 bytes .* only 100 are free: its "
                                                r"parameter and gradient shards do not fit"):  # fmt: skip
        check_disk_store(tmp_path / "nvme" / PARAM_FOLDER, 0, 5000, role=PARAMS)


def _hold(nvme_path, ready, release):
    """Another run's parameter store: open, written, held until `release` (or until killed)."""
    store = param_store(nvme_path)
    store.write("0.param", 0, torch.ones(1000, dtype=torch.bfloat16))
    ready.set()
    release.wait(60)
    store.close()


def test_a_folder_in_use_by_another_process_names_offload_param(tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold, args=(tmp_path / "nvme", ready, release), daemon=True)
    other.start()
    try:
        assert ready.wait(30), "the other process did not open its store"
        rank0 = tmp_path / "nvme" / PARAM_FOLDER / "rank0"
        written = (rank0 / "0.param.bf16").read_bytes()
        says = (f"the parameter store folder '{rank0}' is in use by another run: process {other.pid} on host "
                f"{socket.gethostname()} holds its lock. Two runs on one store would overwrite each other's parameter "
                f"and gradient shards: give this run another offload_param.nvme_path ({KEY} in the --offload config), "
                "or wait for that run to end (or stop it) and start again")  # fmt: skip
        with pytest.raises(OffloadStoreError) as raised:
            param_store(tmp_path / "nvme")
        assert str(raised.value) == says
        with pytest.raises(OffloadStoreError) as raised:
            check_disk_store(tmp_path / "nvme" / PARAM_FOLDER, 0, 0, in_use=True, role=PARAMS)
        assert str(raised.value) == says
        with pytest.raises(OffloadStoreError) as raised:  # training/plan.py: the check when the Trainer is built
            plan.check_disk_room(None, None, None, 0, 1, ParamOffloadSpec("nvme", nvme_path=str(tmp_path / "nvme")))
        assert str(raised.value) == says
        assert (rank0 / "0.param.bf16").read_bytes() == written  # refused before touching anything
    finally:
        release.set()
        other.join(30)
        if other.is_alive():
            other.kill()
    assert other.exitcode == 0 and not (tmp_path / "nvme").exists()


def test_a_folder_in_use_by_this_process_names_the_sharded_model(tmp_path):
    first = param_store(tmp_path / "nvme")
    try:
        with pytest.raises(OffloadStoreError) as raised:
            param_store(tmp_path / "nvme")
        text = str(raised.value)
        assert text == (f"the parameter store folder '{tmp_path}/nvme/{PARAM_FOLDER}/rank0' is in use by another "
                        f"store of this process (pid {os.getpid()}): close the sharded model that holds it "
                        "(ShardedModel.close()) before making another one there, or give this one another "
                        "offload_param.nvme_path"), text  # fmt: skip
    finally:
        first.close()


# ---- what closing leaves --------------------------------------------------------------------------


def test_a_fresh_nvme_path_is_gone_after_close(tmp_path):
    store = param_store(tmp_path / "a" / "nvme")
    data = torch.arange(1000.0).to(torch.bfloat16)
    store.write("0.param", 0, data)
    assert torch.equal(store.read("0.param", 0, torch.empty(1000, dtype=torch.bfloat16)), data)
    store.close()
    assert os.listdir(tmp_path) == []  # nvme_path, the folder above it, zero3_params/, rank0/: all made, all gone
    store.close()  # idempotent


def test_a_folder_the_user_made_stays(tmp_path):
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "notes.txt").write_text("mine")
    store = param_store(tmp_path / "nvme")
    store.close()
    assert os.listdir(tmp_path / "nvme") == ["notes.txt"]  # zero3_params/ (made) gone, the user's folder and file kept
    (tmp_path / "nvme" / "notes.txt").unlink()
    store = param_store(tmp_path / "nvme")
    store.close()
    assert os.listdir(tmp_path / "nvme") == []  # empty, and still there: not the store's to remove


def test_zero3_params_made_by_the_user_stays(tmp_path):
    (tmp_path / "nvme" / PARAM_FOLDER).mkdir(parents=True)
    param_store(tmp_path / "nvme").close()
    assert os.listdir(tmp_path / "nvme") == [PARAM_FOLDER] and os.listdir(tmp_path / "nvme" / PARAM_FOLDER) == []


@pytest.mark.parametrize("first", ["params", "optimizer"])
def test_a_store_still_open_inside_keeps_the_folder(tmp_path, first):
    """The optimizer's store in nvme_path/rank0 and the parameter store in nvme_path/zero3_params/rank0,
    nvme_path made by whichever opened first: the first to close leaves the other's files and
    folders as they are; the last leaves nothing."""
    nvme = tmp_path / "nvme"
    opened = {}
    for role in ([first] + [r for r in ("params", "optimizer") if r != first]):
        opened[role] = param_store(nvme) if role == "params" else DiskStore({"0.master": 100}, nvme)
    opened["optimizer"].write("0.master", 0, torch.arange(100.0))
    opened["params"].write("1.param", 0, torch.ones(10))
    opened["params"].close()
    assert sorted(os.listdir(nvme / "rank0")) == [".lock", "0.master.f32"]
    assert torch.equal(opened["optimizer"].read("0.master", 0, torch.empty(100)), torch.arange(100.0))
    assert not (nvme / PARAM_FOLDER).exists()
    opened["optimizer"].close()
    assert os.listdir(tmp_path) == []

    opened = {role: param_store(nvme) if role == "params" else DiskStore({"0.master": 100}, nvme)
              for role in ([first] + [r for r in ("params", "optimizer") if r != first])}  # fmt: skip
    opened["optimizer"].close()
    assert sorted(os.listdir(nvme / PARAM_FOLDER / "rank0")) == [".lock", "0.param.bf16", "1.param.f32"]
    opened["params"].close()
    assert os.listdir(tmp_path) == []


def test_ranks_close_in_any_order(tmp_path):
    ranks = [param_store(tmp_path / "nvme", rank=r) for r in range(3)]
    for closing in (1, 0):
        ranks[closing].close()
        assert (tmp_path / "nvme" / PARAM_FOLDER / "rank2").is_dir()
    ranks[2].close()
    assert os.listdir(tmp_path) == []


def test_a_background_job_holds_nothing_once_its_result_is_set():
    """[Note: a finished job keeps nothing]: when the waiting thread wakes, the job's function and
    arguments are already dropped (a plain ThreadPoolExecutor still holds them here, until its
    worker next runs Python: a dropped model stayed alive through gc.collect())."""
    import threading
    import weakref
    from concurrent.futures import ThreadPoolExecutor

    from trainer_shard.offload.workers import Workers

    class Owner:
        def work(self, tensor):
            return tensor.sum()

    def held_when_done(pool_class):
        pool = pool_class(1)
        owner, tensor = Owner(), torch.ones(4)
        refs = (weakref.ref(owner), weakref.ref(tensor))
        gate = threading.Event()
        future = pool.submit(lambda o, t: (gate.wait(), o.work(t))[1], owner, tensor)
        del owner, tensor
        seen = []  # done callbacks run on the worker, as the result is set
        future.add_done_callback(lambda f: seen.append([r() is not None for r in refs]))
        gate.set()
        assert float(future.result()) == 4.0
        pool.shutdown(wait=True)
        return seen[0]

    assert held_when_done(ThreadPoolExecutor) == [True, True]  # the trap, so the check can fail
    assert held_when_done(Workers) == [False, False]
