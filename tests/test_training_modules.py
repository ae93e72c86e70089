"""The concerns of the Trainer mixin, each tested without building a Trainer: the distributed
guard, the run's plan and its size estimates, the optimizer it builds, staged checkpoint saves,
and fault supervision. The references are independent: the bytes a real save writes, the errors
a real disk gives, torch's own optimizers."""

import copy
import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (AutoModelForSeq2SeqLM, PretrainedConfig, PreTrainedModel, T5Config, TrainerControl, TrainerState,
                          TrainingArguments)
from transformers.training_args import ParallelMode

from test_sharded_optimizer import make_model
from trainer_shard import ArgumentError, DistributedSetupError, OffloadSpec, OffloadStoreError, ShardedTrainer
from trainer_shard.checkpoint import MANIFEST, STAGING, manifest_problems, save_model
from trainer_shard.disk import format_bytes
from trainer_shard.offload.param_store import ParamOffloadSpec
from trainer_shard.errors import CheckpointError, ConfigError
from trainer_shard.sharding import ShardedOptimizer, state_io
from trainer_shard.config import apply as config_apply
from trainer_shard.config import load_config
from trainer_shard.constants import BUCKET_NUMEL
from trainer_shard.training import build, checkpoints, guard, plan, supervision


# ---- guard ------------------------------------------------------------------------------------


def test_guard_refuses_ranks_the_trainer_did_not_join(monkeypatch):
    args = SimpleNamespace(distributed_state=None, parallel_mode=ParallelMode.NOT_DISTRIBUTED, device="cpu",
                           world_size=1)  # fmt: skip
    guard.check_distributed_setup(args)  # one process: nothing to join
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedSetupError, match="WORLD_SIZE=2 processes were launched.*--use_cpu"):
        guard.check_distributed_setup(args)


# ---- plan -------------------------------------------------------------------------------------


def test_state_tensors_count_what_the_optimizer_keeps_per_element():
    assert plan.state_tensors(torch.optim.AdamW, {"lr": 1e-3, "params": []}) == 2
    assert plan.state_tensors(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}) == 1
    assert plan.state_tensors(lambda params: None, {}) is None  # a factory: known once built


def test_checkpoint_bytes_match_what_a_sharded_save_writes(tiny_model, tmp_path):
    """The estimate that the room checks and the failure messages quote, against the files a
    checkpoint of the same model and optimizer really holds (safetensors headers aside)."""
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-3)
    model(input_ids=torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 3, dtype=torch.long)).loss.backward()
    opt.step()
    weights = save_model(model, tmp_path / "ckpt")
    shards = state_io.save_shards(opt, tmp_path / "ckpt" / state_io.FOLDER, state_io.param_names(model))
    written = sum(f["bytes"] for f in {**weights, **shards}.values())
    estimate = plan.checkpoint_bytes(model, sharded=True, states=2)
    assert 0.98 * written <= estimate <= written
    assert plan.checkpoint_bytes(model, sharded=True, states=2, with_optimizer=False) <= sum(
        f["bytes"] for f in weights.values())  # fmt: skip


