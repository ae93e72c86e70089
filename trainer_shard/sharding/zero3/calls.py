"""[Note: diverging calls]: before each gather, every rank says which unit it gathers, so that
ranks running different modules raise one error instead of pairing different gathers."""

import torch
from torch.autograd.profiler import record_function

from ... import comm
from ...errors import ShardingError


class CallCheck:
    """Mixed into `ShardedModel`: the check each unit calls before and after starting a gather
    (`Unit.check`, `Unit.announce`)."""

    def _install_call_check(self) -> None:
        # the units gathered this iteration and the last, in order, and the announcement of this
        # rank's next gather in flight: (handle, everyone's announcements)
        self._gathered_now, self._gathered_last, self._posted, self._missed = [], [], None, False
        self.gathers = 0  # unit gathers started, counted alike on every rank
        self.announce_ahead = self.store is None

    # [Note: diverging calls] Ranks that run their modules a different number of times (a module
    # called on one rank only, generate() without synced_gpus, data-dependent routing) would pair
    # one unit's gather on one rank with another unit's on the next, silently mixing weights when
    # the sizes agree, and aborting the process in gloo (SIGABRT) when they do not. So no rank
    # starts a gather before every rank has said which unit it gathers next, in a small all-gather
    # of (gather count, unit, kind), and all raise the same error naming both sides if they differ.
    #
    # Said right before the gather, that exchange makes the ranks meet at every gather (about 4 ms
    # each on 2 busy cores, 25 a step on t5-small: 3 s of 35 through the Trainer). So, from the
    # second iteration (a root forward to the next) on, each rank announces its next gather one
    # gather ahead, asynchronously: the unit the last iteration gathered at that position. At the
    # next gather the announcement has landed (sent right after that gather): if every rank
    # announced the same unit and this is it, the gather starts without a meeting. A rank whose
    # next gather is another unit (the iteration went another way) first starts the announced
    # one anyway, which is the collective the others start (on every rank alike, a guess that
    # missed: it is released unused), then says which it gathers instead and waits: the others'
    # next announcement pairs with that, so every rank sees the difference, unless every rank
    # changed course alike, which ends the guesses for that iteration (the next one guesses from
    # the gathers this one asked for). Parameters on disk keep the exchange before every gather (a
    # gather the plan did not count could take a buffer the store's reads need). Collective.
    def _check_same_call(self, unit) -> None:
        posted, self._posted = self._posted, None
        if posted is not None:
            announced = self._agreed(*posted)
            if announced != unit.index:  # this rank changes course: the others start the announced gather
                other = self.units[announced]
                if not other.gathered:
                    for part in other.parts:
                        part.start_gather()
                    self.gathers += 1  # counted, not recorded: not a gather this iteration asked for
                self._exchange(unit, changed=True)
                self._missed = True  # no more guesses this iteration
        else:
            self._exchange(unit)
        self.gathers += 1
        self._gathered_now.append(unit.index)
        if len(self._gathered_now) > 64 * len(self.units):  # no root forward comes: keep no endless record
            self._gathered_now.clear()

    def _announce_next(self, unit) -> None:
        """After `unit`'s gather started (so that it goes first on every rank): announce the next."""
        position = len(self._gathered_now)
        if self.announce_ahead and not self._missed and position < len(self._gathered_last):
            self._posted = self._say(unit, self._gathered_last[position], changed=False, async_op=True)

    def _exchange(self, unit, changed: bool = False) -> None:
        self._agreed(*self._say(unit, unit.index, changed, async_op=False))

    def _say(self, unit, index: int, changed: bool, async_op: bool) -> tuple:
        """All-gather (gather count, `index`, `changed`) from every rank, on `unit`'s device: (the
        handle, or None once done; everyone's rows)."""
        device = unit.parts[0].buffer.device
        header = torch.tensor([self.gathers, index, int(changed)], dtype=torch.int64, device=device)
        everyone = torch.empty(3 * self.world_size, dtype=torch.int64, device=device)
        with record_function("trainer_shard::zero3_check_calls"):
            return comm.all_gather(everyone, header, self.group, async_op=async_op), everyone

    def _agreed(self, handle, everyone) -> int:
        """The unit every rank said it gathers next (after waiting for `handle`), or the error."""
        if handle is not None:
            with record_function("trainer_shard::zero3_check_calls"):
                handle.wait()
        seen = everyone.view(-1, 3).tolist()
        if all(row == seen[0] for row in seen):
            return seen[0][1]
        said = "; ".join(f"rank {r}: {self.units[i].name if 0 <= i < len(self.units) else i!r} (gather {n + 1}"
                         f"{', instead of the one announced' if changed else ''})"
                         for r, (n, i, changed) in enumerate(seen))  # fmt: skip
        raise ShardingError(f"ZeRO-3: the ranks ran different modules, so their gathers no longer pair up ({said}); "
                            "every rank must call the same modules the same number of times (generate() with "
                            "synced_gpus=True; no module run on some ranks only)")  # fmt: skip

    def _next_iteration(self) -> None:
        """At the root's forward: the gathers of the iteration that ends are the next one's guesses."""
        if self._gathered_now:
            self._gathered_last, self._gathered_now = self._gathered_now, []
        self._missed = False

    def _drop_announcement(self) -> None:
        """At close: wait for an announcement in flight (every rank sent it); nothing follows it."""
        if self._posted is not None:
            self._posted[0].wait()
            self._posted = None
