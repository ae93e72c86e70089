"""`trainer-shard estimate` and `--sharded_ddp auto`: exact state arithmetic (every row against the
bytes real ranks hold), and auto's choice on a real 2-rank run. The predictions against measured
peak RSS are benchmarks: bench/planner_trainer.py (ddp, simple, zero_dp_2 through the Trainer;
tolerance 15%) and bench/planner_zero3.py (zero_dp_3 and zero_dp_2 in a plain loop)."""

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_FLAGS, assert_ok, run_script
from trainer_shard import planner
from trainer_shard.args import ShardedSeq2SeqTrainingArguments
from trainer_shard.errors import ArgumentError

PEAK = ROOT / "tests" / "helpers" / "peak_rss.py"
TOLERANCE = 0.15
GiB = 2**30


def test_named_architectures_count_their_parameters():
    assert planner.count_parameters(planner.model_config("t5-small")) == (60_506_624, 60_506_624)
    assert planner.count_parameters(planner.model_config("t5-3b"))[0] == 2_851_598_336


def test_zero3_units_are_the_models_blocks():
    """t5-small as `shard_model(units=[T5Block])` cuts it: 6 encoder and 6 decoder blocks (their
    layer norms and relative attention bias kept whole), the tied embedding in the root unit."""
    units = planner.zero3_units(planner.model_config("t5-small"), 2)
    encoder, decoder, embedding = 4 * 512 * 512 + 2 * 512 * 2048, 8 * 512 * 512 + 2 * 512 * 2048, 32128 * 512
    assert units.inner == (encoder,) * 6 + (decoder,) * 6 and units.root == embedding
    assert units.persistent == (6 * 2 + 1 + 6 * 3 + 1) * 512 + 2 * 32 * 8  # layer norms, relative attention bias
    assert sum(units.inner) + units.root + units.persistent == 60_506_624
    # the root, a unit and the next: the encoder blocks gather into the decoder blocks' storages
    assert units.pool_numel() == embedding + 2 * decoder
    assert units.classes == ("T5Block",) and "12 units" in planner.zero3_note(units)
    assert planner.zero3_units(planner.model_config("t5-small"), 3).root == -(-embedding // 3) * 3  # padded


def test_zero3_gather_pool_keeps_the_most_gathered_at_once_sharing_storages_up_to_twice_the_size():
    def pool(inner, root):
        return planner.Units(tuple(inner), root, 0, 1).pool_numel()

    # the 10s gather into the 20s' storages (two at once); 5 takes none of them (over twice its size)
    assert pool([10, 10, 20, 20, 5], 30) == 30 + 2 * 20 + 5
    assert pool([10, 20, 10, 20], 0) == 10 + 20  # a free storage of its own size first
    assert pool([10, 10], 10) == 3 * 10  # the root's buffer shares its size's slots
    assert pool([7], 3) == 7 + 3 and pool([], 3) == 3


def test_the_compute_buffers_bound_what_the_cast_holds():
    """16-bit parameters computed in fp32: the planner's compute buffers (4 L + min(4 R, 2 C)) against the
    pool `ComputeCast` keeps after two steps of a bf16 T5 (measured: 50,048 of 58,496 bytes)."""
    import torch
    import transformers

    from trainer_shard.compute import ComputeCast
    from trainer_shard.sharding.zero3.selection import auto_wrap_units

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                   decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).to(torch.bfloat16)
    ids = torch.randint(1, 64, (2, 8))
    with ComputeCast(model, torch.float32, units=auto_wrap_units(model)[0]) as cast:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
        held = cast.pool_bytes()
    units = planner.zero3_units(config, 1, persistence_threshold=0)
    counted = planner.compute_buffer_bytes("zero_dp_3", "bf16", "fp32", units)
    assert held <= counted <= 1.25 * held, (held, counted)
    assert planner.compute_buffer_bytes("ddp", "bf16", "fp32", units) == 0  # DDP: plain fp32, no copies
    assert planner.compute_buffer_bytes("zero_dp_2", "bf16", "bf16", units) == 0
    assert planner.probe_modes("bf16", "fp32") == {"ddp": "fp32", "sharded": "fp32"}
    assert planner.probe_modes("bf16", "bf16") == {"ddp": "autocast-bf16", "sharded": "bf16"}


