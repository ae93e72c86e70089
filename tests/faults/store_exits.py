"""A process that holds a disk store and ends one way or another, for test_store_exits.py.

    python store_exits.py MODE FOLDER            (MODE: raise, sigterm, sigterm_after_train, forced)
    python store_exits.py peer FOLDER RANK PORT  (2 ranks on gloo, rendezvous at 127.0.0.1:PORT)

raise: an exception ends the process. sigterm: it waits for SIGTERM, whose action is the default
one. sigterm_after_train: the same, once the signal guard of train() has been installed and
restored around the store's opening (as the Trainer opens it). forced: it waits under the signal
guard for a second signal `FORCE_AFTER` (here 0.2 s) after the first, which ends it at once.
peer: both ranks run a fault watch (timeout 2 s, grace 0.5 s) and block their main thread (as in
a collective that never returns); rank 0 holds the store, rank 1 waits to be killed.

Prints "ready" once the store is open (rank 1: once its watch runs).
"""

import sys
import time

import torch
import torch.distributed as dist

from trainer_shard import faults
from trainer_shard.offload.store import DiskStore

MODE, FOLDER = sys.argv[1], sys.argv[2]


def open_store() -> DiskStore:
    store = DiskStore({"0.master": 1000, "0.exp_avg": 1000}, FOLDER)
    store.write("0.master", 0, torch.ones(1000))
    return store


def ready() -> None:
    print("ready", flush=True)


def block() -> None:
    """The main thread stuck for good, in Python (signal handlers run) as in a collective."""
    while True:
        time.sleep(0.05)


if MODE == "raise":
    store = open_store()
    ready()
    raise RuntimeError("injected failure with a disk store open")
elif MODE == "sigterm":
    store = open_store()
    ready()
    block()
elif MODE == "sigterm_after_train":
    guard = faults.InterruptGuard()
    store = open_store()  # the optimizer is made inside train()
    guard.restore()  # train() returned; evaluation, prediction... would follow
    ready()
    block()
elif MODE == "forced":
    faults.FORCE_AFTER = 0.2
    guard = faults.InterruptGuard()
    store = open_store()
    ready()
    block()
elif MODE == "peer":
    rank, port = int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = open_store() if rank == 0 else None
    watch = faults.FaultWatch.start(2.0, interval=0.2, grace=0.5)
    ready()
    block()
else:
    raise SystemExit(f"unknown mode {MODE}")
