"""ZeRO-3 parameter offload: where a rank's parameter shards (and, on disk, its gradient shards)
live between uses. `zero3.shard_model(..., param_offload=ParamOffloadSpec(...))` drives it.

    spec = ParamOffloadSpec("nvme", nvme_path="/scratch/params", buffer_count=5)
    sharded = shard_model(model, units=[T5Block], param_offload=spec)

- device "cpu": each unit's parameter shard is a tensor in CPU RAM (page-locked with
  `pin_memory` when CUDA is present, so the copy to the device before the all-gather runs
  asynchronously); gradients stay where the optimizer keeps them.
- device "nvme": each unit's parameter shard is a file under `<nvme_path>/zero3_params/rank<R>/`
  (a `DiskStore`: locked for the run, checked for room before anything is written, deleted at
  the end), and so is its gradient shard; the first units up to `max_in_cpu` elements stay in
  RAM instead, as DeepSpeed keeps them. Reads run on one background thread: the sharded model
  starts them in the recorded order of its units (forward, then backward's reverse), into the
  gather buffer the unit will use, so at most `buffer_count` units' buffers are alive at once;
  gradient shards are written on another thread, one at a time (the next waits: a unit's
  gradient of t5-11b is 0.5 GB).

[Note: parameter store names] "<i>.param" and "<i>.grad" for the i-th flat buffer of the model
(units in order, one per param-group key and dtype), in the parameters' dtype and the gradient
shard's; the offload engine's optimizer store is another store ("<i>.master", ...).

[Note: gradient store] With the optimizer's state on disk (offload_optimizer nvme) and a unit's
parameter shard in RAM, its gradient shard goes to disk as well, in a store of its own under the
optimizer's folder (`GradStore`: `<nvme_path>/zero3_grads/rank<R>/`, written as backward makes
each unit's slice, read chunk by chunk with the master and moments at the step), as DeepSpeed's
ZeRO-3 swaps fp32 gradient partitions out with `offload_optimizer: nvme`. What a rank then holds
in RAM of the model is its parameter shards: t5-large in fp32 on 2 ranks, 1.37 GiB, not 2.75
(issue 35, bench/results/load_rss.md).
"""

import collections
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .store import CpuStore, DiskStore, StoreRole, bytes_needed
from .workers import Workers

logger = logging.getLogger(__name__)

PARAM_FOLDER = "zero3_params"
GRAD_FOLDER = "zero3_grads"

# whose store it is, in the disk store's errors (offload/store.py): the key to change, what it holds
PARAMS = StoreRole(
    key="zero_optimization.offload_param.nvme_path",
    setting="offload_param.nvme_path",
    what="parameter and gradient shards",
    name="parameter store",
    owner="the sharded model that holds it (ShardedModel.close())",
)

GRADS = StoreRole(
    key="zero_optimization.offload_optimizer.nvme_path",
    setting="offload_optimizer.nvme_path",
    what="gradient shards",
    name="gradient store",
    owner="the sharded model that holds it (ShardedModel.close())",
)


@dataclass(frozen=True)
class ParamOffloadSpec:
    """Where ZeRO-3 parameter shards live between uses (the `offload_param` section of the config)."""

    device: str  # "cpu" | "nvme"
    nvme_path: str | None = None
    buffer_count: int = 5  # units whose gather buffers may be alive at once (read ahead + running)
    buffer_size: int = 100_000_000  # elements of the largest unit a buffer must hold (checked)
    max_in_cpu: int = 1_000_000_000  # nvme: parameter elements kept in RAM, the first units'
    pin_memory: bool = False

    def __post_init__(self):
        if self.device not in ("cpu", "nvme"):
            raise ValueError(f"offload_param device must be 'cpu' or 'nvme', got {self.device!r}")
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("offload_param device 'nvme' needs nvme_path")
        if self.buffer_count < 2:
            raise ValueError(f"offload_param buffer_count must be at least 2 (the running unit and the model's "
                             f"root), got {self.buffer_count}")  # fmt: skip
        if self.buffer_size < 1 or self.max_in_cpu < 0:
            raise ValueError("offload_param buffer_size must be at least 1 and max_in_cpu at least 0")

    @property
    def folder(self) -> Path:
        return Path(self.nvme_path) / PARAM_FOLDER