def test_zero3_bytes_per_part():
    """The ZeRO-3 arithmetic on a layout small enough to check by hand, and where it differs
    from zero_dp_2: shards of everything, gather buffers and unit buckets instead of w A."""
    units = planner.Units((100, 100, 140), 60, 8, 2)  # 400 sharded elements: 200 a rank
    parts = planner.zero3_parts(None, units, 2, 2)  # bf16
    assert parts == {"shards": 400, "grad_shards": 800, "persistent": 8 * 2 * 4, "pool": 2 * (60 + 2 * 140),
                     "buckets": 3 * 2 * 140, "optimizer": 200 * (4 + 8)}  # fmt: skip
    assert planner.strategy_bytes("zero_dp_3", None, 408, 408, 2, "bf16", units)["device"] == sum(parts.values())
    cpu = planner.strategy_bytes("zero_dp_3", "cpu", 408, 408, 2, "bf16", units)
    assert cpu == {"device": sum(parts.values()) - parts["optimizer"] - 400, "cpu": parts["optimizer"], "disk": 0}
    disk = planner.strategy_bytes("zero_dp_3", "disk", 408, 408, 2, "fp32", units)
    # fp32 offloaded: a master too; the gradient shards on disk beside it, in RAM the slices of the
    # largest unit (140 elements, 70 a rank) being written and the next
    assert disk["disk"] == 200 * (4 + 8) + 200 * 4 and disk["cpu"] == planner.DISK_BUFFERS + 2 * 4 * 70
    on_device = planner.zero3_parts("disk", units, 2, 4)
    assert disk["device"] == sum(on_device.values()) - on_device["optimizer"] - on_device["grad_shards"]
    assert planner.zero3_parts(None, units, 2, 4)["optimizer"] == 200 * 8  # fp32: the shard is the parameter
    wide = planner.Units((160,), 0, 0, 16)
    assert planner.zero3_parts(None, wide, 16, 2)["buckets"] == 3 * 4 * 160  # over 8 ranks reduced in fp32
    with pytest.raises(ValueError, match="zero_dp_3 needs its units for 2 ranks"):
        planner.strategy_bytes("zero_dp_3", None, 408, 408, 2, "bf16")
    with pytest.raises(ValueError, match="zero_dp_3 needs its units for 3 ranks"):
        planner.strategy_bytes("zero_dp_3", None, 408, 408, 3, "bf16", units)


def test_peft_zero3_bytes_count_no_gradient_or_state_for_frozen_elements():
    """LoRA under ZeRO-3: the frozen elements are sharded, gathered and (disk_params) stored like
    the rest, but have no gradient shard, master, moments or reduce bucket. A trainable fraction of
    0 leaves only the parameters; a partly trainable layout counts its trainable part only."""
    units = planner.Units((100, 100, 140), 60, 8, 2)  # as in test_zero3_bytes_per_part: all trainable
    frozen = planner.Units((100, 100, 140), 60, 8, 2, (), (0, 0, 0), 0, 0)
    full, none = planner.zero3_parts(None, units, 2, 2), planner.zero3_parts(None, frozen, 2, 2)
    assert none == {"shards": full["shards"], "grad_shards": 0, "persistent": 8 * 2, "pool": full["pool"],
                    "buckets": 0, "optimizer": 0}  # fmt: skip
    for offload in (None, "cpu", "disk"):
        held = planner.strategy_bytes("zero_dp_3", offload, 408, 0, 2, "bf16", frozen)
        assert held == {"device": 400 + 16 + full["pool"], "cpu": planner.DISK_BUFFERS if offload == "disk" else 0,
                        "disk": 0}, offload  # fmt: skip
    on_disk = planner.zero3_param_offload_parts(frozen, 2, 2)
    assert on_disk["grad_shards"] == on_disk["optimizer"] == on_disk["reduced"] == on_disk["grad_writes"] == 0
    assert on_disk["param_shards"] == 400 and on_disk["pool"] == planner.zero3_param_offload_parts(units, 2, 2)["pool"]
    traffic = planner.disk_traffic("zero_dp_3", "disk_params", 0, 2, "bf16", frozen)
    # the parameters gathered twice, but the root's shard (30 elements) once; only the step's write
    assert traffic == {"read": 2 * 400 - 2 * 30, "written": 400}
    assert planner.disk_traffic("zero_dp_3", "disk", 0, 2, "bf16", frozen) == {"read": 0, "written": 0}
    # adapters: 40 of the third unit's 140 elements (padded), 4 of the 8 persistent ones
    lora = planner.Units((100, 100, 140), 60, 8, 2, (), (0, 0, 40), 0, 4)
    parts = planner.zero3_parts(None, lora, 2, 2)
    assert parts == {"shards": 400, "grad_shards": 4 * 20, "persistent": 2 * 8 + 2 * 4 * 3, "pool": full["pool"],
                     "buckets": 3 * 2 * 40, "optimizer": 20 * (4 + 8)}  # fmt: skip
    disk = planner.zero3_param_offload_parts(lora, 2, 2)
    assert disk["grad_shards"] == 2 * 20 and disk["optimizer"] == 4 * 3 * (20 + 2) and disk["reduced"] == 2 * 2 * 20


