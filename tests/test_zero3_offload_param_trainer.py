"""ZeRO-3 parameter offload through the Trainer: `--sharded_ddp "zero_dp_3 offload"` with a config
whose `offload_param` says where the parameters go. One 2-rank launch against plain DDP (the
parameter and gradient shards in files, the optimizer state too, all deleted at the end); the
bad inputs are refused when the arguments are parsed or the Trainer is built, before anything
is written, with no launch. (The engine itself, against plain AdamW on 1 and 2 ranks, cpu and
nvme: tests/test_zero3_offload_param.py.)"""

import json
import multiprocessing
import shutil
from collections import namedtuple

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from conftest import assert_ok, run_script
from test_sharded_trainer import DUMP, ddp_run, train_flags  # noqa: F401 (ddp_run: the DDP reference fixture)
from test_zero3_trainer import assert_matches
from trainer_shard import ArgumentError, OffloadSpec, OffloadStoreError, ShardedSeq2SeqTrainer
from trainer_shard import ShardedSeq2SeqTrainingArguments
from trainer_shard.offload.param_store import PARAM_FOLDER, ParamOffloadSpec
from trainer_shard.offload.store import DiskStore


def offload_config(folder, optimizer=True, **param) -> str:
    """Stage 3, every parameter of the tiny model sharded (threshold 0), parameters and gradients
    on disk under `folder`/store (none kept in RAM: max_in_cpu 0), the optimizer's state there too
    (or, with `optimizer` False, no offload_optimizer section)."""
    store = str(folder / "store")
    param = {"device": "nvme", "nvme_path": store, "max_in_cpu": 0, "buffer_count": 3, **param}
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": param}
    if optimizer:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": store}
    path = folder / "zero3_offload_param.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return str(path)


def files_under(folder) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.mark.slow
@pytest.mark.multiproc
def test_matches_ddp_with_parameters_gradients_and_optimizer_on_disk(ddp_run, tiny_model, tiny_data, tmp_path):
    """One unit per T5Block (implied by offload_param), every shard in the stores' files: the final fp32 weights
    within 1e-6 of DDP's, the logged loss and grad norm as DDP's, model.safetensors streamed from
    the stores; the model built on the meta device and read into the store a tensor at a time;
    and nothing of the stores left on disk."""
    out = tmp_path / "out"
    extra = ["--sharded_ddp", "zero_dp_3 offload", "--offload", offload_config(tmp_path), "--log_level", "info"]
    proc = run_script(train_flags(tiny_model, tiny_data, out, *extra), nproc=2, script=DUMP)
    assert_ok(proc)
    assert "built on the meta device; its weights were read from" in proc.stdout + proc.stderr  # never whole
    held = assert_matches(out, ddp_run, 2)
    assert held["shards"] == held["grad_shards"] == held["persistent"] == 0 and held["on_disk"] > 0, held
    assert files_under(tmp_path / "store") == []


# ---- refused before anything is written: no launch -------------------------------------------


def args_for(tmp_path, config, sharded_ddp="zero_dp_3 auto_wrap offload"):
    return ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                                           sharded_ddp=sharded_ddp, offload=config)  # fmt: skip


def test_without_the_optimizer_offloaded_the_config_is_refused_at_start(tmp_path):
    config = offload_config(tmp_path, optimizer=False)
    with pytest.raises(ArgumentError) as raised:
        args_for(tmp_path, config, sharded_ddp="zero_dp_3 auto_wrap")
    text = str(raised.value)
    assert "$.zero_optimization.offload_param.device: puts the parameter shards in files, but the optimizer is not " \
           "offloaded: its fp32 master weights and moments" in text
    assert 'set zero_optimization.offload_optimizer.device to "cpu" or "nvme"' in text
    assert 'or add offload to --sharded_ddp ("zero_dp_3 offload"' in text
    assert not (tmp_path / "store").exists() and not (tmp_path / "out").exists()


def test_the_offload_flag_puts_the_optimizer_state_in_cpu_ram(tiny_model, tmp_path):
    """`zero_dp_3 offload` with a config that names no offload_optimizer: the optimizer state in
    CPU RAM (the flag's offload), the parameters where the config says; the model's shards go
    to their files when the optimizer is built and are deleted when it closes."""
    args = args_for(tmp_path, offload_config(tmp_path, optimizer=False))
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    trainer = ShardedSeq2SeqTrainer(model=model, args=args)
    assert trainer.sharding_stage == 3 and trainer.offload_spec == OffloadSpec("cpu")
    assert trainer.param_offload_spec == ParamOffloadSpec("nvme", nvme_path=str(tmp_path / "store"), buffer_count=3,
                                                          max_in_cpu=0)  # fmt: skip
    assert not (tmp_path / "store").exists()  # nothing written until the optimizer is built
    optimizer = trainer.create_optimizer()
    try:
        assert trainer.sharded_model.store is not None
        files = files_under(tmp_path / "store")
        assert f"{PARAM_FOLDER}/rank0/0.param.f32" in files and f"{PARAM_FOLDER}/rank0/0.grad.f32" in files, files
    finally:
        optimizer.close()
        trainer.sharded_model.close()
    assert files_under(tmp_path / "store") == []


