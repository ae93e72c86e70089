"""Will it fit? Memory per rank for every strategy, before training (`trainer-shard estimate`).

    trainer-shard estimate --model t5-3b --world_size 2 --precision bf16 --batch_size 8 \
        --source_length 64 --target_length 64 --max_memory 24GiB

Parameter, gradient and optimizer bytes are exact arithmetic on the real parameter shapes (the
model is built on the meta device: no weights needed) and on what each strategy keeps, as
trainer_shard implements it:

| strategy | parameters | gradients | optimizer (AdamW: master + 2 moments, fp32) | loading (before training) |
|---|---|---|---|---|
| DDP (Trainer) | 4 A (fp32; `--bf16` autocasts fp32 weights) | 4 P `.grad` + 4 P DDP buckets | 8 P | 4 A + 4 T |
| `simple` (ZeRO-1) | w A | w P `.grad` + w P DDP buckets + shard 4 P/N (w = 4: none, views of `.grad`) | (4 if w = 2) P/N master + 8 P/N | w A + 4 T |
| `zero_dp_2` (ZeRO-2) | w A | shard 4 P/N + up to 3 reduce buckets | as `simple` | w A + 4 T |
| `zero_dp_3` (ZeRO-3) | w S/N + w K + gathered | shard 4 S/N + w K + 3 unit buckets | as `simple` on S; 2 w K | w S/N + w K + w U + 4 T |
| + offload cpu / disk | | the shard in w bytes (16-bit default); `zero_dp_3` + disk: on disk (w S/N) + 3 unit buckets + 2 units' slices | master and moments in CPU RAM / on disk | as without |
| `zero_dp_3` + offload `disk_params` | on disk (w S/N); `buffer_count` units gathered + w K | on disk (w S/N) + 3 unit buckets + 4 units' slices | on disk, K/N's too | w K + w U + 4 T |

A = all parameters, P = trainable, N = ranks, w = 2 for `--bf16`/`--fp16` (16-bit parameters,
fp32 masters in the shards) else 4; T = the largest parameter, U = the largest unit (see below).

LoRA (`--use_peft`, `--lora_r`, `--lora_target_modules`, `--lora_modules_to_save`: finetune.py's
flags and defaults, r 16 and PEFT's target modules for the model type): the model counted is what
`peft.get_peft_model` makes of the meta-device model (`meta_model`: finetune.py's LoraConfig, the
adapters on the meta device too), A = the frozen base and the adapters, P = the trainable elements
(the adapters, and the copies of `modules_to_save`). Parameters are held as the table says for A
(ZeRO-3 shards the frozen base like the rest); gradients, DDP's and the reduce buckets, fp32
masters and moments exist for P only. Under ZeRO-3 a unit's frozen and trainable parameters are
flat buffers of their own (each padded to N; `model_units` counts each unit's, from the PEFT
model's own parameters grouped by `auto_wrap_units`): the parameter columns count all of S and K,
the gradient and optimizer columns only their trainable parts (a frozen element has no gradient
shard, master or moments), and the unit buckets the largest unit's trainable elements. Adapters of
at most `PERSISTENCE_THRESHOLD` elements (T5's q and v at r 16) are kept whole in K, with their
gradients and state. `--sharded_ddp auto` counts a PEFT model as it is (`estimate(model=...)`).
Not counted: the activations are the base model's (probe and meta estimate alike): LoRA saves
less for frozen weights and adds its adapters' inputs (the dropout's copies) and r-wide outputs.

Compute dtype (`--compute_dtype`, `compute.py`): with 16-bit parameters computed in fp32 (`auto`
on a CPU without 16-bit matrix kernels) the sharded strategies also hold the compute buffers,
4 L + min(4 R, 2 C) bytes: the fp32 copies of one layer L (the largest `auto_wrap_units` layer,
cast while it runs, pooled) and what is cast outside the layers, R elements (ZeRO-3's root unit:
T5's shared embedding, whose table is never cast, and the lm_head that shares it, cast C = 4
`CHUNK_NUMEL` bytes of rows at a time, `compute.BLOCK_NUMEL`: a block and the last, shorter one);
and the activations are probed in fp32. Under DDP fp32 compute is plain fp32 (no autocast).

ZeRO-3 (`zero3_units`: the units `zero_dp_3 auto_wrap` makes of the meta-device model, by the
rule of `zero3.auto_wrap_units`: one per class in its `_no_split_modules`, T5Block for T5): S sharded elements (every
unit's flat buffer, padded to N), K kept whole on every rank (at most `PERSISTENCE_THRESHOLD`
elements: layer norms, biases; AdamW state in their dtype); "gathered" is the gather pool
(`GatherPool`: after the first step it keeps, for each buffer size, as many buffers as are ever
gathered at once: the root unit, T5's shared embedding = lm_head, gathered through forward and
backward, with the running unit and the prefetched next one), "unit buckets" the full gradients
of up to 3 units being reduce-scattered (`GradReducer`: one filling, 2 in flight).

Loading (`load_bytes`: the load peak, in CPU RAM, before training starts). ZeRO-3 builds the model
on the meta device and fills each unit's flat buffer from the checkpoint a tensor at a time, keeps
this rank's slice of it (a clone; with `disk_params` written to the parameter store instead) and
frees the buffer before the next unit ([Note: meta-device model] in sharding/zero3): at the end
the rank holds its shards (w S/N), the persistent parameters read whole (w K) and the last unit's
buffer, counted as the largest unit's, the root included (w U). Every other strategy loads the
whole model on every rank: DDP in fp32 (4 A), the sharded ones in the parameters' dtype (w A).
Each also holds the tensor being read (4 T, counted fp32). `trainer-shard estimate` prints the
load peak, that plus the process (the probe's runtime), in rows of its own, per rank and times N
per node; on a CPU (one memory) a strategy fits only if both its training and load peaks do
(`budgeted_bytes`), on a GPU if its training peak does.

`disk_params` (ZeRO-Infinity's layout: `offload_param` and `offload_optimizer` on nvme, as
`--sharded_ddp auto` runs it, `AUTO_PARAM_OFFLOAD`: no parameter kept in RAM, `max_in_cpu` 0):
each unit's parameter shard and gradient shard are files (`offload.param_store`), and so are the
fp32 masters and moments, the persistent parameters' too (the engine steps them from its store).
In RAM (`zero3_param_offload_parts`): the gather buffers of at most `buffer_count` units (the root,
held through forward and backward, and the largest others), the persistent parameters and the
unit buckets as above, the reduce-scatter outputs of the 2 buckets in flight, the reduced slices
being written (the one on the writer thread and the next), and the engine's chunk buffers
(master, moments, gradient and parameter chunks; one fp32 gradient chunk per kind of flat group).

`zero_dp_3` with the optimizer's state on disk (offload `disk`) keeps its gradient shards on disk
beside it ([Note: gradient store] in offload/param_store.py), as DeepSpeed's ZeRO-3 does with
`offload_optimizer: nvme`: in RAM the reduced slices being written (the one on the writer thread
and the next, `zero3_disk_grad_writes`) instead of the shards.

Disk traffic a step, per rank (`disk_traffic`; a node's disk serves its N ranks): the disk rows
read and write every byte of the optimizer's store once (master and moments, chunk by chunk;
`zero_dp_3`'s gradient shards too: written in backward, read at the step);
`disk_params` also reads the parameter shards twice (gathered in forward, again in backward; the
root's R elements once, as it stays gathered between) and the gradient shards once (the step), and
writes the gradient shards (backward) and the new parameter shards (the step): reads = 2 w S/N -
w R/N + w S/N + 12 (S + K)/N, writes = 2 w S/N + 12 (S + K)/N (gradients in w bytes, 16-bit by
default).

Activations and the runtime come from a short measured probe: in a fresh process that imports
what training imports, a forward and backward pass at batch size 1 and 4 on the actual device
(the rise of peak RSS, or of CUDA's peak allocation, above the model and its gradients),
extrapolated linearly to the batch size; without a probe (`--no_probe`), from the bytes autograd
saves for backward on the meta device. The tests check the state arithmetic against the bytes
real ranks hold; the predictions are checked against the measured peaks of real runs by
bench/planner_trainer.py (ddp, simple, zero_dp_2 through the Trainer) and bench/planner_zero3.py
(zero_dp_3 and zero_dp_2 in plain loops).
"""

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass

