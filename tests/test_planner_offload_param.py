"""The planner's `disk_params` row (zero_dp_3 with parameters, gradients and optimizer state on
disk) against what the engine really does, on one process: its disk bytes against the stores'
sizes, its disk traffic a step against the stores' own I/O counters (`DiskStore.stats`), its RAM
against the engine's accounting of what it holds; `--sharded_ddp auto` choosing it only when
nothing else fits, and then training with the parameter store it chose; and the estimate command
showing it. (The other rows: tests/test_planner.py.)"""

import re

import pytest
import torch
from transformers.models.t5.modeling_t5 import T5Block

from trainer_shard import planner
from trainer_shard.offload import OffloadSpec
from trainer_shard.offload.param_store import ParamOffloadSpec
from trainer_shard.offload.store import bytes_needed

ROW = ("zero_dp_3", planner.PARAM_OFFLOAD)
THRESHOLD = 500  # the small T5 below keeps its layer norms and relative attention bias whole
GiB = 2**30


def _config():
    from transformers import T5Config

    # vocab 1001: an odd embedding; 2 encoder and 2 decoder blocks of different sizes
    return T5Config(vocab_size=1001, d_model=64, d_ff=256, num_layers=2, num_heads=4, d_kv=16,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)  # fmt: skip


def _step(model, opt, seed: int) -> None:
    ids = torch.randint(2, 1001, (2, 7), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A bf16 small T5 sharded per T5Block with its parameter (and gradient) shards on disk, as
    auto opens the store (`AUTO_PARAM_OFFLOAD`: buffer_count 5, max_in_cpu 0), AdamW's state on
    disk too, one process; a warm-up step, then one step measured: the stores' sizes and I/O
    counters, and the most of each part the engine held."""
    from transformers import T5ForConditionalGeneration

    from trainer_shard.sharding import ShardedOptimizer, shard_model
    from trainer_shard.sharding.zero3 import Unit

    store = tmp_path_factory.mktemp("offload") / "store"
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(_config()).to(torch.bfloat16)
    spec = ParamOffloadSpec("nvme", nvme_path=str(store), **planner.AUTO_PARAM_OFFLOAD)
    sharded = shard_model(model, units=[T5Block], persistence_threshold=THRESHOLD, param_offload=spec)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=3, lr=1e-3,
                           offload=OffloadSpec("nvme", nvme_path=str(store)))  # fmt: skip
    held = {"buffers": 0, "grad_write": 0}
    gather, write_async = Unit.gather, sharded.store.write_async

    def watched_gather(unit):
        gather(unit)
        now = sharded.held_parameter_bytes()
        held["buffers"] = max(held["buffers"], now["gathered"] + now["pool"])

    def watched_write(name, start, data, in_flight=1):
        held["grad_write"] = max(held["grad_write"], data.numel() * data.element_size())
        return write_async(name, start, data, in_flight)

    Unit.gather, sharded.store.write_async = watched_gather, watched_write
    optimizer_store = opt.stepper.store  # the engine steps chunks on their mapped pages: count them
    store_map, store_unmap = optimizer_store.map, optimizer_store.unmap
    mapped = {"now": 0, "most": 0}

    def watched_map(name, start, numel):
        got = store_map(name, start, numel)
        mapped["now"] += len(got[1])
        mapped["most"] = max(mapped["most"], mapped["now"])
        return got

    def watched_unmap(mapping):
        mapped["now"] -= len(mapping)
        store_unmap(mapping)

    optimizer_store.map, optimizer_store.unmap = watched_map, watched_unmap
    try:
        _step(model, opt, 0)  # the warm-up: the optimizer's state made, the order of the units recorded
        params, optimizer = sharded.store.disk, opt.stepper.store
        before = {"params": dict(params.stats), "optimizer": dict(optimizer.stats)}
        _step(model, opt, 1)
        traffic = {kind: {what: store.stats[f"{what}_bytes"] - before[kind][f"{what}_bytes"]
                          for what in ("read", "write")}
                   for kind, store in (("params", params), ("optimizer", optimizer))}  # fmt: skip
    finally:
        Unit.gather = gather
    engine = opt.stepper
    now = sharded.held_parameter_bytes()
    files = sorted(p for p in store.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
    out = {
        "on_disk": now["on_disk"], "optimizer_store": bytes_needed(optimizer.sizes),
        "files": sum(p.stat().st_size for p in files), "traffic": traffic, "held": held, "now": now,
        "buckets": sharded.reducer.peak_bucket_bytes,
        "engine": mapped["most"] + sum(t.nbytes for chunk in engine._buffers or [] for t in chunk.values())
        + sum(t.nbytes for t in [*engine._grad_buffers.values(), *engine._param_buffers.values()])
        + sum(link.grad32.nbytes for link in engine._links.values() if link.grad32 is not None),
        "persistent_grads": sum(p.grad.numel() * p.grad.element_size() for p in sharded.persistent
                                if p.grad is not None),
    }  # fmt: skip
    opt.close()
    sharded.close()
    return out


def _predicted(precision: str = "bf16") -> tuple:
    """(strategy_bytes, zero3_param_offload_parts, disk_traffic) of the row for the small T5, one rank."""
    units = planner.zero3_units(_config(), 1, persistence_threshold=THRESHOLD)
    total = sum(units.inner) + units.root + units.persistent
    w = 2 if precision == "bf16" else 4
    return (planner.strategy_bytes(*ROW, total, total, 1, precision, units),
            planner.zero3_param_offload_parts(units, 1, w),
            planner.disk_traffic(*ROW, total, 1, precision, units))  # fmt: skip


def test_disk_bytes_are_what_the_stores_hold(measured):
    """Parameter and gradient shards (16-bit) in the parameter store, fp32 masters and moments
    (of the shards and of the persistent parameters) in the optimizer's: exactly, by the stores'
    sizes and by the files on disk."""
    predicted, parts, _ = _predicted()
    assert measured["on_disk"] == parts["param_shards"] + parts["grad_shards"]
    assert measured["optimizer_store"] == parts["optimizer"]
    assert predicted["disk"] == measured["on_disk"] + measured["optimizer_store"] == measured["files"]


def test_disk_traffic_a_step_is_what_the_stores_count(measured):
    """One step after a warm-up, by each store's own I/O counters: the parameter store reads each
    parameter shard twice (forward, backward) but the root's once (gathered from its forward into
    its backward), and the gradients once, writes the gradients and the new parameters; the
    optimizer's store reads and writes its masters and moments once."""
    _, parts, traffic = _predicted()
    got = measured["traffic"]
    root = 2 * planner.zero3_units(_config(), 1, persistence_threshold=THRESHOLD).root  # bf16, one rank
    assert root > 0
    assert got["params"] == {"read": 2 * parts["param_shards"] - root + parts["grad_shards"],
                             "write": parts["grad_shards"] + parts["param_shards"]}  # fmt: skip
    assert got["optimizer"] == {"read": parts["optimizer"], "write": parts["optimizer"]}
    assert traffic == {"read": got["params"]["read"] + got["optimizer"]["read"],
                       "written": got["params"]["write"] + got["optimizer"]["write"]}  # fmt: skip


