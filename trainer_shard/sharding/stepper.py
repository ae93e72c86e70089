"""The stepper interface: what steps a `ShardedOptimizer`'s shards and holds their state.

`ShardedOptimizer` decides what each rank owns and when to step; a stepper decides where the
fp32 master weights and the inner optimizer's state of those shards live, and runs the update.
Two implement it:

- `OnDevice` (sharding/on_device.py): a torch optimizer steps the masters where they are;
- `OffloadEngine` (offload/engine.py): masters and state in a CPU or disk store, streamed
  through a CPU step a chunk at a time.

The optimizer, its checkpoints (sharding/state_io.py) and the re-partitioning of saved state
(sharding/repartition.py) use these methods only, so neither branches on where state lives.

[Note: chunked state access] State is read and written a range of one shard-sized tensor at a
time, by name: "master" (the fp32 weights: for fp32 parameters, the parameters themselves) and
the optimizer's per-element state ("exp_avg", ...). A flat's state is "fresh" until its first
step or load: `tensor_names` then lists "master" alone and `scalar_state` is empty.
"""

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Stepper(Protocol):
    """Implemented by `OnDevice` and `OffloadEngine`; `index` is the position of a `FlatGroup`
    in the order `add` received them."""

    def add(self, flat, hyper: dict) -> None:
        """Take over the master shard of `flat` (its param group's settings in `hyper`)."""

    def step(self, hypers: list, factors) -> None:
        """One update of every flat, with each flat's group settings; the gradients are
        multiplied by the product of `factors` (1/loss scale, clip coefficients) first."""

    def refresh_master(self, index: int, flat) -> None:
        """Master <- the parameters as the model holds them now (edited from outside)."""

    def tensor_names(self, index: int) -> list:
        """"master" and the per-element state names this flat holds now."""

    def read(self, index: int, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """out <- elements [start, start + len(out)) of the shard-sized tensor `name`."""

    def write(self, index: int, name: str, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + len(values)) of `name` <- values (a state tensor not held
        yet is created, zero elsewhere)."""

    def scalar_state(self, index: int) -> dict:
        """The state that is not per element ("step"...), empty while fresh."""

    def set_scalar_state(self, index: int, scalars: dict) -> None:
        """Set the scalar state; after it the flat is no longer fresh."""

    def clear_state(self, index: int) -> None:
        """Forget the optimizer state of a flat: the next step starts it afresh."""

    def state_bytes(self) -> dict:
        """Bytes held, by kind ("master", "optimizer_state", or the offload store's)."""

    def close(self) -> None:
        """Free what the stepper holds (a disk store deletes its files). Idempotent."""