def test_disk_room_is_checked_before_training(tmp_path, monkeypatch):
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    spec = OffloadSpec("nvme", nvme_path=str(tmp_path))
    needed = 4 * 3 * -(-numel // 2)  # fp32 master + AdamW's two moments, half the model on each of 2 ranks
    monkeypatch.setattr("shutil.disk_usage", lambda p: SimpleNamespace(total=1 << 40, used=0, free=needed - 1))
    with pytest.raises(OffloadStoreError, match=f"needs {needed:,} bytes"):
        plan.check_disk_room(spec, model, 2, rank=0, world_size=2)
    monkeypatch.setattr("shutil.disk_usage", lambda p: SimpleNamespace(total=1 << 40, used=0, free=needed))
    plan.check_disk_room(spec, model, 2, rank=0, world_size=2)
    plan.check_disk_room(OffloadSpec("cpu"), model, 2, rank=0, world_size=2)  # nothing on disk


def test_disk_room_at_stage_3_counts_the_gradient_shards_beside_the_optimizer(tmp_path, monkeypatch):
    """[Note: gradient store]: ZeRO-3 with the optimizer on disk writes its gradient shards there too,
    in the gradients' dtype (fp32; bf16 with --bf16); not with the parameter store on disk (it holds
    them), nor at stage 2."""
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    spec = OffloadSpec("nvme", nvme_path=str(tmp_path))
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    config = load_config(path)
    fp32, bf16 = SimpleNamespace(bf16=False, fp16=False), SimpleNamespace(bf16=True, fp16=False)
    grads = plan.grad_store_bytes(3, spec, None, model, 2, fp32, config)
    assert grads == 4 * -(-numel // 2) and plan.grad_store_bytes(3, spec, None, model, 2, bf16, config) == grads // 2
    assert plan.grad_store_bytes(2, spec, None, model, 2, fp32, config) == 0
    assert plan.grad_store_bytes(3, OffloadSpec("cpu"), None, model, 2, fp32, config) == 0
    params = ParamOffloadSpec("nvme", nvme_path=str(tmp_path))  # the parameter store holds them
    assert plan.grad_store_bytes(3, spec, params, model, 2, fp32, config) == 0
    needed = 4 * 3 * -(-numel // 2) + grads
    monkeypatch.setattr("shutil.disk_usage", lambda p: SimpleNamespace(total=1 << 40, used=0, free=needed - 1))
    with pytest.raises(OffloadStoreError, match=f"needs {needed:,} bytes.*and the gradient shards do not fit"):
        plan.check_disk_room(spec, model, 2, rank=0, world_size=2, grad_bytes=grads)
    monkeypatch.setattr("shutil.disk_usage", lambda p: SimpleNamespace(total=1 << 40, used=0, free=needed))
    plan.check_disk_room(spec, model, 2, rank=0, world_size=2, grad_bytes=grads)


# ---- build ------------------------------------------------------------------------------------


def test_wrap_builds_what_the_flags_and_config_ask_for(tmp_path):
    model = make_model()
    args = SimpleNamespace(fp16=True, bf16=False)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({
        "zero_optimization": {"stage": 2, "overlap_comm": False, "reduce_bucket_size": 123, "allgather_bucket_size": 456},
        "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32",
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 10, "hysteresis": 3,
                 "consecutive_hysteresis": True},
    }))  # fmt: skip
    config = load_config(path)
    opt = build.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), 2, None, args, config)
    assert isinstance(opt, ShardedOptimizer) and opt.stage == 2 and opt.optim_class is torch.optim.AdamW
    scaler = opt.loss_scaler
    assert scaler.scale == 2.0**8 and scaler.growth_interval == 10 and scaler.hysteresis == 3
    assert scaler.consecutive_hysteresis and scaler.raise_error_at_min_scale  # as DeepSpeed's, from a config
    assert opt.bucket_numel == 123 and opt.reducer.reduce_dtype is torch.float32 and not opt.reducer.overlap
    assert build.bucket_numel(config, 2) == 123 and build.bucket_numel(config, 1) == 456
    build.check_adoptable(opt, 2, None, args)
    with pytest.raises(ArgumentError, match="asks for ZeRO-1 but the trainer was given ShardedOptimizer at stage 2"):
        build.check_adoptable(opt, 1, None, args)
    with pytest.raises(ArgumentError, match="asks for ZeRO-2 but the trainer was given AdamW"):
        build.check_adoptable(torch.optim.AdamW(model.parameters()), 2, None, args)
    opt.close()


def test_auto_bucket_sizes_come_from_the_hidden_size(tmp_path):
    """As the Hugging Face DeepSpeed integration fills them: h*h, 0.9*h*h, 10*h (T5: h = d_model)."""
    t5 = SimpleNamespace(config=T5Config(d_model=48, d_ff=64, num_layers=1, num_heads=2, d_kv=8, vocab_size=50))
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                                      "allgather_bucket_size": "auto"}}))  # fmt: skip
    config = load_config(path)
    assert build.bucket_numel(config, 2, t5) == 48 * 48 == build.bucket_numel(config, 1, t5)
    stage3 = SimpleNamespace(raw={"zero_optimization": {"stage3_prefetch_bucket_size": "auto",
                                                        "stage3_param_persistence_threshold": "auto"}})  # fmt: skip
    sizes = config_apply.hidden_size_fills(stage3, t5)
    assert sizes["stage3_prefetch_bucket_size"] == int(0.9 * 48 * 48) and sizes["stage3_param_persistence_threshold"] == 480
    with pytest.raises(ConfigError, match="neither hidden_size nor hidden_sizes; write a number"):
        build.bucket_numel(config, 2, make_model())
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))  # left out: the default, with no model needed
    assert build.bucket_numel(load_config(path), 2) == BUCKET_NUMEL


