"""Where offloaded shard tensors live: CPU RAM or files on disk.

A store holds named flat tensors, fp32 unless a size says `(numel, dtype)` ("0.master",
"0.exp_avg", ...: one set per flat group of the shard, each of its own size; ZeRO-3's 16-bit
parameter shards), read and written by ranges; the engine streams through it
chunk by chunk and decides what moves where.

- `CpuStore`: plain tensors in RAM, page-locked (pinned) when CUDA is present and asked for,
  so host-device copies can run asynchronously.
- `DiskStore`: one file per name under `<nvme_path>/rank<R>/`, created at start after a
  free-space check, removed by `close()`. Ranges are read into and written from caller-owned
  buffers with `pread`/`pwrite`, or mapped (`map`/`unmap`) for the optimizer step to update in
  place: see [Note: stepping on mapped pages]. Either way the RAM the store costs is the chunks
  in flight, not the model. The store creates its files afresh (`O_EXCL`), opens nothing through
  a symbolic link (`O_NOFOLLOW`), and works in a rank folder that is a real folder of this user's,
  through that folder's descriptor: an `nvme_path` in a folder others can write (the system
  temporary folder, a scratch disk) gives them no way to make a run write over, truncate or
  delete a file of its user's.

Failures are errors that name the path and the bytes needed (`OffloadStoreError`), raised before
anything is written: an unwritable folder, a disk without room for the files, a folder that
another run's store is using, a rank folder or lock file that is a symbolic link or another
user's, or files like a store's (`*.f32`, `*.bf16`, `*.f16`) that no lock file of a store names.
A `StoreRole` says whose store it is, for the errors to name the config key to change and what
is at stake: the optimizer's (`OPTIMIZER`, the default) or ZeRO-3's parameter store
(`param_store.PARAMS`).

[Note: disk store lifetime] A rank's folder belongs to one store at a time, and nothing of it
outlives the process that made it except after SIGKILL:

- Open: the store takes an exclusive `flock` on `<folder>/rank<R>/.lock` before it creates a file,
  and holds it until it is deleted. The lock file says who holds it (pid and host) and names each
  file the store has made, once made. A second store there, another run's or this process's, is
  refused naming the holder; a lock file of a store that is not locked is what a store killed
  with SIGKILL left behind: the files it names are deleted (relative to the folder's descriptor),
  and the log says so. Nothing else is deleted: a folder with files like a store's that no such
  lock file names is refused, naming them.
- Delete: `close()`; the store's finalizer when it is garbage collected and, through `weakref`,
  at interpreter exit (a normal end, or an exception that ends the process); `close_all()` just
  before `os._exit`, which skips both (faults.py calls it: a peer's failure, a forced stop); and
  SIGTERM arriving while its default action (death) is in place: the handler installed while a
  store is open deletes them all, then dies of the signal as before. SIGTERM/SIGINT during
  `train()` are faults.py's: they end the process through one of the paths above.
- A file that cannot be deleted is reported (a warning naming it, its size and the error).
- SIGBUS on a mapped page: the handler of [Note: a fault on a mapped page] in mapping.py says
  which file and why, deletes the files, lock files and rank folders of every store open in the
  process (not the marked folders above them), and lets the process die of the signal.
- Folders: the rank's folder is the store's and goes with it; each folder above it that a store
  created (nvme_path, `zero3_params/`, `zero3_grads/`) is marked (`_MADE_HERE`) and removed when nothing but the
  mark is left in it: by whichever store closes last, of any rank or role. A folder the user made
  is never removed.

[Note: stepping on mapped pages] The offload step reads every byte of the master weights and
moments and writes every byte back. Through `pread`/`pwrite` that is two copies between the page
cache and a buffer (t5-large: 17.7 GB a step; by hand, vmstat showed 60% of 2 cores in the
kernel while it stepped). `map` gives the step a chunk's own page-cache pages instead (a
shared mapping of its file range, populated writable on the reader thread: `_populate_writable`), the
optimizer updates them in place, and `unmap` hands them back dirty: no copy, and the kernel writes
them back. Only the
chunks in flight are mapped (at most one more than `buffer_count`), so the mapped pages count in
RSS as the chunk buffers did, which are then not made.

Either way a step writes the whole state, and the disk's write bandwidth bounds it: the kernel
lets a process dirty a share of RAM (`vm.dirty_background_ratio`, `vm.dirty_ratio`) and then
makes it wait for the disk. So the engine starts each chunk's write-back as soon as the chunk is
written (`flush`: `sync_file_range(SYNC_FILE_RANGE_WRITE)`, on a thread of its own): the disk
writes from the step's first chunk on, rather than once the dirty pages pass the background
threshold, and what is still dirty when the step ends is written while the next forward and
backward compute, not at the start of the next step. Measured on t5-large (bench/results/offload.md):
the mapping took the disk row's step from 7.89 to 6.58 s (runs back to back), the early
write-back the optimizer step from 2.2-2.3 to 1.95-2.0 s (by hand).

The cost of mapping: where `pread`/`pwrite` raise an error that names the file, a mapped page the
kernel cannot read in (an I/O error, the file truncated) or cannot back when written is a SIGBUS.
The files are reserved at creation (`posix_fallocate`), so on a filesystem that rewrites blocks
in place a full disk is not one; a copy-on-write filesystem (btrfs, ZFS, ...: `mapping.copy_on_write`)
needs new blocks at each rewrite, and a full disk there would be a SIGBUS mid-run: on those, and
where the SIGBUS handler cannot be built, `map` gives copies (`pread` into a tensor that `unmap`
writes back with `pwrite`; logged once), whose full disk is an `OffloadStoreError ... No space
left on device`. Elsewhere the handler of [Note: a fault on a mapped page] (mapping.py) names
the file and the cause and deletes the stores before the process dies of it. Ranges that do not
start on a page boundary are read and written with copies.

Write-back errors (an I/O error, or no room on a filesystem that allocates at write-back) are
seen, not lost with the page: `flush` checks the error that `sync_file_range` reports for the file
since its last check, and `read`/`map` check it (waiting for that range's write-back still in
flight, if any) before they return the range's data; the error is raised there, or, when `flush`
ran on another thread, by the store's next call. Nothing needs `fsync` beyond that: the files are
read back only by this process, through the page cache, and deleted at the end.
"""