def test_not_enough_disk_for_both_stores_is_refused_with_the_bytes(tiny_model, tmp_path, monkeypatch):
    """Each store alone would fit; together on one disk they do not: refused when the Trainer is
    built, naming both stores' bytes and the room free, and nothing made."""
    args = args_for(tmp_path, offload_config(tmp_path))
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    sharded = sum(p.numel() for p in model.parameters())  # threshold 0: every parameter sharded
    params = 2 * 4 * sharded  # one rank: fp32 parameter shard + gradient shard, none kept in RAM
    optimizer = 4 * 3 * sharded  # fp32 master + AdamW's two moments
    free = max(params, optimizer) + 1
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, free) if str(p).startswith(str(tmp_path))
                        else real(p))  # fmt: skip
    with pytest.raises(OffloadStoreError) as raised:
        ShardedSeq2SeqTrainer(model=model, args=args)
    text = str(raised.value)
    assert text.startswith("not enough disk for parameters, gradients and optimizer state: rank 0's parameter and "
                           f"gradient shards need {params:,} bytes in '{tmp_path}/store/{PARAM_FOLDER}/rank0' and its "
                           f"optimizer state (fp32 master weights and moments) {optimizer:,} bytes in "
                           f"'{tmp_path}/store/rank0', on the same disk: {params + optimizer:,} bytes in all, but only "
                           f"{free:,} are free"), text  # fmt: skip
    assert "offload_param.max_in_cpu" in text
    assert not (tmp_path / "store").exists()


def _hold(folder, ready, release):
    """Another run's parameter store: open, written, held until `release`."""
    store = DiskStore({"0.param": (1000, torch.bfloat16)}, folder)
    store.write("0.param", 0, torch.ones(1000, dtype=torch.bfloat16))
    ready.set()
    release.wait(60)
    store.close()


def test_a_parameter_store_in_use_by_another_run_is_refused(tiny_model, tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold, args=(tmp_path / "store" / PARAM_FOLDER, ready, release), daemon=True)
    other.start()
    try:
        assert ready.wait(30), "the other run did not open its store"
        held = tmp_path / "store" / PARAM_FOLDER / "rank0" / "0.param.bf16"
        written = held.read_bytes()
        args = args_for(tmp_path, offload_config(tmp_path))
        with pytest.raises(OffloadStoreError) as raised:
            ShardedSeq2SeqTrainer(model=AutoModelForSeq2SeqLM.from_pretrained(tiny_model), args=args)
        text = str(raised.value)
        assert f"the parameter store folder '{held.parent}' is in use by another run: process {other.pid}" in text
        assert "zero_optimization.offload_param.nvme_path in the --offload config" in text
        assert held.read_bytes() == written  # the other run's shards untouched
        assert not (tmp_path / "store" / "rank0").exists()  # nor anything of this run's optimizer store made
    finally:
        release.set()
        other.join(30)
        if other.is_alive():
            other.kill()
    assert other.exitcode == 0 and files_under(tmp_path / "store") == []


def test_a_meta_built_fp32_model_trains_in_bf16(tiny_model, tmp_path):
    """A user's own `load_meta` in fp32 with --bf16: the Trainer shards it at its start, then the
    optimizer's cast to bf16 raised (a sharded parameter's dtype cannot change); now the model is
    cast on the meta device before it is sharded, so its shards and store are bf16 from the start
    and the cast is a no-op."""
    from transformers import AutoConfig

    from trainer_shard.loading import load_meta

    config = offload_config(tmp_path)
    args = ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", bf16=True,
                                           sharded_ddp="zero_dp_3 auto_wrap offload", offload=config)  # fmt: skip
    model = load_meta(AutoModelForSeq2SeqLM, tiny_model, AutoConfig.from_pretrained(tiny_model), torch.float32)
    trainer = ShardedSeq2SeqTrainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    try:
        assert {part.dtype for part in trainer.sharded_model.parts} == {torch.bfloat16}
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    finally:
        optimizer.close()
        trainer.sharded_model.close()