from .constants import BUCKET_NUMEL, CHUNK_NUMEL, PRECISIONS

STRATEGIES = [("ddp", None), ("simple", None), ("zero_dp_2", None), ("zero_dp_3", None), ("simple", "cpu"),
              ("zero_dp_2", "cpu"), ("zero_dp_3", "cpu"), ("simple", "disk"), ("zero_dp_2", "disk"),
              ("zero_dp_3", "disk"), ("zero_dp_3", "disk_params")]  # fmt: skip
# --sharded_ddp auto tries these in order: less communication and I/O first. zero_dp_3 right after
# zero_dp_2, each offload after zero_dp_2's: gathering every unit twice a step, its step measured
# 0.99x and 1.01x zero_dp_2's (t5-small, t5-base, 2 gloo ranks: bench/results/zero3.md), while on
# a GPU CPU offload moves gradients and weights over PCIe and steps on the CPU every step, and disk
# offload took 1.9x the step without (bench/results/offload.md). zero_dp_2 first where both fit:
# ZeRO-3 moves 1.5x ZeRO-2's bytes (NCCL), and the measured peaks at 2 ranks differ little.
# disk_params last: the most I/O a step (every parameter shard read twice, the gradients written and
# read back, on top of the optimizer's store), for a model whose 16-bit weights do not fit.
AUTO_ORDER = [("ddp", None), ("simple", None), ("zero_dp_2", None), ("zero_dp_3", None), ("zero_dp_2", "cpu"),
              ("zero_dp_3", "cpu"), ("zero_dp_2", "disk"), ("zero_dp_3", "disk"),
              ("zero_dp_3", "disk_params")]  # fmt: skip
PARAM_OFFLOAD = "disk_params"  # the offload of zero_dp_3 with parameters and gradients on disk too
NAMED = {  # T5 architectures, built on the meta device: no download, no weights
    "t5-small": dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64),
    "t5-base": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64),
    "t5-large": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, d_kv=64),
    "t5-3b": dict(d_model=1024, d_ff=16384, num_layers=24, num_heads=32, d_kv=128),
    "t5-11b": dict(d_model=1024, d_ff=65536, num_layers=24, num_heads=128, d_kv=128),
}
STATE_TENSORS = 2  # AdamW's exp_avg and exp_avg_sq
PROBE_TIMEOUT_S = 1800  # the longest one memory probe may take (a subprocess); up to two a run
ENGINE_BUFFERS = 4  # the offload engine's sets of chunk buffers (OffloadSpec.buffer_count's default)
# the disk store's chunks in RAM: on mapped pages, at most one more than its sets of chunk buffers,
# which it then does not make ([Note: stepping on mapped pages] in offload/store.py)
DISK_BUFFERS = (ENGINE_BUFFERS + 1) * CHUNK_NUMEL * (1 + STATE_TENSORS) * 4
# The parameter store `--sharded_ddp auto` opens for disk_params (with nvme_path under output_dir):
# DeepSpeed's buffer_count, and no parameter kept in RAM (DeepSpeed's max_in_cpu 1e9 would keep a
# small model's shards whole in RAM, out of this row's arithmetic, when nothing else fitted it).
AUTO_PARAM_OFFLOAD = {"buffer_count": 5, "max_in_cpu": 0}


@dataclass
class Probe:
    runtime: int  # bytes of the process before the model: interpreter, torch, transformers...
    act_base: int  # activation bytes at batch size 1
    act_per_sample: int  # and for each sample more

    def activations(self, batch: int) -> int:
        return self.act_base + (batch - 1) * self.act_per_sample


def model_config(spec: str):
    """A local model folder, a config.json, or a named architecture (t5-small ... t5-11b)."""
    from transformers import AutoConfig, T5Config

    if spec in NAMED:
        return T5Config(vocab_size=32128, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **NAMED[spec])
    return AutoConfig.from_pretrained(spec)


