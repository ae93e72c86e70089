"""All-gather and reduce-scatter between the CPU ranks of one host through shared memory.

[Note: shared-memory collectives] On gloo every byte of a collective goes through the loopback
TCP stack: a copy into the kernel, one out of it, and the work of the socket threads, all on the
cores that compute (2 ranks on 2 cores here). Measured through the Trainer (t5-base, 2 ranks, 10
steps), ZeRO-3 waited less on its collectives than ZeRO-2 (4.1 s against 6.0) and still took
1.16x its time: the transfers of the gathers it overlaps with compute took the compute's cores.
When every rank of a gloo group runs on this host, each rank instead gets a slot of
`SLOT_BYTES` in /dev/shm that every rank maps: a rank writes its part of a chunk into its own
slot, raises its `written` counter, reads the peers' parts straight from their slots once their
counters reach the chunk, then raises its `read` counter, and writes its next chunk only when
every peer has read the last one. One copy in and one out, no kernel, no sockets.

- The reduce-scatter sums the parts in rank order, as the gloo path in comm.py does: the same
  bits on either path.
- The collectives of a group run in the order called, on one thread of the group's
  (`async_op` returns at once, as gloo's works do); a rank that waits for a peer spins briefly,
  then sleeps in steps up to a millisecond, so a peer that computes keeps its core.
- A peer whose process is gone, or a wait past `timeout`, raises `ShmCollectiveError` naming
  the rank, where a gloo collective would report a closed connection (the fault watch covers a
  peer that hangs: [Note: fault watch] in faults.py).
- The files are unlinked as soon as every rank has mapped them: nothing is left in /dev/shm
  when a rank is killed.
- Used only on x86-64, whose stores are seen by other cores in the order made (the counter is
  written after the data); elsewhere, on a group that spans hosts, or with
  TRAINER_SHARD_SHM_COLLECTIVES=0, comm.py uses gloo's sockets, and says so once at INFO level.

[Note: gathered in shared memory] ZeRO-3 gathers every unit twice a step (forward, backward),
and through the slots a gather copies each rank's part in and every part out again: 1.5 times
the buffer a rank. Every rank gathers the same units into the same buffers in the same order,
so the gather pool (sharding/zero3/pool.py) takes the storages of those gathers from here
(`new_storage`): file number k in /dev/shm, mapped by every rank, the k-th made on each. A
gather then writes this rank's part into the one memory and waits for the peers' parts to be
written: half the buffer a rank, nothing copied out.
- Before writing, each rank announces (storage, how many gathers into it, bytes) and waits for
  every peer's announcement of the same gather. A peer that announces storage k has released
  its last use of k (its pool lent k again), so no rank writes into memory a peer still reads;
  ranks announcing different storages raise `ShmCollectiveError` (nothing written).
- Only gathers whose buffers nothing else writes share memory: the step writes the shards, not
  the buffers. Edits that every rank makes to gathered parameters (`gathered(writeback=True)`,
  `load_state_dict`) would be made once a rank on one memory, so those buffers move to memory of
  their own first (`GatherPool.privatize`); parameters read from disk (read into the buffer
  ahead of the gather) keep their own memory too.
- `posix_fallocate` reserves a storage's pages when it is made: where /dev/shm has no room,
  that rank's storage is its own memory (a warning says so) and gathers into it go through the
  slots, on every rank. A storage's file is unlinked at its first gather (every rank has mapped
  it by then), and files of processes that are gone are swept when a group is made.
"""

import logging
import os
import pathlib
import platform
import queue
import socket
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SLOT_BYTES = 8 * 2**20  # each rank's slot: 8 MiB (both count in each rank's RSS once touched)
_HEADER = 64  # bytes before a slot's data: int64 counters (written, read, announced) and a shared gather's token
_WRITTEN, _READ, _ANNOUNCED, _STORAGE, _USE, _NBYTES = range(6)  # the header's int64 fields
_ENV = "TRAINER_SHARD_SHM_COLLECTIVES"
_SHM = "/dev/shm"
_LIVENESS_S = 0.5  # how often a waiting rank checks that the peer's process is there