import ctypes
import errno
import fcntl
import gc
import logging
import mmap
import os
import re
import signal
import socket
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..disk import existing_parent, format_bytes, free_bytes, is_writable
from ..errors import TrainerShardError
from . import mapping as _mapping
from .mapping import copy_on_write

logger = logging.getLogger(__name__)


class OffloadStoreError(TrainerShardError):
    """The offload store cannot be created or written: the path and the bytes are in the message."""


@dataclass(frozen=True)
class StoreRole:
    """Whose disk store it is, in the words of its errors."""

    key: str  # the config key that says where it goes: "set {key} to a writable folder"
    setting: str  # that key, short: "point {setting} to a larger disk"
    what: str  # what it holds: "two runs on one store would overwrite each other's {what}"
    name: str  # "the {name} folder ... is in use"
    owner: str  # "close {owner} before making another one there"


OPTIMIZER = StoreRole(
    key="zero_optimization.offload_optimizer.nvme_path",
    setting="nvme_path",
    what="master weights and optimizer state",
    name="disk store",
    owner="the optimizer that holds it (ShardedOptimizer.close())",
)


class CpuStore:
    """Tensors in RAM. `read` returns views (no copy); `write` of a view onto itself is free."""

    def __init__(self, sizes: dict, *, pin_memory: bool = False):
        self.sizes = dict(sizes)
        self.pinned = bool(pin_memory and torch.cuda.is_available())
        self._tensors = {}
        self.add(self.sizes)

    def add(self, sizes: dict) -> None:
        for name, size in sizes.items():
            numel, dtype = _numel_dtype(size)
            self._tensors[name] = torch.zeros(numel, dtype=dtype, pin_memory=self.pinned)
        self.sizes.update(sizes)

    def view(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of `name`, in place."""
        return self._tensors[name][start:end]

    def read(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self._tensors[name][start : start + out.numel()])

    def write(self, name: str, start: int, data: torch.Tensor) -> None:
        target = self._tensors[name][start : start + data.numel()]
        if target.data_ptr() != data.data_ptr():
            target.copy_(data)

    def close(self) -> None:
        self._tensors = {}


class DiskStore:
    """Files under `folder/rank<rank>/`, locked for this store's lifetime; see the module docstring
    and [Note: disk store lifetime]. `role`: whose store it is, for its errors (the optimizer's by
    default)."""

    def __init__(self, sizes: dict, folder, *, rank: int = 0, role: StoreRole = OPTIMIZER):
        self.folder = Path(folder) / f"rank{rank}"
        self.role = role
        self.sizes = {}
        _check_folder(self.folder, role)
        made = not self.folder.exists()
        # the room a store killed there left counts: it is deleted below, once the lock is ours
        _check_writable(self.folder, bytes_needed(sizes) - _leftover_bytes(self.folder), role)
        try:
            folder_fd, lock_fd, previous = _lock(self.folder, role)
        except OffloadStoreError:
            if made:
                _remove_folders(self.folder, role)
            raise
        self._held = _Held(self.folder, folder_fd, lock_fd, role)
        self._fds = self._held.fds  # one dict: what `add` opens, `close` closes
        self._files = self._held.files  # name -> file name
        # bytes moved and seconds spent in pread/pwrite (all threads), for the benchmarks
        self.stats = {"read_bytes": 0, "write_bytes": 0, "read_seconds": 0.0, "write_seconds": 0.0}
        self._stats_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self._held.release)
        self._copies = None  # why `map` gives copies, not mapped pages: decided at the first `map`
        self._watched = {}  # id(mapping) -> the finalizer that stops watching it for SIGBUS
        self._pending = None  # a write-back error that `flush` met on another thread: raised by the next call
        try:
            _remove_leftover(self._held, previous)
        except OffloadStoreError:
            self.close()
            raise
        self.add(sizes)

    def add(self, sizes: dict) -> None:
        """Create (and reserve on disk) the files of more tensors: {name: numel} (fp32) or
        {name: (numel, dtype)}. Each is made afresh: an existing file is never opened."""
        needed = bytes_needed(sizes)
        _check_writable(self.folder, needed, self.role)
        self.sizes.update(sizes)
        try:
            for name, size in sizes.items():
                numel, dtype = _numel_dtype(size)
                self._held.create(name, f"{name}.{_SUFFIX[dtype]}")
                if numel:
                    # reserved now: no ENOSPC later where blocks are rewritten in place (not on a
                    # copy-on-write filesystem: see [Note: stepping on mapped pages])
                    os.posix_fallocate(self._fds[name], 0, numel * dtype.itemsize)
        except OSError as e:
            self.close()
            raise self._not_created(needed, e) from None

    def _not_created(self, needed: int, e: OSError) -> OffloadStoreError:
        fp32 = "fp32 " if all(_numel_dtype(size)[1] == torch.float32 for size in self.sizes.values()) else ""
        if e.errno == errno.EEXIST:
            fix = (f"{e.filename} is there already, and the store never opens a file it did not make: move it, or "
                   f"point {self.role.setting} to another folder")  # fmt: skip
        else:
            fix = f"{e.strerror or e}; free some space or point {self.role.setting} to a larger disk"
        return OffloadStoreError(
            f"cannot create the {self.role.name} in {str(self.folder)!r} ({needed:,} bytes for {len(self.sizes)} "
            f"{fp32}tensors): {fix}"
        )

    def read(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (CPU, the tensor's dtype; any strides) with elements [start, start + out.numel())."""
        self._check(name, out, "read into")
        if not out.is_contiguous():
            return out.copy_(self.read(name, start, torch.empty(out.shape, dtype=out.dtype)))
        view = _bytes_of(out)
        done, offset = 0, out.element_size() * start
        self._written_back(name, offset, len(view))
        began = time.perf_counter()
        while done < len(view):
            try:
                got = os.preadv(self._fds[name], [view[done:]], offset + done)
            except OSError as e:
                raise self._failed("read", name, offset, len(view), e) from None
            if got == 0:
                raise OffloadStoreError(f"{self.folder / self._files[name]} is shorter than expected (read past its end)")
            done += got
        self._count("read", done, began)
        return out

    def write(self, name: str, start: int, data: torch.Tensor) -> None:
        """Elements [start, start + data.numel()) of `name` <- `data` (CPU, the tensor's dtype; any strides)."""
        self._check(name, data, "write from")
        data = data.contiguous()  # kept alive while its bytes are written
        view = _bytes_of(data)
        done, offset = 0, data.element_size() * start
        began = time.perf_counter()
        while done < len(view):
            try:
                done += os.pwritev(self._fds[name], [view[done:]], offset + done)
            except OSError as e:
                raise self._failed("write", name, offset, len(view), e) from None
        self._count("write", done, began)

    def _check(self, name: str, t: torch.Tensor, what: str) -> None:
        """Raise the write-back error `flush` met; refuse a tensor whose bytes are not the file's."""
        self._raise_pending()
        dtype = _numel_dtype(self.sizes[name])[1]
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(f"cannot {what} a {t.dtype} tensor on {t.device}: {name} of the {self.role.name} holds "
                             f"{dtype} (read and write a CPU tensor of that dtype)")  # fmt: skip

    def map(self, name: str, start: int, numel: int):
        """Elements [start, start + numel) of `name` as a tensor on the file's page-cache pages,
        faulted in writable (`_populate_writable`) before it returns, with the mapping to give to
        `unmap`: (tensor, mapping). The range must start on a page boundary and hold an element at
        least (else `read`/`write` it). Writes to the tensor are writes to the file. On a
        copy-on-write filesystem, or where no SIGBUS handler could be built, the tensor is a copy
        that `unmap` writes back. See [Note: stepping on mapped pages]."""
        self._raise_pending()
        dtype = _numel_dtype(self.sizes[name])[1]
        offset, nbytes = start * dtype.itemsize, numel * dtype.itemsize
        if offset % mmap.ALLOCATIONGRANULARITY or not nbytes:
            raise ValueError(f"cannot map {nbytes} bytes at byte {offset} of {name}: not a page-aligned, "
                             "non-empty range")
        if self._copied():
            copy = self.read(name, start, torch.empty(numel, dtype=dtype))
            return copy, _Copy(name, start, copy)
        self._written_back(name, offset, nbytes)
        began = time.perf_counter()
        try:
            mapping = mmap.mmap(self._fds[name], nbytes, flags=mmap.MAP_SHARED | _populate_flag(), offset=offset)
        except OSError as e:
            raise self._failed("map", name, offset, nbytes, e) from None
        _populate_writable(mapping)
        tensor = torch.frombuffer(mapping, dtype=dtype, count=numel)
        self._watch(mapping, tensor.data_ptr(), name, offset, nbytes)
        self._count("read", nbytes, began)
        return tensor, mapping

    def unmap(self, mapping) -> None:
        """Give back a range from `map` whose tensor was written (counted as written). The tensor
        and every view of it must be gone; a view still alive keeps the pages mapped until it
        goes (never a dangling pointer)."""
        if isinstance(mapping, _Copy):
            self.write(mapping.name, mapping.start, mapping.tensor)
            return
        self._raise_pending()
        began = time.perf_counter()
        nbytes = len(mapping)
        watched = self._watched.pop(id(mapping), None)
        try:
            mapping.close()
        except BufferError:  # a view is still alive: the mapping goes with it (and is watched until then)
            pass
        else:
            if watched is not None:
                watched()
        self._count("write", nbytes, began)

    def flush(self, name: str, start: int, numel: int) -> None:
        """Start writing back the dirty pages of elements [start, start + numel) of `name`, without
        waiting for it (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`; nothing elsewhere, and
        nothing once the store is closed: the kernel writes them back anyway). A write-back error
        of the file (this range's or an earlier one's) raises `OffloadStoreError`, here and at the
        store's next call."""
        self._raise_pending()
        fd = self._fds.get(name)
        if _sync_file_range is not None and fd is not None:
            size = _numel_dtype(self.sizes[name])[1].itemsize
            flags = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE  # the file's errors so far, checked
            self._sync_range(name, fd, start * size, numel * size, flags)

    def _written_back(self, name: str, offset: int, nbytes: int) -> None:
        """Raise the file's write-back error, if any, once that range's write-back in flight is done."""
        fd = self._fds.get(name)
        if _sync_file_range is not None and fd is not None:
            self._sync_range(name, fd, offset, nbytes, _SYNC_FILE_RANGE_WAIT_BEFORE)

    def _sync_range(self, name: str, fd: int, offset: int, nbytes: int, flags: int) -> None:
        if _sync_file_range(fd, offset, nbytes, flags) == 0:
            return
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.ESPIPE, errno.EINVAL) or (code == errno.EBADF and self._held.closed):
            return  # not supported here, or the store closed meanwhile: nothing to check
        self._pending = self._failed("write back", name, offset, nbytes, OSError(code, os.strerror(code)))
        raise self._pending

    def _raise_pending(self) -> None:
        if self._pending is not None:
            raise self._pending

    def _copied(self) -> bool:
        """Whether `map` gives copies (decided, and said, once a store)."""
        with _DECIDING:  # the engine maps on two reader threads
            if self._copies is None:
                self._copies = self._why_copies()
        return bool(self._copies)

    def _why_copies(self) -> str:
        """Why `map` must give copies ("" where it maps), said in the log once."""
        why = copy_on_write(self.folder)
        if why is None and _mapping.guard() is None:
            why = "no SIGBUS handler could be built for the mapped pages"
        _tell_the_sigbus_handler()  # the handler may have been built just now: what it deletes
        if why:
            logger.info("the %s in %s reads and writes copies, not mapped pages: %s", self.role.name, self.folder,
                        why)  # fmt: skip
        return why or ""

    def _watch(self, mapping, address: int, name: str, offset: int, nbytes: int) -> None:
        """A SIGBUS on `mapping`'s pages says which file and why: [Note: a fault on a mapped page]."""
        guard, role = _mapping.guard(), self.role
        message = (
            f"trainer_shard: SIGBUS (bus error) on a mapped page of the {role.name} file "
            f"{self.folder / self._files[name]} (bytes {offset:,} to {offset + nbytes:,}): the filesystem could not "
            "back a write to the page (disk full on a copy-on-write filesystem?) or read it in (an I/O error, or "
            f"the file truncated by another process). The {role.what} of this run are lost and the store's files "
            f"deleted: resume from the last checkpoint, with {role.setting} on a healthy disk; set "
            f"{_NO_MMAP}=1 for errors that name the cause instead of this signal.\n"
        )
        slot = guard.watch(address, nbytes, message) if guard is not None else None
        if slot is not None:
            self._watched[id(mapping)] = weakref.finalize(mapping, guard.unwatch, slot)

    def _count(self, what: str, nbytes: int, began: float) -> None:
        with self._stats_lock:  # reader and writer threads both count
            self.stats[f"{what}_bytes"] += nbytes
            self.stats[f"{what}_seconds"] += time.perf_counter() - began

    def _failed(self, what: str, name: str, offset: int, size: int, error: OSError) -> OffloadStoreError:
        role = self.role
        return OffloadStoreError(
            f"the {role.name} could not {what} {size:,} bytes at byte {offset:,} of "
            f"{str(self.folder / self._files[name])}: {error.strerror or error}; the {role.what} of this run are lost "
            f"from that point: resume from the last checkpoint with {role.setting} on a healthy, writable disk"
        )

    def close(self) -> None:
        """Delete this rank's files, lock file and folder (and the folders above it that a store
        made, once nothing else is in them), then release the lock. Idempotent; also runs when the
        store is garbage collected and at exit. A file it cannot delete is reported (a warning)."""
        self._finalizer()


