"""The hooks that move each unit through its life: see [Note: unit lifecycle] in unit.py."""

import functools
import logging

import torch
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from ... import comm
from ...errors import ShardingError
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
        # [Note: diverging calls]: the units gathered this iteration and the last, in order, and the
        # announcement of this rank's next gather in flight: (handle, everyone's announcements)
        self._gathered_now, self._gathered_last, self._posted, self._missed = [], [], None, False
        self.announce_ahead = self.store is None
        self._by_storage = {part.buffer.untyped_storage()._cdata: part.unit for part in self.parts}
        by_module = {id(u.module): u for u in self.units}
        for module in unit_modules:
            unit, is_root = by_module.get(id(module)), module is self.model
            self._handles.append(module.register_forward_pre_hook(
                functools.partial(self._pre_forward, unit, is_root), with_kwargs=True))  # fmt: skip
            self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, unit, is_root)))
        for p in [*(p for unit in self.units for p in unit.params), *self.persistent]:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _: self._queue_callback()))

    # -- forward
    def _pre_forward(self, unit, is_root, module, args, kwargs):
        backward = in_backward()
        if is_root and not backward:
            self._reset_iteration()
            self._next_iteration()
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
                # fewer (t5-small through the Trainer: 35.0 s against 37.2 for 30 steps).
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
    def _pack(self, tensor):
        unit = self._by_storage.get(tensor.untyped_storage()._cdata)
        return tensor if unit is None else (tensor, unit)

    def _unpack(self, packed):
        if type(packed) is not tuple:
            return packed
        tensor, unit = packed
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

    def _queue_callback(self) -> None:
        """Queue the end of backward once, on the outermost backward of the iteration (the one
        that first called here): reentrant checkpointing runs a backward of its own per
        segment, whose callbacks would fire at each segment's end."""
        task = torch._C._current_graph_task_id()
        if self._outer_task is None:
            self._outer_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._outer_task = None
        self.reducer.finish()
        for unit in [*self.units, *self._backward_external]:  # also a prefetch whose unit had no backward
            if unit.holds == 0 and unit.gathered:  # a read ahead stays: the step drops it if it writes the shard
                unit.release()
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
        for unit in self.units:
            if unit.holds == 0 and unit.gathered:
                unit.release()
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

    # [Note: diverging calls] Ranks that run their modules a different number of times (a module
    # called on one rank only, generate() without synced_gpus, data-dependent routing) would pair
    # one unit's gather on one rank with another unit's on the next, silently mixing weights when
    # the sizes agree, and aborting the process in gloo (SIGABRT) when they do not. So no rank
    # starts a gather before every rank has said which unit it gathers next, in a small all-gather
    # of (gather count, unit, kind), and all raise the same error naming both sides if they differ.
    #
    # Said right before the gather, that exchange makes the ranks meet at every gather (about 4 ms
    # each on 2 busy cores, 25 a step on t5-small: 3 s of 35 through the Trainer). So, from the
    # second iteration (a root forward to the next) on, each rank announces its next gather one
    # gather ahead, asynchronously: the unit the last iteration gathered at that position. At the
    # next gather the announcement has landed (sent right after that gather): if every rank
    # announced the same unit and this is it, the gather starts without a meeting. A rank whose
    # next gather is another unit (the iteration went another way) first starts the announced
    # one anyway, which is the collective the others start (on every rank alike, a guess that
    # missed: it is released unused), then says which it gathers instead and waits: the others'
    # next announcement pairs with that, so every rank sees the difference, unless every rank
    # changed course alike, which ends the guesses for that iteration (the next one guesses from
    # the gathers this one asked for). Parameters on disk keep the exchange before every gather (a
    # gather the plan did not count could take a buffer the store's reads need). Collective.
    def _check_same_call(self, unit) -> None:
        posted, self._posted = self._posted, None
        if posted is not None:
            announced = self._agreed(*posted)
            if announced != unit.index:  # this rank changes course: the others start the announced gather
                other = self.units[announced]
                if not other.gathered:
                    for part in other.parts:
                        part.start_gather()
                    self.gathers += 1  # counted, not recorded: not a gather this iteration asked for
                self._exchange(unit, changed=True)
                self._missed = True  # no more guesses this iteration
        else:
            self._exchange(unit)
        self.gathers += 1
        self._gathered_now.append(unit.index)
        if len(self._gathered_now) > 64 * len(self.units):  # no root forward comes: keep no endless record
            self._gathered_now.clear()

    def _announce_next(self, unit) -> None:
        """After `unit`'s gather started (so that it goes first on every rank): announce the next."""
        position = len(self._gathered_now)
        if self.announce_ahead and not self._missed and position < len(self._gathered_last):
            device = unit.parts[0].buffer.device
            header = torch.tensor([self.gathers, self._gathered_last[position], 0], dtype=torch.int64, device=device)
            everyone = torch.empty(3 * self.world_size, dtype=torch.int64, device=device)
            with record_function("trainer_shard::zero3_check_calls"):
                self._posted = (comm.all_gather(everyone, header, self.group, async_op=True), everyone)

    def _exchange(self, unit, changed: bool = False) -> None:
        device = unit.parts[0].buffer.device
        header = torch.tensor([self.gathers, unit.index, int(changed)], dtype=torch.int64, device=device)
        everyone = torch.empty(3 * self.world_size, dtype=torch.int64, device=device)
        with record_function("trainer_shard::zero3_check_calls"):
            comm.all_gather(everyone, header, self.group)
        self._agreed(None, everyone)

    def _agreed(self, handle, everyone) -> int:
        """The unit every rank said it gathers next (after waiting for `handle`), or the error."""
        if handle is not None:
            with record_function("trainer_shard::zero3_check_calls"):
                handle.wait()
        seen = everyone.view(-1, 3).tolist()
        if all(row == seen[0] for row in seen):
            return seen[0][1]
        said = "; ".join(f"rank {r}: {self.units[i].name if 0 <= i < len(self.units) else i!r} (gather {n + 1}"
                         f"{', instead of the one announced' if changed else ''})"
                         for r, (n, i, changed) in enumerate(seen))  # fmt: skip
        raise ShardingError(f"ZeRO-3: the ranks ran different modules, so their gathers no longer pair up ({said}); "
                            "every rank must call the same modules the same number of times (generate() with "
                            "synced_gpus=True; no module run on some ranks only)")  # fmt: skip

    def _next_iteration(self) -> None:
        """At the root's forward: the gathers of the iteration that ends are the next one's guesses."""
        if self._gathered_now:
            self._gathered_last, self._gathered_now = self._gathered_now, []
        self._missed = False

    def _drop_announcement(self) -> None:
        """At close: wait for an announcement in flight (every rank sent it); nothing follows it."""
        if self._posted is not None:
            self._posted[0].wait()
            self._posted = None
