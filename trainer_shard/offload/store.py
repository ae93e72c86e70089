"""Where offloaded shard tensors live: CPU RAM or memmap files on disk.

A store holds named flat fp32 tensors ("0.master", "0.exp_avg", ...: one set per flat group of
the shard, each of its own size), read and written by ranges; the engine streams through it
chunk by chunk and decides what moves where.

- `CpuStore`: plain tensors in RAM, page-locked (pinned) when CUDA is present and asked for,
  so host-device copies can run asynchronously.
- `DiskStore`: one file per name under `<nvme_path>/rank<R>/`, created at start after a
  free-space check, removed by `close()`. Chunks are read into and written from caller-owned
  buffers with `pread`/`pwrite` (no memory map, whose touched pages would count in the process's
  RSS), so the RAM the store costs is the chunk buffers in flight, not the model.

Failures are errors that name the path and the bytes needed (`OffloadStoreError`), raised before
anything is written: an unwritable folder, or a disk without room for the files.
"""

import os
import shutil
from pathlib import Path

import torch

from ..disk import existing_parent, free_bytes, is_writable
from ..errors import TrainerShardError


class OffloadStoreError(TrainerShardError):
    """The offload store cannot be created or written: the path and the bytes are in the message."""


class CpuStore:
    """Tensors in RAM. `read` returns views (no copy); `write` of a view onto itself is free."""

    def __init__(self, sizes: dict, *, pin_memory: bool = False):
        self.sizes = dict(sizes)
        self.pinned = bool(pin_memory and torch.cuda.is_available())
        self._tensors = {n: torch.zeros(k, dtype=torch.float32, pin_memory=self.pinned) for n, k in self.sizes.items()}

    def add(self, sizes: dict) -> None:
        for name, numel in sizes.items():
            self._tensors[name] = torch.zeros(numel, dtype=torch.float32, pin_memory=self.pinned)
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
    """Files under `folder/rank<rank>/`; see the module docstring."""

    def __init__(self, sizes: dict, folder, *, rank: int = 0):
        self.folder = Path(folder) / f"rank{rank}"
        made_parent = not self.folder.parent.exists()
        self.sizes = {}
        self._fds = {}
        self.add(sizes)
        if made_parent:  # nvme_path is ours to remove when the last rank's folder is gone
            (self.folder.parent / _MADE_HERE).touch()

    def add(self, sizes: dict) -> None:
        """Create (and reserve on disk) the files of more tensors."""
        needed = bytes_needed(sizes)
        _check_writable(self.folder, needed)
        self.sizes.update(sizes)
        try:
            for name, numel in sizes.items():
                fd = os.open(self.folder / f"{name}.f32", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self._fds[name] = fd
                if numel:
                    os.posix_fallocate(fd, 0, 4 * numel)  # reserve the space now: no ENOSPC mid-run
        except OSError as e:
            self.close()
            raise OffloadStoreError(
                f"cannot create the disk store in {str(self.folder)!r} ({needed:,} bytes for {len(self.sizes)} "
                f"fp32 tensors): {e.strerror or e}; free some space or point nvme_path to a larger disk"
            ) from None

    def read(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (fp32, contiguous, CPU) with elements [start, start + out.numel())."""
        view = memoryview(out.numpy()).cast("B")
        done, offset = 0, 4 * start
        while done < len(view):
            try:
                got = os.preadv(self._fds[name], [view[done:]], offset + done)
            except OSError as e:
                raise self._failed("read", name, offset, len(view), e) from None
            if got == 0:
                raise OffloadStoreError(f"{self.folder / name}.f32 is shorter than expected (read past its end)")
            done += got
        return out

    def write(self, name: str, start: int, data: torch.Tensor) -> None:
        view = memoryview(data.contiguous().numpy()).cast("B")
        done, offset = 0, 4 * start
        while done < len(view):
            try:
                done += os.pwritev(self._fds[name], [view[done:]], offset + done)
            except OSError as e:
                raise self._failed("write", name, offset, len(view), e) from None

    def _failed(self, what: str, name: str, offset: int, size: int, error: OSError) -> OffloadStoreError:
        return OffloadStoreError(
            f"the disk store could not {what} {size:,} bytes at byte {offset:,} of {str(self.folder / name)}.f32: "
            f"{error.strerror or error}; the optimizer state of this run is lost from that point: resume from the "
            "last checkpoint with nvme_path on a healthy, writable disk"
        )

    def close(self) -> None:
        """Close and delete this rank's files (and nvme_path itself if this store made it and it is empty)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self.folder.is_dir():
            shutil.rmtree(self.folder, ignore_errors=True)
        parent = self.folder.parent
        # Ranks close in any order: whichever finds no rank folder left removes the folder a rank
        # created (marked); a folder the user made stays.
        try:
            if (parent / _MADE_HERE).exists() and not any(p.name.startswith("rank") for p in parent.iterdir()):
                (parent / _MADE_HERE).unlink(missing_ok=True)
                parent.rmdir()
        except OSError:
            pass  # another rank got there first (even between the two checks), or a file appeared


_MADE_HERE = ".made-by-trainer_shard"


def bytes_needed(sizes: dict) -> int:
    return 4 * sum(sizes.values())


def check_disk_store(folder, rank: int, needed: int) -> None:
    """The checks `DiskStore` makes before it writes anything, for a run to make at start."""
    _check_writable(Path(folder) / f"rank{rank}", needed, create=False)


def _check_writable(folder: Path, needed: int, create: bool = True) -> None:
    existing = existing_parent(folder)
    free = free_bytes(existing)
    if free < needed:
        raise OffloadStoreError(
            f"the disk store needs {needed:,} bytes in {str(folder)!r} but only {free:,} are free; free some space "
            "or point nvme_path to a larger disk"
        )
    if not create:
        if not existing.is_dir():
            raise OffloadStoreError(
                f"cannot create the disk store folder {str(folder)!r}: {str(existing)!r} is not a folder; set "
                "zero_optimization.offload_optimizer.nvme_path to a writable folder"
            )
        if not is_writable(existing):
            raise OffloadStoreError(
                f"cannot create the disk store folder {str(folder)!r}: {str(existing)!r} is not writable; set "
                "zero_optimization.offload_optimizer.nvme_path to a writable folder"
            )
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OffloadStoreError(
            f"cannot create the disk store folder {str(folder)!r}: {e.strerror or e}; set "
            "zero_optimization.offload_optimizer.nvme_path to a writable folder"
        ) from None
    if not is_writable(folder):
        raise OffloadStoreError(
            f"the disk store folder {str(folder)!r} is not writable; set zero_optimization.offload_optimizer.nvme_path "
            "to a writable folder"
        )