@dataclass
class _Copy:
    """What `map` gives for `unmap` where it copies: the range and the copy to write back."""

    name: str
    start: int
    tensor: torch.Tensor


_DECIDING = threading.Lock()
_NO_MMAP = "TRAINER_SHARD_NO_MMAP"  # store_io.NO_MMAP_ENV: the engine then reads and writes copies itself


# ---- what a store holds, and every store of this process ---------------------------------------


class _Held:
    """What an open `DiskStore` holds (its folder and that folder's descriptor, the descriptor of
    its locked lock file, its files' descriptors), apart from the store so that its finalizer and
    `close_all` can delete them without keeping the store alive. Registered in `_OPEN` until deleted."""

    def __init__(self, folder: Path, folder_fd: int, lock_fd: int, role: StoreRole = OPTIMIZER):
        self.folder, self.folder_fd, self.lock_fd, self.role = folder, folder_fd, lock_fd, role
        self.fds, self.files = {}, {}
        self.pid = os.getpid()
        self.deleted = self.closed = False
        _OPEN.add(self)
        watch_sigterm()

    def create(self, name: str, file: str) -> None:
        """Make `file`, the file of tensor `name`, in the folder (never an existing one, never
        through a link), then name it in the lock file: a store killed from then on left it, and
        the next one deletes it."""
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self.folder_fd)  # fmt: skip
        self.files[name], self.fds[name] = file, fd
        os.pwrite(self.lock_fd, f"file {file}\n".encode(), os.fstat(self.lock_fd).st_size)
        _tell_the_sigbus_handler()

    def release(self, *, hard: bool = False) -> None:
        """Delete the files, the lock file and the folder, then close the descriptors (releasing
        the lock). `hard`: the process ends next and other threads may still read or write, so
        the descriptors are left for the exit to close. A forked child only closes its copies:
        the files are its parent's."""
        if not self.deleted:
            self.deleted = True
            _OPEN.discard(self)
            if self.pid == os.getpid():
                for name in list(self.fds):
                    _unlink(self.folder / self.files[name], self.role, self.folder_fd)
                _unlink_lock(self)
                _remove_folders(self.folder, self.role)
                _tell_the_sigbus_handler()
            if not _OPEN:
                _unwatch_sigterm()
        if not hard and not self.closed:
            self.closed = True
            for fd in [*self.fds.values(), self.lock_fd, self.folder_fd]:
                _close_fd(fd)
            self.fds.clear()


