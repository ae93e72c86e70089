"""The hooks that move each unit through its life: see [Note: unit lifecycle] in unit.py."""

import functools
import logging

import torch
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from ... import comm
from ..owners import post_accumulate_grad_hook
from .unit import Phase, UnitState

logger = logging.getLogger(__name__)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs that require grad; its backward runs once every one of their
    gradients is computed: the unit's own backward is over (FSDP2's RegisterPostBackwardFunction)."""

    @staticmethod
    def forward(ctx, hook, *tensors):
        ctx.hook = hook
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


class Lifecycle:
    """Mixed into `ShardedModel`: the forward and backward hooks of every unit."""

    def _install_lifecycle(self, unit_modules: list) -> None:
        self._order, self._recording = [], True  # forward order of the inner units, recorded once
        self._next, self._prev = {}, {}  # unit -> the unit after (before) it in that order
        self._running = []  # units whose forward is running, innermost last
        self._outer_task = None  # the graph task of this iteration's backward (reentrant checkpointing nests others)
        self._backward_external = set()  # units fetched in backward outside any unit
        self._saved_hooks = False  # `_pack`/`_unpack` pushed for the root's forward
        self._by_storage = {part.buffer.untyped_storage()._cdata: part.unit for part in self.parts}
        by_module = {id(u.module): u for u in self.units}
        for module in unit_modules:
            unit, is_root = by_module.get(id(module)), module is self.model
            self._handles.append(module.register_forward_pre_hook(
                functools.partial(self._pre_forward, unit, is_root), with_kwargs=True))  # fmt: skip
            self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, unit, is_root)))
        for p in [*(p for unit in self.units for p in unit.params), *self.persistent]:
            if p.requires_grad:
                self._handles.append(post_accumulate_grad_hook(p, self._queue_callback))
        self._install_root_release()

    # -- forward
    def _pre_forward(self, unit, is_root, module, args, kwargs):
        backward = in_backward()
        if is_root and not backward:
            self._reset_iteration()
            self._next_iteration()
            self._root_trained = self._root_let_go and torch.is_grad_enabled()
            if torch.is_grad_enabled():
                torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
                self._saved_hooks = True
        if unit is not None:
            unit.gather()
            if backward:  # reentrant checkpointing's recompute: its backward follows
                unit.phase = Phase.BACKWARD
            self._running.append(unit)
        if not is_root and not backward:
            if self._recording:
                if unit is not None:
                    self._order.append(unit)
            else:
                self._prefetch(unit, self._next)
        if unit is not None and unit is not self.root and torch.is_grad_enabled():
            return self._route_inputs(unit, args, kwargs)
        return None

    def _route_inputs(self, unit, args, kwargs):
        """The inputs that require grad through `PostBackward`, whose backward releases `unit`."""
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not where:
            return None
        routed = PostBackward.apply(functools.partial(self._post_backward, unit), *(flat[i] for i in where))
        for i, t in zip(where, routed):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, unit, is_root, module, args, output):
        if is_root:
            self._pop_saved_hooks()
        if is_root and self._recording:
            self._recording = False
            self._next = dict(zip(self._order, self._order[1:]))
            self._prev = dict(zip(self._order[1:], self._order))
        if unit is not None:
            if self._running and self._running[-1] is unit:
                self._running.pop()
            if not in_backward():
                # The root's backward starts where its forward ends (no other unit runs between; under
                # the Trainer the loss is computed inside it): with grad enabled it stays gathered for
                # it, as FSDP2 leaves its root unsharded after forward. One all-gather of it a step
                # fewer (t5-small through the Trainer: 35.0 s against 37.2 for 30 steps). Backward lets
                # it go early: [Note: the root let go in backward].
                keep = unit is self.root and torch.is_grad_enabled()
                if not keep and not self._hand_over(unit, output):
                    self._release(unit)
                if torch.is_grad_enabled():
                    tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
                    if tensors:
                        torch.autograd.graph.register_multi_grad_hook(
                            tensors, functools.partial(self._pre_backward, unit), mode="any")  # fmt: skip
        if is_root:
            for other in self.units:  # prefetches of units that did not run
                if other is not self.root and other.phase is Phase.IDLE and other.gathered:
                    self._release(other)

    def _hand_over(self, unit, output) -> bool:
        """A unit that returns one of its own parameters (Megatron's layers return their bias for
        the caller to add) stays gathered for the module that called it, as an external
        parameter of that one (DeepSpeed does the same). True when it did."""
        if not self._running or not any(
                isinstance(t, torch.nn.Parameter) and getattr(t, "_trainer_shard_zero3", (None, None))[1] in unit.parts
                for t in tree_flatten(output)[0]):  # fmt: skip
            return False
        self._running[-1].external.add(unit)
        return True

    def _release(self, unit) -> None:
        """Release `unit` and the units it fetched, where nothing holds them (it keeps the list:
        its backward gathers them again)."""
        for other in [unit, *unit.external]:
            if other.holds == 0 and other not in self._running:
                other.release()

    # [Note: saved views of a unit] What autograd saves in forward for backward may be a
    # parameter or a view of one (a transposed weight) of any unit, the running one or another
    # read as an external parameter. While the root's forward runs, every saved tensor goes
    # through `_pack`, which tags those that share a unit's flat buffer storage; `_unpack`
    # gathers a tagged one's unit if its hooks have released it (for the rest of this backward),
    # so backward never reads a released buffer, whatever order autograd runs its nodes in.
    # Packed detached: a node that saves its own output (exp, sigmoid) would otherwise hold the
    # output, whose grad_fn is that node, a cycle in C++ that the garbage collector cannot see, so
    # a forward never followed by its backward (an exception between them, a forward whose loss is
    # dropped) kept its graph, and through `_unpack` this model, for the life of the process.
    # Autograd puts the saved tensor's grad_fn back on what `_unpack` returns.
    def _pack(self, tensor):
        unit = self._by_storage.get(tensor.untyped_storage()._cdata)
        tensor = tensor.detach()
        if unit is None:
            return tensor
        if unit is self.root:
            self._root_views += 1
        return tensor, unit

    def _unpack(self, packed):
        if type(packed) is not tuple:
            return packed
        tensor, unit = packed
        if unit is self.root:
            self._root_views -= 1
        self._gather_in_backward(unit)
        return tensor

    def _gather_in_backward(self, unit) -> None:
        if any(part.state is not UnitState.GATHERED for part in unit.parts):
            with record_function("trainer_shard::zero3_saved_view_gather"):
                unit.gather()
            self._backward_external.add(unit)

    def gather_for_backward(self, param) -> None:
        """Backward is about to read `param` from something saved elsewhere (a compute-dtype copy
        that `compute.ComputeCast` makes again from it): gather its unit if its hooks released it,
        as `_unpack` does for a saved view."""
        part = getattr(param, "_trainer_shard_zero3", (None, None))[1]
        if part is not None:  # a persistent (whole) parameter has none
            self._gather_in_backward(part.unit)

    def _pop_saved_hooks(self) -> None:
        if self._saved_hooks:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._saved_hooks = False

    # -- backward
    def _pre_backward(self, unit, grad):
        self._queue_callback()
        if unit is not self.root:
            self._let_go_of_root()
        unit.gather()
        for other in sorted(unit.external, key=lambda u: u.index):  # the same order on every rank: collectives
            other.gather()
        unit.phase = Phase.BACKWARD
        self._prefetch(unit, self._prev)  # backward runs the forward order in reverse

    def _post_backward(self, unit) -> None:
        if unit.holds == 0 and unit is not self.root:
            unit.release()
            for other in unit.external:
                if other.holds == 0 and other is not self.root:
                    other.release()
            unit.external.clear()

    def _queue_callback(self, _param=None) -> None:
        """Queue the end of backward once, on the outermost backward of the iteration (the one
        that first called here): reentrant checkpointing runs a backward of its own per
        segment, whose callbacks would fire at each segment's end."""
        task = torch._C._current_graph_task_id()
        if self._outer_task is None:
            self._outer_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._outer_task = None
        self._root_read = False
        self.reducer.finish()
        for unit in [*self.units, *self._backward_external]:  # also a prefetch whose unit had no backward
            if unit.holds == 0 and unit.gathered:  # a read ahead stays: the step drops it if it writes the shard
                unit.release(drop=unit is self.root and self._root_trained)
            unit.phase = Phase.IDLE
            unit.external.clear()
        self._backward_external.clear()
        self._reduce_persistent()
        if self.release_memory:  # after every other end-of-backward callback
            torch.autograd.Variable._execution_engine.queue_callback(self._release_freed_memory)

    def _reduce_persistent(self) -> None:
        grads = [p.grad for p in self.persistent if p.grad is not None]
        if grads and self.world_size > 1:
            with record_function("trainer_shard::zero3_persistent_all_reduce"):
                flat = torch._utils._flatten_dense_tensors(grads)
                comm.all_reduce(flat, group=self.group)
                flat.div_(self.world_size)
                for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(reduced)

    def _reset_iteration(self) -> None:
        """At the root's forward: a backward that raised halfway (its end never ran) leaves
        gathered units, half-filled buckets and an armed callback; a forward that raised, the
        saved-tensor hooks pushed; drop them all."""
        self._pop_saved_hooks()
        if self._outer_task is not None or self.reducer.pending:
            logger.warning("ZeRO-3: the last backward did not finish (it raised?): its partial gradient reduction "
                           "is dropped and every unit released")  # fmt: skip
            self.reducer.reset()
        self._outer_task = None
        self._running.clear()
        self._root_views, self._root_read = 0, False
        for unit in self.units:
            if unit.holds == 0 and unit.gathered:
                unit.release(drop=unit is self.root and self._root_trained)
            unit.phase = Phase.IDLE
            unit.external.clear()
        self._backward_external.clear()

    # -- parameters read outside their unit: see access.py
    def fetch_external(self, param, part) -> None:
        """Gather `param`'s unit for the module running now (released with it, gathered again
        for its backward), or for the rest of this backward; outside both, nothing (see [Note:
        external parameters]). Collective inside forward and backward, as they are."""
        unit = part.unit
        if self._running:
            holder = self._running[-1]
        elif in_backward():
            holder = None
        else:
            return
        with record_function("trainer_shard::zero3_external_gather"):
            unit.gather()
        if holder is None:
            self._backward_external.add(unit)
        elif holder is not unit:
            holder.external.add(unit)

    # -- prefetch
    def _prefetch(self, unit, following: dict) -> None:
        """Start gathering the units `_ahead` of `unit`; with parameters on disk, also start
        reading the ones after them, while at most `buffer_count` units have buffers alive."""
        if self.store is None:
            for ahead in self._ahead(unit, following):
                ahead.start_gather()
            return
        room = self.param_offload.buffer_count - sum(u.attached for u in self.units)
        gathering = set()
        for ahead in self._ahead(unit, following):
            if not ahead.attached:
                if room <= 0:
                    return
                room -= 1
            ahead.start_gather()
            gathering.add(ahead)
        if self.store.disk is None:
            return
        seen = 0
        while room > 0 and unit in following and seen < len(self._order):
            unit, seen = following[unit], seen + 1
            if unit not in gathering and not unit.attached:
                unit.load()
                room -= 1

    def _ahead(self, unit, following: dict):
        """The units to prefetch when `unit` starts: the next one with `prefetch` True, else the
        following ones while their elements add up to at most `prefetch` (at least one if > 0)."""
        if not self.prefetch:
            return
        budget = None if self.prefetch is True else int(self.prefetch)
        total, seen = 0, 0
        while unit in following and seen < len(self._order):
            unit = following[unit]
            seen += 1
            total += unit.numel
            if seen > 1 and (budget is None or total > budget):
                return
            yield unit
