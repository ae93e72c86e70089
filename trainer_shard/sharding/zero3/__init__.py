"""ZeRO-3 core: parameters sharded unit by unit, gathered only while their unit runs.

    sharded = shard_model(model, units=[T5Block], persistence_threshold=100)
    opt = torch.optim.AdamW(sharded.shard_parameters(), lr=1e-3)
    loss = model(**batch).loss; loss.backward()
    sharded.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

A *unit* is a wrapped module (every instance of the given classes, or the given modules; the
model itself is always the root unit). Each parameter belongs to the innermost unit holding
every module that registers it, so a tied parameter (T5's shared embedding, used by both stacks and
by lm_head) stays one parameter, in the outermost unit that contains all its users. Parameters
with at most `persistence_threshold` elements stay whole on every rank ("persistent"): their
gradients are all-reduced (averaged) at the end of backward and the optimizer steps them,
identically, on every rank. Frozen parameters are sharded like the others, in flat buffers of
their own: no gradient, no optimizer state, never rewritten.

A unit's sharded parameters are laid end to end in flat buffers (`FlatParams`; one per
`group_fn` key, dtype, and trainable or frozen; `partition.plan_layout` with a single bucket,
padded to a multiple of the world size). Between uses the buffer's storage has size 0, the
parameters are empty tensors, and the rank keeps only its slice (`shard`); the optimizer steps
that slice in place (fp32: the slice *is* the optimizer's parameter; 16-bit: an fp32 master,
cast into the slice before the next gather), so nothing is all-gathered after the step.

The files, in the order data flows:
- `selection.py`: `shard_model`; which modules are units, which unit owns each parameter.
- `model.py`: `ShardedModel`, the state of one sharded model and what the optimizer asks of it.
- `unit.py`: a unit, its states and phases: [Note: unit lifecycle].
- `lifecycle.py`: the hooks that move units through forward and backward, prefetch, the end of
  backward and the per-iteration reset; `root.py`: when backward lets the root go: [Note: the
  root let go in backward]; `calls.py`: the check before each gather that every rank gathers the
  same unit: [Note: diverging calls].
- `access.py`: parameters read outside their unit's hooks, state_dict and load_state_dict:
  [Note: external parameters].
- `flat_params.py`: one flat buffer's gather side: [Note: free and re-gather], [Note: a
  parameter between uses]; `grad_shard.py`: its gradient side; `pool.py`: the gather pool.

[Note: collective calls] `shard_model`, a forward, a backward, `clip_grad_norm_`, `gathered`,
`state_dict`, `load_state_dict`, `full_state_dict` and `load_full_state_dict` are collectives:
every rank runs them, in the same order, on the same modules, or the job hangs. Prefetch follows
the recorded order, which is the same on every rank. A parameter used on one rank and not on
another is such a mismatch too.

Gradients: each trainable sharded parameter's post-accumulate-grad hook hands its gradient to
`GradReducer` (a unit's trainable flat buffer is one bucket: divided by the world size, then
`comm.reduce_scatter`; this rank's slice is added into the gradient shard). A parameter that
reports twice in one backward (reentrant gradient checkpointing re-enters backward per segment)
has the second gradient added (one that comes after its bucket went is reduced in a bucket of
its own at the end), and the reducer's end runs once, at the end of the outermost backward. The
root's buckets wait for that end: its parameters get their gradients last anyway, and they are
the ones checkpointed segments share (a tied embedding, a shared projection).

[Note: parameter offload] With `param_offload` (`offload.param_store`), a flat buffer's shard
lives in the parameter store instead of a tensor of its own: a CPU RAM tensor (device "cpu"),
or a file (device "nvme"; `shard` is None). A shard on disk is read into this rank's slice of
the gather buffer (`load`, on the store's reader thread), started for the units after the
running one in the recorded order while at most `buffer_count` units have buffers alive, and
all-gathered in place; the step's write of a shard drops a read ahead of it. A trainable
flat's gradient shard is on disk too: each reduced slice is written as backward produces it (on
the store's writer thread, one in flight; summed with what is there when micro-batches
accumulate), its squared norm kept (`grad_sq`), so clipping needs no pass over the files. The
optimizer must be offloaded as well: its engine reads the gradient chunk by chunk and writes
the updated parameters back to the store (`write_shard`). With the optimizer's state on disk
and the parameter shard in RAM, the gradient shard goes to disk all the same, in the gradient
store beside the optimizer's files ([Note: gradient store] in offload/param_store.py).

[Note: meta-device model] A model whose weights do not fit in memory is built on the meta
device (shapes only) and sharded with `weights`. From a reader that can read ranges straight into
a tensor (`zero3_weights.checkpoint_weights`: pread, no mapping), each rank reads only its own
slice of each flat buffer, parameter by parameter, into its shard (or writes it to the parameter
store): every rank reads the same files, so no broadcast, and no unit is ever whole in memory
(t5-large, 2 ranks: a rank's load peak is its shards, bench/results/load_rss.md). From any other
mapping each unit's buffer is filled a tensor at a time, the rank's shard kept, the buffer freed,
before the next unit. The parameter objects stay the same (`torch.utils.swap_tensors` gives each
its real tensor), so ties and names are the model's. Persistent parameters are read whole.
Gradient shards are made when first needed (the optimizer, or the first backward): a model only
evaluated never holds one.

`model.to(...)` changing the sharded parameters' dtype or device after sharding is refused.
"""

from .flat_params import FlatParams, full_numel
from .model import ShardedModel
from .pool import GatherPool
from .selection import PERSISTENCE_THRESHOLD, auto_wrap_units, owners, shard_model, sharded_part, unit_modules
from .unit import Phase, Unit, UnitState

__all__ = ["FlatParams", "full_numel", "GatherPool", "PERSISTENCE_THRESHOLD", "Phase", "ShardedModel", "Unit", "UnitState",
           "auto_wrap_units", "owners", "shard_model", "sharded_part", "unit_modules"]
