"""Spawn N processes on gloo for a test, as fairscale's `dist_init` does (file:// rendezvous, loopback)."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world_size, init_file, fn, args):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int = 2, *args) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; an exception on any fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_entry, args=(world_size, init_file, fn, args), nprocs=world_size, start_method="spawn")