class ShmCollectiveError(getattr(dist, "DistError", RuntimeError)):
    """A shared-memory collective could not complete: a peer died or the wait timed out (a
    `torch.distributed.DistError`, as gloo's closed connection is, which faults.py knows)."""


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def alive(pid: int) -> bool:
    """Whether process `pid` of this machine is running (a zombie, killed but not yet reaped by
    its launcher, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # no /proc: trust the beat


def usable_here() -> str | None:
    """None when this process may use shared-memory collectives, else why not."""
    if os.environ.get(_ENV, "1") == "0":
        return f"{_ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm"
    return None


class ShmGroup:
    """The shared-memory transport of one gloo group whose ranks are all on this host. Made by
    `for_group` (collective); `all_gather` and `reduce_scatter` run on the group's thread."""

    def __init__(self, rank: int, world: int, pids: list, timeout: float, name: str = ""):
        self.rank, self.world, self.pids, self.timeout = rank, world, pids, timeout
        self.name = name  # alike on every rank: the shared gather storages' file names
        self.slots, self.counters = [], []
        self.seq = 0  # chunks done, alike on every rank
        self._jobs = queue.SimpleQueue()
        self._thread = None
        self.made = 0  # shared gather storages made (alike on every rank): the next one's number
        self._unlink = {}  # number -> file, until every rank has it mapped
        self.zero_copy_gathers = 0

    # ---- shared gather storages: see [Note: gathered in shared memory] -----------------------

    def new_storage(self, nbytes: int) -> tuple:
        """(storage, its number): storage number `made` for gathered buffers, mapped from
        /dev/shm where every rank maps the same one (every rank makes its storages in the same
        order); where /dev/shm has no room, (this rank's own memory, -1), its gathers then
        through the slots. Not collective."""
        number, self.made = self.made, self.made + 1
        path = os.path.join(_SHM, f"trainer_shard-{self.name}-{number}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # the pages reserved now: a full /dev/shm is ENOSPC, not SIGBUS
            finally:
                os.close(fd)
            storage = torch.UntypedStorage.from_file(path, True, nbytes)
        except (OSError, RuntimeError) as e:
            _unlink(path)
            if "no room" not in _SAID:
                _SAID.add("no room")
                logger.warning("no room in /dev/shm for a gathered buffer of %s bytes (%s): gathers into it copy "
                               "through the transport's slots instead", f"{nbytes:,}", e)  # fmt: skip
            return torch.UntypedStorage(nbytes), -1
        self._unlink[number] = path
        return storage, number

    def forget(self, number: int) -> None:
        """Storage `number` is dropped (its file goes, if no gather into it has run yet)."""
        _unlink(self._unlink.pop(number, None))

    def map_peers(self, paths: list) -> None:
        for path in paths:
            segment = torch.from_file(path, shared=True, size=_HEADER + SLOT_BYTES, dtype=torch.uint8)
            self.counters.append(segment[:_HEADER].view(torch.int64))
            self.slots.append(segment[_HEADER:])

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None
        self.slots, self.counters = [], []
        for path in self._unlink.values():
            _unlink(path)
        self._unlink = {}

    # ---- the group's thread ----------------------------------------------------------------

    def submit(self, fn, *args) -> Future:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="trainer_shard-shm", daemon=True)
            self._thread.start()
        future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            del job  # the tensors go with `args` before the result is set: [Note: a finished job keeps nothing]
            if not future.set_running_or_notify_cancel():
                continue
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the rank that waits for it
                del fn, args
                future.set_exception(e)
                self._fail_rest(e)
            else:
                del fn, args
                future.set_result(None)

    def _fail_rest(self, error: BaseException) -> None:
        """After a failed collective the counters no longer pair up: every later one fails too."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job[0].set_exception(ShmCollectiveError(f"an earlier shared-memory collective failed: {error}"))

    # ---- waiting for peers -------------------------------------------------------------------

    def _wait(self, peer: int, which: int, seq: int) -> None:
        """Until rank `peer`'s counter `which` (`_WRITTEN`, `_READ`, `_ANNOUNCED`) reaches `seq`."""
        counter = self.counters[peer]
        if int(counter[which]) >= seq:
            return
        start = time.monotonic()
        checked, pause, spins = start, 0.0, 0
        while int(counter[which]) < seq:
            spins += 1
            if spins > 100:
                pause = min(1e-3, pause + 2e-5)
                time.sleep(pause)
            now = time.monotonic()
            if now - checked > _LIVENESS_S:
                checked = now
                self._check_peer(peer, now - start)

    def _check_peer(self, peer: int, waited: float) -> None:
        if not alive(self.pids[peer]):
            raise ShmCollectiveError(f"rank {peer} (pid {self.pids[peer]}) exited during a shared-memory collective "
                                     f"of rank {self.rank}")  # fmt: skip
        if waited > self.timeout:
            raise ShmCollectiveError(f"rank {self.rank} waited {waited:.0f} s for rank {peer} in a shared-memory "
                                     "collective (the process group's timeout)")  # fmt: skip

    def _next(self) -> int:
        """Start a chunk: every peer has read this rank's last one. Returns its number."""
        self.seq += 1
        for peer in range(self.world):
            if peer != self.rank:
                self._wait(peer, _READ, self.seq - 1)
        return self.seq

    # ---- the collectives (on the group's thread) -------------------------------------------

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """`output` (world * n) gets every rank's `input` (n); this rank's part is there already."""
        n = input.numel()
        flat_out, flat_in = output.view(-1), input.reshape(-1)
        step = SLOT_BYTES // input.element_size()
        me = self._slot(self.rank, input.dtype)
        for start in range(0, n, step):
            end = min(n, start + step)
            seq = self._next()
            me[: end - start].copy_(flat_in[start:end])
            self.counters[self.rank][_WRITTEN] = seq
            for peer in range(self.world):
                if peer != self.rank:
                    self._wait(peer, _WRITTEN, seq)
                    flat_out[peer * n + start : peer * n + end].copy_(self._slot(peer, input.dtype)[: end - start])
            self.counters[self.rank][_READ] = seq

    def all_gather_shared(self, output: torch.Tensor, input: torch.Tensor, token) -> None:
        """`all_gather` into `output`, the whole of a storage of `new_storage`; `token`: (its
        number, gathers into it so far, bytes), alike on every rank: see [Note: gathered in
        shared memory]."""
        seq = self._next()
        mine = self.counters[self.rank]
        number, use, nbytes = token
        n = input.numel()
        mine[_STORAGE], mine[_USE], mine[_NBYTES] = number, use, nbytes
        mine[_ANNOUNCED] = seq
        said = {}
        for peer in range(self.world):
            if peer != self.rank:
                self._wait(peer, _ANNOUNCED, seq)
            counters = self.counters[peer]
            said[peer] = (int(counters[_STORAGE]), int(counters[_USE]), int(counters[_NBYTES]))
        _unlink(self._unlink.pop(number, None))  # every rank that could map it has by now
        shared = {t for t in said.values() if t[0] >= 0}
        if len(shared) > 1 or len({t[2] for t in said.values()}) > 1:
            raise ShmCollectiveError("the ranks gathered into different buffers (rank: (buffer, its use, bytes) "
                                     f"{said}): their gathers no longer pair up")  # fmt: skip
        if len(shared) == 1 and all(t[0] >= 0 for t in said.values()):
            # the same buffer on every rank: each writes its part, and the gather is done
            output.view(-1)[self.rank * n : (self.rank + 1) * n].copy_(input.reshape(-1))
            mine[_WRITTEN] = seq
            for peer in range(self.world):
                if peer != self.rank:
                    self._wait(peer, _WRITTEN, seq)
            mine[_READ] = seq
            self.zero_copy_gathers += 1
            return
        mine[_WRITTEN] = mine[_READ] = seq  # a rank with its own memory there: through the slots
        mine_part = output.view(-1)[self.rank * n : (self.rank + 1) * n]
        if mine_part.data_ptr() != input.data_ptr():
            mine_part.copy_(input.reshape(-1))
        self.all_gather(output, mine_part)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """`output` (n) gets the sum over ranks of their `input`'s chunk `rank`, summed in rank order."""
        n, world, rank = output.numel(), self.world, self.rank
        flat_out, flat_in = output.view(-1), input.view(-1)
        step = SLOT_BYTES // input.element_size() // world
        me = self._slot(rank, input.dtype)
        for start in range(0, n, step):
            end = min(n, start + step)
            size = end - start
            seq = self._next()
            for peer in range(world):
                if peer != rank:
                    me[peer * size : (peer + 1) * size].copy_(flat_in[peer * n + start : peer * n + end])
            self.counters[rank][_WRITTEN] = seq
            parts = []
            for peer in range(world):
                if peer == rank:
                    parts.append(flat_in[rank * n + start : rank * n + end])
                else:
                    self._wait(peer, _WRITTEN, seq)
                    parts.append(self._slot(peer, input.dtype)[rank * size : (rank + 1) * size])
            sum_in_rank_order(parts, flat_out[start:end])
            self.counters[rank][_READ] = seq

    def _slot(self, peer: int, dtype: torch.dtype) -> torch.Tensor:
        return self.slots[peer].view(dtype)


