"""Gradient chunks to the CPU step and updated weights back to the parameters (`_DeviceLink`).

CUDA: gradients come to pinned staging buffers and updated parameters go back on a side
stream, so host-device copies overlap the CPU step. With `buffer_count` 1 there is one staging
slot, and the next chunk's gradient is copied after the step, not during it (`OffloadEngine._step_flat`).
"""

import torch


def _param_views(flat, start: int, numel: int) -> list | None:
    """`flat`'s parameters for shard elements [start, start + numel) as (offset, contiguous CPU
    tensor) pieces to write updated weights straight into; None where they are not plain CPU
    memory (on disk, or a flat of another kind): the caller stages them and calls `write_shard`."""
    if flat.params_stored:
        return None
    if hasattr(flat, "_buffer_pieces"):  # FlatGroup: this rank's slices of the flat buffer, bucket by bucket
        pieces = list(flat._buffer_pieces(start, numel))
    elif getattr(flat, "shard", None) is not None:  # ZeRO-3: the shard itself
        pieces = [(0, flat.shard[start : start + numel])]
    else:
        return None
    plain = all(t.device.type == "cpu" and t.is_contiguous() for _, t in pieces)
    return pieces if plain and sum(t.numel() for _, t in pieces) == numel else None


class _DeviceLink:
    """Moves gradient chunks to the CPU step and updated weights back to the parameters.

    On the CPU: a gradient chunk is a view (fp32) or an upcast copy (16-bit), and weights are
    cast straight into the parameters. On CUDA: gradient chunks come into pinned staging buffers
    and weights go out of them on a side stream, `slots` of each, so the copies of chunk i+1 and
    i-1 overlap the CPU step of chunk i; an event per slot guards a staging buffer until the
    copy that reads it has finished. The one-pass kernel (`cpu_adam`) takes a gradient chunk as
    it is (`take_raw`) and writes the weights where `param_targets` says: the parameters on the
    CPU, a staging buffer on CUDA (sent by `params_written`).
    """

    def __init__(self, device, grad_dtype, param_dtype, *, slots: int, chunk_numel: int):
        self.cuda = device.type == "cuda"
        self.slots = slots
        self.chunk_numel = chunk_numel
        self.param_dtype = param_dtype
        # One fp32 gradient chunk is enough (chunk i is stepped before chunk i+1 is taken), and
        # one buffer stays in cache between chunks: 4 rotating ones made the upcast 3x slower.
        self.grad32 = None  # made at the first `take_grad` (the one-pass kernel needs none)
        self.cpu_stage = None  # CPU parameters `param_views` cannot reach: staged, then `write_shard`
        self.staged = False
        self.pending = [None] * slots  # CPU: the gradient chunk to upcast; CUDA: (event, numel)
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.grad_stage = [torch.empty(chunk_numel, dtype=grad_dtype, pin_memory=True) for _ in range(slots)]
            self.param_stage = [torch.empty(chunk_numel, dtype=param_dtype, pin_memory=True) for _ in range(slots)]
            self.param_events = [None] * slots

    def begin(self) -> None:
        if self.cuda:  # gradients were produced on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def fetch_grad(self, source: torch.Tensor, slot: int) -> None:
        """Start bringing gradient chunk `source` to the CPU step (taken with `take_grad(slot)`)."""
        if not self.cuda:
            self.pending[slot] = source
            return
        stage = self.grad_stage[slot][: source.numel()]
        with torch.cuda.stream(self.stream):
            stage.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[slot] = (event, source.numel())

    def take_raw(self, slot: int, numel: int) -> torch.Tensor:
        """This slot's gradient chunk on the CPU, in its own dtype (a view of the shard on the CPU)."""
        if self.cuda:
            event, numel = self.pending[slot]
            event.synchronize()
            source = self.grad_stage[slot][:numel]
        else:
            source = self.pending[slot]
        self.pending[slot] = None
        return source

    def take_grad(self, slot: int, numel: int, factors) -> torch.Tensor:
        """This slot's gradient chunk as fp32 on the CPU, multiplied by `factors` in order."""
        source = self.take_raw(slot, numel)
        if source.dtype == torch.float32 and not self.cuda and not factors:
            return source
        if self.grad32 is None:
            self.grad32 = torch.empty(self.chunk_numel)
        out = self.grad32[: source.numel()]
        out.copy_(source)
        for factor in factors:
            out.mul_(factor)
        return out

    def put_params(self, flat, start: int, master: torch.Tensor, slot: int) -> None:
        if not self.cuda:
            flat.write_shard(start, master)
            return
        self._stage(slot, master.numel()).copy_(master)
        self._upload(flat, start, slot, master.numel())

    def param_targets(self, flat, start: int, numel: int, slot: int) -> list:
        """Where the weights of shard elements [start, start + numel) are to be written on the CPU,
        as (offset, tensor) pieces; `params_written` when they are."""
        pieces = None if self.cuda else _param_views(flat, start, numel)
        self.staged = pieces is None
        return [(0, self._stage(slot, numel))] if pieces is None else pieces

    def params_written(self, flat, start: int, numel: int, slot: int) -> None:
        if self.cuda:
            self._upload(flat, start, slot, numel)
        elif self.staged:
            flat.write_shard(start, self.cpu_stage[:numel])

    def _stage(self, slot: int, numel: int) -> torch.Tensor:
        if not self.cuda:
            if self.cpu_stage is None:
                self.cpu_stage = torch.empty(self.chunk_numel, dtype=self.param_dtype)
            return self.cpu_stage[:numel]
        if self.param_events[slot] is not None:
            self.param_events[slot].synchronize()  # its previous upload has read the stage
        return self.param_stage[slot][:numel]

    def _upload(self, flat, start: int, slot: int, numel: int) -> None:
        with torch.cuda.stream(self.stream):
            flat.write_shard(start, self.param_stage[slot][:numel], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.param_events[slot] = event

    def end(self) -> None:
        if self.cuda:  # the all-gather that follows reads the parameters on the compute stream
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
