"""The gather pool: storages lent to flat buffers while gathered, reused across steps."""

import torch


class GatherPool:
    """Storages for gathered flat buffers, reused: after the first step no gather allocates.

    A flat buffer keeps its own (empty) storage, so the parameters and autograd's saved views
    keep pointing at it; gathering swaps a pool storage's memory into it
    (`UntypedStorage._swap_data_ptr_`, which swaps the data pointers and sizes of two storages)
    and releasing swaps it back. Free storages are kept by size: the pool grows to the most
    buffers of each size gathered at once (about three: the root, the running unit, the one
    prefetched), then stays. Where the private swap is missing, buffers are allocated and freed
    with `resize_` instead (`pooled` False).
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

    def attach(self, buffer: torch.Tensor, nbytes: int):
        """Give `buffer` (an empty storage) `nbytes` of memory; returns the token `detach` wants."""
        storage = buffer.untyped_storage()
        if not self.pooled:
            storage.resize_(nbytes)
            return None
        free = self.free.setdefault((nbytes, storage.device), [])
        self.lent += 1
        if free:
            slot = free.pop()
        else:
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
        self.free[(slot.nbytes(), slot.device)].append(slot)

    @property
    def free_count(self) -> int:
        return sum(len(slots) for slots in self.free.values())

    def _drop_one(self) -> None:
        for slots in self.free.values():
            if slots:
                slots.pop()
                return

    @property
    def free_bytes(self) -> int:
        return sum(s.nbytes() for slots in self.free.values() for s in slots)

    def clear(self) -> None:
        self.free = {}