def _tell_the_sigbus_handler() -> None:
    """What the SIGBUS handler deletes, once built: the files of every store open in this process."""
    guard = _mapping.built()
    if guard is not None:
        mine = [held for held in list(_OPEN) if held.pid == os.getpid()]
        guard.deletes([(held.folder_fd, file) for held in mine for file in [*map(held.files.get, held.fds), _LOCK]]
                      + [(None, str(held.folder.absolute())) for held in mine])  # fmt: skip


_OPEN = set()  # the `_Held` of every disk store open in this process


def close_all() -> None:
    """Delete every disk store this process has open, in the last moment before `os._exit` (which
    runs no finalizer and no atexit hook; faults.py calls this before each of its hard exits).
    Other threads may still be reading or writing: the files are unlinked, and their descriptors
    left for the exit to close. Never raises. See [Note: disk store lifetime]."""
    for held in list(_OPEN):
        try:
            held.release(hard=True)
        except Exception as e:  # noqa: BLE001 - on the way out: say it, go on with the others
            logger.warning("could not delete the %s in %s: %s", held.role.name, held.folder, e)


def watch_sigterm() -> None:
    """While a store is open, SIGTERM whose action is the default one (death) deletes the stores
    first (`_die_of_sigterm`); a handler someone installed is left alone (faults.InterruptGuard
    during train() ends the process through `close_all` or an ordinary exit, and calls this when
    it puts the default back). Main thread only, as `signal.signal`."""
    main = threading.current_thread() is threading.main_thread()
    if _OPEN and main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _die_of_sigterm)


