"""Faults in a run of several processes: a rank that dies, raises or hangs; and interrupts.

[Note: fault watch] A collective waits for every rank of the group. When one rank is killed,
raises, or stops (a deadlock, a dead machine), the others would wait in their next collective
until the process group's timeout, or forever where the transport never notices (a machine
that lost power, NCCL). `FaultWatch` bounds that wait and names the rank at fault:

- every rank's watch thread beats a counter in the rendezvous store every `interval` seconds
  and publishes what its rank is doing (`where`: the step, the phase, the collective it waits in);
- a rank that raises posts its error before it exits (`post_failure`), and a rank that stops
  because of a peer says so too, so that a peer stuck outside the collectives learns it;
- a watch that learns of a failure says it has (`seen/<rank>`); the rank that hosts the store
  (rank 0, launched by hand), having posted a failure, waits before it leaves until every peer
  has seen it, posted its own failure, left `train()` or lost its process, for at most
  `min(grace, 2 * interval + 1)` seconds (`_wait_for_peers`): the store ends with its host's
  process group, so a peer that reads the store only once the host has gone (one asleep outside
  the collectives) would learn only that the store is gone, not why;
- a peer is dead when its process is gone (same machine) or its beat has stopped for `timeout`;
- once the watch knows a peer failed, the main thread has `grace` seconds to leave through its
  own error (gloo reports a closed connection at once); after that a second thread, the reaper,
  prints the reason and ends the process (`EXIT_PEER_FAILED`), since a thread cannot interrupt a
  blocked collective. The reaper never calls the store: a client of a store whose host died can
  block for good (it also ends the process when the watch thread has been stuck that long).

So every rank exits within `timeout` + `grace` seconds of a peer's failure (the store's host,
having posted one, at most `min(grace, 2 * interval + 1)` more), naming it; the
Trainer uses `--ddp_timeout` as `timeout` (and as the process group's own timeout). The store
is the one torchrun's agent hosts (or rank 0's, launched otherwise: when it goes, rank 0 is gone).

[Note: interrupts] SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, torchrun passing one
on) set a flag; at the end of the optimizer step the ranks agree on it (one all-reduce of one
number, on a CPU group), so they stop after the same step, write a checkpoint if asked
(`--save_on_interrupt`), and `train()` raises `TrainingInterrupted`: the script exits 128 +
the signal's number. A second signal at least `FORCE_AFTER` seconds after the first stops the
process at once (torchrun passes on the terminal's Ctrl-C a moment after the process got it
itself: that one does not count).

[Note: hard exits] This module ends the process with `os._exit` (the reaper, a forced stop),
which runs no finalizer and no atexit hook: every such exit goes through `_hard_exit`, which
deletes the process's disk stores first (`offload.store.close_all`; see [Note: disk store
lifetime] in offload/store.py), or a run killed by a peer's failure would leave its master
weights and optimizer state on disk (34 GB for t5-3b).
"""

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import comm
from .offload import store as disk_stores
from .shm_comm import alive

EXIT_PEER_FAILED = 3  # a rank stopped because another one failed (2: a user's mistake)
FORCE_AFTER = 2.0  # seconds between two signals for the second to stop the process at once
_PREFIX = "trainer_shard/faults"


class PeerFailedError(RuntimeError):
    """This rank stopped because another rank failed (was killed, raised or hung)."""

    def __init__(self, rank: int, message: str):
        self.rank = rank
        super().__init__(message)


