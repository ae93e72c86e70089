"""A unit: a wrapped module's sharded parameters, gathered and released together.

[Note: unit lifecycle] A unit's memory is in one of four states (`UnitState`), kept by each of its
flat buffers (`FlatParams.state`, moved only by `load`, `start_gather`, `wait` and `release`; the
unit's is theirs, which move together):

    SHARDED --load (parameters on disk: read ahead)--> LOADED --start_gather--> GATHERING
    SHARDED --start_gather (prefetch, or gather)--> GATHERING --wait--> GATHERED --release--> SHARDED

and the iteration moves it through phases (`Phase`), each transition made by one hook of
`lifecycle.Lifecycle`:

- IDLE -> FORWARD: its forward pre-hook gathers it (waiting for a prefetch in flight), starts
  gathering the unit after it in the recorded forward order, and (grad enabled) routes its
  inputs that require grad through `PostBackward`, whose backward is the post-backward hook;
- FORWARD -> IDLE: its forward post-hook releases it (unless held, or in backward, where
  checkpointing recomputes, or the root with grad enabled: its backward starts where its
  forward ends, so it stays gathered for it, as FSDP2's root) with the units it fetched as
  external parameters, and (grad enabled) registers the pre-backward hook on its outputs;
- IDLE -> BACKWARD: the pre-backward hook (the first gradient of its outputs) gathers it again,
  its externals too, and prefetches the unit before it;
- BACKWARD -> IDLE: the post-backward hook (its inputs' gradients are all computed, so nothing of
  its backward is left to read its parameters) releases it, frozen or not. A unit none of whose
  inputs requires grad (the first layer) is released at the end of backward; the root, at the
  first unit's pre-backward after backward has read every view of it that forward saved, its
  memory let go, not pooled ([Note: the root let go in backward] in root.py), else at the
  end of backward;
- the end of backward (an autograd engine callback, queued once per iteration, from the
  outermost backward) reduces what is left, averages the persistent gradients and releases
  every unit not held;
- the root's forward pre-hook resets the iteration: a backward that raised halfway (its callback
  never ran) leaves nothing gathered and no half-filled bucket behind.
`holds` counts explicit holders (`ShardedModel.gathered` blocks, wrapped methods such as
generate): a held unit is never released by a hook.

What else a flat buffer keeps is not the unit's life but the optimizer's protocol, the same for
ZeRO-1/2's `flat.FlatGroup`: where its gradient and master live (`offloaded`, `grad_stored`: set
once by `configure` when the optimizer is built), whether the gradient shard holds anything of
this step (`stale`, `accumulated`: [Note: stale gradients] in flat.py) and whether weights were
written behind the optimizer's back (`edited`: [Note: parameters edited from outside]).
"""

import enum

from ...errors import ShardingError


class UnitState(enum.Enum):
    SHARDED = "sharded"  # no memory: the parameters are empty tensors
    LOADED = "loaded"  # this rank's shard read (or being read) from disk into the buffer
    GATHERING = "gathering"  # the all-gather in flight
    GATHERED = "gathered"  # the parameters are their views of the whole buffer


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Unit:
    """A wrapped module's sharded parameters, one `FlatParams` per (param group key, dtype,
    trainable or frozen)."""

    def __init__(self, module, parts: list, name: str = "", check=None, announce=None):
        self.module, self.parts = module, parts
        self.name = name or type(module).__name__
        # called before and after each gather this unit starts: [Note: diverging calls]
        self.check, self.announce = check, announce
        self.params = [p for part in parts for p in part.params]
        self.numel = sum(p.numel() for part in parts for p in part.views)
        self.holds = 0  # `ShardedModel.gathered` blocks (and wrapped methods) holding it
        self.phase = Phase.IDLE
        self.external = set()  # other units fetched while it ran: gathered and released with it
        self.saving = []  # state_dict calls in progress on its module: whether each gathered it
        for part in parts:
            part.unit = self

    @property
    def state(self) -> UnitState:
        """The furthest of its flat buffers' states (they move together: see the Note)."""
        states = {part.state for part in self.parts}
        return next((s for s in reversed(UnitState) if s in states), UnitState.SHARDED)

    @property
    def gathered(self) -> bool:
        """Gathered or gathering."""
        return self.state in (UnitState.GATHERING, UnitState.GATHERED)

    @property
    def attached(self) -> bool:
        """Its buffers have memory (gathered, gathering, or read ahead from disk)."""
        return self.state is not UnitState.SHARDED

    def load(self) -> None:
        for part in self.parts:
            part.load()

    def start_gather(self) -> None:
        checked = self.check is not None and not self.gathered
        if checked:
            self.check(self)
        for part in self.parts:
            part.start_gather()
        if checked:
            self.announce(self)

    def gather(self) -> None:
        self.start_gather()
        for part in self.parts:
            part.wait()

    def release(self, drop: bool = False) -> None:
        for part in self.parts:
            part.release(drop)
        self.phase = Phase.IDLE

    def param_name(self, param) -> str:
        for part in self.parts:
            for p, name in zip(part.params, part.names):
                if p is param:
                    return name
        raise ShardingError(f"a parameter of no flat buffer of the unit {self.name!r}")