def _unwatch_sigterm() -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _die_of_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _die_of_sigterm(signum, frame) -> None:
    """Delete the stores, then die of the signal as its default action would have."""
    close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # not reached: the signal is delivered before kill() returns


# ---- the lock of a rank's folder ---------------------------------------------------------------

_LOCK = ".lock"
_HEADER = "trainer_shard disk store of process {} on host {}"


def _lock(folder: Path, role: StoreRole = OPTIMIZER) -> tuple:
    """(folder's descriptor, descriptor, previous record) of an exclusive lock on `folder`'s lock
    file, which then names this process and the files of the previous record; that record is the
    ((pid, host), files) a store killed there left, else None. Raises `OffloadStoreError` naming
    the holder when another store has it, and naming the path when the folder or the lock file is
    not this user's own (a symbolic link, another user's)."""
    for attempt in range(100):
        try:
            folder_fd = _open_folder(folder, role)
        except FileNotFoundError:  # a store closing there removed the folder (and those above it that a store made)
            _make_folder(folder, role)
            continue
        try:
            fd = _lock_in(folder_fd, folder, role, retry=attempt == 0)
        except BaseException:
            _close_fd(folder_fd)
            raise
        if fd is not None:
            previous = _read_lock(fd)
            _write_lock(fd, previous[1] if previous else [])
            return folder_fd, fd, previous
        _close_fd(folder_fd)
    raise OffloadStoreError(f"could not lock {str(folder / _LOCK)!r}: other processes kept replacing it; try again")