class ParamStore:
    """This rank's parameter shards ("<i>.param") and, for those on disk, gradient shards
    ("<i>.grad"): see the module docstring and [Note: parameter store names]."""

    def __init__(self, spec: ParamOffloadSpec, sizes: dict, *, rank: int = 0):
        """`sizes`: {name: (numel, dtype)} of the parameter shards, in the units' order."""
        ram, disk, kept = {}, {}, 0
        for name, (numel, dtype) in sizes.items():
            if spec.device == "cpu" or kept + numel <= spec.max_in_cpu:
                ram[name], kept = (numel, dtype), kept + numel
            else:
                disk[name] = (numel, dtype)
        self._open(spec, rank, ram, DiskStore(disk, spec.folder, rank=rank, role=PARAMS) if disk else None,
                   reader=True)  # fmt: skip
        if disk:
            logger.info("offload_param: %s bytes of parameter shards on disk in %s, %s in RAM",
                        f"{bytes_needed(disk):,}", self.disk.folder, f"{bytes_needed(ram):,}")  # fmt: skip

    def _open(self, spec, rank: int, ram: dict, disk, *, reader: bool) -> None:
        """RAM shards `ram` ({name: (numel, dtype)}), the DiskStore `disk` (or None) and, with one,
        its writer thread (and a reader thread with `reader`)."""
        self.spec, self.rank, self.disk = spec, rank, disk
        self.ram = CpuStore(ram, pin_memory=spec is not None and spec.pin_memory)
        threads = disk is not None
        self._reader = Workers(1, thread_name_prefix="trainer_shard-params") if threads and reader else None
        self._writer = Workers(1, thread_name_prefix="trainer_shard-grads") if threads else None
        self._writes = collections.deque()  # futures of `write_async`, oldest first

    def on_disk(self, name: str) -> bool:
        return self.disk is not None and name in self.disk.sizes

    def tensor(self, name: str) -> torch.Tensor:
        """A RAM-held shard, in place."""
        numel, _ = self.ram.sizes[name]
        return self.ram.view(name, 0, numel)

    def add(self, name: str, numel: int, dtype, *, on_disk: bool) -> None:
        (self.disk if on_disk else self.ram).add({name: (numel, dtype)})

    def read(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        if self.on_disk(name):
            return self.disk.read(name, start, out)
        return self.ram.read(name, start, out)

    def read_async(self, name: str, start: int, out: torch.Tensor):
        """A future of `read` on the reader thread (disk only)."""
        return self._reader.submit(self.read, name, start, out)

    def write_async(self, name: str, start: int, data: torch.Tensor, in_flight: int = 1):
        """A future of `write` on the writer thread (disk only); `data` must not change until it is
        done. At most `in_flight` writes wait at once: one more first waits for the oldest."""
        while len(self._writes) >= in_flight:
            self._writes.popleft().result()
        future = self._writer.submit(self.write, name, start, data)
        self._writes.append(future)
        return future

    def write(self, name: str, start: int, data: torch.Tensor) -> None:
        if self.on_disk(name):
            self.disk.write(name, start, data)
        else:
            self.ram.write(name, start, data)

    def bytes(self) -> dict:
        """{"ram": bytes held in RAM, "disk": bytes in files}."""
        return {"ram": bytes_needed(self.ram.sizes), "disk": bytes_needed(self.disk.sizes) if self.disk else 0}

    def close(self) -> None:
        """Free the RAM shards and delete the files. Idempotent."""
        for pool in (self._reader, self._writer):
            if pool is not None:
                pool.shutdown(wait=True)
        self._reader = self._writer = None
        self.ram.close()
        if self.disk is not None:
            self.disk.close()


class GradStore(ParamStore):
    """[Note: gradient store] This rank's gradient shards on disk ("<i>.grad", added by each flat
    buffer as the optimizer configures it), under `<nvme_path>/zero3_grads/rank<R>/`; written on
    one background thread, as the parameter store writes those of parameters on disk."""

    def __init__(self, nvme_path, *, rank: int = 0):
        # no reader thread: the offload engine's own reads the gradient shards with the optimizer's state
        self._open(None, rank, {}, DiskStore({}, Path(nvme_path) / GRAD_FOLDER, rank=rank, role=GRADS), reader=False)
