"""`ShardedOptimizer`'s state: saving, loading and consolidating it.

Three formats: the full state in the unsharded optimizer's format (`consolidate_state_dict`
gathers it on one rank, `state_dict` returns it there, `load_state_dict` takes it, or a local
optimizer's, and keeps this rank's shard); this rank's shard alone (`local_state_dict`, loaded
back on the same rank and world size); and state saved at any world size, filled shard by shard
(`load_repartitioned`, see repartition.py). The methods marked collective follow
[Note: collective methods] in optimizer.py.
"""

import torch

from .. import comm
from ..constants import CHUNK_NUMEL
from ..errors import ShardingError
from ..offload.engine import per_element_state
from .flat import FlatGroup
from .on_device import per_element
from .repartition import TensorSource, fill_shard


class NotConsolidatedError(ShardingError, RuntimeError):
    """`state_dict()` where no full state was consolidated (a RuntimeError, as ZeroRedundancyOptimizer's)."""


class StateDictMixin:
    """The state of a `ShardedOptimizer` in and out (its `flats`, `stepper`, `param_groups`,
    `loss_scaler`, `_fresh` and `_consolidated` are what it reads and writes)."""

    def _param_ids(self) -> dict:
        """{param: index} in the standard torch numbering (groups in order, params in order)."""
        ids, n = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                ids[p] = n
                n += 1
        return ids

    def shard_tensors(self, index: int) -> dict:
        """The state of flats[index] on this rank: per-element tensors, whole shards (read from
        wherever the stepper keeps them), and scalars ("step"); empty while fresh."""
        if self._fresh:
            return {}
        numel = self.flats[index].layout.shard_numel
        names = [n for n in self.stepper.tensor_names(index) if n != "master"]
        out = {n: self.stepper.read(index, n, 0, torch.empty(numel, device=self._state_device())) for n in names}
        return {**out, **self.stepper.scalar_state(index)}

    def master_shard(self, index: int):
        """This rank's fp32 master shard of flats[index]; None for fp32 parameters, which are
        their own masters (saved with the model)."""
        flat = self.flats[index]
        if flat.dtype == torch.float32:
            return None
        return self.stepper.read(index, "master", 0, torch.empty(flat.layout.shard_numel, device=self._state_device()))

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on rank `to`, in the local optimizer's format. Collective.

        Afterwards `state_dict()` on rank `to` returns what the unsharded optimizer would, with
        the fp32 master weights under "master_params" when the parameters are 16-bit, until the
        next `step` (which frees it: a saved state is never stale) or `release_consolidated`.
        """
        self._check_open()
        self._consolidated_to = to
        ids = self._param_ids()
        state, masters = {}, {}
        for index, flat in enumerate(self.flats):
            inner = self.shard_tensors(index)
            like = _shard_like(flat)
            keys = comm.all_gather_objects(sorted(k for k, v in inner.items() if per_element(k, v, like)), self.group)[0]
            pieces = {key: _gather_to(inner[key], to, self.group) for key in keys}
            master = self.master_shard(index)
            if master is not None:  # fp32 parameters are their own masters: nothing to gather
                pieces["__master__"] = _gather_to(master, to, self.group)
            if self.rank != to:
                continue
            for key, stacked in pieces.items():
                for slot, full in zip(flat.layout.slots, _unshard(stacked, flat, self.world_size)):
                    pid = ids[flat.params[slot.index]]
                    if key == "__master__":
                        masters[pid] = full
                    else:
                        state.setdefault(pid, {})[key] = full
            for p in flat.params:
                for key, value in inner.items():
                    if key not in pieces:  # scalars such as "step": the same on every rank
                        state.setdefault(ids[p], {})[key] = value.clone() if torch.is_tensor(value) else value
        if self.rank == to:
            result = {"state": state, "param_groups": self._groups_for_state_dict(ids)}
            if masters:
                result["master_params"] = masters
            if self.loss_scaler is not None:
                result["loss_scaler"] = self.loss_scaler.state_dict()
            self._consolidated = result
        else:
            self._consolidated = None

    def _groups_for_state_dict(self, ids) -> list:
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [ids[p] for p in g["params"]]}
                for g in self.param_groups]  # fmt: skip

    def release_consolidated(self) -> None:
        """Free the state gathered by `consolidate_state_dict`."""
        self._consolidated = None

    def state_dict(self) -> dict:
        """The full state, in the unsharded optimizer's format: on rank `to` after
        `consolidate_state_dict(to)` (and before the next step); before the first step, the empty
        state, on any rank. Otherwise raises `NotConsolidatedError`, as ZeroRedundancyOptimizer
        does: this rank's shard alone is `local_state_dict()`.

        [Note: state_dict callers] accelerate's `prepare()` round-trips the state of the optimizer
        it wraps (`AcceleratedOptimizer.__init__`: state_dict, moved to the device, load_state_dict)
        before training starts; the fresh optimizer's empty state makes that free (nothing is read
        from an offload store, nothing moved). The Trainer's checkpoints do not call it: each rank
        streams its shard (state_io.write_shard).
        """
        if self._consolidated is not None:
            return self._consolidated
        self._check_open()
        if self._fresh:
            return self._empty_state_dict()
        if self._consolidated_to is not None and self._consolidated_to != self.rank:
            where = f"it was consolidated on rank {self._consolidated_to}: call state_dict() there"
        else:
            where = (f"call consolidate_state_dict(to={self.rank}) on every rank first (a collective; the state may "
                     "have changed since an earlier one)")  # fmt: skip
        raise NotConsolidatedError(f"the optimizer state is sharded across ranks and not consolidated here: {where}; "
                                   "or save this rank's shard alone with local_state_dict()")  # fmt: skip

    def _empty_state_dict(self) -> dict:
        """What the unsharded optimizer's `state_dict()` is before its first step."""
        result = {"state": {}, "param_groups": self._groups_for_state_dict(self._param_ids())}
        if self.loss_scaler is not None:
            result["loss_scaler"] = self.loss_scaler.state_dict()
        return result

    def local_state_dict(self) -> dict:
        """This rank's shard of the state: it loads back (`load_state_dict`) only on the same
        rank and world size. Reads the whole shard from wherever it lives (offload store included)."""
        self._check_open()
        indices = range(len(self.flats))
        return {
            "shard": {"rank": self.rank, "world_size": self.world_size, "stage": self.stage},
            "fresh": self._fresh,
            "inner": [self.shard_tensors(i) for i in indices],
            # fp32 parameters are their own masters (saved with the model): None
            "masters": [None if self._fresh else self.master_shard(i) for i in indices],
            "param_groups": self._groups_for_state_dict(self._param_ids()),
            **({"loss_scaler": self.loss_scaler.state_dict()} if self.loss_scaler is not None else {}),
        }

    def _load_shard(self, state_dict: dict) -> None:
        shard = state_dict["shard"]
        if (shard["rank"], shard["world_size"]) != (self.rank, self.world_size):
            raise ShardingError(
                f"this optimizer state is rank {shard['rank']}'s shard of {shard['world_size']}, but this is rank "
                f"{self.rank} of {self.world_size}; load the consolidated state (consolidate_state_dict) instead"
            )
        if "loss_scaler" in state_dict and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        if state_dict.get("fresh") and self._fresh:
            return  # a state saved before any step, into an optimizer before any step: nothing to load
        for index, (state, master) in enumerate(zip(state_dict["inner"], state_dict["masters"])):
            flat = self.flats[index]
            self.stepper.clear_state(index)
            like = _shard_like(flat)
            for key, value in state.items():  # the same rank's shard: no re-partitioning
                if per_element(key, value, like):
                    self.stepper.write(index, key, 0, value)
            if state:
                self.stepper.set_scalar_state(index, {k: v for k, v in state.items() if not per_element(k, v, like)})
            if master is not None:
                self.stepper.write(index, "master", 0, master)
            else:
                self.stepper.refresh_master(index, flat)
            flat.mark_seen()
        self._fresh = bool(state_dict.get("fresh"))

    @torch.no_grad()
    def load_repartitioned(self, source, names: list, saved: list) -> None:
        """Fill this rank's shards from state saved at any world size (repartition.py): for flat
        i, `names[i][j]` is what `source` calls `flats[i].params[j]`, and `saved[i]` is the
        `(keys, scalars)` to load, keys the per-element state names (with "master" when the
        source holds the fp32 masters; otherwise the masters are read from the parameters) and
        scalars None for a fresh flat. Not collective: each rank reads only its own part."""
        for index, (flat, (keys, scalars)) in enumerate(zip(self.flats, saved)):
            self.stepper.clear_state(index)
            for key in keys:
                fill_shard(self.stepper, index, flat, key, source, names[index])
            if "master" not in keys:
                self.stepper.refresh_master(index, flat)
            if scalars is not None:
                self.stepper.set_scalar_state(index, scalars)
            flat.mark_seen()
        self._fresh = all(scalars is None for _, scalars in saved)

    def _check_state_names(self, keys: list) -> None:
        missing = sorted(set(per_element_state(self.optim_class, self.optim_kwargs)) - set(keys))
        if missing:
            raise ShardingError(f"the optimizer state lacks {missing} that {self.optim_class.__name__} keeps for "
                                "every element; load a state saved by the same optimizer")  # fmt: skip

    @torch.no_grad()
    def params_from_masters(self) -> None:
        """The model follows the masters: each rank casts its shard into the parameters, then the
        all-gather gives every rank all of them. Collective."""
        for index, flat in enumerate(self.flats):
            numel = flat.layout.shard_numel
            buffer = torch.empty(min(CHUNK_NUMEL, max(numel, 1)))
            for start in range(0, numel, CHUNK_NUMEL):
                chunk = buffer[: min(CHUNK_NUMEL, numel - start)]
                self.stepper.read(index, "master", start, chunk)
                flat.write_shard(start, chunk)
            flat.gather_params()
            flat.mark_seen()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (consolidated, or a local optimizer's): each rank keeps its shard of it.

        Also takes the shard `state_dict()` returned on this same rank.
        """
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ShardingError(
                f"optimizer state has {len(groups) if isinstance(groups, list) else 'no'} param groups, "
                f"this optimizer has {len(self.param_groups)}"
            )
        self._check_open()
        self._consolidated = None
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        if "shard" in state_dict:
            self._load_shard(state_dict)
            return
        if self._fresh and not state_dict.get("state") and state_dict.get("master_params") is None:
            # an empty state into an empty optimizer (accelerate's round trip: [Note: state_dict callers])
            if "loss_scaler" in state_dict and self.loss_scaler is not None:
                self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
            return
        ids = self._param_ids()
        saved_state = state_dict.get("state", {})
        masters = state_dict.get("master_params")
        full, names, saved = {}, [], []
        for flat in self.flats:
            pids = [ids[p] for p in flat.params]
            names.append(pids)
            per_param = [saved_state.get(pid, saved_state.get(str(pid), {})) for pid in pids]
            keys, scalars = [], {}
            for key in set().union(*(s.keys() for s in per_param)):
                values = [s.get(key) for s in per_param]
                if all(per_element(key, v, p) for v, p in zip(values, flat.params)):
                    keys.append(key)
                else:
                    value = values[0]  # placed by the stepper, as torch places "step" (set_scalar_state)
                    scalars[key] = value.detach().clone() if torch.is_tensor(value) else value
            for pid, state in zip(pids, per_param):
                full[pid] = dict(state)
            if masters is not None and flat.dtype != torch.float32:  # fp32 parameters are their own masters
                keys.append("master")
                for pid in pids:
                    full[pid]["master"] = masters.get(pid, masters.get(str(pid)))
            if any(per_param):
                self._check_state_names(keys)
            saved.append((sorted(keys), scalars if any(per_param) else None))
        self.load_repartitioned(TensorSource(full), names, saved)
        if masters is not None:
            self._fresh = False
        if "loss_scaler" in state_dict and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


def _shard_like(flat) -> torch.Tensor:
    """A tensor shaped like `flat`'s shard (no memory): per-element state has this shape."""
    return torch.empty(flat.layout.shard_numel, device="meta")


def _gather_to(tensor: torch.Tensor, to: int, group):
    """Rank `to` receives every rank's shard-sized tensor stacked [world, n]; others None."""
    rank, world = comm.rank_and_size(group)
    flat = tensor.detach().reshape(-1).contiguous()
    if world == 1:
        return flat.reshape(1, -1).clone()
    import torch.distributed as dist

    gathered = [torch.empty_like(flat) for _ in range(world)] if rank == to else None
    dist.gather(flat, gathered, dst=dist.get_global_rank(group, to) if group else to, group=group)
    return torch.stack(gathered) if rank == to else torch.empty(0)


def _unshard(stacked: torch.Tensor, flat: FlatGroup, world: int) -> list:
    """[world, shard] stacked shards -> one full tensor per parameter (shaped like it)."""
    out = [torch.empty(p.numel(), dtype=stacked.dtype, device=stacked.device) for p in flat.params]
    for rank in range(world):
        for seg in flat.layout.segments(rank):
            out[seg.index][seg.param_start : seg.param_start + seg.numel] = stacked[rank, seg.shard_start : seg.shard_start + seg.numel]
    return [t.view(p.shape) for t, p in zip(out, flat.params)]