def sum_in_rank_order(parts: list, out: torch.Tensor) -> None:
    """`out` = parts[0] + parts[1] + ..., in that order (every rank's reduce-scatter, on either
    transport, adds the same numbers in the same order: the same bits on every path)."""
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


_GROUPS = {}  # process group -> ShmGroup or None (not usable), made once per group
_SAID = set()


def for_group(group, timeout: float | None = None):
    """The `ShmGroup` of the gloo `group` (None: the default group), or None where its ranks may
    not use one (another host, another CPU architecture, switched off). Collective the first
    time for a group: every rank calls it at the same point, as the collective that needs it."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if pg in _GROUPS:
        return _GROUPS[pg]
    for stale in [g for g in _GROUPS if g not in dist.distributed_c10d._world.pg_map]:
        made = _GROUPS.pop(stale)
        if made is not None:
            made.close()
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    why, path = usable_here(), None
    if why is None:
        try:
            _sweep()
            fd, path = tempfile.mkstemp(prefix=f"trainer_shard-g{os.getpid()}x{uuid.uuid4().hex[:8]}-rank{rank}-",
                                        dir=_SHM)  # fmt: skip
            os.ftruncate(fd, _HEADER + SLOT_BYTES)
            os.close(fd)
        except OSError as e:
            why, path = f"cannot make a file in /dev/shm: {e.strerror or e}", None
    name = f"g{os.getpid()}x{uuid.uuid4().hex[:8]}"  # rank 0's names the group's gather storages
    mine = {"host": _host_id(), "pid": os.getpid(), "path": path, "why": why, "name": name}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=pg)
    reasons = sorted({f"rank {r}: {e['why']}" for r, e in enumerate(everyone) if e["why"]})
    if len({e["host"] for e in everyone}) > 1:
        reasons.append("the ranks are on several hosts")
    made = None
    try:
        if not reasons:
            timeout = timeout if timeout is not None else _group_timeout(pg)
            made = ShmGroup(rank, world, [e["pid"] for e in everyone], timeout, name=everyone[0]["name"])
            made.map_peers([e["path"] for e in everyone])
            dist.barrier(group=pg)  # every rank has mapped every file: they can go
    finally:
        _unlink(path)
    _GROUPS[pg] = made
    key = "shm" if made else "; ".join(reasons)
    if key not in _SAID:
        _SAID.add(key)
        logger.info("all-gather and reduce-scatter of %d CPU ranks: %s", world,
                    "through shared memory" if made else f"through gloo's sockets ({key})")  # fmt: skip
    return made


def _unlink(path) -> None:
    if path is not None:
        pathlib.Path(path).unlink(missing_ok=True)


def _sweep() -> None:
    """Remove the files of processes that are gone (killed between making a file and the point
    where every rank has mapped it): a slot, "trainer_shard-g<pid>x<id>-rank<r>-...", and a shared
    gather storage, "trainer_shard-g<pid of rank 0>x<id>-<number>"."""
    try:
        names = os.listdir(_SHM)
    except OSError:
        return
    for name in names:
        if name.startswith("trainer_shard-g") and "x" in name:
            pid = name[len("trainer_shard-g") :].split("x", 1)[0]
            if pid.isdigit() and not alive(int(pid)):
                _unlink(os.path.join(_SHM, name))


def storages() -> list:
    """The shared storages of this process's transports (each rank's slot, mapped here): the
    transport's own buffers, a fixed `SLOT_BYTES` a rank of each group, for memory accounts."""
    return [slot.untyped_storage() for made in _GROUPS.values() if made is not None for slot in made.slots]


def _group_timeout(pg) -> float:
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - an attribute of torch's internals: its default then
        return timedelta(minutes=30).total_seconds()