def count_parameters(config, lora: dict | None = None) -> tuple:
    """(all, trainable) parameter counts, tied ones once, from the meta-device model (with `lora`:
    the PEFT model `meta_model` makes, adapters included in all, trainable = the adapters)."""
    return model_counts(meta_model(config, lora))


def model_counts(model) -> tuple:
    """(all, trainable) elements of a model's parameters as they are (a PEFT model: frozen base
    and adapters), tied ones once; sharded ones counted whole."""
    from .sharding.zero3 import full_numel

    params = {id(p): p for p in model.parameters()}.values()
    return sum(map(full_numel, params)), sum(full_numel(p) for p in params if p.requires_grad)


def meta_model(config, lora: dict | None = None):
    """The model on the meta device; with `lora` (`lora_settings`), LoRA applied to it by
    `peft.get_peft_model` as finetune.py's `apply_peft` applies it (task SEQ_2_SEQ_LM, no bias;
    the adapters on the meta device too: shapes only)."""
    from transformers import AutoModelForSeq2SeqLM

    from .offload.dispatch import empty_model

    model = empty_model(AutoModelForSeq2SeqLM, config)
    if lora is None:
        return model
    import warnings

    from peft import get_peft_model

    from .lora import lora_config

    peft_config = lora_config(lora["r"], target_modules=lora["target_modules"],
                              modules_to_save=lora["modules_to_save"])  # fmt: skip
    with warnings.catch_warnings():  # PEFT asks transformers about gradient checkpointing by a deprecated name
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, peft_config)


def lora_settings(r: int | None = None, target_modules: list | None = None,
                  modules_to_save: list | None = None) -> dict:  # fmt: skip
    """What of finetune.py's LoRA flags the memory depends on (alpha and dropout do not); the
    defaults are its own (r 16, PEFT's target modules for the model type)."""
    from .lora import DEFAULTS

    return {"r": DEFAULTS["lora_r"] if r is None else r, "target_modules": target_modules,
            "modules_to_save": modules_to_save}  # fmt: skip


@dataclass(frozen=True)
class Units:
    """What `shard_model` makes of a model, in elements: each inner unit's flat buffer (padded to a
    multiple of the world size) in forward order, the root unit's (0: none), and the parameters
    kept whole on every rank (persistent); and of each, the trainable elements (a PEFT model's
    adapters; None: all of them), the only ones with gradients and optimizer state. Built by
    `zero3_units` / `model_units`."""

    inner: tuple
    root: int
    persistent: int
    world_size: int
    classes: tuple = ()  # the unit classes, for the table's note
    inner_trainable: tuple | None = None  # each inner unit's trainable flat buffer (padded)
    root_trainable: int | None = None
    persistent_trainable: int | None = None

    @property
    def shard(self) -> int:
        """Elements of this rank's slices of every flat buffer."""
        return (sum(self.inner) + self.root) // self.world_size

    @property
    def largest(self) -> int:
        return max(self.inner, default=self.root)

    @property
    def trainable(self) -> tuple:
        """(each inner unit's trainable elements, the root's, the persistent ones')."""
        return (self.inner if self.inner_trainable is None else self.inner_trainable,
                self.root if self.root_trainable is None else self.root_trainable,
                self.persistent if self.persistent_trainable is None else self.persistent_trainable)  # fmt: skip

    @property
    def trainable_shard(self) -> int:
        """Elements of this rank's slices of the trainable flat buffers: its gradient shards."""
        inner, root, _ = self.trainable
        return (sum(inner) + root) // self.world_size

    @property
    def largest_trainable(self) -> int:
        """The largest unit's trainable elements: a reduce bucket (frozen ones have no gradient)."""
        inner, root, _ = self.trainable
        return max(inner, default=root)

    def pool_numel(self) -> int:
        """Elements of the gather buffers alive at the end of forward once `GatherPool` has
        settled (the gathers of three steps played through its rule, `choose_storage`): the
        root's, gathered from its forward into the start of its backward and let go there, not
        kept ([Note: the root let go in backward] in sharding/zero3/root.py), and the
        storages the pool keeps for the other units; each unit is gathered with the next one
        prefetched, in order in forward and in reverse in backward, and released after its own
        pass."""
        from .sharding.zero3.pool import choose_storage

        forward, backward = [], []  # (gathered, or released; which; size)
        for events, direction, sizes in ((forward, "forward", self.inner), (backward, "backward", self.inner[::-1])):
            for i, size in enumerate(sizes):
                if i == 0:
                    events.append((True, (direction, 0), size))
                if i + 1 < len(sizes):
                    events.append((True, (direction, i + 1), sizes[i + 1]))
                events.append((False, (direction, i), size))
        root = [(True, "root", self.root)] if self.root else []
        free, lent, alive = [], {}, 0
        for _ in range(3):
            for gathered, key, size in [*root, *forward, (None, None, 0), *backward]:
                if gathered is None:  # the end of forward
                    alive = sum(free) + sum(lent.values())
                    lent.pop("root", None)  # let go in backward: the pool does not keep it
                elif not gathered:
                    free.append(lent.pop(key))
                else:
                    take, drop = choose_storage(free, size)
                    if take is not None or drop is not None:
                        free.remove(take if take is not None else drop)
                    lent[key] = take if take is not None else size
        return alive


def zero3_units(config, world_size: int, persistence_threshold: int | None = None, lora: dict | None = None) -> Units:
    """The units `zero_dp_3 auto_wrap` makes of `config`'s meta-device model (with `lora`: of the
    PEFT model `meta_model` makes): `model_units`."""
    return model_units(meta_model(config, lora), world_size, persistence_threshold)


