"""The gradient side of a flat buffer: this rank's fp32 (or offloaded) gradient shard, and what
`ShardedOptimizer(stage=3)` and its steppers use of a flat (as of `flat.FlatGroup`)."""

import torch

from ...constants import CHUNK_NUMEL
from ...errors import ShardingError
from ..norms import power_sum


class GradShard:
    """Mixed into `FlatParams`: the gradient shard (`grad`), kept in memory or on disk
    (`grad_stored`, its squared norm in `grad_sq`): in the parameter store with the parameter
    shard, or with the optimizer's state on disk in the gradient store (`grad_store`, [Note:
    gradient store] in offload/param_store.py), and the
    optimizer's view of the parameter shard (`shard_param`, `master`). A frozen flat
    (`trainable` False) has none of it: no gradient, no optimizer state, never rewritten."""

    grad_views = False  # see [Note: gradient views] in flat.py: a FlatParams keeps its own gradient shard

    def _init_grad_side(self, device) -> None:
        self.offloaded = False
        self.grad_stored = False  # the gradient shard lives on disk, in `grad_store`
        self.grad_store = None  # the parameter store, or the gradient store ([Note: gradient store])
        self.grad_sq = 0.0  # then: its squared 2-norm, kept as backward writes it
        self._grad_write = None  # the future of its last write
        if not self.trainable:  # frozen: nothing for an optimizer
            self.master, self.shard_param = None, None
        elif self.store is not None:  # the fp32 master lives in the offload engine's store: no copy here
            self.master = None
            self.shard_param = torch.nn.Parameter(torch.empty(self.layout.shard_numel, device="meta"))
        elif self.dtype == torch.float32:
            self.master = None
            self.shard_param = torch.nn.Parameter(self.shard)  # shares the shard's storage
        else:  # 16-bit: the fp32 master made when an optimizer is to step it (`ensure_master`), not before
            self.master = None
            self.shard_param = torch.nn.Parameter(torch.empty(0, device=device))
        self._master_version = self.shard_param._version if self.shard_param is not None else 0
        # made when first needed (`_grad_in_memory`): by the optimizer (`configure`, which also says where
        # and in what dtype) or the first backward; a model only evaluated never holds one (issue 35)
        self.grad = torch.empty(self.layout.shard_numel, dtype=torch.float32, device="meta")
        self.stale = True  # the gradient shard holds nothing of this step yet (counts as zero)
        self.accumulated = False  # a second backward added into it before the step
        self.edited = False  # weights written behind the optimizer's back (load_state_dict, gathered(writeback))

    @torch.no_grad()
    def add_to_grad(self, bucket, values: torch.Tensor, alpha: float = 1.0, owned: bool = False) -> None:
        """The gradient shard += alpha * values (= when stale: after `zero_grad`, or never written).
        `owned`: `values` is the caller's no longer (the reducer's output): on disk it is written
        as it is, with no copy."""
        if self.grad_stored:
            self._add_to_stored_grad(values, alpha, owned)
            return
        if self.grad.device.type == "meta":
            if self.store is not None:
                raise ShardingError("offload_param: the gradients have nowhere to go before the optimizer is built "
                                    "(ShardedOptimizer(..., stage=3, offload=...)), or configure(offloaded=True) is "
                                    "called on each flat buffer")  # fmt: skip
            self._grad_in_memory(self.grad.dtype)
        if self.shard_param.grad is None and not self.offloaded and self.shard_param.numel():  # a plain optimizer's zero_grad(set_to_none=True)
            self.shard_param.grad = self.grad
            self.stale = True
        target = self.grad[bucket.shard_offset : bucket.shard_offset + bucket.shard_numel]
        if self.stale:
            target.copy_(values)
            if alpha != 1.0:
                target.mul_(alpha)
            self.stale = False
        else:
            target.add_(values, alpha=alpha)
            self.accumulated = True

    def _add_to_stored_grad(self, values: torch.Tensor, alpha: float, owned: bool) -> None:
        """[Note: parameter offload] The reduced slice goes to the store as backward makes it, its
        squared norm kept on the way (the sum's, when micro-batches accumulate)."""
        self._wait_grad_write()
        if (self.stale and owned and alpha == 1.0 and values.dtype == self.grad.dtype and values.is_contiguous()
                and values.device.type == "cpu"):
            total = values  # written as it is (t5-11b: a unit's gradient is 0.5 GB; no second copy)
        else:
            total = torch.empty(values.numel(), dtype=self.grad.dtype)
            if self.stale:  # as `add_to_grad` does in memory, operation for operation
                total.copy_(values)
                if alpha != 1.0:
                    total.mul_(alpha)
            else:
                self.grad_store.read(self.grad_name, 0, total).add_(values, alpha=alpha)
                self.accumulated = True
        self.stale = False
        self.grad_sq = float(power_sum(total, 2.0))  # fp32 row norms summed in fp64: one pass, no copy
        self._grad_write = self.grad_store.write_async(self.grad_name, 0, total)  # backward goes on meanwhile

    def _wait_grad_write(self) -> None:
        if self._grad_write is not None:
            self._grad_write.result()
            self._grad_write = None

    @torch.no_grad()
    def read_grad(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Gradient shard elements [start, start + out.numel()) into `out` (of the gradient's dtype)."""
        if self.grad_stored:
            self._wait_grad_write()
            return self.grad_store.read(self.grad_name, start, out)
        return out.copy_(self.grad[start : start + out.numel()])

    @torch.no_grad()
    def scale_grad(self, factor: float) -> None:
        """The gradient shard *= factor, wherever it lives (on disk: a chunk at a time)."""
        if not self.grad_stored:
            self.grad.mul_(factor)
            return
        self._wait_grad_write()
        chunk = torch.empty(min(CHUNK_NUMEL, self.layout.shard_numel), dtype=self.grad.dtype)
        for start in range(0, self.layout.shard_numel, CHUNK_NUMEL):
            piece = chunk[: min(CHUNK_NUMEL, self.layout.shard_numel - start)]
            scaled = self.grad_store.read(self.grad_name, start, piece).mul_(factor)
            self.grad_store.write(self.grad_name, start, scaled)
        self.grad_sq *= factor * factor

    def grad_square_sum(self) -> torch.Tensor:
        """sum(gradient shard ** 2) as an fp32 scalar (0 while stale: it counts as zero)."""
        if self.stale:
            return torch.zeros(())
        if self.grad_stored:
            return torch.tensor(self.grad_sq, dtype=torch.float32)
        return self.grad.float().pow(2).sum().cpu()

    def configure(self, offloaded: bool, grad_dtype=None, grad_store=None) -> None:
        """For `ShardedOptimizer`: with `offloaded` the fp32 master lives in the offload store (no
        copy here) and the gradient shard is kept in `grad_dtype` (default: the parameters');
        `grad_store` (a `GradStore`, the optimizer's state on disk): the gradient shard on disk
        there, unless the parameter store holds it with the parameter shard."""
        if not self.trainable:
            raise ShardingError(f"the frozen parameters {self.names[:3]} were handed to an optimizer; give it the "
                                "parameters that require grad (ShardedModel.shard_parameters())")  # fmt: skip
        if self.store is not None and not offloaded:
            raise ShardingError("offload_param keeps the parameter shards out of memory, but the optimizer steps fp32 "
                                "masters in memory: offload the optimizer too (offload_optimizer.device cpu or "
                                "nvme; --sharded_ddp \"zero_dp_3 offload\")")  # fmt: skip
        self.offloaded = offloaded
        dtype = grad_dtype or (self.dtype if offloaded else torch.float32)
        if offloaded:  # the engine's store holds the master: none here, and the Parameter holds no memory
            if self.master is not None:
                self.shard_param.data = torch.empty(0, device=self.master.device)
            self.master = None
            self.shard_param.grad = None
        else:
            self.ensure_master()
        on_disk = self.store if self.store is not None and self.shard is None else None  # parameters on disk
        on_disk = on_disk or (grad_store if offloaded else None)
        if on_disk is None and self.grad_stored:  # an optimizer before this one kept it on disk
            self._wait_grad_write()
            self.grad_store, self.grad_stored = None, False
        if on_disk is not None:  # the gradients on disk too
            self.grad_name = self.store_name.replace(".param", ".grad")
            if self.grad_stored and (self.grad_store is not on_disk or self.grad.dtype != dtype):
                raise ShardingError(f"the gradient shard of {self.names[:3]} is on disk already, in "
                                    f"{self.grad.dtype}; build one optimizer on the sharded model")  # fmt: skip
            if not self.grad_stored:
                on_disk.add(self.grad_name, self.layout.shard_numel, dtype, on_disk=True)
            self.grad_store, self.grad_stored = on_disk, True
            self.grad = torch.empty(self.layout.shard_numel, dtype=dtype, device="meta")  # shape and dtype
            return
        if dtype != self.grad.dtype or self.grad.device.type == "meta":
            self._grad_in_memory(dtype)
        if not offloaded:
            self.shard_param.grad = self.grad

    def ensure_master(self) -> None:
        """The fp32 master of a 16-bit shard in memory, as the optimizer's Parameter (`shard_param`),
        made from the shard when first asked for: a model only evaluated, or stepped by an
        offloaded optimizer, never holds one (issue 35: t5-large, bf16, 2 ranks: 1.37 GiB a rank)."""
        if self.trainable and not self.offloaded and self.master is None and self.store is None and self.dtype != torch.float32:
            self.master = self.shard.float()
            self.shard_param.data = self.master
            self._master_version = self.shard_param._version

    def _grad_in_memory(self, dtype) -> None:
        """The gradient shard in memory, zero, where the parameters are (stale: nothing of this step)."""
        self.grad = torch.zeros(self.layout.shard_numel, dtype=dtype, device=self.buffer.device)
        if self.shard_param is not None and not self.offloaded and self.shard_param.grad is not None:
            self.shard_param.grad = self.grad

    def reduce_target(self, bucket, dtype):
        """Where the reduction of this flat's one bucket may write this rank's slice directly: the
        gradient shard itself, in memory, when it holds nothing of this step (stale) and is of
        `dtype` (no output tensor made and copied). Else None: the result goes through
        `add_to_grad` (on disk it is written as it is, with no copy). The shard counts as written
        from here on, before the reduction lands: a second reduction of the bucket in this
        backward (reentrant checkpointing) is then added to it, after this one, in launch order."""
        if self.grad_stored or not self.stale or self.grad.dtype != dtype:
            return None
        if self.grad.device.type == "meta":
            if self.store is not None:
                return None  # `add_to_grad` says why the gradients have nowhere to go
            self._grad_in_memory(self.grad.dtype)
        if self.shard_param.grad is None and not self.offloaded and self.shard_param.numel():
            self.shard_param.grad = self.grad  # a plain optimizer's zero_grad(set_to_none=True) dropped it
        self.stale = False
        return self.grad[bucket.shard_offset : bucket.shard_offset + bucket.shard_numel]

    def mark_reduced(self, bucket) -> None:
        """The reduction `reduce_target` gave the shard to has landed (it counted as written already)."""

    @property
    def master_views(self) -> list:
        return [] if self.offloaded else [self.shard_param]

    @property
    def master_ranges(self) -> list:
        """(first element in the shard, elements) of each of `master_views`."""
        return [] if self.offloaded else [(0, self.layout.shard_numel)]

    def grad_tensors(self) -> list:
        return [self.grad]

    @property
    def grad_bytes(self) -> int:
        if self.grad_stored or self.grad.device.type == "meta":
            return 0
        return self.grad.numel() * self.grad.element_size()

    @property
    def separate_master(self) -> bool:
        return self.master is not None or self.offloaded

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Master <- the shard (weights loaded into the model)."""
        if self.master is not None:
            self.master.copy_(self.shard)
            self._master_version = self.shard_param._version

    def follow_outside_edits(self) -> bool:
        """True when weights were loaded since the last look and the master is elsewhere."""
        return self.separate_master and self.edited

    def mark_seen(self) -> None:
        self.edited = False

    def mark_grads_stale(self) -> None:
        self.stale = True

    @torch.no_grad()
    def zero_stale(self) -> None:
        if self.stale:
            if self.grad_stored:
                self._wait_grad_write()
                numel = self.layout.shard_numel
                zeros = torch.zeros(min(CHUNK_NUMEL, numel), dtype=self.grad.dtype)
                for start in range(0, numel, CHUNK_NUMEL):
                    self.grad_store.write(self.grad_name, start, zeros[: min(CHUNK_NUMEL, numel - start)])
                self.grad_sq = 0.0
            elif self.grad.device.type == "meta":
                self._grad_in_memory(self.grad.dtype)
            else:
                self.grad.zero_()
        self.stale = False
