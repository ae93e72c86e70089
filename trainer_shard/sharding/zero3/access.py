"""Sharded parameters read from outside their unit's hooks: `module.weight`, `state_dict()` and
`load_state_dict()` on the sharded model.

[Note: external parameters] Between uses a sharded parameter is an empty tensor ([Note: a
parameter between uses] in flat_params.py). A module's parameters are reached through its
`_parameters` dict (`module.weight` is `module._parameters["weight"]`), which `ShardedParameters`
replaces on every module that registers a sharded parameter: a read of one whose unit is not
gathered gathers that unit (DeepSpeed's "external parameter") for the unit whose forward is
running (released with it, gathered again for its backward), or for the rest of a backward.
Outside forward and backward a read returns the parameter as it is, an empty tensor, as
DeepSpeed's does: identity, dtype, device and requires_grad read right there, and a gather
would be a collective that a read on one rank alone (a logging callback on rank 0) would hang.
To read values there: `with sharded_model.gathered():` on every rank, or `model.state_dict()`.
Iterating `parameters()` never gathers (their shapes are `FlatParams.shapes`).

`model.state_dict()` gathers each unit in a pre-hook on its module and, in the post-hook, puts
copies of its parameters in the dict and releases it: the whole state dict on every rank, one
unit gathered at a time. `model.load_state_dict()` gathers each unit in a load pre-hook, lets
torch copy the values into its views, and in the post-hook writes this rank's slice back into
the shard (and fp32 master) and releases it, marking the flat edited so an optimizer that keeps
its master elsewhere follows. Both are collectives: every rank calls them.
"""

import torch

from ...errors import ShardingError
from .unit import UnitState


class ShardedParameters(dict):
    """A module's `_parameters`, gathering a sharded parameter read while its unit is not: see
    [Note: external parameters]."""

    __slots__ = ("sharded",)

    def __getitem__(self, name):
        param = dict.__getitem__(self, name)
        part = _part(param)
        if part is not None:
            if part.state is not UnitState.GATHERED:
                part.unit.sharded.fetch_external(param, part)
            elif part.unit is part.unit.sharded.root:  # [Note: the root let go in backward]
                part.unit.sharded.root_read()
        return param


def _part(param):
    found = getattr(param, "_trainer_shard_zero3", None)
    return found[1] if found is not None else None


def install(sharded) -> list:
    """`ShardedParameters` on every module holding a sharded parameter, and the state dict hooks
    on every unit module. Returns the hook handles (the dicts are put back by `uninstall`)."""
    owned = {id(p) for unit in sharded.units for p in unit.params}
    for module in sharded.model.modules():
        if any(id(p) in owned for p in module._parameters.values() if p is not None):
            replacement = ShardedParameters(module._parameters)
            replacement.sharded = sharded
            module._parameters = replacement
    handles = []
    for unit in sharded.units:
        handles += [
            unit.module.register_state_dict_pre_hook(lambda m, prefix, keep_vars, unit=unit: _hold_for_save(unit,
                                                                                                    keep_vars)),
            unit.module.register_state_dict_post_hook(lambda m, sd, prefix, meta, unit=unit: _copy_out(unit, sd)),
            unit.module.register_load_state_dict_pre_hook(
                lambda m, sd, prefix, meta, *rest, unit=unit: _hold_for_load(unit, meta)),  # fmt: skip
            unit.module.register_load_state_dict_post_hook(lambda m, keys, unit=unit: _write_back(unit)),
        ]
    return handles


def uninstall(model) -> None:
    for module in model.modules():
        if isinstance(module._parameters, ShardedParameters):
            module._parameters = dict(module._parameters)


def _hold(unit) -> None:
    unit.holds += 1
    unit.gather()


def _hold_for_save(unit, keep_vars: bool) -> None:
    """`state_dict(keep_vars=True)` hands out the parameter objects, whose values nobody reads
    there: nothing is gathered (nor copied after)."""
    unit.saving.append(not keep_vars)
    if not keep_vars:
        _hold(unit)


def _let_go(unit) -> None:
    unit.holds -= 1
    if unit.holds == 0:
        unit.release()


@torch.no_grad()
def _copy_out(unit, state_dict: dict) -> None:
    """The unit's entries of `state_dict` become copies (they were views of the gathered buffer,
    which is released now); a tied parameter's names share one copy."""
    if not unit.saving.pop():
        return
    copies = {}
    try:
        for name, value in list(state_dict.items()):
            part = _part(value) if isinstance(value, torch.nn.Parameter) else None
            if part is None and torch.is_tensor(value):
                part = next((p for p in unit.parts if _shares(value, p.buffer)), None)
            if part is not None and part.unit is unit:
                key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
                copies.setdefault(key, value.detach().clone())
                state_dict[name] = copies[key]
    finally:
        _let_go(unit)


def _shares(tensor, buffer) -> bool:
    return tensor.untyped_storage()._cdata == buffer.untyped_storage()._cdata


def _hold_for_load(unit, local_metadata: dict) -> None:
    if local_metadata.get("assign_to_params_buffers"):
        raise ShardingError("load_state_dict(assign=True) would replace the sharded parameters; load without "
                            "assign (the values are copied into the shards)")  # fmt: skip
    _hold(unit)
    for part in unit.parts:  # every rank copies the values in: on memory of its own
        part.make_private()


def _write_back(unit) -> None:
    try:
        for part in unit.parts:
            part.write_back()
    finally:
        _let_go(unit)
