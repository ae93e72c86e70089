"""The gather pool: storages lent to flat buffers while gathered, reused across steps."""

import torch


def choose_storage(free: list, size: int) -> tuple:
    """(the free storage size a buffer of `size` takes, or None to make one; a free size to
    drop first, or None), from the sizes of the free storages `free`: the smallest of `size` to
    twice it, else a new one, replacing the largest free one from half of `size`. The planner
    plays the gathers of a step through it (`Units.pool_numel`)."""
    fits = [s for s in free if size <= s <= 2 * size]
    if fits:
        return min(fits), None
    smaller = [s for s in free if size // 2 <= s < size]
    return None, (max(smaller) if smaller else None)


class GatherPool:
    """Storages for gathered flat buffers, reused: after the first step no gather allocates.

    A flat buffer keeps its own (empty) storage, so the parameters and autograd's saved views
    keep pointing at it; gathering swaps a pool storage's memory into it
    (`UntypedStorage._swap_data_ptr_`, which swaps the data pointers and sizes of two storages)
    and releasing swaps it back. Free storages are kept by size, and a buffer takes the smallest
    free one that holds it, up to twice its size: units of different sizes (T5's encoder and
    decoder blocks) share storages, where one set a size held about 3 idle storages of each size
    through the start of backward, ZeRO-3's peak (44 MB of 1.45 GiB on t5-small through the
    Trainer). When none fits, a free smaller one (at least half the size) is dropped before one
    is made, so the pool settles, within a step or two, on about as many storages as buffers
    gathered at once (the root, the running unit, the one prefetched), then stays. Where the
    private swap is missing, buffers are allocated and freed with `resize_` instead (`pooled`
    False).
    """

    pooled = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def __init__(self, enabled: bool = True, limit: int | None = None):
        if not enabled:
            self.pooled = False
        self.limit = limit  # at most this many storages, lent and free (parameter offload: buffer_count)
        self.free = {}  # (nbytes, device) -> [UntypedStorage]
        self.lent = 0
        self.created = 0
        self.created_bytes = 0
        self.dropped_bytes = 0  # of free storages let go (replaced by a larger one, or past `limit`)

    def attach(self, buffer: torch.Tensor, nbytes: int):
        """Give `buffer` (an empty storage) `nbytes` of memory; returns the token `detach` wants."""
        storage = buffer.untyped_storage()
        if not self.pooled:
            storage.resize_(nbytes)
            return None
        self.lent += 1
        slot = self._take(nbytes, storage.device)
        if slot is None:
            if self.limit is not None and self.lent + self.free_count > self.limit:
                self._drop_one()  # a free storage of another size goes: the limit counts storages
            slot = torch.UntypedStorage(nbytes, device=storage.device)
            self.created += 1
            self.created_bytes += nbytes
        storage._swap_data_ptr_(slot)  # now `slot` is the empty one
        return slot

    def detach(self, buffer: torch.Tensor, slot) -> None:
        """Take the memory back from `buffer`, which is left with an empty storage."""
        storage = buffer.untyped_storage()
        if slot is None:
            storage.resize_(0)
            return
        storage._swap_data_ptr_(slot)
        self.lent -= 1
        self.free.setdefault((slot.nbytes(), slot.device), []).append(slot)

    def _take(self, nbytes: int, device):
        """A free storage on `device` for `nbytes` (`choose_storage`), else None, after dropping
        the free one the new storage replaces."""
        take, drop = choose_storage([size for (size, where), slots in self.free.items() if where == device and slots],
                                    nbytes)  # fmt: skip
        if take is not None:
            return self.free[(take, device)].pop()
        if drop is not None:
            self.dropped_bytes += self.free[(drop, device)].pop().nbytes()
        return None

    @property
    def free_count(self) -> int:
        return sum(len(slots) for slots in self.free.values())

    def _drop_one(self) -> None:
        for slots in self.free.values():
            if slots:
                self.dropped_bytes += slots.pop().nbytes()
                return

    @property
    def free_bytes(self) -> int:
        return sum(s.nbytes() for slots in self.free.values() for s in slots)

    def clear(self) -> None:
        self.free = {}
