"""Where the disk store may step on mapped pages, and what a fault on them says.

- `copy_on_write(path)`: why writes to a mapped page of a file under `path` may need new blocks
  (btrfs, ZFS, ...: a full disk is then a SIGBUS), or None. The store uses copies there.
- `guard()`: the SIGBUS handler, a few lines of C built with the system's C compiler the first
  time a store maps pages in this process; None where it cannot be built (the store then uses
  copies). See [Note: a fault on a mapped page].

[Note: a fault on a mapped page] A mapped page that the kernel cannot read in (an I/O error, the
file truncated under the mapping) or cannot back when it is written (no blocks left on a
copy-on-write filesystem) is a SIGBUS in whatever thread touched it, most often inside a torch
kernel. Python cannot turn that into an error: its own handler only sets a flag and returns, the
instruction faults again, and the process spins for ever; `faulthandler` prints a traceback of
the step but not the file nor the cause; a handler written in Python through ctypes would run
Python code in a signal handler, on a thread that may not hold the GIL (a deadlock). So the
handler is C, async-signal-safe, and only does what is safe there: it looks the faulting address
up in a table of the mapped ranges (each with its message, written beforehand), writes that
message to stderr, deletes the files of every open disk store relative to their folders'
descriptors (`unlinkat`), puts back the previous action (faulthandler's traceback, or death)
and returns: the instruction faults again and the process dies of SIGBUS as before, with the
cause said and the store gone. A SIGBUS elsewhere goes straight to the previous action.
Building it takes a C compiler and about 0.1 s, once a process; a process without one uses the
store's copies (`pread`/`pwrite`), whose errors are Python exceptions naming the file.
"""

import ctypes
import logging
import os
import shutil
import struct
import subprocess
import tempfile
import threading

logger = logging.getLogger(__name__)

# rewriting an allocated block writes a new one (a full disk fails the write of a mapped page)
COPY_ON_WRITE = {"btrfs", "zfs", "bcachefs", "f2fs", "nilfs2"}

_AT_FDCWD = -100
_AT_REMOVEDIR = 0x200


def copy_on_write(path, *, _layer: bool = False) -> str | None:
    """Why a mapped page of a file under `path` may need new blocks when it is written, in words
    ("'/scratch' is btrfs, a copy-on-write filesystem"), or None: the filesystem type of the mount
    that holds `path` (`/proc/self/mountinfo`). An overlay writes to its upper layer: it is told
    by that layer's, and counts as copy-on-write where that layer cannot be seen (a container's
    root, whose upper layer is a folder of the host: podman on btrfs is one)."""
    mount = _mount_of(path)
    if mount is None:
        return None
    point, fstype, options = mount
    if fstype in COPY_ON_WRITE:
        return f"{point!r} is {fstype}, a copy-on-write filesystem"
    if fstype == "overlay":
        upper = next((o[len("upperdir="):] for o in options.split(",") if o.startswith("upperdir=")), None)
        if _layer or upper is None or not os.path.isdir(upper):
            return f"{point!r} is an overlay whose upper layer's filesystem is unknown (copy-on-write?)"
        return copy_on_write(upper, _layer=True)
    return None


def _mount_of(path) -> tuple | None:
    """(mount point, filesystem type, super options) of the mount holding `path`: the longest
    mount point that contains it, the last mounted of equals. None where mountinfo is unreadable."""
    real = os.path.realpath(path)
    found = None
    try:
        with open("/proc/self/mountinfo") as lines:
            for line in lines:
                fields = line.split()
                dash = fields.index("-")
                point = _unescape(fields[4])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and (found is None or len(point) >= len(found[0])):
                    found = (point, fields[dash + 1], _unescape(fields[dash + 3]))
    except (OSError, ValueError, IndexError):
        return None
    return found


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (`\\040`)."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


# ---- the SIGBUS handler ------------------------------------------------------------------------