def test_ram_estimate_bounds_what_the_engine_holds(measured):
    """Part by part, the most the engine held over the steps (gather buffers alive or pooled,
    checked at every gather; reduce buckets; gradient slices written; chunk buffers) is within the
    row's arithmetic, and none of the shards stays in RAM."""
    predicted, parts, _ = _predicted()
    now, held = measured["now"], measured["held"]
    assert now["shards"] == now["grad_shards"] == now["masters"] == 0
    assert 0 < held["buffers"] <= parts["pool"]
    assert 0 < measured["buckets"] <= parts["buckets"]
    assert 0 < 2 * held["grad_write"] <= parts["grad_writes"]
    assert 0 < measured["engine"] <= parts["engine"]
    assert now["persistent"] + measured["persistent_grads"] <= parts["persistent"]
    ram = held["buffers"] + measured["buckets"] + 2 * held["grad_write"] + measured["engine"] + now["persistent"]
    assert ram <= predicted["device"] + predicted["cpu"]
    assert predicted["device"] + predicted["cpu"] == sum(v for k, v in parts.items() if k not in planner.ON_DISK)


def test_traffic_of_the_other_disk_rows_is_their_optimizer_store_and_zero3_gradients():
    units = planner.Units((100, 100, 140), 60, 8, 2)  # 400 sharded elements: 200 a rank
    # zero_dp_3: its bf16 gradient shards (200 elements) written in backward and read at the step, beside the state
    traffic = planner.disk_traffic("zero_dp_3", "disk", 408, 2, "bf16", units)
    assert traffic == {"read": 200 * 12 + 400, "written": 200 * 12 + 400}
    assert planner.disk_traffic("zero_dp_2", "disk", 408, 2, "bf16") == {"read": 204 * 12, "written": 204 * 12}
    assert planner.disk_traffic("zero_dp_2", "cpu", 408, 2, "bf16") == {"read": 0, "written": 0}
    assert planner.disk_traffic("zero_dp_3", None, 408, 2, "bf16", units) == {"read": 0, "written": 0}
    # disk_params at 2 ranks: 16-bit shards of 200 elements (the root's 30 read once), the persistent
    # parameters' 4 elements' state
    assert planner.disk_traffic(*ROW, 408, 2, "bf16", units) == {"read": 3 * 400 - 2 * 30 + 12 * 204,
                                                                  "written": 2 * 400 + 12 * 204}  # fmt: skip
    with pytest.raises(ValueError, match="disk_params offloads zero_dp_3's parameters, not zero_dp_2's"):
        planner.strategy_bytes("zero_dp_2", planner.PARAM_OFFLOAD, 408, 408, 2, "bf16")


