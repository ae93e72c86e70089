"""The root unit let go in backward, once backward has read it.

[Note: the root let go in backward] The root's forward starts before every unit's and ends
after, so its buffer stays gathered from the start of forward (T5's and most LMs' root is
the tied embedding and lm_head) into backward; but backward reads it only where forward saved
a view of it (`_pack` counts them: T5's lm_head matmul, backward's first node; an embedding
saves its indices, not its weight). Once every such view has been read, at the next unit's
pre-backward (the node that read it has run), the root is released and its memory let go,
not pooled: the rest of backward, where the activations' gradients peak, runs without it
(t5-small through the Trainer: 66 MB off the peak, at the first decoder block's backward,
where the decoder embedding's 66 MB gradient is added to lm_head's). It stays to the end of
backward where something else may read it there: a module reading a root parameter in
backward (a checkpointed segment's recompute, whose saved tensors `_pack` does not see:
`root_read`), or a gather of it in backward (a saved view read after the release, as in a
second backward through a retained graph: `_backward_external`). Its memory goes whenever a
root gathered for a forward with grad is released, early or at the end of backward, so every
rank's pool holds the same storages whichever hook let it go (their shared storages are
numbered in the order made: [Note: gathered in shared memory]); the next forward's gather
maps it anew (t5-small's 66 MB made, first written and let go in 52 ms of one process's
time, against 7 ms to write a reused one, on an AMD EPYC: bench/results/shm_storage.md). A root parameter's gradient arrives after all its uses (the tied weight's
three), into a released parameter, and accumulating needs its shape: its hooks give it a
stand-in of that shape and no memory for the accumulation only (`_shape_for_accumulation`,
`_root_grad_taken`). Not done, the root pooled and kept to the end of backward, where it is
the only unit (nothing runs after its views are read, and the whole model would be mapped
anew each step) or parameters are offloaded (its buffer counts against `buffer_count`,
which decides each rank's collectives: prefetch).
"""

import functools

from ..owners import post_accumulate_grad_hook
from .lifecycle import in_backward
from .unit import UnitState


def _shape_for_accumulation(param, grad):
    """A released root parameter's gradient is about to be accumulated: its `.data` a stand-in
    of its shape with no memory (a zero-stride view of one element), which accumulation reads the
    shape and layout of, never the values; `RootRelease._root_grad_taken` puts the empty tensor
    back. See [Note: the root let go in backward]."""
    part = param._trainer_shard_zero3[1]
    if part.state is not UnitState.GATHERED:
        param.data = part.empty.new_zeros(1).expand(param.ds_shape)


class RootRelease:
    """Mixed into `ShardedModel`, beside `lifecycle.Lifecycle`, whose hooks call it: when the
    root is let go in backward."""

    def _install_root_release(self) -> None:
        # not where nothing else is a unit, nor with parameters offloaded: see the module docstring
        self._root_let_go = self.root is not None and len(self.units) > 1 and self.store is None
        self._root_views = 0  # views of the root's buffer forward saved that backward has not read yet
        self._root_read = False  # a module read a root parameter in this backward (a checkpoint's recompute)
        self._root_trained = False  # the last forward of the root had grad: its memory goes when released
        for p in self.root.params if self._root_let_go else []:
            if p.requires_grad:
                self._handles.append(p.register_hook(functools.partial(_shape_for_accumulation, p)))
                self._handles.append(post_accumulate_grad_hook(p, self._root_grad_taken))

    def _let_go_of_root(self) -> None:
        root = self.root
        if (self._root_trained and self._root_views == 0 and not self._root_read and root.holds == 0
                and root.state is UnitState.GATHERED and root not in self._running and not self._saved_hooks
                and root not in self._backward_external):  # fmt: skip
            root.release(drop=True)

    def root_read(self) -> None:
        """A module read a parameter of the gathered root (`access.ShardedParameters`): in backward,
        a recompute (gradient checkpointing) whose saved tensors `_pack` does not see may hold a
        view of it, so the root stays to the end of this backward."""
        if in_backward():
            self._root_read = True

    def _root_grad_taken(self, param) -> None:
        part = param._trainer_shard_zero3[1]
        if part.state is not UnitState.GATHERED:
            param.data = part.empty
