"""Where offloaded shard tensors live: CPU RAM or memmap files on disk.

A store holds named flat fp32 tensors of the shard's size ("master", "exp_avg", ...), read and
written by ranges; the engine streams through it chunk by chunk and decides what moves where.

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

from ..errors import TrainerShardError


class OffloadStoreError(TrainerShardError):
    """The offload store cannot be created or written: the path and the bytes are in the message."""


class CpuStore:
    """Tensors in RAM. `read` returns views (no copy); `write` of a view onto itself is free."""

    def __init__(self, names, numel: int, *, pin_memory: bool = False):
        self.names = list(names)
        self.numel = numel
        self.pinned = bool(pin_memory and torch.cuda.is_available())
        self._tensors = {n: torch.zeros(numel, dtype=torch.float32, pin_memory=self.pinned) for n in self.names}

    def read(self, name: str, start: int, out: torch.Tensor | None = None) -> torch.Tensor:
        view = self._tensors[name][start : start + (out.numel() if out is not None else self.numel - start)]
        if out is None:
            return view
        return out.copy_(view)

    def write(self, name: str, start: int, data: torch.Tensor) -> None:
        target = self._tensors[name][start : start + data.numel()]
        if target.data_ptr() != data.data_ptr():
            target.copy_(data)

    def close(self) -> None:
        self._tensors = {}


class DiskStore:
    """Files under `folder/rank<rank>/`; see the module docstring."""

    def __init__(self, names, numel: int, folder, *, rank: int = 0):
        self.folder = Path(folder) / f"rank{rank}"
        self._made_parent = not self.folder.parent.exists()
        self.names = list(names)
        self.numel = numel
        needed = 4 * numel * len(self.names)
        _check_writable(self.folder, needed)
        self._fds = {}
        try:
            for name in self.names:
                fd = os.open(self.folder / f"{name}.f32", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self._fds[name] = fd
                os.posix_fallocate(fd, 0, 4 * numel)  # reserve the space now: no ENOSPC mid-run
        except OSError as e:
            self.close()
            raise OffloadStoreError(
                f"cannot create the disk store in {str(self.folder)!r} ({needed:,} bytes for {len(self.names)} "
                f"tensors of {numel:,} fp32 values): {e.strerror or e}"
            ) from None

    def read(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (fp32, contiguous, CPU) with elements [start, start + out.numel())."""
        view = memoryview(out.numpy()).cast("B")
        done, offset = 0, 4 * start
        while done < len(view):
            got = os.preadv(self._fds[name], [view[done:]], offset + done)
            if got == 0:
                raise OffloadStoreError(f"{self.folder / name}.f32 is shorter than expected (read past its end)")
            done += got
        return out

    def write(self, name: str, start: int, data: torch.Tensor) -> None:
        view = memoryview(data.contiguous().numpy()).cast("B")
        done, offset = 0, 4 * start
        while done < len(view):
            done += os.pwritev(self._fds[name], [view[done:]], offset + done)

    def close(self) -> None:
        """Close and delete this rank's files (and nvme_path itself if this store made it and it is empty)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self.folder.is_dir():
            shutil.rmtree(self.folder, ignore_errors=True)
        if self._made_parent:
            try:
                self.folder.parent.rmdir()
            except OSError:
                pass  # other ranks' folders are still there


def _check_writable(folder: Path, needed: int) -> None:
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise OffloadStoreError(
            f"the disk store needs {needed:,} bytes in {str(folder)!r} but only {free:,} are free; free some space "
            "or point nvme_path to a larger disk"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OffloadStoreError(
            f"cannot create the disk store folder {str(folder)!r}: {e.strerror or e}; set "
            "zero_optimization.offload_optimizer.nvme_path to a writable folder"
        ) from None
    if not os.access(folder, os.W_OK):
        raise OffloadStoreError(
            f"the disk store folder {str(folder)!r} is not writable; set zero_optimization.offload_optimizer.nvme_path "
            "to a writable folder"
        )
