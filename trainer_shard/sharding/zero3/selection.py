"""From a model and the units asked for to a `ShardedModel`: which modules are units, which unit
owns each parameter, and where a meta-device model's weights come from."""

import torch

from ...errors import ShardingError
from .model import ShardedModel

PERSISTENCE_THRESHOLD = 100_000
"""Parameters of at most this many elements stay whole on every rank (DeepSpeed's
`stage3_param_persistence_threshold` default; DeepSpeed too keeps `numel <= threshold` whole)."""

SIZE_BASED_UNIT_NUMEL = 10**8
"""auto_wrap's fallback for a model without `_no_split_modules` and without a ModuleList of layers:
a module of at least this many elements is a unit (FSDP's `size_based_auto_wrap_policy` default)."""


def auto_wrap_units(model) -> tuple:
    """(the modules `auto_wrap` makes units of, how they were chosen): every instance of the
    classes in the model's `_no_split_modules` (`T5Block` for T5: what transformers keeps on one
    device), else the children of each `ModuleList` (a model's layers), else every module of at
    least `SIZE_BASED_UNIT_NUMEL` elements. The one rule: the Trainer's wiring and the planner's
    estimate both take their units from here."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found, f"one unit per {', '.join(sorted({type(m).__name__ for m in found}))} ({len(found)} units, " \
                      "from the model's _no_split_modules)"
    found = [child for m in model.modules() if isinstance(m, torch.nn.ModuleList) for child in m]
    if found:
        return found, f"one unit per layer of the model's ModuleLists ({len(found)} units)"
    found = [m for m in model.modules() if m is not model
             and sum(p.numel() for p in m.parameters()) >= SIZE_BASED_UNIT_NUMEL]  # fmt: skip
    return found, f"one unit per module of at least {SIZE_BASED_UNIT_NUMEL:.0e} elements ({len(found)} units)"


def _device_of(model) -> torch.device:
    """Where the flat buffers of a meta-device model go: its first real tensor's device, else the CPU."""
    real = next((t for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"), None)
    return real.device if real is not None else torch.device("cpu")


def _weight_reader(model, weights):
    """`fetch(parameter, out=None) -> tensor` for the parameters still on the meta device, from
    `weights` (a mapping read by name: any of a tied parameter's names will do; into `out` when
    given, straight from the file when `weights` can: `read_into`); checks first that every one
    of them is there, and that no buffer is on the meta device, so nothing is built on a miss."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    on_meta = [p for p in names if p.device.type == "meta"]
    meta_buffers = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if meta_buffers:
        raise ShardingError(f"buffers {meta_buffers[:3]} are on the meta device; materialize them (module.to_empty, "
                            "then set their values) before shard_model")  # fmt: skip
    if not on_meta:
        return None
    if weights is None:
        raise ShardingError(f"{len(on_meta)} parameters are on the meta device (e.g. {names[on_meta[0]][0]!r}); pass "
                            "their values: shard_model(..., weights=<a mapping of name -> tensor>, such as "
                            "zero3_weights.checkpoint_weights(folder))")  # fmt: skip
    missing = [names[p][0] for p in on_meta if not any(n in weights for n in names[p])]
    if missing:
        raise ShardingError(f"weights: {len(missing)} parameters of the model are not there, e.g. {missing[:3]}; "
                            "pass the weights of this model")  # fmt: skip

    direct = hasattr(weights, "read_into") and hasattr(weights, "shape")  # zero3_weights' reader: no copies

    def named(p, shape) -> str:
        """The name `p` is read by, once `shape` (of that name) is found to be `p`'s."""
        name = next(n for n in names[p] if n in weights)
        found = tuple(shape(name))
        if found != tuple(p.shape):
            raise ShardingError(f"weights: {names[p][0]!r} has shape {found}, the model's is {tuple(p.shape)}")
        return name

    def read_slice(p, start: int, out) -> None:
        """`out` <- elements [start, start + out.numel()) of `p`'s weights, flattened."""
        weights.read_into(named(p, weights.shape), out, start)

    def fetch(p, out=None):
        if direct and out is not None:
            read_slice(p, 0, out)
            return out
        value = weights[next(n for n in names[p] if n in weights)]
        named(p, lambda name: value.shape)  # read once, checked
        return value if out is None else out.copy_(value.reshape(out.shape))

    fetch.read_slice = read_slice if direct else None  # each rank reads only its slice ([Note: meta-device model])
    return fetch


def sharded_part(param):
    """(ShardedModel, FlatParams) of a parameter `shard_model` sharded, (ShardedModel, None) for
    one it keeps whole, None for a parameter of no sharded model (an attribute of the parameter:
    a WeakKeyDictionary of parameters crashed the interpreter here)."""
    return getattr(param, "_trainer_shard_zero3", None)


def shard_model(model, units=None, group=None, persistence_threshold: int = PERSISTENCE_THRESHOLD,
                prefetch=True, group_fn=None, gather_pool: bool = True, reduce_dtype=None,
                check_calls: bool = True, release_memory: bool = False, param_offload=None, weights=None,
                device=None) -> ShardedModel:  # fmt: skip
    """Shard `model`'s parameters ZeRO-3 style, in place; see the package docstring. Collective.

    Args:
        model: the model, with the same weights on every rank (seed it, or load the same file).
        units: module classes (every instance is a unit) or modules; default: the model alone.
        group: the process group (default: the world).
        persistence_threshold: parameters of at most this many elements stay whole on every rank.
        prefetch: True: start gathering the next unit (in the recorded forward order) as one
            starts; an int: the following units while their elements add up to at most that
            many (at least the next one); 0 or False: no prefetch.
        group_fn: `group_fn(name, parameter) -> key`: parameters of different keys go in
            different flat buffers, so `param_groups` can give each key its own optimizer
            settings (weight decay or not); default: one key, None.
        gather_pool: reuse gather buffers (`GatherPool`); False: allocate and free each time.
            Measured on t5-small (2 ranks, 2 cores): the same speed and peak RSS either way,
            within noise; the pool keeps its buffers between steps (`pool.clear()` frees them).
        reduce_dtype: the dtype gradients are summed over ranks in (default: as ZeRO-2's
            `GradReducer`, the parameters' up to 8 ranks).
        check_calls: before each gather, check that every rank gathers the same unit (see
            [Note: diverging calls]); False saves one small collective per gather.
        release_memory: at the end of each backward, hand the memory freed into the C heap
            back to the OS (`memory.release_freed_memory`, glibc's malloc_trim). Off by default:
            the call and the pages faulted in again after it cost t5-small through the Trainer
            (2 ranks, 40 steps, two interleaved rounds) 51.5-54.7 s against 47.7-49.8 s, for a
            peak RSS of 1.40 GiB against 1.42-1.43 (zero_dp_2's 1.44-1.45), once a reduction goes
            straight into a stale gradient shard (`GradShard.reduce_target`).
        param_offload: an `offload.param_store.ParamOffloadSpec`: each unit's parameter shard
            lives in CPU RAM or on disk between uses (see [Note: parameter offload]); the
            optimizer must be offloaded too (`ShardedOptimizer(..., offload=...)`).
        weights: for a model built on the meta device (`with torch.device("meta"): ...`): a
            mapping name -> tensor its parameters are read from, a tensor at a time, straight
            into each unit's buffer and store (`zero3_weights.checkpoint_weights(folder)` reads
            a saved model's safetensors files that way); see [Note: meta-device model].
        device: where a meta-device model's parameters go (default: the CPU).
    """
    if int(persistence_threshold) < 0:
        raise ShardingError(f"persistence_threshold must be 0 or more, got {persistence_threshold}")
    if not isinstance(prefetch, bool) and int(prefetch) < 0:
        raise ShardingError(f"prefetch must be True, False or a number of elements >= 0, got {prefetch}")
    modules = unit_modules(model, units)
    owner, names = owners(model, modules)
    fetch = _weight_reader(model, weights)
    device = torch.device(device) if device is not None else _device_of(model)
    return ShardedModel(model, modules, owner, names, group, int(persistence_threshold), prefetch, group_fn,
                        gather_pool, reduce_dtype, check_calls, release_memory, param_offload, fetch, device)


def unit_modules(model, units) -> list:
    """The unit modules in module order (outer before inner), the model itself last. A class
    given that no module of the model is an instance of is refused (it would silently make the
    whole model one unit), as a module given that is not in the model."""
    units = list(units or [])
    classes = tuple(u for u in units if isinstance(u, type))
    chosen = {id(u) for u in units if isinstance(u, torch.nn.Module)}
    found = [m for m in model.modules() if m is not model and (id(m) in chosen or (classes and isinstance(m, classes)))]
    missing = chosen - {id(m) for m in found} - {id(model)}
    if missing:
        raise ShardingError(f"{len(missing)} of the unit modules given are not submodules of the model")
    unmatched = [c.__name__ for c in classes if not any(isinstance(m, c) for m in model.modules() if m is not model)]
    if unmatched:
        raise ShardingError(f"units: no module of the model is a {', '.join(unmatched)}; name classes the model uses "
                            f"(its layers are {_layer_classes(model)})")  # fmt: skip
    return found + [model]


def _layer_classes(model) -> str:
    """The classes of the modules in the model's ModuleLists, for an error message."""
    seen = {type(m).__name__ for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst}
    return ", ".join(sorted(seen)) or "not in any ModuleList"


def owners(model, unit_modules: list):
    """{parameter: the innermost unit module holding every module that uses it} and each
    parameter's first name. A module reached by two paths counts under both."""
    unit_ids = {id(m) for m in unit_modules}
    owner, names = {}, {}

    def walk(module, prefix, chain):  # chain: the unit modules above, root first, itself if a unit
        chain = chain + [module] if id(module) in unit_ids else chain
        for pname, p in module.named_parameters(recurse=False):
            if p in owner:
                owner[p] = _common(owner[p], chain)
            else:
                owner[p] = chain
                names[p] = prefix + pname
        for child_name, child in module.named_children():
            walk(child, f"{prefix}{child_name}.", chain)

    walk(model, "", [])
    return {p: chain[-1] for p, chain in owner.items()}, names


def _common(a: list, b: list) -> list:
    n = 0
    while n < min(len(a), len(b)) and a[n] is b[n]:
        n += 1
    return a[:n]
