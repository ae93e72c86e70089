"""`OnDevice`: the stepper without offload; a torch optimizer steps the master shards in place.

The inner optimizer holds one tensor per bucket of each `FlatGroup` (its `master_views`: the
parameters' own storage for fp32, a separate fp32 shard for 16-bit parameters), so its state
is bucket by bucket too; per segment with gradient views (see [Note: gradient views] in flat.py),
where the padding of the shard belongs to no tensor and reads as zeros. Implements
`stepper.Stepper`; see [Note: chunked state access] there.
"""

import torch

from .flat import FlatGroup


def per_element(key: str, value, like: torch.Tensor) -> bool:
    """A state entry with one value per parameter element (exp_avg...), not a counter ("step")."""
    return torch.is_tensor(value) and key != "step" and value.shape == like.shape


class OnDevice:
    def __init__(self, optim_class, defaults: dict):
        self.optim_class, self.defaults = optim_class, defaults
        self.optim = None
        self.flats = []

    def add(self, flat: FlatGroup, hyper: dict) -> None:
        group = {"params": flat.master_views, **hyper}
        if self.optim is None:
            self.optim = self.optim_class([group], **self.defaults)
        else:
            self.optim.add_param_group(group)
        self.flats.append(flat)

    def step(self, hypers: list, factors) -> None:
        for inner, hyper in zip(self.optim.param_groups, hypers):  # lr as the scheduler left it...
            inner.update(hyper)
        self.optim.step()

    def refresh_master(self, index: int, flat: FlatGroup) -> None:
        flat.refresh_master()

    def tensor_names(self, index: int) -> list:
        view = self.flats[index].master_views[0]
        state = self.optim.state.get(view, {})
        return ["master", *(k for k, v in state.items() if per_element(k, v, view))]

    def read(self, index: int, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        flat = self.flats[index]
        if name == "master" and flat.master is None:  # fp32 parameters are their own masters
            return flat.read_shard(start, out)
        if flat.grad_views:
            out.zero_()  # the padding, which no segment covers
        for lo, hi, tensor in self._pieces(index, name, start, start + out.numel()):
            out[lo - start : hi - start].copy_(tensor)
        return out

    def write(self, index: int, name: str, start: int, values: torch.Tensor) -> None:
        flat = self.flats[index]
        if name == "master" and flat.master is None:
            flat.write_shard(start, values)
            return
        for lo, hi, tensor in self._pieces(index, name, start, start + values.numel(), create=True):
            tensor.copy_(values[lo - start : hi - start])

    def _pieces(self, index: int, name: str, start: int, end: int, create: bool = False):
        """(lo, hi, tensor view) for shard elements [lo, hi) of `name` in [start, end), bucket by bucket."""
        flat = self.flats[index]
        for view, (first, numel) in zip(flat.master_views, flat.master_ranges):
            lo, hi = max(start, first), min(end, first + numel)
            if lo >= hi:
                continue
            if name == "master":
                tensor = view
            else:
                state = self.optim.state[view]
                if name not in state and create:
                    state[name] = torch.zeros_like(view)
                tensor = state[name]
            yield lo, hi, tensor[lo - first : hi - first]

    def scalar_state(self, index: int) -> dict:
        view = self.flats[index].master_views[0]
        return {k: v for k, v in self.optim.state.get(view, {}).items() if not per_element(k, v, view)}

    def set_scalar_state(self, index: int, scalars: dict) -> None:
        """Each bucket's state gets its own copy of `scalars`, placed as torch places a loaded state."""
        group = self.optim.param_groups[index]
        for view in self.flats[index].master_views:
            self.optim.state[view].update({k: _placed(k, v, view, group) for k, v in scalars.items()})

    def clear_state(self, index: int) -> None:
        for view in self.flats[index].master_views:
            self.optim.state.pop(view, None)

    def state_bytes(self) -> dict:
        if self.optim is None:
            return {"master": 0, "optimizer_state": 0}
        state = sum(v.numel() * v.element_size() for s in self.optim.state.values() for v in s.values()
                    if torch.is_tensor(v))  # fmt: skip
        master = sum(f.master.numel() * f.master.element_size() for f in self.flats if f.master is not None)
        return {"master": master, "optimizer_state": state}

    def close(self) -> None:
        """Drop the inner optimizer and its state (the masters go with it)."""
        self.optim = None
        self.flats = []


def _placed(key: str, value, view: torch.Tensor, group: dict):
    """A copy of a loaded scalar state entry where torch's `Optimizer.load_state_dict` puts it:
    "step" on the parameters' device as fp32 for a fused or capturable optimizer (the fused
    CUDA kernels read it there), else where it came from (a CPU counter, as torch keeps it);
    other tensors on the parameters' device."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.detach().to(dtype=torch.float32, device=view.device, copy=True)
        return value.detach().clone()
    return value.detach().to(device=view.device, copy=True)