def _load_config():
    """A small T5 with both sides of the persistence threshold: q, k, v, o (128 x 128), layer norms
    and relative attention bias kept whole; wi, wo (128 x 1000) and the tied embedding (3001 x 128:
    the largest tensor, and the root unit the largest unit, as in T5's own sizes) sharded; 3 divides
    neither a block's sharded elements nor the embedding's."""
    from transformers import T5Config

    return T5Config(vocab_size=3001, d_model=128, d_ff=1000, num_layers=2, num_decoder_layers=3, num_heads=4,
                    d_kv=32, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip


def _load_arithmetic(config, world: int, w: int) -> dict:
    """The load peak by hand, from the model's own parameters (built by transformers on the meta
    device, grouped by the `auto_wrap_units` block holding them, the rest the root's): ZeRO-3 keeps
    its shards (S/N of the padded flat buffers), the persistent K and one whole unit (U); every
    strategy reads one tensor (T) in fp32."""
    import torch
    import transformers

    from trainer_shard.sharding.zero3 import PERSISTENCE_THRESHOLD, auto_wrap_units

    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    blocks, _ = auto_wrap_units(model)
    params = {id(p): p for p in model.parameters()}  # the tied embedding once
    unit_of = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    sharded, K = [0] * (len(blocks) + 1), 0  # the root last
    for key, p in params.items():
        if p.numel() <= PERSISTENCE_THRESHOLD:
            K += p.numel()
        else:
            sharded[unit_of.get(key, len(blocks))] += p.numel()
    padded = [-(-n // world) * world for n in sharded]
    A, S, U = sum(p.numel() for p in params.values()), sum(padded), max(padded)
    T = max(p.numel() for p in params.values())
    assert T == sharded[-1] == 3001 * 128 > max(sharded[:-1]) and 0 < K < A and all(n % 3 for n in sharded)
    return {"ddp": 4 * A + 4 * T, "zero_dp_2": w * A + 4 * T, "zero_dp_3": w * S // world + w * K + w * U + 4 * T,
            "disk_params": w * K + w * U + 4 * T, "A": A, "T": T}  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_load_bytes_are_the_arithmetic_of_the_models_parameters(world, precision):
    config = _load_config()
    expected = _load_arithmetic(config, world, 2 if precision == "bf16" else 4)
    A, T, units = expected["A"], expected["T"], planner.zero3_units(config, world)
    assert planner.largest_tensor(planner.meta_model(config)) == T
    for strategy, offload in planner.STRATEGIES:
        key = "zero_dp_2" if strategy == "simple" else strategy  # simple loads as zero_dp_2 does
        key = "disk_params" if offload == planner.PARAM_OFFLOAD else key
        loaded = planner.load_bytes(strategy, offload, A, world, precision, units, T)
        assert loaded == expected[key], (strategy, offload)
    runtime = 123_456  # the process: in the load peak as in the training estimate
    probe = planner.Probe(runtime=runtime, act_base=0, act_per_sample=0)
    for device in ("cpu", "cuda"):  # the load happens in CPU RAM either way
        rows = planner.estimate(config, world_size=world, precision=precision, batch_size=2, source_length=8,
                                target_length=8, device=device, probes={"ddp": probe, "sharded": probe})  # fmt: skip
        loads = {(r["strategy"], r["offload"]): (r["load_per_rank"], r["load_per_node"]) for r in rows}
        zero3 = runtime + expected["zero_dp_3"]
        assert loads[("zero_dp_3", "cpu")] == (zero3, world * zero3)
        assert loads[("ddp", "none")][0] == runtime + expected["ddp"]
        assert loads[("zero_dp_3", "disk_params")][0] == runtime + expected["disk_params"]
    with pytest.raises(ValueError, match=f"zero_dp_3 needs its units for {world + 1} ranks"):
        planner.load_bytes("zero_dp_3", None, A, world + 1, precision, units, T)


def test_zero3_loads_less_than_the_whole_model():
    """t5-large in bf16: zero_dp_2 loads the whole model on every rank (w A), zero_dp_3 its shards
    and one unit: below zero_dp_2's at 2 ranks, a fraction of it at 8."""
    config = planner.model_config("t5-large")
    model = planner.meta_model(config)
    A, T = planner.model_counts(model)[0], planner.largest_tensor(model)
    load = {}
    for world in (2, 8):
        units = planner.model_units(model, world)
        load[world] = {strategy: planner.load_bytes(strategy, offload, A, world, "bf16", units, T)
                       for strategy, offload in (("ddp", None), ("zero_dp_2", None), ("zero_dp_3", None))}  # fmt: skip
        assert load[world]["zero_dp_2"] == 2 * A + 4 * T < load[world]["ddp"] == 4 * A + 4 * T
    assert load[2]["zero_dp_3"] < load[2]["zero_dp_2"] - 0.5 * GiB  # about w A / 2 less
    assert load[8]["zero_dp_3"] < load[8]["zero_dp_2"] / 3
    on_disk = planner.load_bytes("zero_dp_3", planner.PARAM_OFFLOAD, A, 8, "bf16", planner.model_units(model, 8), T)
    assert on_disk == load[8]["zero_dp_3"] - 2 * planner.model_units(model, 8).shard  # its shards written, not kept


def _held_bytes(rank, world, nvme, out):
    """A bf16 model stepped once by ShardedOptimizer (ZeRO-2) without offload and with CPU and disk
    offload, on 2 gloo ranks: the bytes each rank really holds for the optimizer, measured on the
    tensors and files themselves; and a ZeRO-3 model's (`_zero3_held`)."""
    import os

    import torch

    from trainer_shard.offload import OffloadSpec
    from trainer_shard.sharding import ShardedOptimizer

    held = {}
    for offload in (None, "cpu", "disk"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(100, 77), torch.nn.Linear(77, 33)).to(torch.bfloat16)
        spec = {None: None, "cpu": OffloadSpec("cpu"), "disk": OffloadSpec("nvme", nvme_path=nvme)}[offload]
        opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, offload=spec, lr=1e-3)
        model(torch.ones(2, 100, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        grads = sum(f.grad.numel() * f.grad.element_size() for f in opt.flats)
        if offload is None:
            masters = sum(f.master.numel() * f.master.element_size() for f in opt.flats)
            state = sum(v.numel() * v.element_size() for s in opt.stepper.optim.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0)  # fmt: skip
            held[offload] = {"device": grads + masters + state}
        elif offload == "cpu":
            held[offload] = {"device": grads, "cpu": sum(t.numel() * t.element_size()
                                                          for t in opt.stepper.store._tensors.values())}  # fmt: skip
        else:
            folder = os.path.join(nvme, f"rank{rank}")
            held[offload] = {"device": grads, "disk": sum(os.path.getsize(os.path.join(folder, f))
                                                           for f in os.listdir(folder) if not f.endswith(".lock"))}  # fmt: skip
        opt.close()
    held["ddp"], held["simple"] = _ddp_held(torch.float32), _ddp_held(torch.bfloat16)
    held["zero3"] = _zero3_held()
    torch.save(held, f"{out}/rank{rank}.pt")


def _ddp_held(dtype) -> dict:
    """What a rank of the ddp row (fp32: the model in torch's DDP, plain AdamW) or of the simple
    row (bf16: DDP over ShardedOptimizer(stage=1)) holds after a step: the parameters, their
    `.grad`s, DDP's bucket copies of the gradients (its own count, `bucket_sizes`), and the
    optimizer's shard or whole state, counted on the tensors."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from trainer_shard.sharding import ShardedOptimizer

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 77), torch.nn.Linear(77, 33)).to(dtype)
    ddp = DistributedDataParallel(model)
    if dtype == torch.float32:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=1, lr=1e-3)
    ddp(torch.ones(2, 100, dtype=dtype)).sum().backward()
    opt.step()
    held = {"parameters": nbytes(model.parameters()), "grads": nbytes(p.grad for p in model.parameters()),
            "buckets": sum(int(n) for n in ddp._get_ddp_logging_data()["bucket_sizes"].split(","))}  # fmt: skip
    if dtype == torch.float32:
        held["optimizer"] = nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    else:
        held["grad_shards"] = nbytes(f.grad for f in opt.flats)
        held["optimizer"] = nbytes(f.master for f in opt.flats) + nbytes(
            v for s in opt.stepper.optim.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        opt.close()
    return held


ZERO3_THRESHOLD = 500  # the tiny T5 below keeps its layer norms and relative attention bias whole


def _zero3_config():
    from transformers import T5Config

    # d_model 31, vocab 301: an odd embedding (9,331 elements), so the root's flat buffer is padded
    return T5Config(vocab_size=301, d_model=31, d_ff=64, num_layers=2, num_heads=2, d_kv=16, decoder_start_token_id=0,
                    pad_token_id=0, eos_token_id=1, dropout_rate=0.0)  # fmt: skip


def _zero3_held() -> dict:
    """The same for ZeRO-3: a bf16 tiny T5 sharded per T5Block, two steps of fused AdamW on its
    shards; the engine's accounting of what this rank holds, by the planner's parts."""
    import torch
    from transformers import T5ForConditionalGeneration

    from trainer_shard.sharding import shard_model

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(_zero3_config()).to(torch.bfloat16)
    blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    sharded = shard_model(model, units=blocks, persistence_threshold=ZERO3_THRESHOLD)
    opt = torch.optim.AdamW(sharded.shard_parameters(), lr=1e-3, fused=True)
    whole = {id(p) for p in sharded.persistent}
    for step in range(2):
        ids = torch.randint(2, 301, (2, 7), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        at_forwards_end = sharded.held_parameter_bytes()  # the gather buffers alive: the root's and the pool's
        loss.backward()
        persistent_grads = sum(p.grad.numel() * p.grad.element_size() for p in sharded.persistent)
        opt.step()
        opt.zero_grad()
    state = {kind: sum(v.numel() * v.element_size() for p, st in opt.state.items() if (id(p) in whole) == kind
                       for v in st.values() if v.dim() > 0) for kind in (True, False)}  # fmt: skip
    held = sharded.held_parameter_bytes()
    sharded.close()
    assert held["gathered"] == 0
    return {"shards": held["shards"], "grad_shards": held["grad_shards"],
            "pool": at_forwards_end["pool"] + at_forwards_end["gathered"],
            "persistent": held["persistent"] + persistent_grads + state[True],
            "optimizer": held["masters"] + state[False], "buckets": sharded.reducer.peak_bucket_bytes}  # fmt: skip


@pytest.mark.multiproc
def test_state_bytes_are_what_the_optimizer_holds(tmp_path):
    """The planner's bytes for the optimizer's shard (its gradient shard, fp32 masters and Adam
    state: on the device, in the CPU store, or in the disk store's files) against what two real
    ranks hold after a step. The real layout pads each shard a little; nothing else may differ.
    ZeRO-3: every part of `zero3_parts`, exactly, against the engine's own accounting. ddp and
    simple: every byte a rank keeps for them (parameters, gradients, DDP's buckets, the optimizer)
    against the row, exactly for ddp and up to the shard's padding for simple."""
    import torch

    from distributed import spawn

    spawn(_held_bytes, 2, str(tmp_path / "nvme"), str(tmp_path))
    P = 100 * 77 + 77 + 77 * 33 + 33  # odd: the two shards differ by padding
    w, buckets = 2, 3 * min(planner.BUCKET_NUMEL, P) * 2  # bf16 weights; reduce buckets in flight
    for rank in range(2):
        held = torch.load(tmp_path / f"rank{rank}.pt")
        zero3, ddp, simple = held.pop("zero3"), held.pop("ddp"), held.pop("simple")
        assert planner.strategy_bytes("ddp", None, P, P, 2, "fp32")["device"] == sum(ddp.values()), ddp
        predicted = planner.strategy_bytes("simple", None, P, P, 2, "bf16")["device"]
        assert predicted <= sum(simple.values()) <= predicted * 1.01 + 64, (predicted, simple)
        for offload, measured in held.items():
            predicted = planner.strategy_bytes("zero_dp_2", offload, P, P, 2, "bf16")
            predicted["device"] -= w * P + buckets  # the weights and reduce buckets: not the optimizer's
            for where, value in measured.items():
                assert predicted[where] <= value <= predicted[where] * 1.01 + 64, (offload, where, predicted, measured)
        units = planner.zero3_units(_zero3_config(), 2, persistence_threshold=ZERO3_THRESHOLD)
        predicted = planner.zero3_parts(None, units, 2, 2)
        assert units.root % 2 == 0 and units.root != 301 * 31  # padded
        # the unit buckets: at most 3 units in flight, besides the root's gradient (reduced where
        # autograd left it, as the probe's activations hold it)
        assert zero3.pop("buckets") <= predicted.pop("buckets") + 2 * units.root, zero3
        assert zero3 == predicted, (rank, zero3, predicted)
    with pytest.raises(ValueError, match="DDP has no offload"):
        planner.strategy_bytes("ddp", "cpu", P, P, 2, "fp32")


def test_auto_takes_the_least_costly_strategy_that_fits():
    probe = planner.Probe(runtime=0, act_base=0, act_per_sample=0)
    rows = planner.estimate(planner.model_config("t5-small"), world_size=2, precision="fp32", batch_size=8,
                            source_length=32, target_length=32, probes={"ddp": probe, "sharded": probe})  # fmt: skip
    per_rank = {(r["strategy"], r["offload"]): r["per_rank"] for r in rows}
    assert {(s, o or "none") for s, o in planner.STRATEGIES} == set(per_rank)
    assert planner.choose(rows, 10 * GiB)["strategy"] == "ddp"
    assert planner.choose(rows, per_rank[("zero_dp_2", "none")])["strategy"] == "zero_dp_2"
    for budget in per_rank.values():  # at each row's estimate: the first of AUTO_ORDER that fits
        first = next((s, o or "none") for s, o in planner.AUTO_ORDER if per_rank[(s, o or "none")] <= budget)
        assert (planner.choose(rows, budget)["strategy"], planner.choose(rows, budget)["offload"]) == first
    assert planner.choose(rows, min(per_rank.values()) - 1) is None
    assert "nothing fits" in planner.explain(rows, None, 1)
    order = planner.AUTO_ORDER  # zero_dp_3 after zero_dp_2, each offload after zero_dp_2's
    assert order.index(("zero_dp_3", None)) == order.index(("zero_dp_2", None)) + 1 < order.index(("zero_dp_2", "cpu"))
    assert order.index(("zero_dp_2", "cpu")) < order.index(("zero_dp_3", "cpu")) < order.index(("zero_dp_2", "disk"))
    big = planner.estimate(planner.model_config("t5-3b"), world_size=2, precision="bf16", batch_size=8,
                           source_length=32, target_length=32, probes={"ddp": probe, "sharded": probe})  # fmt: skip
    big_rank = {(r["strategy"], r["offload"]): r["per_rank"] for r in big}
    saved = big_rank[("zero_dp_2", "none")] - big_rank[("zero_dp_3", "none")]
    assert saved > 1.5 * GiB  # w A / 2, less the gathered units and their buckets
    assert planner.choose(big, big_rank[("zero_dp_3", "none")])["strategy"] == "zero_dp_3"


def _rows_by_hand(device: str = "cpu") -> list:
    """Rows of every strategy: ddp's training estimate 1 GiB, its load peak 3 GiB; the others 2 and 1."""
    return [{"strategy": s, "offload": o or "none", "device": device, "per_rank": (1 if s == "ddp" else 2) * GiB,
             "load_per_rank": (3 if s == "ddp" else 1) * GiB} for s, o in planner.STRATEGIES]  # fmt: skip


def test_auto_refuses_a_strategy_whose_load_peak_does_not_fit():
    rows = _rows_by_hand()
    choice = planner.choose(rows, 2 * GiB)  # ddp's training fits, its loading does not
    assert (choice["strategy"], choice["offload"]) == ("simple", "none")
    assert "ddp 3.00 (loading); simple 2.00;" in planner.explain(rows, choice, 2 * GiB)
    assert planner.choose(rows, 3 * GiB)["strategy"] == "ddp"
    assert planner.choose(rows, 2 * GiB - 1) is None
    assert planner.choose(_rows_by_hand("cuda"), 2 * GiB)["strategy"] == "ddp"  # on a GPU: the training peak
    # estimate's fits: on a GPU the process (in the load peak, not in per rank) is no part of the budget
    probe = planner.Probe(runtime=GiB // 4, act_base=0, act_per_sample=0)
    for device in ("cpu", "cuda"):
        kwargs = dict(world_size=2, precision="bf16", batch_size=2, source_length=8, target_length=8, device=device,
                      probes={"ddp": probe, "sharded": probe})  # fmt: skip
        rows = planner.estimate(_load_config(), **kwargs)
        budget = max(r["per_rank"] for r in rows if r["offload"] != "disk")  # every training estimate but disk's fits
        assert (device == "cuda") == all(r["load_per_rank"] > budget for r in rows)
        for row in planner.estimate(_load_config(), max_memory=budget, **kwargs):
            assert row["fits"] == (row["per_rank"] <= budget and (device == "cuda" or row["load_per_rank"] <= budget))


def test_auto_hands_every_choice_on_as_a_stage(monkeypatch, tmp_path):
    """`choose_strategy` turns each (strategy, offload) auto may choose into the stage and store."""
    from types import SimpleNamespace

    import torch

    from trainer_shard.offload import OffloadSpec
    from trainer_shard.training import plan

    monkeypatch.setattr(planner, "measure_probes", lambda *args, **kwargs: {})
    monkeypatch.setattr(planner, "estimate", lambda config, **kwargs: [])
    monkeypatch.setattr(planner, "explain", lambda rows, choice, budget: "fits")
    args = SimpleNamespace(process_index=0, device=torch.device("cpu"), world_size=1, bf16=False, fp16=False,
                           per_device_train_batch_size=2, output_dir=str(tmp_path))  # fmt: skip
    model = SimpleNamespace(config=SimpleNamespace(save_pretrained=lambda folder: None), parameters=lambda: iter(()))
    devices = {None: None, "cpu": "cpu", "disk": "nvme", planner.PARAM_OFFLOAD: "nvme"}
    stages = {"ddp": None, "simple": 1, "zero_dp_2": 2, "zero_dp_3": 3}
    for strategy, offload in planner.AUTO_ORDER:
        row = {"strategy": strategy, "offload": offload or "none"}
        monkeypatch.setattr(planner, "choose", lambda rows, budget, row=row: row)
        stage, spec, params = plan.choose_strategy(args, model, None, None)
        assert stage == stages[strategy] and (spec.device if spec else None) == devices[offload]
        assert (params is not None) == (offload == planner.PARAM_OFFLOAD)  # the parameter store: disk_params only
        assert spec is None or isinstance(spec, OffloadSpec)


def test_auto_refuses_what_it_would_override(tmp_path):
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"max_memory": {"cpu": "4GiB"}}))
    base = dict(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none")
    ShardedSeq2SeqTrainingArguments(**base, sharded_ddp="auto", offload=str(budget))  # accepted
    with pytest.raises(ArgumentError, match="max_memory is the per-rank budget of --sharded_ddp auto"):
        ShardedSeq2SeqTrainingArguments(**base, offload=str(budget))
    stage = tmp_path / "stage.json"
    stage.write_text(json.dumps({"zero_optimization": {"stage": 2}, "max_memory": {"cpu": "4GiB"}}))
    with pytest.raises(ArgumentError, match="zero_optimization: --sharded_ddp auto chooses the stage"):
        ShardedSeq2SeqTrainingArguments(**base, sharded_ddp="auto", offload=str(stage))
    with pytest.raises(ArgumentError, match="'auto' chooses the offload itself"):
        ShardedSeq2SeqTrainingArguments(**base, sharded_ddp="auto offload")


@pytest.mark.slow
def test_estimate_command_prints_every_strategy(tiny_model, capsys):
    proc = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "estimate", "--model", "t5-3b", "--world_size",
                           "2", "--precision", "bf16", "--no_probe", "--max_memory", "24GiB", "--batch_size", "4"],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "2,851,598,336 parameters" in proc.stdout
    assert proc.stdout.count("| zero_dp_2 |") == 3 + 1 and "| ddp | none |" in proc.stdout  # + the load rows' column
    assert proc.stdout.count("| zero_dp_3 |") == 4 + 1 and "zero_dp_3 (auto_wrap): one unit per T5Block" in proc.stdout
    assert "Compute dtype " in proc.stdout  # auto: what it measured and chose on this CPU
    # the rest in this process (the entry point is the one above; each import of it costs seconds)
    from trainer_shard import cli

    sizes = {}
    for compute in ("bf16", "fp32"):  # forced: the fp32 copies of a layer counted for the sharded rows only
        assert cli.main(["estimate", "--model", "t5-3b", "--precision", "bf16", "--no_probe", "--compute_dtype",
                         compute]) == 0  # fmt: skip
        out = capsys.readouterr().out
        assert f"Compute dtype {compute}: as asked" in out
        sizes[compute] = {tuple(r[:2]): float(r[2]) for r in re.findall(r"\| (\w+) \| (\w+) \| ([\d.]+) \|", out)}
    # both estimates count this process's RSS (--no_probe), the same but for what each allocates
    assert abs(sizes["fp32"][("ddp", "none")] - sizes["bf16"][("ddp", "none")]) <= 0.05
    assert all(sizes["fp32"][k] > sizes["bf16"][k] + 0.05 for k in sizes["bf16"] if k[0] != "ddp")  # >= 0.3 GiB
    assert cli.main(["estimate", "--model", "t5-3b", "--max_memory", "lots"]) == 2
    assert "must be a size" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert cli.main(["estimate", "--model", "t5-small", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def _peft_trainable(config, **lora) -> tuple:
    """(all, trainable) elements of `peft.get_peft_model` on `config`'s T5, built by transformers on
    the meta device: the count the planner's must equal, made without the planner."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    model = get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM", **lora))
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _estimate_rows(capsys, *flags) -> tuple:
    """(the header line, GiB per rank by (strategy, offload)) of `trainer-shard estimate` on t5-small."""
    assert planner.estimate_main(["--model", "t5-small", "--world_size", "2", "--precision", "bf16", "--no_probe",
                                  "--compute_dtype", "bf16", "--batch_size", "2", *flags]) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = {tuple(r[:2]): float(r[2]) for r in re.findall(r"^\| (\w+) \| (\w+) \| ([\d.]+) \|", out, re.M)}
    assert len(rows) == len(planner.STRATEGIES), out
    return out.splitlines()[0], rows


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_estimate_command_with_peft_counts_gradients_and_state_of_the_adapters_only(capsys):
    config = planner.model_config("t5-small")
    header, full = _estimate_rows(capsys)
    assert header.startswith("t5-small: 60,506,624 parameters (60,506,624 trainable), world size 2")
    for flags, lora in ((["--use_peft"], dict(r=16)),  # PEFT's targets for T5: q and v
                        (["--use_peft", "--lora_r", "8", "--lora_target_modules", "all-linear"],
                         dict(r=8, target_modules="all-linear"))):  # fmt: skip
        total, trainable = _peft_trainable(config, **lora)
        assert 0 < trainable < total // 20
        header, rows = _estimate_rows(capsys, *flags)
        assert f"LoRA r={lora['r']}: {trainable:,} trainable of {total:,} parameters" in header, header
        targets = [lora["target_modules"]] if "target_modules" in lora else None  # as the flag gives it
        assert planner.count_parameters(config, planner.lora_settings(lora["r"], targets)) == (total, trainable)
        for key in rows:
            if key[0] in ("zero_dp_2", "zero_dp_3"):
                assert rows[key] < full[key], (flags, key, rows[key], full[key])
    assert "k, o, q, v, wi, wo" in header  # all-linear: every linear layer but lm_head
    assert planner.estimate_main(["--model", "t5-small", "--lora_r", "8", "--no_probe"]) == 2
    assert "only --use_peft turns on" in capsys.readouterr().err
    assert planner.estimate_main(["--model", "t5-small", "--use_peft", "--lora_target_modules", "nope",
                                  "--no_probe"]) == 2  # fmt: skip
    assert "nope" in capsys.readouterr().err


def test_peft_zero3_units_split_each_unit_into_frozen_and_trainable():
    """The planner's units of the PEFT model, every parameter sharded (threshold 0): the adapters,
    counted per unit, add up to what PEFT makes trainable; the base's elements stay in the units."""
    config = planner.model_config("t5-small")
    total, trainable = _peft_trainable(config, r=16, target_modules="all-linear")
    lora = planner.lora_settings(16, ["all-linear"])
    units = planner.zero3_units(config, 1, persistence_threshold=0, lora=lora)
    assert sum(units.inner) + units.root == total and units.persistent == 0
    inner, root, persistent = units.trainable
    assert sum(inner) + root == units.trainable_shard == trainable and persistent == 0
    assert len(inner) == 12 and all(0 < t < n for t, n in zip(inner, units.inner)) and root == 0
    base = planner.zero3_units(config, 1, persistence_threshold=0)
    assert units.inner == tuple(n + t for n, t in zip(base.inner, inner))  # the base's units, plus their adapters
    assert units.largest_trainable == max(inner) and units.root == base.root
    plain = planner.zero3_units(config, 2)
    assert plain.trainable == (plain.inner, plain.root, plain.persistent)  # no PEFT: everything trainable


def test_auto_counts_a_peft_model_as_it_is(monkeypatch):
    """--sharded_ddp auto with a PEFT model: the estimate counts its own trainable parameters (the
    adapters), not every parameter of its config."""
    from types import SimpleNamespace

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from trainer_shard.training import plan

    config = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                   decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    probe = planner.Probe(0, 0, 0)
    monkeypatch.setattr(planner, "measure_probes", lambda *a, **k: {"ddp": probe, "sharded": probe})
    counted, estimate = [], planner.estimate
    spy = lambda config, **kw: counted.append(kw["model"]) or estimate(config, **kw)  # noqa: E731
    monkeypatch.setattr(planner, "estimate", spy)
    args = SimpleNamespace(compute_dtype="bf16", bf16=False, fp16=False, device=torch.device("cpu"), world_size=2,
                           per_device_train_batch_size=2)  # fmt: skip
    base = transformers.T5ForConditionalGeneration(config)
    plan._plan_on_rank_zero(args, base, None, 2**30)
    model = get_peft_model(transformers.T5ForConditionalGeneration(config), LoraConfig(task_type="SEQ_2_SEQ_LM", r=4))
    plan._plan_on_rank_zero(args, model, None, 2**30)
    assert counted == [None, model]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert planner.model_counts(model)[1] == trainable < sum(p.numel() for p in base.parameters()) // 10


# ---- --sharded_ddp auto on a real run -------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model(tiny_data, tmp_path_factory):
    """The t5-small architecture (60.5 M parameters): big enough that the state, not the runtime,
    decides the peak."""
    from trainer_shard.demo import build_demo_model

    return build_demo_model(tiny_data, tmp_path_factory.mktemp("small"), d_model=512, d_ff=2048, num_layers=6,
                            num_heads=8, d_kv=64, model_vocab_size=32128)  # fmt: skip


def run_flags(model, data, out, *extra):
    """Two steps: the second runs forward and backward with the optimizer's state in place (the
    first step creates it after its backward), so its peak is the run's."""
    return ["--model_name_or_path", model, "--data_dir", data, "--output_dir", out, *TINY_FLAGS, "--do_train",
            "--max_steps", "2", "--per_device_train_batch_size", "8", "--optim", "adamw_torch_fused", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def auto_run(small_model, tiny_data, tmp_path_factory):
    """`--sharded_ddp auto` within 1.5 GiB a rank, peaks measured: (its output folder, the estimates
    it printed, GiB per rank by (strategy, offload)). It chooses zero_dp_2. (The same run, with
    DDP's and simple's, checks these estimates against the measured peaks: bench/planner_trainer.py.)"""
    folder = tmp_path_factory.mktemp("auto")
    budget = folder / "budget.json"
    budget.write_text(json.dumps({"max_memory": {"cpu": "1.5GiB"}}))
    out = folder / "auto"
    proc = run_script(run_flags(small_model, tiny_data, out, "--sharded_ddp", "auto", "--offload", budget), nproc=2,
                      script=PEAK)  # fmt: skip
    assert_ok(proc)
    assert "--sharded_ddp auto: chose zero_dp_2: the least costly strategy that fits 1.50 GiB" in proc.stdout
    listed = re.search(r"estimates, GiB per rank: ([^)]*)\)", proc.stdout).group(1)
    estimates = {(name, offload or "none"): float(gib)
                 for name, offload, gib in re.findall(r"(\w+)(?: \+ (\w+) offload)? (\d+\.\d+)", listed)}  # fmt: skip
    assert set(estimates) == {(s, o or "none") for s, o in planner.AUTO_ORDER}, listed
    return out, estimates


def measured_peak(out) -> int:
    return max(json.loads(p.read_text())["peak_rss_bytes"] for p in out.glob("peak_rss_rank*.json"))


@pytest.mark.slow
@pytest.mark.multiproc
def test_sharded_ddp_auto_chooses_what_fits_and_trains(small_model, tiny_data, auto_run, tmp_path):
    assert measured_peak(auto_run[0]) <= 1.5 * GiB * (1 + TOLERANCE)  # chose zero_dp_2 within 1.5 GiB: `auto_run`
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"max_memory": {"cpu": "600MiB"}}))
    proc = run_script(run_flags(small_model, tiny_data, tmp_path / "none", "--sharded_ddp", "auto", "--offload", budget),
                      nproc=2)  # fmt: skip
    assert proc.returncode != 0 and "nothing fits 0.59 GiB per rank" in proc.stderr
