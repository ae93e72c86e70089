"""Run a check on N gloo ranks for a test, as fairscale's `dist_init` does (file:// rendezvous, loopback).

The ranks are kept between tests: each pytest worker starts one set of rank processes per world
size (a process per rank that imported torch, the test module and trainer_shard once, in a process
group) and hands them one check after another. A fresh set costs 5-10 s of interpreter start and
imports on 2 cores; the check itself is usually well under a second. Each check starts as a fresh
process would: torch's default seed, default dtype and thread count, and the environment as the
ranks started with it. A check that measures the process itself (its RSS) asks for `fresh=True`.

A failure on any rank fails the test with every rank's traceback, and the set is stopped (the
ranks that did not fail may be waiting in a collective): the next check starts a new one.
"""

import multiprocessing.connection
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TORCH_DEFAULT_SEED = 67280421310721  # what torch's CPU generator starts from in a new process
PEERS_GRACE_S = 10  # once a rank failed, how long the others may take to finish or fail too


class RanksFailed(AssertionError):
    """A check raised on a rank, or a rank died."""


def _init(rank, world_size, init_file):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def _entry(rank, world_size, init_file, fn, args):
    _init(rank, world_size, init_file)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _serve(rank, world_size, init_file, conn):
    """A kept rank: run each check sent, as a new process would, and answer None or a traceback."""
    _init(rank, world_size, init_file)
    environ, dtype, threads = dict(os.environ), torch.get_default_dtype(), torch.get_num_threads()
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        except BaseException:  # noqa: BLE001 - the check could not be unpickled (its module failed to import)
            conn.send(traceback.format_exc())
            continue
        if job is None:
            break
        fn, args = job
        torch.manual_seed(TORCH_DEFAULT_SEED)
        try:
            fn(rank, world_size, *args)
            answer = None
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            answer = traceback.format_exc()
        finally:
            os.environ.clear()
            os.environ.update(environ)
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)
        if answer is None and not dist.is_initialized():
            answer = f"{fn.__name__} destroyed the process group: run it with spawn(..., fresh=True)"
        conn.send(answer)
    if dist.is_initialized():
        dist.destroy_process_group()


class _Ranks:
    """`world_size` kept rank processes in one process group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._folder = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._folder.name, "rendezvous")
        context = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_serve, args=(rank, world_size, init_file, theirs), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def run(self, fn, args) -> None:
        for conn in self.conns:
            conn.send((fn, args))
        errors, pending, failed_at = {}, set(range(self.world_size)), None
        while pending:
            waiting = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            multiprocessing.connection.wait(waiting, timeout=1.0)
            for rank in sorted(pending):
                if self.conns[rank].poll():
                    try:
                        answer = self.conns[rank].recv()
                    except EOFError:
                        answer = f"rank {rank} died (exit code {self.procs[rank].exitcode})"
                    pending.discard(rank)
                    if answer is not None:
                        errors[rank] = answer
                elif not self.procs[rank].is_alive():
                    pending.discard(rank)
                    errors[rank] = f"rank {rank} died (exit code {self.procs[rank].exitcode})"
            if errors and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > PEERS_GRACE_S:
                for rank in pending:  # most likely waiting in a collective for the rank that failed
                    errors[rank] = f"rank {rank} still running {PEERS_GRACE_S} s after another rank failed"
                break
        if errors:
            self.close()
            said = "\n".join(f"-- rank {rank}:\n{error}" for rank, error in sorted(errors.items()))
            raise RanksFailed(f"{fn.__name__} failed:\n{said}")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self._folder.cleanup()


_kept: dict = {}  # world size -> _Ranks, for this pytest worker's life


def spawn(fn, world_size: int = 2, *args, fresh: bool = False) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; an exception on any fails the
    test. `fresh`: in processes started for it alone (a check that measures its process's RSS)."""
    if fresh:
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "rendezvous")
            mp.start_processes(_entry, args=(world_size, init_file, fn, args), nprocs=world_size, start_method="spawn")
        return
    ranks = _kept.get(world_size)
    if ranks is None or not ranks.alive():
        if ranks is not None:
            ranks.close()
        ranks = _kept[world_size] = _Ranks(world_size)  # the others kept too: files switch between 1, 2, 3 ranks
    try:
        ranks.run(fn, args)
    except RanksFailed:
        _kept.pop(world_size, None)
        raise
