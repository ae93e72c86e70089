"""--offload through finetune_trainer.py: the same weights as without offload, 1 and 2 processes."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, assert_ok, run_script
from test_sharded_trainer import DUMP, ddp_run, log, plain_run, train_flags  # noqa: F401 (ddp_run, plain_run: fixtures)

pytestmark = [pytest.mark.slow]


def offload_config(tmp_path, device, **zero):
    section = {"device": device, **({"nvme_path": str(tmp_path / "store")} if device == "nvme" else {})}
    data = {"zero_optimization": {"offload_optimizer": section, **zero}, "gradient_clipping": "auto"}
    path = tmp_path / f"{device}.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_one_process_offload_matches_plain_fp32(plain_run, tiny_model, tiny_data, tmp_path, device):
    """6 steps, accumulation 2, clipping at 0.3, weight decay: within 1e-6 of the plain Trainer."""
    out = tmp_path / "out"
    flags = train_flags(tiny_model, tiny_data, out, "--use_cpu", "--offload", offload_config(tmp_path, device), "--log_level", "info")
    proc = run_script(flags)
    assert_ok(proc)
    assert "offload=" + device in proc.stdout  # the ShardedOptimizer that ran says where its state was
    reference, ours = load_file(plain_run / "model.safetensors"), load_file(out / "model.safetensors")
    worst = max((ours[k] - reference[k]).abs().max().item() for k in reference)
    assert worst <= 1e-6, worst
    for (loss, norm), (ref_loss, ref_norm) in zip(log(out), log(plain_run), strict=True):
        assert loss == pytest.approx(ref_loss, abs=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
    assert not (tmp_path / "store").exists()  # the disk store is gone at the end of the run


@pytest.mark.multiproc
@pytest.mark.parametrize("option,device", [("zero_dp_2", "cpu"), ("simple", "nvme")])
def test_two_ranks_offload_matches_ddp_fp32(ddp_run, tiny_model, tiny_data, tmp_path, option, device):
    """The same 2-rank run as plain DDP (accumulation, clipping): weights within 1e-6."""
    out = tmp_path / "out"
    flags = train_flags(tiny_model, tiny_data, out, "--sharded_ddp", option, "--offload", offload_config(tmp_path, device))
    assert_ok(run_script(flags, nproc=2, script=DUMP))
    rank0, rank1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), "ranks diverged"
    reference = torch.load(ddp_run / "rank0.pt")
    worst = max((rank0[k] - reference[k]).abs().max().item() for k in reference)
    assert worst <= 1e-6, worst
    assert not (tmp_path / "store").exists()


def test_config_scheduler_and_optimizer_take_effect(tiny_model, tiny_data, tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.5}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": "auto",
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}},
    }))  # fmt: skip
    out = tmp_path / "out"
    flags = train_flags(tiny_model, tiny_data, out, "--use_cpu", "--offload", str(config), "--logging_steps", "1",
                        "--learning_rate", "0.1", "--warmup_steps", "4", "--log_level", "info")  # fmt: skip
    proc = run_script(flags)
    assert_ok(proc)
    assert "optim=SGD" in proc.stdout
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    lrs = [e["learning_rate"] for e in history if "learning_rate" in e]
    # The lr each of the 6 steps ran at: DeepSpeed's WarmupDecayLR(total 6, warmup 4, linear) at
    # iterations -1..4 (DeepSpeed sets iteration -1's at construction and steps after each step).
    assert lrs == pytest.approx([0.0, 0.0, 0.025, 0.05, 0.075, 0.1], abs=1e-9), lrs


def test_a_full_disk_stops_the_run_before_it_touches_a_checkpoint(tiny_model, tiny_data, tmp_path, monkeypatch, capsys):
    """Resuming with a disk store that does not fit: exit 2 naming the path and the bytes; the
    output folder, its checkpoint included, is byte for byte as it was."""
    import re
    import runpy
    import shutil
    from collections import namedtuple

    out = tmp_path / "out"
    flags = train_flags(tiny_model, tiny_data, out, "--use_cpu", "--save_strategy", "steps", "--save_steps", "2",
                        "--max_steps", "2")  # fmt: skip
    assert_ok(run_script(flags))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert any("checkpoint-2" in str(p) for p in before)

    store = tmp_path / "store"
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")

    def disk_usage(path):  # the disk under tmp_path has 100 bytes free from now on; every other path is as it is
        return usage(10**9, 10**9 - 100, 100) if str(path).startswith(str(tmp_path)) else real(path)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    script = runpy.run_path(str(ROOT / "scripts" / "finetune_trainer.py"))
    resume = [*flags, "--max_steps", "4", "--resume_from_checkpoint", "latest", "--offload", offload_config(tmp_path, "nvme")]
    assert script["run"]([str(a) for a in resume]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"needs [\d,]+ bytes in '{store}/rank0' but only 100 are free", err), err
    assert not store.exists()
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before


def test_sharded_ddp_offload_option_is_cpu_offload(plain_run, tiny_model, tiny_data, tmp_path):
    out = tmp_path / "out"
    flags = train_flags(tiny_model, tiny_data, out, "--use_cpu", "--sharded_ddp", "zero_dp_2 offload", "--log_level", "info")
    proc = run_script(flags)
    assert_ok(proc)
    assert "offload=cpu" in proc.stdout
    reference, ours = load_file(plain_run / "model.safetensors"), load_file(out / "model.safetensors")
    assert max((ours[k] - reference[k]).abs().max().item() for k in reference) <= 1e-6


@pytest.mark.multiproc
def test_offloaded_checkpoint_resumes_exactly(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "out"
    flags = train_flags(tiny_model, tiny_data, out, "--sharded_ddp", "zero_dp_2", "--offload", offload_config(tmp_path, "nvme"),
                        "--save_strategy", "steps", "--save_steps", "3")  # fmt: skip
    assert_ok(run_script(flags, nproc=2))
    straight = load_file(out / "model.safetensors")
    assert_ok(run_script([*flags, "--resume_from_checkpoint", out / "checkpoint-3"], nproc=2))
    resumed = load_file(out / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