_SOURCE = r"""
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

#define SLOTS 4096
struct watched { volatile uintptr_t start, end; const char *volatile message; volatile size_t length; };
static struct watched watched[SLOTS];
static const char *volatile deletes;
static volatile size_t deletes_length;
static struct sigaction previous;

void ts_watch(int slot, uintptr_t start, uintptr_t end, const char *message, size_t length) {
    watched[slot].end = 0;
    __sync_synchronize();
    watched[slot].start = start;
    watched[slot].message = message;
    watched[slot].length = length;
    __sync_synchronize();
    watched[slot].end = end;
}

void ts_unwatch(int slot) { watched[slot].end = 0; __sync_synchronize(); }

void ts_deletes(const char *records, size_t length) {
    deletes_length = 0;
    __sync_synchronize();
    deletes = records;
    __sync_synchronize();
    deletes_length = length;
}

static void say(const char *text, size_t length) {
    while (length > 0) {
        ssize_t n = write(2, text, length);
        if (n <= 0) return;
        text += n;
        length -= (size_t) n;
    }
}

/* records: int32 folder descriptor, int32 unlinkat flags, name, NUL; one after the other */
static void delete_all(void) {
    const char *at = deletes, *end = deletes + deletes_length;
    while (at != NULL && at + 8 < end) {
        int32_t fd, flags;
        memcpy(&fd, at, 4);
        memcpy(&flags, at + 4, 4);
        unlinkat(fd, at + 8, flags);
        at += 8;
        while (at < end && *at) at++;
        at++;
    }
}

static void on_sigbus(int signum, siginfo_t *info, void *context) {
    uintptr_t address = (uintptr_t) info->si_addr;
    for (int i = 0; i < SLOTS; i++) {
        if (watched[i].start <= address && address < watched[i].end) {
            say(watched[i].message, watched[i].length);
            delete_all();
            break;
        }
    }
    sigaction(SIGBUS, &previous, NULL);  /* the instruction faults again: the previous action */
}

int ts_install(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    return sigaction(SIGBUS, &action, &previous);
}
"""

_SLOTS = 4096


class _Guard:
    """The installed handler: a table of watched ranges (slots) and the records of what to delete."""

    def __init__(self, library):
        self.lib = library
        self.lib.ts_watch.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
        self.lib.ts_unwatch.argtypes = [ctypes.c_int]
        self.lib.ts_deletes.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.lock = threading.RLock()  # close_all may run in a signal handler on a thread inside it
        self.free = list(range(_SLOTS - 1, -1, -1))
        self.messages = {}  # slot -> its message (kept alive while the handler may read it)
        self.records = []  # the last two records given to the handler (the older may still be read)

    def watch(self, address: int, length: int, message: str) -> int | None:
        """Watch [address, address + length): a SIGBUS there writes `message`. The slot, for
        `unwatch`; None when every slot is taken (the range is then not watched)."""
        text = message.encode(errors="replace")
        with self.lock:
            if not self.free:
                return None
            slot = self.free.pop()
            self.messages[slot] = text
        self.lib.ts_watch(slot, address, address + length, text, len(text))
        return slot

    def unwatch(self, slot: int) -> None:
        self.lib.ts_unwatch(slot)
        with self.lock:
            self.messages.pop(slot, None)
            self.free.append(slot)

    def deletes(self, entries) -> None:
        """What the handler deletes: (folder descriptor, name) files, and (None, path) folders."""
        blob = b"".join(_record(fd, name) for fd, name in entries)
        with self.lock:
            self.records = [*self.records[-1:], blob]
            self.lib.ts_deletes(blob, len(blob))


def _record(fd, name) -> bytes:
    if fd is None:  # a folder, by its absolute path
        return struct.pack("=ii", _AT_FDCWD, _AT_REMOVEDIR) + os.fsencode(name) + b"\0"
    return struct.pack("=ii", fd, 0) + os.fsencode(name) + b"\0"


_guard = None
_tried = False
_build_lock = threading.Lock()


def guard() -> "_Guard | None":
    """The SIGBUS handler, built and installed on the first call of this process; None (and the
    reason logged once) where it cannot be."""
    global _guard, _tried
    with _build_lock:
        if not _tried:
            _tried = True
            try:
                _guard = _Guard(_build())
                if _guard.lib.ts_install() != 0:
                    raise OSError(ctypes.get_errno(), "sigaction failed")
            except (OSError, subprocess.SubprocessError) as e:
                _guard = None
                logger.info("the disk store uses copies, not mapped pages: no SIGBUS handler (%s)", e)
    return _guard


def built() -> "_Guard | None":
    """The SIGBUS handler if `guard()` has installed it, without building it."""
    return _guard


def _build():
    """Compile `_SOURCE` into a private temporary folder and load it (the file goes once loaded)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) to build it with")
    with tempfile.TemporaryDirectory(prefix="trainer_shard-sigbus-") as folder:
        source, library = os.path.join(folder, "sigbus.c"), os.path.join(folder, "sigbus.so")
        with open(source, "w") as out:
            out.write(_SOURCE)
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", library, source], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        return ctypes.CDLL(library, use_errno=True)