def model_units(model, world_size: int, persistence_threshold: int | None = None) -> Units:
    """The units `zero_dp_3 auto_wrap` makes of `model` (`zero3.auto_wrap_units`, the rule the
    Trainer's wiring uses): the same ownership rule (a parameter belongs to the innermost unit
    holding all its users; T5's tied embedding to the root) and threshold. A unit's frozen and
    trainable parameters are flat buffers of their own, each padded to the world size."""
    from .sharding.zero3 import PERSISTENCE_THRESHOLD, auto_wrap_units, full_numel, owners, unit_modules

    threshold = PERSISTENCE_THRESHOLD if persistence_threshold is None else persistence_threshold
    found, _ = auto_wrap_units(model)
    classes = tuple(sorted({type(m).__name__ for m in found}))
    modules = unit_modules(model, found)
    owner, _ = owners(model, modules)
    frozen, trained = {id(m): 0 for m in modules}, {id(m): 0 for m in modules}
    persistent = persistent_trainable = 0
    for p, module in owner.items():
        numel = full_numel(p)
        if numel <= threshold:  # frozen parameters are sharded too
            persistent += numel
            persistent_trainable += numel if p.requires_grad else 0
        else:
            (trained if p.requires_grad else frozen)[id(module)] += numel

    def padded(numel):
        return -(-numel // world_size) * world_size

    sizes = [(padded(frozen[id(m)]) + padded(trained[id(m)]), padded(trained[id(m)])) for m in modules]
    inner = [(n, t) for n, t in sizes[:-1] if n]  # the root is last
    return Units(tuple(n for n, _ in inner), sizes[-1][0], persistent, world_size, classes,
                 tuple(t for _, t in inner), sizes[-1][1], persistent_trainable)  # fmt: skip


def strategy_bytes(strategy: str, offload, total: int, trainable: int, world: int, precision: str,
                   units: Units | None = None) -> dict:  # fmt: skip
    """{"device", "cpu", "disk"}: bytes a rank keeps for parameters, gradients and optimizer
    state under `strategy` (ddp, simple, zero_dp_2, zero_dp_3: with its `units`) and `offload`
    (None, cpu, disk; zero_dp_3 also disk_params: `zero3_param_offload_parts`); zero_dp_3 also its
    gather buffers and unit buckets. Pure."""
    A, P, N = total, trainable, world
    if strategy == "ddp":
        if offload:
            raise ValueError("DDP has no offload: offload shards with simple or zero_dp_2")
        return {"device": 4 * A + 4 * P + 4 * P + 4 * STATE_TENSORS * P, "cpu": 0, "disk": 0}
    w = 2 if precision in ("bf16", "fp16") else 4
    if strategy == "zero_dp_3":
        return _zero3_bytes(offload, units, N, w)
    if offload == PARAM_OFFLOAD:
        raise ValueError(f"{PARAM_OFFLOAD} offloads zero_dp_3's parameters, not {strategy}'s")
    shard = -(-P // N)
    grad_shard = w * shard if offload else 4 * shard
    if strategy == "simple":
        # .grad, DDP's bucket copies, the shard (fp32 on the device: views of .grad, [Note: gradient views])
        grads = w * P + w * P + (0 if w == 4 and not offload else grad_shard)
    elif strategy == "zero_dp_2":
        grads = grad_shard + 3 * min(BUCKET_NUMEL, P) * w  # the shard, reduce buckets in flight
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    optimizer = (4 if w == 2 or offload else 0) * shard + 4 * STATE_TENSORS * shard  # offload keeps a master always
    device = w * A + grads + (0 if offload else optimizer)
    if offload == "disk":
        return {"device": device, "cpu": DISK_BUFFERS, "disk": optimizer}
    return {"device": device, "cpu": optimizer if offload else 0, "disk": 0}


def _zero3_bytes(offload, units: Units | None, world: int, w: int) -> dict:
    if offload == PARAM_OFFLOAD:
        parts = zero3_param_offload_parts(units, world, w)
        return {"device": sum(parts[k] for k in ON_DEVICE), "cpu": sum(parts[k] for k in IN_CPU_RAM),
                "disk": sum(parts[k] for k in ON_DISK)}  # fmt: skip
    parts = zero3_parts(offload, units, world, w)
    device = sum(v for k, v in parts.items() if k != "optimizer")
    optimizer = parts["optimizer"]
    if not offload:
        return {"device": device + optimizer, "cpu": 0, "disk": 0}
    if offload == "disk":  # the gradient shards on disk too: [Note: gradient store] in offload/param_store.py
        grads = parts["grad_shards"]
        return {"device": device - grads, "cpu": DISK_BUFFERS + zero3_disk_grad_writes(units, world, w),
                "disk": optimizer + grads}  # fmt: skip
    return {"device": device, "cpu": optimizer, "disk": 0}


def zero3_disk_grad_writes(units: "Units", world: int, w: int) -> int:
    """A unit's reduced gradient slice on the disk store's writer thread and the next one, made
    before it waits for that write (w bytes an element): what RAM holds of the gradient shards
    when they are on disk."""
    trained_inner, trained_root, _ = units.trainable
    return 2 * w * (max((*trained_inner, trained_root)) // world)


def zero3_parts(offload, units: Units | None, world: int, w: int) -> dict:
    """zero_dp_3's bytes per rank by part, as the engine names them (`held_parameter_bytes`):
    "shards" (w bytes), "grad_shards" (the trainable elements'; fp32, offloaded: w, as zero_dp_2's
    store keeps them), "persistent" (whole, with the trainable ones' gradients and AdamW state in
    their dtype), "pool" (the gather buffers alive at the end of forward: `Units.pool_numel`),
    "buckets" (3 units' gradients being reduced: the one filling and `GradReducer`'s 2 in flight)
    and "optimizer" (fp32 masters for 16-bit or offloaded trainable shards, AdamW's moments: on
    the device, or in the offload store). `w`: the parameters' bytes an element."""
    if units is None or units.world_size != world:
        raise ValueError(f"zero_dp_3 needs its units for {world} ranks: zero3_units(config, {world})")
    from .sharding.reducer import MAX_16BIT_RANKS

    shard, K, trained, trained_K = units.shard, units.persistent, units.trainable_shard, units.trainable[2]
    return {
        "shards": w * shard,
        "grad_shards": (w if offload else 4) * trained,
        "persistent": w * K + w * trained_K * (1 + STATE_TENSORS),
        "pool": w * units.pool_numel(),
        "buckets": 3 * (4 if world > MAX_16BIT_RANKS else w) * units.largest_trainable,  # `default_reduce_dtype`
        "optimizer": (4 if w == 2 or offload else 0) * trained + 4 * STATE_TENSORS * trained,
    }


# `zero3_param_offload_parts`' parts, by where they live
ON_DEVICE = ("pool", "persistent", "buckets", "reduced")
IN_CPU_RAM = ("grad_writes", "engine")
ON_DISK = ("param_shards", "grad_shards", "optimizer")


def zero3_param_offload_parts(units: Units | None, world: int, w: int,
                              buffer_count: int = AUTO_PARAM_OFFLOAD["buffer_count"]) -> dict:  # fmt: skip
    """zero_dp_3 with parameters, gradients and optimizer state on disk (`disk_params`: the
    parameter store on nvme with `max_in_cpu` 0, the optimizer's too), bytes per rank by part. On
    the compute device: "pool" (the gather buffers of at most `buffer_count` units alive at once:
    the root, held through forward and backward, and the largest others), "persistent" and
    "buckets" (as `zero3_parts`), "reduced" (the reduce-scatter outputs of the 2 buckets in flight:
    this rank's slice of a unit's trainable gradients). In CPU RAM: "grad_writes" (a unit's reduced
    slice in w bytes on the store's writer thread and the next one, made before it waits for that
    write) and "engine"
    (the offload engine's `ENGINE_BUFFERS` sets of chunk buffers: fp32 master and moments, the
    gradient chunks read and the parameter chunks written, w bytes each; and an fp32 gradient chunk
    for the shards' flat groups and one for the persistent parameters'). On disk: "param_shards"
    and "grad_shards" (w S/N each; gradients of the trainable elements only) and "optimizer" (fp32
    masters and moments of the trainable shards and of the trainable persistent parameters' shard,
    which the engine steps from its store too)."""
    from .sharding.reducer import MAX_16BIT_RANKS

    parts = zero3_parts("disk", units, world, w)
    shard, N = units.shard, world
    trained_inner, trained_root, trained_K = units.trainable
    others = min(buffer_count - (1 if units.root else 0), len(units.inner))
    slice_numel = max((*trained_inner, trained_root)) // N  # this rank's slice of the largest unit's gradient
    return {
        "pool": w * (units.root + others * max(units.inner, default=0)),
        "persistent": parts["persistent"],
        "buckets": parts["buckets"],
        "reduced": 2 * (4 if N > MAX_16BIT_RANKS else w) * slice_numel,  # `default_reduce_dtype`
        "grad_writes": zero3_disk_grad_writes(units, world, w),
        "engine": DISK_BUFFERS + ENGINE_BUFFERS * CHUNK_NUMEL * 2 * w + 2 * 4 * CHUNK_NUMEL,
        "param_shards": w * shard,
        "grad_shards": w * units.trainable_shard,
        "optimizer": 4 * (1 + STATE_TENSORS) * (units.trainable_shard + -(-trained_K // N)),
    }


def load_bytes(strategy: str, offload, total: int, world: int, precision: str, units: Units | None = None,
               largest_tensor: int = 0) -> int:  # fmt: skip
    """Bytes a rank holds at the top of loading the model, before training (the process aside):
    ddp 4 A (the model whole in fp32), simple and zero_dp_2 w A (in the precision's dtype);
    zero_dp_3 ([Note: meta-device model] in sharding/zero3) its shards so far, at the end all of
    them (w S/N; none with `disk_params`, which writes each to the parameter store), the persistent
    parameters read whole (w K), and the unit being filled: its whole flat buffer (w bytes an
    element, the largest unit, the root included). Every strategy besides: one tensor being read
    from the checkpoint, `largest_tensor` elements counted in fp32. Pure."""
    A, N, read = total, world, 4 * largest_tensor
    if strategy == "ddp":
        return 4 * A + read
    w = 2 if precision in ("bf16", "fp16") else 4
    if strategy != "zero_dp_3":
        return w * A + read
    if units is None or units.world_size != N:
        raise ValueError(f"zero_dp_3 needs its units for {N} ranks: zero3_units(config, {N})")
    shards = 0 if offload == PARAM_OFFLOAD else w * units.shard
    return shards + w * units.persistent + w * max((*units.inner, units.root)) + read


def largest_tensor(model) -> int:
    """Elements of the model's largest parameter (a tensor read whole from a checkpoint)."""
    from .sharding.zero3 import full_numel

    return max(map(full_numel, model.parameters()), default=0)


def disk_traffic(strategy: str, offload, trainable: int, world: int, precision: str,
                 units: Units | None = None) -> dict:  # fmt: skip
    """{"read", "written"}: bytes a rank's disk stores read and write in one training step (one
    micro-batch; checkpoints aside), 0 without disk offload. The optimizer's store (master and
    moments) is read and written whole once, chunk by chunk; with `disk_params` the parameter store
    also reads each parameter shard twice (forward's gather, backward's) but the root's once (it
    stays gathered from its forward into its backward), and the gradient shards once (the step),
    and writes the gradient shards (backward) and the updated parameter shards (the step). Pure."""
    if offload not in ("disk", PARAM_OFFLOAD):
        return {"read": 0, "written": 0}
    w = 2 if precision in ("bf16", "fp16") else 4
    if offload == "disk":
        optimizer = strategy_bytes(strategy, offload, trainable, trainable, world, precision, units)["disk"]
        return {"read": optimizer, "written": optimizer}
    if strategy != "zero_dp_3":
        raise ValueError(f"{PARAM_OFFLOAD} offloads zero_dp_3's parameters, not {strategy}'s")
    parts = zero3_param_offload_parts(units, world, w)
    params, grads, optimizer = parts["param_shards"], parts["grad_shards"], parts["optimizer"]
    root = w * (units.root // units.world_size)
    return {"read": 2 * params - root + grads + optimizer, "written": grads + optimizer + params}


def probe_modes(precision: str, compute: str | None = None) -> dict:
    """The probe each strategy needs: DDP trains fp32 weights (autocast for --bf16/--fp16), the
    sharded strategies 16-bit parameters; fp32 `compute` (the compute dtype apart from the
    16-bit storage) makes fp32 activations for both."""
    if precision == "fp32" or compute == "fp32":
        return {"ddp": "fp32", "sharded": "fp32"}
    return {"ddp": f"autocast-{precision}", "sharded": precision}


def compute_buffer_bytes(strategy: str, precision: str, compute: str | None, units: "Units | None") -> int:
    """The fp32 copies `compute.ComputeCast` holds (see the module docstring): 4 L + min(4 R, 2 C)
    bytes where 16-bit parameters compute in fp32 under a sharded strategy, else 0."""
    if strategy == "ddp" or precision == "fp32" or compute != "fp32" or units is None:
        return 0
    return 4 * units.largest + min(4 * units.root, 2 * 4 * CHUNK_NUMEL)


def estimate(config, *, world_size: int, precision: str, batch_size: int, source_length: int, target_length: int,
             device: str = "cpu", probes: dict | None = None, max_memory: int | None = None,
             compute: str | None = None, model=None) -> list:  # fmt: skip
    """One row per strategy: bytes per rank on the device, CPU RAM per node, the load peak per rank
    and per node (`load_bytes` and the process, in CPU RAM), disk per node, the bytes the node's
    disk reads and writes a step (`disk_traffic`), fits (`budgeted_bytes`).
    `probes`: {"ddp": Probe, "sharded": Probe} (see `probe_modes`); None: on the meta device.
    `compute`: the compute dtype's name ("fp32" over 16-bit `precision` adds the compute buffers,
    `compute_buffer_bytes`); None: the precision's own. `model`: the model to count, its
    parameters as they are (a PEFT model: the adapters trainable, the base frozen; on the meta
    device or not); None: `config`'s, built on the meta device, every parameter trainable."""
    model = meta_model(config) if model is None else model
    total, trainable = model_counts(model)
    units = model_units(model, world_size)
    read = largest_tensor(model)
    if probes is None:
        probes = dict.fromkeys(("ddp", "sharded"), meta_probe(config, source_length, target_length))
    rows = []
    for strategy, offload in STRATEGIES:
        probe = probes["ddp" if strategy == "ddp" else "sharded"]
        activations = probe.activations(batch_size)
        parts = strategy_bytes(strategy, offload, total, trainable, world_size, precision, units)
        parts["device"] += compute_buffer_bytes(strategy, precision, compute, units)
        if device == "cpu":  # one memory: the "device" is CPU RAM
            per_rank = probe.runtime + parts["device"] + parts["cpu"] + activations
            node = world_size * per_rank
        else:
            per_rank = parts["device"] + activations
            node = world_size * (probe.runtime + parts["cpu"])
        load = probe.runtime + load_bytes(strategy, offload, total, world_size, precision, units, read)
        traffic = disk_traffic(strategy, offload, trainable, world_size, precision, units)
        row = {"strategy": strategy, "offload": offload or "none", "device": device, "per_rank": per_rank,
               "cpu_per_node": node, "load_per_rank": load, "load_per_node": world_size * load,
               "disk_per_node": world_size * parts["disk"], "disk_read_per_node": world_size * traffic["read"],
               "disk_written_per_node": world_size * traffic["written"]}  # fmt: skip
        rows.append({**row, "fits": None if max_memory is None else budgeted_bytes(row) <= max_memory})
    return rows


def budgeted_bytes(row: dict) -> int:
    """What of a row must fit the per-rank budget: on a CPU (one memory) the larger of the training
    and load peaks; on a GPU the training peak (the model loads in CPU RAM)."""
    return max(row["per_rank"], row["load_per_rank"]) if row["device"] == "cpu" else row["per_rank"]


# ---- --sharded_ddp auto --------------------------------------------------------------------------


def choose(rows: list, budget: int):
    """The first strategy of `AUTO_ORDER` whose estimate fits `budget` per rank (`budgeted_bytes`:
    on a CPU its load peak too), or None."""
    by_name = {(r["strategy"], r["offload"]): r for r in rows}
    for strategy, offload in AUTO_ORDER:
        row = by_name[(strategy, offload or "none")]
        if budgeted_bytes(row) <= budget:
            return row
    return None


def explain(rows: list, choice, budget: int) -> str:
    """What `choose` compared: each row's `budgeted_bytes`, marked where the load peak is the larger."""
    gib = 2**30
    by_name = {(r["strategy"], r["offload"]): r for r in rows}

    def compared(strategy, offload):
        row = by_name[(strategy, offload or "none")]
        name = strategy if offload is None else f"{strategy} + {offload} offload"
        loading = " (loading)" if budgeted_bytes(row) > row["per_rank"] else ""
        return f"{name} {budgeted_bytes(row) / gib:.2f}{loading}"

    tried = "; ".join(compared(s, o) for s, o in AUTO_ORDER)
    if choice is None:
        return f"nothing fits {budget / gib:.2f} GiB per rank (GiB per rank: {tried})"
    name = choice["strategy"] + ("" if choice["offload"] == "none" else f" + {choice['offload']} offload")
    return (f"chose {name}: the least costly strategy that fits {budget / gib:.2f} GiB per rank "
            f"(estimates, GiB per rank: {tried})")  # fmt: skip


def detect_budget(device) -> int:
    """Memory per rank: the GPU's total, or this machine's available RAM over its local ranks."""
    import os

    if getattr(device, "type", device) == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[1]
    return _available() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def dataset_lengths(dataset, default: int = 128) -> tuple:
    """The longest tokenized source and target in a training set (the collator pads a batch to them)."""
    source = target = 0
    try:
        for i in range(min(len(dataset), 200_000)):
            item = dataset[i]
            source, target = max(source, len(item["input_ids"])), max(target, len(item["labels"]))
    except (KeyError, TypeError, IndexError):
        return default, default
    return source or default, target or default


# ---- the probe --------------------------------------------------------------------------------


def measure_probes(model: str, precision: str, source_length: int, target_length: int, device: str = "cpu",
                   compute: str | None = None) -> dict:  # fmt: skip
    """{"ddp": Probe, "sharded": Probe} for `precision` and `compute` (one probe when they are the same)."""
    modes = probe_modes(precision, compute)
    done = {mode: measure_probe(model, mode, source_length, target_length, device) for mode in set(modes.values())}
    return {kind: done[mode] for kind, mode in modes.items()}


def measure_probe(model: str, precision: str, source_length: int, target_length: int, device: str = "cpu") -> Probe:
    """Run the probe in a fresh process (its runtime is what training's will be). `precision`:
    fp32, bf16 / fp16 (16-bit parameters), autocast-bf16 / autocast-fp16 (fp32 weights)."""
    cmd = [sys.executable, "-m", "trainer_shard.planner", "--_probe", model, precision, str(source_length),
           str(target_length), device]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(f"the memory probe failed:\n{proc.stderr[-2000:]}")
    return Probe(**json.loads(proc.stdout.strip().splitlines()[-1]))


SPAN = 3  # the probe runs batch 1 and 1 + SPAN: a wider step than 1 -> 2 keeps the allocator's noise small
LAYER_KEYS = ("num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers", "num_hidden_layers")


def _probe_main(model: str, precision: str, source_length: int, target_length: int, device: str) -> None:
    """Activation bytes at batch 1 and 2 of the whole model; of a model too big to probe whole
    (its fp32 weights, gradients and activations over half the free memory), of the model cut
    to 1 and 2 layers, extrapolated to its depth (each layer adds the same activations)."""
    import contextlib
    import copy

    import torch
    from transformers import AutoModelForSeq2SeqLM, Seq2SeqTrainer  # noqa: F401  (what training imports)

    from . import metrics, trainer  # noqa: F401  (what a training run imports besides)
    from .dtypes import half_dtype

    runtime = _rss()
    config = model_config(model)
    dtype = half_dtype(precision.removeprefix("autocast-"))
    autocast = torch.autocast(device, dtype=dtype) if precision.startswith("autocast") else contextlib.nullcontext()
    keys = [k for k in LAYER_KEYS if isinstance(getattr(config, k, None), int) and getattr(config, k) > 0]
    depth = max((getattr(config, k) for k in keys), default=1)

    def measure(layers):
        cut = copy.deepcopy(config)
        for key in keys:
            setattr(cut, key, min(layers, getattr(config, key)))
        net = AutoModelForSeq2SeqLM.from_config(cut).to(device)
        if dtype is not None and not precision.startswith("autocast"):
            net.to(dtype)  # the sharded runs' 16-bit parameters
        net.train()

        def step(batch: int) -> int:
            ids = torch.randint(2, config.vocab_size, (batch, source_length), device=device)
            labels = torch.randint(2, config.vocab_size, (batch, target_length), device=device)
            before = _reset_peak(device)
            with autocast:
                loss = net(input_ids=ids, labels=labels).loss
            loss.backward()
            return _peak(device) - before

        step(1)  # gradients allocated: from here the rise is activations and temporaries
        result = step(1), step(1 + SPAN)
        del net
        return result

    total, _ = count_parameters(config)
    if keys and depth > 2 and 12 * total > _available() // 2:
        (a11, a12), (a21, a22) = measure(1), measure(2)
        per_layer1, per_layer2 = a21 - a11, a22 - a12
        a1, a2 = a11 + (depth - 1) * per_layer1, a12 + (depth - 1) * per_layer2
    else:
        a1, a2 = measure(depth)
    print(json.dumps({"runtime": runtime, "act_base": a1, "act_per_sample": max(a2 - a1, 0) // SPAN}))


def _available() -> int:
    """MemAvailable of this machine, bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _reset_peak(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS
    return _rss()


def _peak(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def meta_probe(config, source_length: int, target_length: int) -> Probe:
    """Without running anything: the bytes autograd saves for backward, on the meta device, at
    batch 1 and 2; the runtime taken as this process's own size."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    from .offload.dispatch import empty_model

    model = empty_model(AutoModelForSeq2SeqLM, config).to("meta")
    model.train()

    def saved(batch: int) -> int:
        total = [0]

        def pack(t):
            if not (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)):
                total[0] += t.numel() * t.element_size()  # activations, not the weights backward needs
            return t

        ids = torch.zeros(batch, source_length, dtype=torch.long, device="meta")
        labels = torch.zeros(batch, target_length, dtype=torch.long, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=labels)
        return total[0]

    a1, a2 = saved(1), saved(2)
    return Probe(runtime=_rss(), act_base=a1, act_per_sample=max(a2 - a1, 0))


# ---- the command --------------------------------------------------------------------------------


def format_table(rows: list, max_memory: int | None, units: Units | None = None) -> str:
    """The rows as a markdown table; with `units`, a note on what the zero_dp_3 rows assume."""
    gib = 2**30
    lines = ["| strategy | offload | per rank (GiB) | CPU RAM per node (GiB) | disk per node (GiB) | "
             "disk read / written a step per node (GiB) | fits |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "no")
        traffic = (f"{r['disk_read_per_node'] / gib:.2f} / {r['disk_written_per_node'] / gib:.2f}"
                   if r["disk_read_per_node"] or r["disk_written_per_node"] else "-")  # fmt: skip
        lines.append(f"| {r['strategy']} | {r['offload']} | {r['per_rank'] / gib:.2f} | {r['cpu_per_node'] / gib:.2f} | "
                     f"{r['disk_per_node'] / gib:.2f} | {traffic} | {fits} |")  # fmt: skip
    lines += ["", *load_table(rows)]
    if max_memory is not None:
        on_cpu = all(r["device"] == "cpu" for r in rows)
        lines.append(f"\nfits: per rank at most {max_memory / gib:.2f} GiB"
                     + (", training and loading alike (one memory)" if on_cpu else ", training"))  # fmt: skip
    if units is not None:
        lines.append(f"\n{zero3_note(units)}")
    return "\n".join(lines)


def load_table(rows: list) -> list:
    """The load peaks (`load_bytes` and the process, CPU RAM) as rows of their own, per rank and per
    node: a column per strategy (its offload after a "+")."""
    gib = 2**30
    names = [r["strategy"] + ("" if r["offload"] == "none" else f" + {r['offload']}") for r in rows]

    def line(cells):
        return "| " + " | ".join(cells) + " |"

    return [line(["load peak, before training (GiB)", *names]), line(["---"] * (len(rows) + 1)),
            line(["per rank", *(f"{r['load_per_rank'] / gib:.2f}" for r in rows)]),
            line(["per node", *(f"{r['load_per_node'] / gib:.2f}" for r in rows)])]  # fmt: skip


def zero3_note(units: Units) -> str:
    m = 1e6
    wrap = "no _no_split_modules:"
    if units.inner:
        wrap = (f"one unit per {', '.join(units.classes)} (the model's _no_split_modules): {len(units.inner)} "
                f"units of up to {units.largest / m:.2f} M elements, the rest")  # fmt: skip
    return (f"zero_dp_3 (auto_wrap): {wrap} the root unit of {units.root / m:.2f} M elements, gathered through "
            f"forward into backward; {units.persistent / m:.2f} M elements kept whole on every rank; gather buffers "
            f"at the end of forward: {units.pool_numel() / m:.2f} M elements. {PARAM_OFFLOAD}: parameter, gradient "
            f"and optimizer shards in files (offload_param nvme, buffer_count {AUTO_PARAM_OFFLOAD['buffer_count']}: "
            "the gather buffers of at most that many units in RAM; max_in_cpu 0)" + _trainable_note(units))  # fmt: skip


def _trainable_note(units: Units) -> str:
    """Where some parameters are frozen (LoRA): what of the units has gradients and optimizer state."""
    inner, root, persistent = units.trainable
    if (inner, root, persistent) == (units.inner, units.root, units.persistent):
        return ""
    m = 1e6
    return (f". Trainable (gradients and optimizer state; the rest frozen): {(sum(inner) + root) / m:.2f} M sharded "
            f"elements and {persistent / m:.2f} M kept whole")  # fmt: skip


def compute_dtype(requested: str, precision: str, device: str) -> tuple:
    """(the compute dtype's name, the line saying it) as the Trainer would choose it
    (`compute.choose_compute_dtype`: `auto` times a small product on a CPU)."""
    from .compute import choose_compute_dtype, dtype_name
    from .dtypes import DTYPES

    dtype, line = choose_compute_dtype(requested, DTYPES[precision], device)
    return dtype_name(dtype), line[0].upper() + line[1:] + "."


def estimate_main(argv=None) -> int:
    from .config.load import parse_size

    parser = argparse.ArgumentParser(prog="trainer-shard estimate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help=f"a model folder, a config.json, or one of {', '.join(NAMED)}")
    parser.add_argument("--world_size", type=int, default=1)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--batch_size", type=int, default=8, help="per rank")
    parser.add_argument("--source_length", type=int, default=128)
    parser.add_argument("--target_length", type=int, default=128)
    parser.add_argument("--max_memory", default=None, help="per-rank budget on the compute device, e.g. 24GiB")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the probe runs and training computes")
    parser.add_argument("--no_probe", action="store_true", help="estimate activations on the meta device instead")
    parser.add_argument("--compute_dtype", default="auto", choices=("auto", *PRECISIONS),
                        help="as the Trainer's flag: auto times a product on --device (CPU) as training would")  # fmt: skip
    parser.add_argument("--use_peft", action="store_true",
                        help="LoRA (PEFT) as finetune_trainer.py --use_peft: the base frozen, gradients and "
                        "optimizer state for the adapters only")  # fmt: skip
    parser.add_argument("--lora_r", type=int, default=None, help="LoRA rank (with --use_peft; default 16)")
    parser.add_argument("--lora_target_modules", nargs="+", default=None,
                        help="modules given adapters (e.g. q v), or all-linear; default: PEFT's for the model "
                        "type")  # fmt: skip
    parser.add_argument("--lora_modules_to_save", nargs="+", default=None,
                        help="modules trained whole beside the adapters (e.g. lm_head)")  # fmt: skip
    args = parser.parse_args(argv)
    lora_flags = {"--lora_r": args.lora_r, "--lora_target_modules": args.lora_target_modules,
                  "--lora_modules_to_save": args.lora_modules_to_save}  # fmt: skip
    given = [flag for flag, value in lora_flags.items() if value is not None]
    if given and not args.use_peft:
        print(f"trainer-shard estimate: {', '.join(given)} configure LoRA, which only --use_peft turns on",
              file=sys.stderr)  # fmt: skip
        return 2
    lora = None
    if args.use_peft:
        lora = lora_settings(args.lora_r, args.lora_target_modules, args.lora_modules_to_save)
        if lora["r"] < 1:
            print(f"trainer-shard estimate: --lora_r {lora['r']}: the rank must be at least 1", file=sys.stderr)
            return 2
    try:
        config = model_config(args.model)
        budget = parse_size(args.max_memory) if args.max_memory else None
        model = meta_model(config, lora)
    except ImportError as e:
        print(f"trainer-shard estimate: --use_peft needs the peft package ({e})", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # ValueError: also a LoRA target module the model does not have
        print(f"trainer-shard estimate: {e}", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not args.no_probe:
        import torch

        if not torch.cuda.is_available():
            print("trainer-shard estimate: --device cuda, but this machine has no CUDA device: run the probe where "
                  "training will run, or pass --no_probe", file=sys.stderr)  # fmt: skip
            return 2
    if args.world_size < 1 or args.batch_size < 1:
        print("trainer-shard estimate: --world_size and --batch_size must be at least 1", file=sys.stderr)
        return 2
    compute, said = compute_dtype(args.compute_dtype, args.precision, args.device)
    probes = None if args.no_probe else measure_probes(args.model, args.precision, args.source_length,
                                                       args.target_length, args.device, compute)  # fmt: skip
    rows = estimate(config, world_size=args.world_size, precision=args.precision, batch_size=args.batch_size,
                    source_length=args.source_length, target_length=args.target_length, device=args.device,
                    probes=probes, max_memory=budget, compute=compute, model=model)  # fmt: skip
    total, trainable = model_counts(model)
    counted = f"{total:,} parameters ({trainable:,} trainable)"
    if lora is not None:
        targets = model.peft_config["default"].target_modules
        targets = targets if isinstance(targets, str) else ", ".join(sorted(targets))
        counted = f"LoRA r={lora['r']}: {trainable:,} trainable of {total:,} parameters (adapters on {targets})"
    print(f"{args.model}: {counted}, world size {args.world_size}, "
          f"{args.precision}, batch {args.batch_size} x {args.source_length}/{args.target_length} tokens per rank; "
          f"activations {'measured' if probes else 'estimated on the meta device'}\n{said}\n")  # fmt: skip
    print(format_table(rows, budget, model_units(model, args.world_size)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_probe":
        _probe_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        sys.exit(estimate_main())
