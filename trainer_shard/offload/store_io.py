"""The offload engine's reads and writes of its store: chunks in and out during the step, and
the state access of the `Stepper` interface (checkpoints, re-partitioning).

The store itself (store.py) is a mapping of named fp32 tensors; `StoreIO`, mixed into
`OffloadEngine`, names a flat group's tensors in it ("<index>.master", "<index>.exp_avg"...),
cuts them into chunks, and reads and writes them: on the disk store as mapped page-cache pages
stepped in place, or as copies in `buffer_count` sets of chunk buffers ([Note: stepping on mapped
pages] in store.py).
"""

import mmap
import os

import torch

from .store import DiskStore, bytes_needed

NO_MMAP_ENV = "TRAINER_SHARD_NO_MMAP"  # "1": the disk store's chunks are read and written as copies
_MAPS = "maps"  # a mapped chunk's entry: the mappings to give back once it is written


class StoreIO:
    """The engine's traffic with its store. A mixin: it uses the engine's `spec`, `store`,
    `names`, `state_names`, `flats`, `sizes`, `scalars`, its chunk buffers (`_buffers`,
    `_grad_buffers`, `_param_buffers`) and its flushing thread (`_flusher`)."""

    # ---- where a flat group's tensors are: their names in the store, and its chunks -----------

    def _key(self, index: int, name: str) -> str:
        return f"{index}.{name}"

    def _ranges(self, index: int) -> list:
        numel, chunk = self.sizes[index], self.spec.chunk_numel
        return [(s, min(s + chunk, numel)) for s in range(0, numel, chunk)]

    # ---- chunks in and out during the step (the disk store's on its reader and writer threads) -

    def _ensure_chunk_buffers(self) -> None:
        if self._buffers is None:
            n = self.spec.chunk_numel
            self._buffers = [{name: torch.empty(n) for name in self.names} for _ in range(self.spec.buffer_count)]

    def _mapped(self) -> bool:
        """Whether the disk store's chunks are stepped on their mapped pages (every chunk starts
        on a page boundary of the store's fp32 files, and `TRAINER_SHARD_NO_MMAP` is not set)."""
        aligned = self.spec.chunk_numel * 4 % mmap.ALLOCATIONGRANULARITY == 0
        return aligned and os.environ.get(NO_MMAP_ENV) != "1"

    def _read(self, index: int, start: int, end: int, slot: int) -> dict:
        if self._mapped():
            mapped = {name: self.store.map(self._key(index, name), start, end - start) for name in self.names}
            chunk = {name: tensor for name, (tensor, _) in mapped.items()}
            chunk[_MAPS] = [mapping for _, mapping in mapped.values()]
        else:
            buffers = self._buffers[slot]
            chunk = {name: self.store.read(self._key(index, name), start, buffers[name][: end - start])
                     for name in self.names}  # fmt: skip
        if self.flats[index].grad_stored:
            chunk["grad"] = self._read_grad(self.flats[index], start, end, slot)
        return chunk

    def _read_grad(self, flat, start: int, end: int, slot: int) -> torch.Tensor:
        """A gradient chunk of a flat that keeps its gradients in its own store (ZeRO-3, on disk)."""
        key = (slot, flat.grad.dtype)
        if key not in self._grad_buffers:
            self._grad_buffers[key] = torch.empty(self.spec.chunk_numel, dtype=flat.grad.dtype)
        return flat.read_grad(start, self._grad_buffers[key][: end - start])

    def _param_buffer(self, slot: int, dtype, numel: int) -> torch.Tensor:
        key = (slot, dtype)
        if key not in self._param_buffers:
            self._param_buffers[key] = torch.empty(self.spec.chunk_numel, dtype=dtype)
        return self._param_buffers[key][:numel]

    def _write(self, index: int, start: int, chunk: dict, flat=None, params=None) -> None:
        """Chunk `chunk` of flat `index` back to the store, and its write-back to the disk started:
        see [Note: stepping on mapped pages] in store.py."""
        maps = chunk.pop(_MAPS, None)
        numel = chunk[self.names[0]].numel()
        if maps is not None:  # stepped in place: the pages go back, the views of them first
            for name in self.names:
                del chunk[name]
            for mapping in maps:
                self.store.unmap(mapping)
        else:
            for name in self.names:
                self.store.write(self._key(index, name), start, chunk[name])
        # the store, not the engine: the write-back outlasts the step ([Note: a finished job keeps nothing])
        self._flusher.submit(_flush, self.store, [self._key(index, name) for name in self.names], start, numel)
        if params is not None:
            flat.write_shard(start, params)

    # ---- state in and out: the `Stepper` interface, see [Note: chunked state access] in sharding/stepper.py

    @torch.no_grad()
    def refresh_master(self, index: int, flat) -> None:
        """Master <- the parameters (their values as the model holds them), chunk by chunk."""
        buffer = torch.empty(min(self.spec.chunk_numel, max(self.sizes[index], 1)))
        for start, end in self._ranges(index):
            chunk = buffer[: end - start]
            flat.read_shard(start, chunk)
            self.store.write(self._key(index, "master"), start, chunk)

    def tensor_names(self, index: int) -> list:
        return list(self.names) if self.scalars[index] is not None else ["master"]

    def read(self, index: int, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        return self.store.read(self._key(index, name), start, out)

    def write(self, index: int, name: str, start: int, values: torch.Tensor) -> None:
        self.store.write(self._key(index, name), start, values)

    def scalar_state(self, index: int) -> dict:
        return dict(self.scalars[index] or {})

    def set_scalar_state(self, index: int, scalars: dict) -> None:
        self.scalars[index] = {k: (v.detach().clone().cpu() if torch.is_tensor(v) else v) for k, v in scalars.items()}

    def clear_state(self, index: int) -> None:
        self.scalars[index] = None  # the next step starts the state afresh (what is stored is unused)

    def state_bytes(self) -> dict:
        where = "disk" if isinstance(self.store, DiskStore) else "cpu"
        return {"offload_device": where, "offload_bytes": bytes_needed(self.store.sizes) if self.store else 0}


def _flush(store, names, start: int, numel: int) -> None:
    for name in names:
        store.flush(name, start, numel)
