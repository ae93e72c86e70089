"""The disk under a folder (made or not yet): its room, whether it can be written, and what a
failed write means. Checkpoints (`checkpoint.check_writable`) and the offload store
(`offload.store.check_disk_store`) check through these and word their own errors.

    base = existing_parent("out/checkpoint-500")   # the folder the new one would be made in
    is_writable(base), free_bytes(base)             # a read-only mount or no permission; room
    same_disk("store/params", "store/optim")        # whether two folders (made or not) share their room
    format_bytes(3 * 2**30)                         # '3.00 GiB'
"""

import os
import shutil
from pathlib import Path


def existing_parent(path) -> Path:
    """`path`, or its nearest ancestor that exists (where a folder about to be made would live)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path) -> int:
    """Bytes free on the disk `path` (made or not yet) is on."""
    return shutil.disk_usage(existing_parent(path)).free


def same_disk(a, b) -> bool:
    """Whether folders `a` and `b` (made or not yet) are on one filesystem, so share its free room."""
    return os.stat(existing_parent(a)).st_dev == os.stat(existing_parent(b)).st_dev


def is_read_only(path) -> bool:
    """Whether the filesystem `path` (made or not yet) is on is mounted read-only."""
    return bool(os.statvfs(existing_parent(path)).f_flag & os.ST_RDONLY)


def is_writable(path) -> bool:
    """Whether this process can make files in `path`'s nearest existing folder: not a read-only
    mount, and write and search permission."""
    base = existing_parent(path)
    return not is_read_only(base) and os.access(base, os.W_OK | os.X_OK)


def format_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def describe_write_error(error: Exception, folder=None) -> str:
    """`[Errno 28] No space left on device` -> what failed, where, and the room left there.
    `folder`: where the writing went, for errors that name no file (torch.save's)."""
    where = getattr(error, "filename", None) or folder
    if isinstance(error, OSError):
        text = f"{error.strerror or error} writing {where or 'a file'}"
    else:
        text = f"torch.save could not write into {where}"
    try:
        if is_read_only(where):
            text += " (a read-only filesystem)"
        else:
            text += f" ({format_bytes(free_bytes(where))} free there)"
    except (OSError, TypeError):
        pass
    return text


_WRITE_FAILURES = ("iostream error", "unexpected pos", "cannot be opened", "file write failed", "No space left",
                   "Parent directory",
                   "Read-only file system")  # fmt: skip


def is_write_error(error: Exception) -> bool:
    """Whether a RuntimeError is torch.save's way of saying that a file could not be written."""
    return any(s in str(error) for s in _WRITE_FAILURES)
