"""Nodes without a shared filesystem (see [Note: nodes without a shared filesystem] in
trainer_shard/training/checkpoints.py), simulated on one machine: two `torchrun --nnodes 2
--node_rank K` launches of one rank each, each node given a folder of its own as --output_dir,
as two machines with their own disks would be."""

import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM

from conftest import ROOT, SCRIPT, TINY_FLAGS, free_port, script_env
from trainer_shard.checkpoint import STAGING, manifest_problems
from trainer_shard.errors import CheckpointError
from trainer_shard.sharding import ShardedOptimizer, state_io
from trainer_shard.training import checkpoints


def run_nodes(flags_by_node: list, timeout: int = 300) -> list:
    """One `torchrun --nnodes N --node_rank K --nproc_per_node 1` per node, all at once."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(flags_by_node)),
                               "--node_rank", str(k), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                               "--master_port", str(port), str(SCRIPT), *map(str, flags)],
                              cwd=ROOT, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, flags in enumerate(flags_by_node)]  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append((proc.returncode, out))
        return outputs
    finally:
        for proc in procs:
            proc.kill()  # after a timeout: no node left waiting for the other


def flags(model, data, out, *extra):
    return ["--model_name_or_path", model, "--data_dir", data, "--output_dir", out, *TINY_FLAGS, "--do_train",
            "--max_steps", "4", "--per_device_train_batch_size", "4", "--sharded_ddp", "zero_dp_2",
            "--save_strategy", "steps", "--save_steps", "2", "--save_on_each_node", *extra]  # fmt: skip


def assert_all_ok(outputs):
    for node, (rc, out) in enumerate(outputs):
        assert rc == 0, f"node {node}: exit {rc}\n{out[-4000:]}"


@pytest.mark.slow
@pytest.mark.multiproc
def test_each_node_publishes_its_own_ranks_and_resumes_from_them(tiny_model, tiny_data, tmp_path):
    nodes = [tmp_path / f"node{k}" for k in range(2)]  # each node's own disk
    assert_all_ok(run_nodes([flags(tiny_model, tiny_data, node / "out") for node in nodes]))
    for k, node in enumerate(nodes):
        for step in (2, 4):
            checkpoint = node / "out" / f"checkpoint-{step}"
            shards = checkpoint / state_io.FOLDER
            # published, and holding this node's rank's shard only
            assert sorted(p.name for p in shards.iterdir()) == ["index.json", state_io.rank_file(k, 2)]
            assert manifest_problems(checkpoint) == []
        assert not (node / "out" / STAGING).exists()

    # the same world size: each node resumes from its own folder alone
    resumed = [tmp_path / f"resumed{k}" for k in range(2)]
    for node, out in zip(nodes, resumed):
        shutil.copytree(node / "out" / "checkpoint-2", out / "checkpoint-2")
    resume = ["--resume_from_checkpoint", "latest"]
    assert_all_ok(run_nodes([flags(tiny_model, tiny_data, out, *resume) for out in resumed]))
    straight = load_file(nodes[0] / "out" / "model.safetensors")
    for out in resumed:
        again = load_file(out / "model.safetensors")
        assert all(torch.equal(straight[k], again[k]) for k in straight), f"{out}: the resumed run differs"

    # another world size (one process): the files it lacks, and where they are
    for k, node in enumerate(nodes):
        written_by = state_io.read_index(node / "out" / "checkpoint-2" / state_io.FOLDER)["written_by"]
        other = nodes[1 - k] / "out" / "checkpoint-2" / state_io.FOLDER
        assert written_by[state_io.rank_file(1 - k, 2)] == {"node": 1 - k, "host": socket.gethostname(),
                                                             "folder": str(other.resolve())}  # fmt: skip
    checkpoint = nodes[0] / "out" / "checkpoint-2"
    model = AutoModelForSeq2SeqLM.from_pretrained(checkpoint)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, lr=3e-3)
    with pytest.raises(CheckpointError) as raised:
        state_io.load_shards(opt, checkpoint / state_io.FOLDER, state_io.param_names(model))
    text = str(raised.value)
    other = nodes[1] / "out" / "checkpoint-2" / state_io.FOLDER
    assert f"{str(checkpoint / state_io.FOLDER / 'rank-00001-of-00002.safetensors')!r} is missing" in text
    host = socket.gethostname()
    assert f"needs rank-00001-of-00002.safetensors, which node 1 (host {host}) wrote into {other.resolve()}" in text
    assert "or resume on 2 ranks as they were saved" in text


class _TwoNodes:
    """Two ranks on threads, each a node (LOCAL_WORLD_SIZE 1), gathering through a barrier: the
    start check's logic without processes (comm.all_gather_objects is its only collective)."""

    def __init__(self):
        self.barrier, self.slots, self.local = threading.Barrier(2), [None, None], threading.local()

    def all_gather_objects(self, obj, group=None):
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def run(self, folders, each_node) -> list:
        """Each rank's outcome of check_output_dirs: None, or its error's text."""
        outcomes, unexpected = [None, None], []

        def rank(r):
            self.local.rank = r
            args = SimpleNamespace(world_size=2, process_index=r, local_process_index=0, output_dir=folders[r],
                                   save_on_each_node=each_node)  # fmt: skip
            try:
                checkpoints.check_output_dirs(args)
            except CheckpointError as e:
                outcomes[r] = str(e)
            except BaseException as e:
                unexpected.append(e)
                self.barrier.abort()
            self.barrier.wait()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not unexpected and not any(t.is_alive() for t in threads), unexpected
        assert not [p for folder in folders for p in Path(folder).iterdir()]  # what each left to be seen is gone
        return outcomes


def test_the_start_check_matches_save_on_each_node_to_the_disks(tmp_path, monkeypatch):
    nodes = _TwoNodes()
    monkeypatch.setattr(checkpoints.comm, "all_gather_objects", nodes.all_gather_objects)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    shared = [str(tmp_path / "shared")] * 2
    own = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    blind, seeing = nodes.run(own, each_node=False)  # the same error on both, each naming its own folder
    assert blind.replace(own[0], "OUT") == seeing.replace(own[1], "OUT")
    assert "the node(s) of rank(s) 1 do not see the files rank 0 writes there" in blind
    assert "Pass --save_on_each_node" in blind
    both = nodes.run(shared, each_node=True)
    assert both[0] == both[1] and "--save_on_each_node, but nodes share --output_dir" in both[0]
    assert "rank 0 sees rank 1's files there; rank 1 sees rank 0's files there" in both[0]
    assert nodes.run(shared, each_node=False) == [None, None]
    assert nodes.run(own, each_node=True) == [None, None]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one node: nothing to check, no collective
    monkeypatch.setattr(checkpoints.comm, "all_gather_objects", None)
    checkpoints.check_output_dirs(SimpleNamespace(world_size=2, process_index=0, local_process_index=0,
                                                  output_dir=own[0], save_on_each_node=False))  # fmt: skip