def _lock_in(folder_fd: int, folder: Path, role: StoreRole, retry: bool) -> int | None:
    """The descriptor of the lock file in the folder `folder_fd`, locked; None to try again: the
    folder or the lock file was removed meanwhile, or (`retry`) a store of this process that
    nothing references any more held it."""
    path = folder / _LOCK
    try:
        fd = _open_lock(folder_fd, path, role)
    except FileNotFoundError:  # the folder was removed after we opened it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd, wait=1.0)
        _close_fd(fd)
        if holder == _me() and retry:
            gc.collect()  # a store of this process that nothing references any more: its finalizer frees it
            return None
        raise _in_use(folder, holder, role) from None
    except OSError as e:
        _close_fd(fd)
        raise OffloadStoreError(
            f"cannot lock {str(path)!r}: {e.strerror or e}; the {role.name} needs a filesystem with file locks "
            f"(flock): point {role.setting} to a local disk"
        ) from None
    if _same_file(fd, folder_fd):
        return fd
    _close_fd(fd)  # its holder deleted it between our open and our lock: lock the one there now
    return None


def _open_folder(folder: Path, role: StoreRole) -> int:
    """A descriptor of the rank's folder, which must be a real folder of this user (not a link)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        _check_folder(folder, role)
        raise OffloadStoreError(f"cannot open the {role.name} folder {str(folder)!r}: {e.strerror or e}; set "
                                f"{role.key} to a writable folder") from None  # fmt: skip
    try:
        _refuse_unless_own_folder(os.fstat(fd), folder, role)
    except OffloadStoreError:
        _close_fd(fd)
        raise
    return fd


def _check_folder(folder: Path, role: StoreRole = OPTIMIZER) -> None:
    """Refuse a rank folder that is there but is not a real folder of this user's (`lstat`)."""
    try:
        _refuse_unless_own_folder(os.lstat(folder), folder, role)
    except (FileNotFoundError, NotADirectoryError):
        return  # not there yet (or cannot be: making it says why)


def _refuse_unless_own_folder(st: os.stat_result, folder: Path, role: StoreRole) -> None:
    if stat.S_ISLNK(st.st_mode):
        why = "is a symbolic link: the store would make and delete files where it points"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a folder"
    elif st.st_uid != os.geteuid():
        why = f"belongs to another user (uid {st.st_uid}): its files are not this run's to make or delete"
    else:
        return
    raise OffloadStoreError(f"the {role.name} folder {str(folder)!r} {why}; remove it, or set {role.key} to a folder "
                            "of your own")  # fmt: skip


def _open_lock(folder_fd: int, path: Path, role: StoreRole) -> int:
    """The lock file in the folder `folder_fd`, made if missing, never through a link, and only
    this user's own, with no other name (a hard link to a file of the user's)."""
    try:
        fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _not_own_lock(path, "is a symbolic link: the store opens nothing through a link", role) from None
        raise OffloadStoreError(
            f"cannot create the lock file {str(path)!r} of the {role.name}: {e.strerror or e}; set "
            f"{role.key} to a writable folder"
        ) from None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_uid != os.geteuid():
        why = f"belongs to another user (uid {st.st_uid})"
    elif st.st_nlink != 1:
        why = f"has {st.st_nlink} names (a hard link to another file?): the store writes only a file of its own"
    if why is not None:
        _close_fd(fd)
        raise _not_own_lock(path, why, role)
    return fd


def _not_own_lock(path: Path, why: str, role: StoreRole) -> OffloadStoreError:
    return OffloadStoreError(f"the lock file {str(path)!r} of the {role.name} {why}; nothing was written or "
                             f"deleted: remove it, or set {role.key} to a folder of your own")  # fmt: skip


def _read_lock(fd: int) -> tuple | None:
    """((pid, host), file names) that a store's lock file records, or None: no such record (empty,
    or not written by a store)."""
    lines = os.pread(fd, 1 << 20, 0).decode(errors="replace").splitlines()
    header = re.fullmatch(_HEADER.format(r"(\d+)", r"(\S+)"), lines[0]) if lines else None
    if header is None:
        return None
    files = [line[len("file "):] for line in lines[1:] if line.startswith("file ")]
    return header.groups(), sorted({file for file in files if _is_store_file(file)})