def test_mixed_precision_casts_the_parameters_to_16_bits():
    model = make_model()
    build.cast_for_mixed_precision(model, SimpleNamespace(bf16=True, fp16=False))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    build.cast_for_mixed_precision(model, SimpleNamespace(bf16=False, fp16=False))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # fp32 runs leave them be


# ---- checkpoints ------------------------------------------------------------------------------


def _args(output_dir, limit=None):
    return SimpleNamespace(should_save=True, save_total_limit=limit, output_dir=str(output_dir))


def _save(run_dir, step, *, error=None, last=None, limit=None):
    save = checkpoints.StagedSave(str(run_dir), step, _args(run_dir, limit), lambda: 12345, last)
    save.begin()
    os.makedirs(save.staging)
    Path(save.staging, "model.safetensors").write_bytes(b"x" * (100 + step))
    if error is not None:
        save.record(error)
    save.gather()
    return save, save.publish(TrainerState())


def test_a_staged_save_is_published_whole_with_its_manifest_and_rotated(tmp_path):
    _, first = _save(tmp_path, 1)
    save, second = _save(tmp_path, 2, limit=1)
    assert second == str(tmp_path / "checkpoint-2") and save.final == second
    assert Path(second, MANIFEST).is_file() and manifest_problems(second) == []
    assert Path(second, "model.safetensors").stat().st_size == 102
    assert not Path(first).exists()  # rotated out by save_total_limit=1
    assert not (tmp_path / STAGING / "checkpoint-2").exists()


def test_a_failed_save_removes_what_it_wrote_and_keeps_the_last_checkpoint(tmp_path):
    _, first = _save(tmp_path, 1)
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / STAGING / "checkpoint-2" / "x"))
    with pytest.raises(CheckpointError) as raised:
        _save(tmp_path, 2, error=full, last=first)
    text = str(raised.value)
    assert "checkpoint-2 was not saved: rank 0: No space left on device" in text
    assert f"{first} (the last complete checkpoint) is untouched" in text
    assert f"takes about {format_bytes(12345)}" in text  # the size the trainer said
    assert not (tmp_path / STAGING).exists() and not (tmp_path / "checkpoint-2").exists()
    assert manifest_problems(first) == [] and Path(first, "model.safetensors").stat().st_size == 101


def test_a_save_reraises_what_is_not_a_write_error(tmp_path):
    save = checkpoints.StagedSave(str(tmp_path), 1, _args(tmp_path), lambda: 0)
    oom = RuntimeError("CUDA out of memory")
    with pytest.raises(RuntimeError) as raised:
        save.record(oom)
    assert raised.value is oom and save.failure is None
    save.record(RuntimeError("[enforce fail at inline_container.cc] . unexpected pos 64 vs 0"))
    assert save.failure and "torch.save could not write" in save.failure


def test_a_checkpoint_without_optimizer_state_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="holds no optimizer state.*--save_only_model"):
        checkpoints.has_optimizer_shards(tmp_path)
    (tmp_path / state_io.FOLDER).mkdir()
    assert checkpoints.has_optimizer_shards(tmp_path)


# ---- supervision ------------------------------------------------------------------------------


def test_an_agreed_signal_stops_after_the_step_and_saves_under_save_on_interrupt():
    supervisor = supervision.Supervisor()
    args = SimpleNamespace(save_on_interrupt=True)
    callback, state, control = supervisor.callback(args), TrainerState(), TrainerControl()
    with supervisor.running(timeout=60):
        callback.on_step_end(args, state, control)
        assert not control.should_training_stop
        supervisor.interrupt.signum = 15  # as the SIGTERM handler sets it
        callback.on_step_end(args, state, control)
    assert control.should_training_stop and control.should_save
    with pytest.raises(Exception, match="SIGTERM") as raised:
        supervisor.raise_if_interrupted(7, "out/checkpoint-7")
    assert type(raised.value).__name__ == "TrainingInterrupted"


def test_supervision_lets_errors_through_on_one_process():
    supervisor = supervision.Supervisor()
    with pytest.raises(ValueError, match="boom"):
        with supervisor.running(timeout=60):
            raise ValueError("boom")
    supervisor.raise_if_interrupted(0, None)  # no signal: nothing raised


# ---- loss normalization -------------------------------------------------------------------------


class _TinyConfig(PretrainedConfig):
    model_type = "trainer-shard-tiny-loss"


class _Tiny(PreTrainedModel):
    config_class = _TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.loss_type = "ForMaskedLM"  # no label shift: every label counts
        self.lin = torch.nn.Linear(4, 3)

    def _init_weights(self, module):
        pass