# ---- --sharded_ddp auto -------------------------------------------------------------------------


def _rows(model: str, world_size: int = 2):
    probe = planner.Probe(runtime=0, act_base=0, act_per_sample=0)
    return planner.estimate(planner.model_config(model), world_size=world_size, precision="bf16", batch_size=8,
                            source_length=32, target_length=32, probes={"ddp": probe, "sharded": probe})  # fmt: skip


def test_auto_takes_disk_params_only_when_nothing_else_fits():
    assert planner.AUTO_ORDER[-1] == ROW and ROW in planner.STRATEGIES
    for model in ("t5-small", "t5-3b"):  # t5-small: the row's chunk buffers outweigh its shards
        rows = _rows(model)
        per_rank = {(r["strategy"], r["offload"]): r["per_rank"] for r in rows}
        others = [per_rank[(s, o or "none")] for s, o in planner.AUTO_ORDER if (s, o) != ROW]
        for budget in sorted({*per_rank.values(), *(v - 1 for v in per_rank.values())}):
            choice = planner.choose(rows, budget)
            chose_row = choice is not None and (choice["strategy"], choice["offload"]) == ROW
            assert chose_row == (min(others) > budget >= per_rank[ROW]), (model, budget)
    assert per_rank[ROW] < min(others)  # t5-3b at 2 ranks: the row is the smallest
    big = {(r["strategy"], r["offload"]): r for r in rows}
    # its 16-bit parameter shards (2 bytes x 2.85 B / 2 ranks: 2.66 GiB) off RAM, less its buffers
    # beyond the disk row's gather pool (the disk row's gradient shards are on disk too: [Note:
    # gradient store])
    assert big[ROW]["per_rank"] < big[("zero_dp_3", "disk")]["per_rank"] - 2.1 * GiB
    assert big[ROW]["disk_per_node"] > big[("zero_dp_3", "disk")]["disk_per_node"]
    assert "zero_dp_3 + disk_params offload" in planner.explain(list(big.values()), big[ROW], big[ROW]["per_rank"])


def test_auto_hands_disk_params_on_as_both_stores(monkeypatch, tmp_path):
    """`choose_strategy` turns the row into stage 3, the optimizer's store on disk and the parameter
    store beside it, as the row assumes: buffer_count 5, nothing kept in RAM."""
    from types import SimpleNamespace

    from trainer_shard.training import plan

    monkeypatch.setattr(planner, "measure_probes", lambda *args, **kwargs: {})
    monkeypatch.setattr(planner, "estimate", lambda config, **kwargs: [])
    monkeypatch.setattr(planner, "explain", lambda rows, choice, budget: "fits")
    monkeypatch.setattr(planner, "choose", lambda rows, budget: {"strategy": ROW[0], "offload": ROW[1]})
    args = SimpleNamespace(process_index=0, device=torch.device("cpu"), world_size=1, bf16=True, fp16=False,
                           per_device_train_batch_size=2, output_dir=str(tmp_path))  # fmt: skip
    model = torch.nn.Linear(1000, 200_000, bias=False, device="meta")  # 2e8 elements: over buffer_size's default
    model.config = SimpleNamespace(save_pretrained=lambda folder: None)
    stage, spec, params = plan.choose_strategy(args, model, None, None)
    store = str(tmp_path / "offload_store")
    assert stage == 3 and spec == OffloadSpec("nvme", nvme_path=store)
    assert params == ParamOffloadSpec("nvme", nvme_path=store, buffer_count=5, max_in_cpu=0, buffer_size=200_000_000)
    monkeypatch.setattr(planner, "choose", lambda rows, budget: {"strategy": "zero_dp_3", "offload": "disk"})
    assert plan.choose_strategy(args, model, None, None)[2] is None