class TrainingInterrupted(Exception):
    """Training stopped after a signal; `checkpoint` is the folder saved at the stop, if any."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        saved = (f"checkpoint saved to {checkpoint}; resume with --resume_from_checkpoint latest" if checkpoint
                 else "no checkpoint was written (pass --save_on_interrupt to write one)")  # fmt: skip
        super().__init__(f"training interrupted by {name} after step {step}: {saved}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# ---- what this rank is doing ------------------------------------------------------------------


class _Where:
    """What this rank is doing, as the watch thread publishes it. Plain attribute writes: the
    main thread pays nothing but a store of a reference."""

    step = 0
    phase = "starting"
    collective = None
    since = 0.0  # when it entered `collective`

    def describe(self) -> str:
        inside = f", waiting in {self.collective}" if self.collective else ""
        return f"step {self.step} ({self.phase}{inside})"


WHERE = _Where()


@contextlib.contextmanager
def inside(collective: str):
    """Mark this rank as waiting in `collective` (comm.py wraps every collective's wait in it)."""
    WHERE.collective, WHERE.since = collective, time.monotonic()
    try:
        yield
    finally:
        WHERE.collective = None


# Registered on import: a process that uses the fault watch has imported this module, so its
# collectives are tracked whichever of comm and faults was imported first.
comm.set_wait_tracker(inside)


def at(step: int | None = None, phase: str | None = None) -> None:
    if step is not None:
        WHERE.step = step
    if phase is not None:
        WHERE.phase = phase


# ---- the watch --------------------------------------------------------------------------------


def _store_client(timeout: float):
    """A connection of our own to the rendezvous store (a thread must not queue behind the main
    thread's blocking store calls), and who hosts it."""
    store = dist.distributed_c10d._get_default_store()
    inner = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    host = "the launcher" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
    if isinstance(inner, dist.TCPStore):
        inner = dist.TCPStore(inner.host, inner.port, is_master=False, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)  # fmt: skip
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return inner, host, restart


class FaultWatch:
    """See [Note: fault watch]. `start()` on every rank, as many times on each (the keys of each
    session are its own)."""

    _sessions = 0  # several train() calls in one process: keys of their own

    def __init__(self, timeout: float, *, interval: float | None = None, grace: float | None = None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout = float(timeout)
        self.interval = interval or min(5.0, max(0.2, self.timeout / 20))
        self.grace = grace if grace is not None else min(self.timeout, max(5.0, 4 * self.interval))
        inner, self.store_host, restart = _store_client(self.timeout)
        FaultWatch._sessions += 1
        self.store = dist.PrefixStore(f"{_PREFIX}/{restart}/{FaultWatch._sessions}/", inner)
        self.failure = None  # (rank, reason) once a peer is known to have failed
        self._posted = False  # this rank posted a failure (the store's host then waits for the peers)
        self._hosts_store = self.store_host == "rank 0" and self.rank == 0
        self.last_checkpoint = None  # the Trainer keeps it current, for the messages
        self._seen, self._stop = {}, threading.Event()
        self.store.set(f"proc/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._peers = {}
        self._deadline, self._last_round = None, time.monotonic()
        self._thread = threading.Thread(target=self._run, name="trainer_shard-fault-watch", daemon=True)
        self._reaper = threading.Thread(target=self._reap, name="trainer_shard-fault-reaper", daemon=True)

    @classmethod
    def start(cls, timeout: float, **kwargs):
        """A running watch, or None on one process."""
        if not _several_ranks():
            return None
        watch = cls(timeout, **kwargs)
        watch._thread.start()
        watch._reaper.start()
        return watch

    def stop(self) -> None:
        """Stop the thread, tell the peers this rank left `train()` (not a failure: a failure was
        posted first), and let go of this watch's store client: its connection closes now, not
        whenever the last reference to the watch goes (the signal guard keeps one after train())."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval + 1)
        self._reaper.join(timeout=2 * self.interval + 1)
        self._wait_for_peers()
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass
        self.store = None  # a late call (post_failure) fails, and is caught, as on a store that failed

    # -- posting ------------------------------------------------------------------------------

    def post_failure(self, error, *, because_of: int | None = None) -> None:
        """Tell the other ranks this one stops, and why. Never raises: it runs on the way out."""
        if isinstance(error, BaseException):
            error = " ".join(f"{type(error).__name__}: {error}".split())[:600]
        text = str(error)
        try:
            seq = self.store.add("failures", 1)
            self.store.set(f"fail/{self.rank}", f"{seq}|{'' if because_of is None else because_of}|{text}")
            self._posted = True
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass

    def _linger(self) -> float:
        """How long the store's host waits for its peers to read its failure (see `_wait_for_peers`):
        a live peer's watch reads the store every `interval`; two rounds leave one missed under load."""
        return min(self.grace, 2 * self.interval + 1.0)

    def _wait_for_peers(self) -> None:
        """The store's host, once it posted a failure: wait until every peer has seen it (its watch
        said so), posted a failure of its own, left train(), or lost its process (same machine),
        for at most `_linger()` seconds; the store goes when this process does, and a peer
        asleep outside the collectives would otherwise read only that it is gone. Never raises."""
        if not (self._hosts_store and self._posted):
            return
        deadline = time.monotonic() + self._linger()
        waiting = [r for r in range(self.world) if r != self.rank]
        try:
            while waiting and time.monotonic() < deadline:
                waiting = [r for r in waiting if not self._peer_settled(r)]
                if waiting:
                    time.sleep(min(0.05, self.interval / 4))
        except Exception:  # noqa: BLE001 - the store failed: nobody can read it any more
            pass

    def _peer_settled(self, r: int) -> bool:
        """Whether peer `r` has read this rank's failure, or need not: see `_wait_for_peers`."""
        if self.store.check([f"seen/{r}"]) or self.store.check([f"fail/{r}"]) or self.store.check([f"done/{r}"]):
            return True
        if self._peers.get(r) is None and self.store.check([f"proc/{r}"]):
            self._peers[r] = self.store.get(f"proc/{r}").decode().split()
        peer = self._peers.get(r)
        return bool(peer) and peer[0] == socket.gethostname() and not alive(int(peer[1]))

    # -- finding the rank at fault --------------------------------------------------------------

    def _failures(self) -> list:
        """[(seq, rank, because_of, text)] posted by the other ranks, first first."""
        if self.store.add("failures", 0) == 0:
            return []
        found = []
        for r in range(self.world):
            if r != self.rank and self.store.check([f"fail/{r}"]):
                seq, because, text = self.store.get(f"fail/{r}").decode(errors="replace").split("|", 2)
                found.append((int(seq), r, int(because) if because else None, text))
        return sorted(found)

    def _dead(self, now: float) -> tuple | None:
        """(rank, reason) of a peer whose process is gone or whose beat stopped `timeout` ago."""
        for r in range(self.world):
            if r == self.rank:
                continue
            if self._peers.get(r) is None and self.store.check([f"proc/{r}"]):
                self._peers[r] = self.store.get(f"proc/{r}").decode().split()
            if self.store.check([f"done/{r}"]):
                continue  # it left train() normally: its beat stops, and its process may end
            beats = self.store.add(f"beat/{r}", 0)
            seen = self._seen.get(r)
            if seen is None or seen[0] != beats:
                self._seen[r] = (beats, now)
            elif now - seen[1] > self.timeout:
                return r, f"it has not answered for {now - seen[1]:.0f} s (killed, stopped, or its machine is down)"
            peer = self._peers.get(r)
            if peer and peer[0] == socket.gethostname() and not alive(int(peer[1])):
                return r, f"its process {peer[1]} is gone (killed or crashed)"
        return None

    def culprit(self) -> tuple | None:
        """(rank, reason) of the first peer known to have failed, else None."""
        if self.failure is not None:
            return self.failure
        try:
            failures = self._failures()
            for _, r, because, text in failures:
                if because is None:
                    return r, f"it raised {text}"
            for _, r, because, text in failures:  # ranks that stopped because of another
                if because == self.rank:
                    return r, "it gave up waiting for this rank, which had not joined its collective"
                return because, text  # the rank it blames, and why (a third rank's view)
            return self._dead(time.monotonic())
        except Exception as e:  # noqa: BLE001
            host = 0 if self.store_host == "rank 0" else -1
            return host, f"the rendezvous store hosted by {self.store_host} is gone ({e})"

    def wait_for_culprit(self, error) -> tuple | None:
        """After a collective failed on this rank: the peer at fault, waiting for the watch to see
        it up to `timeout` (a closed connection is seen in a beat or two; a silent peer takes
        `timeout`). A timeout with every peer alive blames the peers not waiting in a collective."""
        # a peer that timed out is alive: a few beats show whether someone failed meanwhile
        wait = (3 * self.interval if _is_timeout(error) else self.timeout) if is_comm_error(error) else 0
        deadline = time.monotonic() + wait
        while True:
            found = self.culprit()
            if found is not None or time.monotonic() >= deadline:
                break
            time.sleep(self.interval / 2)
        if found is None and is_comm_error(error):
            found = self._outside_collectives()
        return found

    def _outside_collectives(self) -> tuple | None:
        try:
            where = {r: self.store.get(f"where/{r}").decode() for r in range(self.world)
                     if r != self.rank and self.store.check([f"where/{r}"])}  # fmt: skip
        except Exception:  # noqa: BLE001
            return None
        stuck = {r: w for r, w in where.items() if "waiting in" not in w}
        if not stuck:
            return None
        r = min(stuck)
        return r, f"it is alive but did not join the collective within {self.timeout:.0f} s; it reports {stuck[r]}"

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        """Beat, publish, look for a failed peer; `_reap` acts on what this finds."""
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                self.store.set(f"where/{self.rank}", WHERE.describe())
            except Exception:  # noqa: BLE001 - culprit() names the store
                pass
            if self.failure is None:
                self.failure = self.culprit() or self._stuck()
                if self.failure is not None:
                    self._deadline = time.monotonic() + self.grace
                    try:
                        self.store.set(f"seen/{self.rank}", "1")  # the store's host may wait for it
                    except Exception:  # noqa: BLE001 - culprit() names the store
                        pass
            self._last_round = time.monotonic()

    def _reap(self) -> None:
        """End the process once the grace after a failure has passed, or once the watch thread
        has been stuck in a store call for `timeout` + `grace` (a store whose host died can block
        a client for good). Never touches the store itself."""
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if self._deadline is not None and now >= self._deadline:
                self.exit_now()
            if now - self._last_round > self.timeout + self.grace:
                host = 0 if self.store_host == "rank 0" else -1
                self.failure = self.failure or (host, f"the rendezvous store hosted by {self.store_host} stopped "
                                                      f"answering for {now - self._last_round:.0f} s")  # fmt: skip
                self.exit_now()

    def _stuck(self) -> tuple | None:
        """The backstop where a transport has no timeout of its own: this rank has waited in one
        collective for longer than `timeout`."""
        waited = time.monotonic() - WHERE.since
        if WHERE.collective is None or waited <= self.timeout:
            return None
        return self._outside_collectives() or (
            None, f"this rank waited {waited:.0f} s in {WHERE.collective} while every rank is alive and in a "
                  "collective: they called different collectives (a bug; please report it)")  # fmt: skip

    def message(self, failure=None) -> str:
        rank, reason = failure or self.failure
        last = (f"The last complete checkpoint is {self.last_checkpoint}" if self.last_checkpoint
                else "No checkpoint was completed in this run")  # fmt: skip
        if rank is None:
            return f"rank {self.rank} stopped at {WHERE.describe()}: {reason}. {last}"
        who = f"rank {rank}" if rank >= 0 else "the launcher"
        return f"rank {self.rank} stopped at {WHERE.describe()} because {who} failed: {reason}. {last}"

    def exit_now(self) -> None:
        """End this process with the failure's message (its main thread is blocked). The others
        are told too, for at most a second (the store may be what failed), and the store's host
        waits for them to read it, at most `_linger()` seconds more (`_wait_for_peers`)."""
        rank, reason = self.failure
        print(f"trainer_shard: error: {self.message()}", file=sys.stderr, flush=True)

        def post_and_wait():
            self.post_failure(reason, because_of=rank if rank is not None else self.rank)
            self._wait_for_peers()

        post = threading.Thread(target=post_and_wait, daemon=True)
        post.start()
        post.join(timeout=1.0 + (self._linger() if self._hosts_store else 0.0))
        _hard_exit(EXIT_PEER_FAILED)


def _hard_exit(code: int) -> None:
    """End the process now, whatever its other threads are doing; its disk stores are deleted
    first. See [Note: hard exits]."""
    disk_stores.close_all()
    os._exit(code)


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def apply_timeout(seconds: float) -> None:
    """Make `seconds` the default process group's timeout: transformers passes --ddp_timeout to
    the group only on GPUs (not with use_cpu), where gloo's default is 30 minutes."""
    if _several_ranks():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def is_comm_error(error) -> bool:
    """Whether `error` came from a collective (a peer's fault, likely) rather than this rank."""
    for cls in ("DistError", "DistBackendError", "DistNetworkError"):
        if isinstance(error, getattr(dist, cls, ())):
            return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(s in text for s in _COMM_WORDS + _TIMEOUT_WORDS)


_COMM_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "pair closure")
_TIMEOUT_WORDS = ("timed out", "timeout")


def _is_timeout(error) -> bool:
    return any(s in str(error).lower() for s in _TIMEOUT_WORDS)


# ---- interrupts -------------------------------------------------------------------------------


class InterruptGuard:
    """SIGINT and SIGTERM set `signum` instead of stopping at once. See [Note: interrupts].
    Installed by `train()` on the main thread; `restore()` puts the previous handlers back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, watch: FaultWatch | None = None):
        self.signum, self.first, self.watch, self._previous = None, None, watch, {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.watch is not None and self.watch.failure is not None:
            self.watch.exit_now()  # a peer failed and the launcher is stopping us
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first = signum, now
            print(f"trainer_shard: {signal.Signals(signum).name} received: stopping after the current step "
                  f"(again after {FORCE_AFTER:.0f} s to stop at once)", file=sys.stderr, flush=True)  # fmt: skip
            return
        if now - self.first >= FORCE_AFTER:
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            _hard_exit(128 + signum)

    def restore(self) -> None:
        """The previous handlers back; where SIGTERM's is the default (death), a disk store opened
        during train() gets deleted first when it comes (see [Note: disk store lifetime])."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        disk_stores.watch_sigterm()


class StopAgreement:
    """One all-reduce (MAX) of the signal number per optimizer step, so that every rank stops
    after the same step. On a CPU (gloo) group: no device sync. Collective."""

    def __init__(self):
        self.group = cpu_group() if _several_ranks() else None
        self._flag = torch.zeros(1, dtype=torch.int32)

    def agree(self, signum: int | None) -> int:
        self._flag.fill_(signum or 0)
        if self.group is not None:
            with inside("all_reduce(stop flag)"):
                dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(self._flag.item())


_GLOO_TWIN = None  # (the default group, a gloo group over the same ranks), made once


def cpu_group():
    """A gloo group over every rank: the default group when it is gloo, else one made on the first
    call and reused until the default group is replaced (a group lives, with its connections,
    until the process group is destroyed: one per train() call would pile up). Collective on the
    call that makes it: every rank calls this at the same point."""
    global _GLOO_TWIN
    world = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return world
    if _GLOO_TWIN is None or _GLOO_TWIN[0] is not world:
        _GLOO_TWIN = (world, dist.new_group(backend="gloo"))
    return _GLOO_TWIN[1]
