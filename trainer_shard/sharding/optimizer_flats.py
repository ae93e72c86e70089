"""`ShardedOptimizer`'s flat buffers: how its parameters become the flats it steps.

Each param group's trainable parameters are flattened, one `flat.FlatGroup` per dtype and
device, after every rank has checked it holds the same ones; at stage 3 the sharded model's own
flat buffers are adopted instead ([Note: ZeRO-3 flats]); parameters that start requiring grad
later are flattened at the next step ([Note: trainability] in frozen.py). The methods marked
collective follow [Note: collective methods] in optimizer.py.
"""

import logging
from collections import defaultdict

import torch

from .. import comm
from ..errors import ShardingError
from .flat import FlatGroup
from .partition import plan_layout

# ShardedOptimizer's one logger, whichever of its modules speaks (users filter by this name)
logger = logging.getLogger(f"{__package__}.optimizer")


class FlatsMixin:
    """Building the flats of a `ShardedOptimizer` (its `flats`, `_flat_owner`, `_flattened`,
    `stepper`, `reducer` and `param_groups` are the state it works on)."""

    def _build_flats(self, index: int, params=None) -> None:
        """Flatten `params` (default: the trainable ones of group `index`), one FlatGroup per
        dtype and device. Collective."""
        if params is None:
            params = [p for p in self.param_groups[index]["params"] if p.requires_grad]
        _check_same_everywhere(index, params, self.group)
        if self.stage == 3:
            params = self._adopt_zero3_flats(index, params)
            if not params:
                return
        self._flattened.update(params)
        by_kind = defaultdict(list)
        for p in params:
            by_kind[(p.dtype, p.device)].append(p)
        for kind_params in by_kind.values():
            layout = plan_layout([p.numel() for p in kind_params], self.world_size, self.bucket_numel)
            grad_dtype = self.grad_dtype
            if grad_dtype is not None and grad_dtype not in (torch.float32, kind_params[0].dtype):
                raise ShardingError(f"grad_dtype must be float32 or the parameters' dtype {kind_params[0].dtype}, "
                                    f"got {grad_dtype}")  # fmt: skip
            if grad_dtype not in (None, torch.float32) and self.offload is None:
                raise ShardingError("a 16-bit gradient shard needs offload: the inner optimizer steps fp32 masters "
                                    "from fp32 gradients")  # fmt: skip
            # ZeRO-1 (and ZeRO-3's persistent parameters) step views of the all-reduced `.grad`s:
            # [Note: gradient views] in flat.py
            flat = FlatGroup(kind_params, layout, self.rank, self.group, offloaded=self.offload is not None,
                             grad_dtype=grad_dtype, grad_views=self.stage != 2)  # fmt: skip
            comm.broadcast(flat.buffer, 0, self.group)  # every rank starts from rank 0's weights
            flat.refresh_master()
            self.flats.append(flat)
            self._flat_owner.append(index)
            self.stepper.add(flat, self._hyperparameters(len(self.flats) - 1))
            if self.reducer is not None and self.stage == 2:
                self.reducer.add(flat)

    def _adopt_zero3_flats(self, index: int, params: list) -> list:
        """[Note: ZeRO-3 flats] At stage 3 the flat buffers are the sharded model's own
        (`zero3.FlatParams`: one per unit and param-group key), and so is the gradient reduction:
        each is stepped here as a `FlatGroup` would be, its shard standing for this rank's slice
        of the buffer, and nothing is all-gathered after the step (the next forward gathers). The
        parameters the model keeps whole (persistent: small or frozen ones), their gradients
        all-reduced by the model, are flattened here as at stage 1. Returns those."""
        from .zero3 import sharded_part

        found = [sharded_part(p) for p in params]
        if any(f is None for f in found):
            raise ShardingError("stage=3 steps the parameters of a model zero3.shard_model sharded; shard the model "
                                "first (shard_model(model, ...)), then build the optimizer on its parameters")  # fmt: skip
        models = {id(f[0]): f[0] for f in found}
        if len(models) > 1:
            raise ShardingError("stage=3: the parameters come from several sharded models; one optimizer per model")
        sharded = next(iter(models.values()), None)
        if sharded is not None:
            if sharded.world_size != self.world_size:
                raise ShardingError(f"stage=3: the model is sharded over {sharded.world_size} ranks, the optimizer's "
                                    f"group has {self.world_size}; use the same process group")  # fmt: skip
            self.sharded_model = sharded
            self.reducer = sharded.reducer
        ours = set(params)
        parts = list({id(f[1]): f[1] for f in found if f[1] is not None}.values())
        on_disk = getattr(self.offload, "device", None) == "nvme"  # [Note: gradient store] in offload/param_store.py
        in_ram = [part for part in parts if not part.params_stored]  # the others' gradients go with their parameters
        grad_store = sharded.gradient_store(self.offload.nvme_path) if on_disk and in_ram else None
        for part in parts:
            outside = [n for p, n in zip(part.params, part.names) if p not in ours]
            if outside:
                raise ShardingError(f"stage=3: param group {index} holds some of the parameters of one flat buffer and "
                                    f"not {outside[:3]}; shard the model with a group_fn that gives every param "
                                    "group its own key, so no flat buffer spans two groups")  # fmt: skip
            part.configure(self.offload is not None, self.grad_dtype, grad_store)
            self._flattened.update(part.params)
            self.flats.append(part)
            self._flat_owner.append(index)
            self.stepper.add(part, self._hyperparameters(len(self.flats) - 1))
        return [p for p, f in zip(params, found) if f[1] is None]

    def _hyperparameters(self, flat_index: int) -> dict:
        """The outer group's settings (lr as the scheduler left it, weight_decay...) for flats[i]."""
        group = self.param_groups[self._flat_owner[flat_index]]
        return {k: v for k, v in group.items() if k not in ("params", "param_names")}

    def _adopt_newly_trainable(self) -> None:
        """Flatten the parameters that require grad now but did not when their group was added,
        and bring their gradients (in `.grad`, from before they had hooks) into the new shards.
        Collective when any parameter waits: every rank must unfreeze the same ones. See
        [Note: trainability] in frozen.py."""
        if len(self._flattened) == sum(len(g["params"]) for g in self.param_groups):
            return  # every parameter is in a flat: the common case, checked in a sum per step
        waiting = [(i, [p for p in g["params"] if p not in self._flattened]) for i, g in enumerate(self.param_groups)]
        waiting = [(i, params) for i, params in waiting if params]
        if not waiting:
            return
        ready = [(i, [p for p in params if p.requires_grad]) for i, params in waiting]
        ready = [(i, params) for i, params in ready if params]
        if ready and self.stage == 3:
            raise ShardingError("stage=3: parameters frozen when the model was sharded require grad now; the sharded "
                                "model keeps them whole and never reduces their gradients: set requires_grad before "
                                "shard_model")  # fmt: skip
        count = sum(len(params) for _, params in ready)
        counts = torch.tensor([count, -count], device=self._device())
        most, fewest = comm.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=self.group).tolist()
        if most != -fewest:
            raise ShardingError(f"ranks unfroze different parameters ({-fewest} to {most} on different ranks, "
                                f"{count} here); change requires_grad the same way on every rank")  # fmt: skip
        before = len(self.flats)
        for index, params in ready:
            self._build_flats(index, params)
        for flat in self.flats[before:]:
            if self.reducer is not None:
                self.reducer.reduce_from_grads(flat)
        if ready:
            logger.info("%d parameters that did not require grad when the optimizer was built do now: sharded and "
                        "stepped from this step on", count)  # fmt: skip


def _check_same_everywhere(index: int, params: list, group) -> None:
    """Every rank must shard the same parameters, or collectives would mismatch and hang."""
    mine = [(tuple(p.shape), str(p.dtype)) for p in params]
    everyone = comm.all_gather_objects(mine, group)
    for rank, theirs in enumerate(everyone):
        if theirs != mine:
            diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            raise ShardingError(
                f"param group {index}: the parameters differ across ranks (rank {rank} has {len(theirs)}, this rank "
                f"{len(mine)}; first difference at position {diff}); every rank must build the same model"
            )
