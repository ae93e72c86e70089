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
    """Storages for gathered flat buffers, reused: after the first steps no gather allocates but
    the root's, whose memory is let go in each backward ([Note: the root let go in backward]).

    A flat buffer keeps its own (empty) storage, so the parameters and autograd's saved views
    keep pointing at it; gathering swaps a pool storage's memory into it
    (`UntypedStorage._swap_data_ptr_`, which swaps the data pointers and sizes of two storages)
    and releasing swaps it back. Free storages are kept by size, and a buffer takes the smallest
    free one that holds it, up to twice its size: units of different sizes (T5's encoder and
    decoder blocks) share storages, where one set a size held about 3 idle storages of each size
    through the start of backward, ZeRO-3's peak (44 MB of 1.45 GiB on t5-small through the
    Trainer). When none fits, a free smaller one (at least half the size) is dropped before one
    is made, so the pool settles, within a step or two, on about as many storages as buffers
    gathered at once (the running unit, the one prefetched), then stays. Where the
    private swap is missing, buffers are allocated and freed with `resize_` instead (`pooled`
    False). With `shm` (CPU ranks of one host), the storages of gathers that nothing else writes
    are the ranks' shared ones, kept apart from this rank's own: [Note: gathered in shared memory]
    in shm_comm.py. A token is (storage, its shared number, or None for this rank's own).
    """

    pooled = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def __init__(self, enabled: bool = True, limit: int | None = None, shm=None):
        if not enabled:
            self.pooled = False
        self.limit = limit  # at most this many storages, lent and free (parameter offload: buffer_count)
        # a callable returning the group's ShmGroup or None, called at the first shared gather (it is
        # collective the first time, as that gather is): [Note: gathered in shared memory]
        self._shm_of = shm if self.pooled else None
        self.shm = None
        self.free = {}  # (nbytes, device, shared) -> [(UntypedStorage, its shared number or None)]
        self.uses = {}  # shared storage number -> gathers into it
        self.lent = 0
        self.created = 0
        self.created_bytes = 0
        self.dropped_bytes = 0  # of free storages let go (replaced by a larger one, or past `limit`)

    def attach(self, buffer: torch.Tensor, nbytes: int, shared: bool = False):
        """Give `buffer` (an empty storage) `nbytes` of memory, with `shared` (CPU ranks of one
        host, the buffer's writes are the gather's alone) the memory every rank's same buffer
        has; returns the token `detach` wants."""
        storage = buffer.untyped_storage()
        if not self.pooled:
            storage.resize_(nbytes)
            return None
        if shared and self._shm_of is not None and storage.device.type == "cpu":
            self.shm, self._shm_of = self._shm_of(), None
        shared = shared and self.shm is not None and storage.device.type == "cpu"
        self.lent += 1
        slot = self._take(nbytes, storage.device, shared)
        if slot is None:
            if self.limit is not None and self.lent + self.free_count > self.limit:
                self._drop_one()  # a free storage of another size goes: the limit counts storages
            slot = self._new(nbytes, storage.device, shared)
        storage._swap_data_ptr_(slot[0])  # now the token's storage is the empty one
        return slot

    def detach(self, buffer: torch.Tensor, token, drop: bool = False) -> None:
        """Take the memory back from `buffer`, which is left with an empty storage; with `drop`,
        let that memory go instead of keeping it for the next attach."""
        storage = buffer.untyped_storage()
        if token is None:
            storage.resize_(0)
            return
        storage._swap_data_ptr_(token[0])
        self.lent -= 1
        if drop:
            self._let_go(token)
        else:
            self.free.setdefault(self._key(token), []).append(token)

    def gather_token(self, token, nbytes: int):
        """What `comm.all_gather(shared=)` wants for a gather into the buffer attached with
        `token`: (storage number, gathers into it so far, bytes), or None where its memory is
        this rank's alone."""
        if token is None or token[1] is None:
            return None
        number = token[1]
        self.uses[number] = self.uses.get(number, 0) + 1
        return number, self.uses[number] if number >= 0 else 0, nbytes

    def privatize(self, buffer: torch.Tensor, token):
        """`buffer`'s memory (attached with `token`) made its own if shared, the values kept:
        before edits that every rank makes (`gathered(writeback=True)`, `load_state_dict`). Returns
        the token `detach` wants then."""
        if token is None or token[1] is None:
            return token
        storage = buffer.untyped_storage()
        nbytes = storage.nbytes()
        own = self._take(nbytes, storage.device, False) or self._new(nbytes, storage.device, False)
        storage._swap_data_ptr_(token[0])  # the shared memory back in the token, the buffer empty
        storage._swap_data_ptr_(own[0])  # the buffer takes its own memory, `own` is empty: the new token
        as_bytes = lambda st: torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)  # noqa: E731
        as_bytes(storage)[: token[0].nbytes()].copy_(as_bytes(token[0]))  # `own` may be larger (up to twice)
        self.free.setdefault(self._key(token), []).append(token)
        return own

    def _new(self, nbytes: int, device, shared: bool):
        """A new storage's token: shared (`ShmGroup.new_storage`) or this rank's own."""
        self.created += 1
        self.created_bytes += nbytes
        return self.shm.new_storage(nbytes) if shared else (torch.UntypedStorage(nbytes, device=device), None)

    def _key(self, token) -> tuple:
        """A free storage's list: (bytes, device, shared)."""
        return token[0].nbytes(), token[0].device, token[1] is not None

    def _take(self, nbytes: int, device, shared: bool = False):
        """A free storage's token on `device` for `nbytes` (`choose_storage`), else None, after
        dropping the free one the new storage replaces."""
        take, drop = choose_storage([size for (size, where, kind), slots in self.free.items()
                                     if where == device and kind == shared and slots], nbytes)  # fmt: skip
        if take is not None:
            return self.free[(take, device, shared)].pop()
        if drop is not None:
            self._let_go(self.free[(drop, device, shared)].pop())
        return None

    @property
    def free_count(self) -> int:
        return sum(len(slots) for slots in self.free.values())

    def _drop_one(self) -> None:
        for slots in self.free.values():
            if slots:
                self._let_go(slots.pop())
                return

    def _let_go(self, token) -> None:
        self.dropped_bytes += token[0].nbytes()
        if token[1] is not None:
            self.shm.forget(token[1])
            self.uses.pop(token[1], None)  # one storage made a step (the root's): the count goes with it

    @property
    def free_bytes(self) -> int:
        return sum(token[0].nbytes() for slots in self.free.values() for token in slots)

    def clear(self) -> None:
        for token in (token for slots in self.free.values() for token in slots if token[1] is not None):
            self.shm.forget(token[1])
            self.uses.pop(token[1], None)
        self.free = {}
