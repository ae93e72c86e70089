"""What the fault supervision of a train() call holds is given back when it ends, however many
calls a process makes (issue 17, item 11): the gloo group of the stop agreement is made once per
process, and the fault watch's own client of the rendezvous store (a TCP connection) is closed
when the watch stops.

Two ranks on gloo with a TCPStore rendezvous (tcp://), as torchrun's is: with file:// the watch
would share the default store and make no client of its own."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from trainer_shard.training.supervision import Supervisor

pytestmark = pytest.mark.multiproc


def _entry(rank, world_size, port, fn):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank)
    finally:
        dist.destroy_process_group()


def spawn_on_tcp_store(fn, world_size=2):
    mp.start_processes(_entry, args=(world_size, free_port(), fn), nprocs=world_size, start_method="spawn")


def train_calls(n):
    """What `ShardedTrainerMixin.train()` does around the Trainer's loop, `n` times: the stop
    agreement agrees once (one step) in each."""
    supervisor = Supervisor()
    for _ in range(n):
        with supervisor.running(timeout=30):
            assert supervisor.agreement.agree(None) == 0
    return supervisor


def _groups_on_a_non_gloo_backend(rank):
    dist.get_backend = lambda group=None: "nccl"  # as on GPUs: the stop flag needs a gloo group of its own
    before = len(dist.distributed_c10d._world.pg_map)
    train_calls(3)
    after = len(dist.distributed_c10d._world.pg_map)
    assert after == before + 1, (rank, before, after)  # one, not one per train() call


def test_the_stop_agreement_makes_one_gloo_group_per_process():
    spawn_on_tcp_store(_groups_on_a_non_gloo_backend)


def sockets() -> int:
    """The sockets this process has open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # the descriptor of the listing itself, closed by now
            pass
    return count


def _store_clients_closed(rank):
    train_calls(1)  # connections made once per process (the stop agreement's group, the default store's)
    dist.barrier()
    before = sockets()
    supervisor = train_calls(3)
    assert supervisor.interrupt.watch is not None  # the signal guard still holds the last watch...
    dist.barrier()  # every rank's watches stopped
    deadline = time.monotonic() + 5  # (rank 0 hosts the store: its end of a connection closes once it sees it)
    while sockets() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    # ...but not its connection to the store. Fewer than before is no leak: rank 0's end of an
    # earlier watch's connection can close late, once the store sees it gone (seen on a busy machine)
    assert sockets() <= before, (rank, before, sockets())


def test_the_fault_watch_closes_its_store_client_when_it_stops():
    spawn_on_tcp_store(_store_clients_closed)