@pytest.fixture(scope="module")
def sharded_model_dir(tiny_data, tmp_path_factory):
    """A tiny T5 whose feed-forward weights (32 x 4096) are over the default persistence threshold:
    zero_dp_3 shards them, so the parameter store has files."""
    from trainer_shard.demo import build_demo_model

    return build_demo_model(tiny_data, tmp_path_factory.mktemp("model"), vocab_size=300, d_model=32, d_ff=4096,
                            num_layers=1, num_heads=2, d_kv=16)  # fmt: skip


def test_auto_choosing_disk_params_trains_with_parameters_on_disk(sharded_model_dir, tiny_data, tmp_path, monkeypatch):
    """`--sharded_ddp auto` choosing the row (the choice forced: on a model this small it never fits
    first) trains in the Trainer with the parameter and gradient shards in files under
    --output_dir/offload_store, none in RAM, the loss finite; the files go when the stores close."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, TrainerCallback

    from trainer_shard import ShardedSeq2SeqTrainer, ShardedSeq2SeqTrainingArguments
    from trainer_shard.data import TokenizedSeq2SeqDataset, read_split

    probe = planner.Probe(runtime=0, act_base=0, act_per_sample=0)
    monkeypatch.setattr(planner, "measure_probes", lambda *args, **kwargs: {"ddp": probe, "sharded": probe})
    monkeypatch.setattr(planner, "choose",
                        lambda rows, budget: next(r for r in rows if (r["strategy"], r["offload"]) == ROW))
    tokenizer = AutoTokenizer.from_pretrained(sharded_model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(sharded_model_dir)
    dataset = TokenizedSeq2SeqDataset(read_split(tiny_data, "train", n_obs=16), tokenizer, max_source_length=32,
                                      max_target_length=32, prefix="t: ")  # fmt: skip
    out = tmp_path / "out"
    args = ShardedSeq2SeqTrainingArguments(output_dir=str(out), use_cpu=True, report_to="none", save_strategy="no",
                                           sharded_ddp="auto", max_steps=2, per_device_train_batch_size=4,
                                           logging_steps=1, disable_tqdm=True)  # fmt: skip
    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(trainer.sharded_model.held_parameter_bytes())

    trainer = ShardedSeq2SeqTrainer(model=model, args=args, train_dataset=dataset, callbacks=[Watch()],
                                    data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))  # fmt: skip
    store = out / "offload_store"
    assert trainer.sharding_stage == 3 and trainer.offload_spec == OffloadSpec("nvme", nvme_path=str(store))
    assert trainer.param_offload_spec.folder == store / "zero3_params" and trainer.param_offload_spec.max_in_cpu == 0
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(seen) == 2 and len(losses) == 2 and all(loss == loss for loss in losses)
    sharded = sum(u.numel for u in trainer.sharded_model.units)
    for held in seen:  # 32 x 4096 fp32 weights: their shards and gradients in files, not in RAM
        assert held["shards"] == held["grad_shards"] == 0 and held["on_disk"] >= 2 * 4 * sharded > 0, held
    assert any((store / "zero3_params" / "rank0").iterdir())
    getattr(trainer.optimizer, "optimizer", trainer.optimizer).close()  # accelerate's wrapper: the ShardedOptimizer
    trainer.sharded_model.close()
    assert not [p for p in store.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


# ---- trainer-shard estimate ---------------------------------------------------------------------


def test_estimate_command_shows_the_row_and_its_disk_traffic(capsys):
    assert planner.estimate_main(["--model", "t5-small", "--world_size", "2", "--precision", "bf16", "--no_probe",
                                  "--max_memory", "4GiB", "--batch_size", "2"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "| disk read / written a step per node (GiB) |" in printed
    line = re.search(r"^\| zero_dp_3 \| disk_params \|.*$", printed, re.M).group(0)
    cells = [c.strip() for c in line.strip("|").split("|")]
    read, written = (float(x) for x in cells[5].split(" / "))
    units = planner.zero3_units(planner.model_config("t5-small"), 2)
    traffic = planner.disk_traffic(*ROW, 60_506_624, 2, "bf16", units)
    assert (read, written) == (round(2 * traffic["read"] / GiB, 2), round(2 * traffic["written"] / GiB, 2))
    assert cells[6] == "yes" and "disk_params: parameter, gradient and optimizer shards in files" in printed
    assert "| zero_dp_2 | disk |" in printed and "| zero_dp_2 | none |" in printed
    assert re.search(r"^\| zero_dp_2 \| none \| [\d.]+ \| [\d.]+ \| 0\.00 \| - \| yes \|$", printed, re.M)