def _write_lock(fd: int, files: list) -> None:
    """The lock file <- this process, and `files`: what a killed store left, until deleted."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, "".join([_HEADER.format(*_me()) + "\n", *(f"file {file}\n" for file in files)]).encode(), 0)


def _make_folder(folder: Path, role: StoreRole) -> None:
    """Make a rank's folder and what is missing above it, marking each folder above it that this
    made (`_MADE_HERE`): a store removes those, and only those, when it is done with them."""
    missing = []
    parent = folder.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for made in missing:
            (made / _MADE_HERE).touch()
    except OSError as e:
        raise OffloadStoreError(
            f"cannot create the {role.name} folder {str(folder)!r}: {e.strerror or e}; set {role.key} to a "
            "writable folder"
        ) from None


def _me() -> tuple:
    return str(os.getpid()), socket.gethostname()


def _holder(fd: int, wait: float = 0.0) -> tuple | None:
    """(pid, host) the lock file names; waits up to `wait` s for a holder that has just locked it
    to write itself in."""
    deadline = time.monotonic() + wait
    while True:
        record = _read_lock(fd)
        if record is not None or time.monotonic() >= deadline:
            return record[0] if record is not None else None
        time.sleep(0.05)


def _same_file(fd: int, folder_fd: int) -> bool:
    """Whether `fd` is the lock file now in the folder `folder_fd`."""
    try:
        here, there = os.fstat(fd), os.stat(_LOCK, dir_fd=folder_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _in_use(folder: Path, holder: tuple | None, role: StoreRole = OPTIMIZER) -> OffloadStoreError:
    if holder == _me():
        return OffloadStoreError(
            f"the {role.name} folder {str(folder)!r} is in use by another store of this process (pid {holder[0]}): "
            f"close {role.owner} before making another one there, or give this one another {role.setting}"
        )
    who = f"process {holder[0]} on host {holder[1]}" if holder else "another process"
    return OffloadStoreError(
        f"the {role.name} folder {str(folder)!r} is in use by another run: {who} holds its lock. Two runs on one "
        f"store would overwrite each other's {role.what}: give this run another {role.setting} ({role.key} in the "
        "--offload config), or wait for that run to end (or stop it) and start again"
    )


def _check_not_in_use(folder: Path, role: StoreRole = OPTIMIZER) -> None:
    """Raise `OffloadStoreError` if another process's store holds `folder` (a check at start: it
    takes no lock and deletes nothing; a store of this process is its own business)."""
    try:
        fd = os.open(folder / _LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (or a link: the store refuses it when it opens): no store there
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd, wait=1.0)
        if holder != _me():
            raise _in_use(folder, holder, role) from None
    except OSError:
        pass  # no file locks here: the store says so when it opens
    finally:
        _close_fd(fd)


# ---- deleting ----------------------------------------------------------------------------------


def _leftover_bytes(folder: Path) -> int:
    """Bytes of the files that a store's lock file in `folder` names (a killed store's: deleted
    once the lock is ours; a live one's: that store refuses this one anyway)."""
    try:
        fd = os.open(folder / _LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        record = _read_lock(fd)
    finally:
        _close_fd(fd)
    return sum(_size(folder / file) for file in record[1]) if record else 0


def _remove_leftover(held: "_Held", previous: tuple | None) -> None:
    """Delete the files a store killed with SIGKILL left in the folder (its lock file names them,
    and its lock was free: no process uses them), and say so. Refuse a folder with files like a
    store's that no lock file names: they are the user's, or of unknown origin, and stay."""
    role, folder = held.role, held.folder
    named = previous[1] if previous else []
    others = sorted(f for f in os.listdir(held.folder_fd) if _is_store_file(f) and f not in named)
    if others:
        raise OffloadStoreError(
            f"the {role.name} folder {str(folder)!r} holds files that no store made (no lock file of a store "
            f"names them): {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}; the store neither "
            f"overwrites nor deletes them: move them, or set {role.key} to another folder"
        )
    files = [f for f in named if _exists(f, held.folder_fd)]
    if not files:
        return
    freed = sum(_unlink(folder / f, role, held.folder_fd) for f in files)
    by = f" by process {previous[0][0]} on host {previous[0][1]}"
    logger.warning("removed a leftover %s in %s: %s freed (%d files left%s, which ended without "
                   "deleting them: killed with SIGKILL, or its machine went down)",
                   role.name, folder, format_bytes(freed), len(files), by)  # fmt: skip


def _exists(file: str, folder_fd: int) -> bool:
    try:
        os.stat(file, dir_fd=folder_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _size(path: Path, folder_fd: int | None = None) -> int:
    """The size of `path` (itself, not where a link points), or of its name in the folder `folder_fd`."""
    try:
        if folder_fd is None:
            return os.lstat(path).st_size
        return os.stat(path.name, dir_fd=folder_fd, follow_symlinks=False).st_size
    except OSError:
        return 0


def _unlink(path: Path, role: StoreRole = OPTIMIZER, folder_fd: int | None = None) -> int:
    """Delete `path` (by its name in the folder `folder_fd`, when given): the bytes freed (0 when
    there was nothing to delete, or it could not be: that is reported)."""
    size = _size(path, folder_fd)
    try:
        if folder_fd is None:
            os.unlink(path)
        else:
            os.unlink(path.name, dir_fd=folder_fd)
    except FileNotFoundError:
        return 0
    except OSError as e:
        logger.warning("could not delete the %s file %s (%s): %s; delete it by hand", role.name, path,
                       format_bytes(size), e.strerror or e)  # fmt: skip
        return 0
    return size


def _unlink_lock(held: "_Held") -> None:
    """Delete the lock file while it is still locked (a store taking over after the lock is released
    makes a new one); only the one `held` locks: another store's is never touched."""
    if _same_file(held.lock_fd, held.folder_fd):
        _unlink(held.folder / _LOCK, held.role, held.folder_fd)


def _remove_folders(folder: Path, role: StoreRole = OPTIMIZER) -> None:
    """Remove a rank's folder once empty, then each folder above it that a store made (marked by
    `_MADE_HERE`) and that holds nothing else, up to the first that stays. A folder with anything
    else in it stays (another rank's folder, another store's, a file of the user's, the lock of a
    store that just took over), and so does one the user made (unmarked); one that cannot be
    removed is reported."""
    try:
        folder.rmdir()
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
            logger.warning("could not delete the %s folder %s: %s; delete it by hand", role.name, folder,
                           e.strerror or e)  # fmt: skip
    # Ranks and stores close in any order: whichever finds a marked folder empty but for its mark
    # removes it, and goes on up.
    parent = folder.parent
    while parent != parent.parent:
        try:
            if os.listdir(parent) != [_MADE_HERE]:
                return  # unmarked (the user's), or something else still in it
            (parent / _MADE_HERE).unlink(missing_ok=True)
        except FileNotFoundError:
            parent = parent.parent  # another store removed it first: the one above may be empty now too
            continue
        except OSError:
            return
        try:
            parent.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # something appeared in it between the two steps: it stays, still a store's
            try:
                (parent / _MADE_HERE).touch()
            except OSError:
                pass
            return
        parent = parent.parent


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


_MADE_HERE = ".made-by-trainer_shard"

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault the pages in at mmap, on the caller's thread
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the pages in writable (and dirty), in one call
_populate_write = [hasattr(mmap.mmap, "madvise")]  # until the kernel refuses it once (EINVAL before 5.14)


def _populate_flag() -> int:
    """MAP_POPULATE where `_populate_writable` cannot populate the mapping instead."""
    return 0 if _populate_write[0] else _POPULATE


def _populate_writable(mapping) -> None:
    """Fault a new shared mapping's pages in writable, on the caller's (reader) thread, where the
    kernel can: MAP_POPULATE maps a shared file's pages read-only, and the step's first write to
    each page then traps once more for the kernel to mark it dirty (t5-large: 2.2 million faults a
    step on the thread that steps). The step writes every page it maps, so nothing is dirtied
    that would not be. Where the kernel refuses (before Linux 5.14), the mappings after it are
    made with MAP_POPULATE instead and this one faults on first touch. An I/O error here is left
    to the touch, where the SIGBUS handler names it."""
    if not _populate_write[0]:
        return
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except OSError as e:
        if e.errno == errno.EINVAL:
            _populate_write[0] = False
_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE = 1, 2


def _libc_sync_file_range():
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_sync_file_range = _libc_sync_file_range()


def _numel_dtype(size) -> tuple:
    """A store size, `numel` (fp32) or `(numel, dtype)`, as (numel, dtype)."""
    return (int(size), torch.float32) if isinstance(size, int) else (int(size[0]), size[1])


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, any dtype, in place; valid while `t` lives. Not
    `t.numpy()`: numpy has no bfloat16, and torch marks a storage it exposed to numpy as not
    resizable, which a ZeRO-3 gather buffer must be (`zero3.GatherPool`)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _is_store_file(name: str) -> bool:
    """Whether `name` could be a store's file: a plain name ending as one (`*.f32`, `*.bf16`, `*.f16`)."""
    return "/" not in name and not name.startswith(".") and name.rsplit(".", 1)[-1] in _SUFFIX.values()


def bytes_needed(sizes: dict) -> int:
    """Bytes of the files of `sizes` ({name: numel} for fp32, or {name: (numel, dtype)})."""
    return sum(numel * dtype.itemsize for numel, dtype in map(_numel_dtype, sizes.values()))


def check_disk_store(folder, rank: int, needed: int, *, in_use: bool = False, role: StoreRole = OPTIMIZER) -> None:
    """The checks `DiskStore` makes before it writes anything, for a run to make at start: writable,
    with room (counting what a killed store left) and, with `in_use`, not held by another process's
    store (for this process's own rank only: a peer's store of the same run may be open already).
    `role`: whose store it is, for the errors (the optimizer's by default)."""
    folder = Path(folder) / f"rank{rank}"
    _check_folder(folder, role)
    if in_use:
        _check_not_in_use(folder, role)
    _check_writable(folder, needed - _leftover_bytes(folder), role, create=False)


def _check_writable(folder: Path, needed: int, role: StoreRole = OPTIMIZER, create: bool = True) -> None:
    existing = existing_parent(folder)
    free = free_bytes(existing)
    if free < needed:
        raise OffloadStoreError(
            f"the {role.name} needs {needed:,} bytes in {str(folder)!r} but only {free:,} are free: its {role.what} "
            f"do not fit; free some space or point {role.setting} to a larger disk"
        )
    if not create:
        if not existing.is_dir():
            raise OffloadStoreError(
                f"cannot create the {role.name} folder {str(folder)!r}: {str(existing)!r} is not a folder; set "
                f"{role.key} to a writable folder"
            )
        if not is_writable(existing):
            raise OffloadStoreError(
                f"cannot create the {role.name} folder {str(folder)!r}: {str(existing)!r} is not writable; set "
                f"{role.key} to a writable folder"
            )
        return
    _make_folder(folder, role)
    if not is_writable(folder):
        raise OffloadStoreError(
            f"the {role.name} folder {str(folder)!r} is not writable; set {role.key} to a writable folder"
        )