class MeanLoss(_Tiny):
    """A per-batch mean, in a forward whose text names loss_function (the old test read the text)."""

    def forward(self, x, labels=None, **kwargs):
        logits = self.lin(x)  # not self.loss_function: a plain mean over this micro-batch
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


class CountedLoss(_Tiny):
    """Divides by num_items_in_batch, through a helper: forward's own text names neither."""

    def forward(self, x, labels=None, **kwargs):
        logits = self.lin(x)
        return {"loss": self._loss(logits, labels, **kwargs), "logits": logits}

    def _loss(self, logits, labels, **kwargs):
        return self.loss_function(logits, labels, vocab_size=3, **kwargs)


class _InOrder(ShardedTrainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def _cross_entropy(model, batch, reduction="mean"):
    logits = model.lin(batch["x"])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction=reduction)


@pytest.mark.parametrize("model_class", [MeanLoss, CountedLoss])
def test_gradient_accumulation_averages_what_each_model_computes(model_class, tmp_path):
    """Two micro-batches a step, of 4 and 2 labelled tokens: the weights equal a plain loop's on
    what the model's loss means (a token mean over the step for CountedLoss, the mean of the
    micro-batches' means for MeanLoss), told by what the model does, not by its source text."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    full = {"x": x, "labels": torch.tensor([0, 2])}
    half = {"x": x, "labels": torch.tensor([1, -100])}
    model = model_class(_TinyConfig())
    reference, initial = copy.deepcopy(model), model.lin.weight.detach().clone()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                             optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=0.0, remove_unused_columns=False, disable_tqdm=True)  # fmt: skip
    _InOrder(model=model, args=args, train_dataset=[full, full, half, half] * 4).train()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    micro = [{k: torch.stack([v, v]) for k, v in sample.items()} for sample in (full, half)]
    for _ in range(3):
        if model_class is CountedLoss:
            loss = sum(_cross_entropy(reference, b, "sum") for b in micro) / 6  # 6 labelled tokens a step
        else:
            loss = sum(_cross_entropy(reference, b) for b in micro) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        assert reference.lin.weight.sub(initial).abs().max() > 0.1  # the steps moved the weights
        assert torch.allclose(model.lin.weight, reference.lin.weight, rtol=1e-5, atol=1e-6)


# ---- --sharded_ddp auto on several ranks ------------------------------------------------------


def _auto_on_rank(rank, world_size, init_file, out):
    """choose_strategy twice on a 2-rank gloo group whose collectives time out after 2 s; rank 0's
    probe takes 4 s, then succeeds, then fails. Writes what each rank got each time."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from trainer_shard import planner

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=2))  # fmt: skip
    calls = []

    def probes(*args, **kwargs):
        time.sleep(4)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the memory probe failed:\nKilled")
        return {}

    planner.measure_probes, planner.detect_budget = probes, lambda device: 10**12
    planner.estimate = lambda config, **kwargs: []
    planner.choose = lambda rows, budget: {"strategy": "zero_dp_2", "offload": "cpu"}
    planner.explain = lambda rows, choice, budget: "zero_dp_2 + cpu offload fits"
    args = SimpleNamespace(process_index=rank, device=torch.device("cpu"), world_size=world_size, bf16=False,
                           fp16=False, per_device_train_batch_size=2, output_dir=out)  # fmt: skip
    model = SimpleNamespace(config=SimpleNamespace(save_pretrained=lambda folder: None))
    for attempt in ("slow", "fails"):
        try:
            got = repr(plan.choose_strategy(args, model, None, None))
        except Exception as e:
            got = f"{type(e).__name__}: {e}"
        Path(out, f"{attempt}{rank}").write_text(got)
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_sharded_ddp_auto_waits_for_the_probe_and_shares_its_failure(tmp_path):
    """Rank 0's probe outlasts the group's timeout: rank 1 waits for it; it fails: every rank
    raises the same error, naming the probe's."""
    import torch.multiprocessing as mp

    mp.start_processes(_auto_on_rank, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    slow, fails = ([(tmp_path / f"{attempt}{r}").read_text() for r in range(2)] for attempt in ("slow", "fails"))
    assert slow == [repr((2, OffloadSpec("cpu"), None))] * 2
    assert fails[0] == fails[1], fails
    assert fails[0].startswith("TrainerShardError: --sharded_ddp auto: the memory probe on rank 0 failed") and (
        "Killed" in fails[0])  # fmt: skip
