"""Sharded optimizer checkpoints: saved at 2 ranks, loaded at 1 and 3, under ZeRO-1, ZeRO-2,
CPU and disk offload and a plain optimizer; the loaded state is what torch's own AdamW, stepped on
the whole model with fp32 masters kept by hand, holds after the same steps."""

import json

import pytest
import torch
from distributed import spawn

from trainer_shard.checkpoint import SafetensorsFile, manifest_problems, write_manifest
from trainer_shard.errors import CheckpointError
from trainer_shard.offload import OffloadSpec
from trainer_shard.sharding import ShardedOptimizer
from trainer_shard.sharding import state_io

pytestmark = pytest.mark.multiproc


def make_model():
    """Two flat groups: fp32 layers and a bf16 one (fp32 masters), sizes that do not divide evenly."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(7, 5), "b": torch.nn.Linear(5, 13), "c": torch.nn.Linear(13, 3)})
    model["b"].to(torch.bfloat16)
    return model


def forward(model, x):
    h = model["a"](x)
    h = model["b"](h.bfloat16()).float()
    return model["c"](h).pow(2).mean()


def build(model, stage=2, offload=None):
    return ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=stage, bucket_numel=40, offload=offload,
                            lr=1e-2, weight_decay=0.1)  # fmt: skip


def batch(step):
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(step))


def plain_reference() -> dict:
    """{name: {"exp_avg", "exp_avg_sq", "master"}} after the three steps `_save` takes, by torch's
    AdamW on the whole model: fp32 masters of every parameter (for the bf16 layer, what mixed
    precision means), stepped on the parameters' gradients and cast back after each step."""
    model = make_model()
    masters = {name: p.detach().float().clone().requires_grad_() for name, p in model.named_parameters()}
    opt = torch.optim.AdamW(masters.values(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        forward(model, batch(step)).backward()
        for name, p in model.named_parameters():
            masters[name].grad = p.grad.float()
        opt.step()
        model.zero_grad()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(masters[name])
    return {name: {**{k: opt.state[m][k] for k in ("exp_avg", "exp_avg_sq")}, "master": m.detach()}
            for name, m in masters.items()}  # fmt: skip


def assert_close(actual, expected, what):
    # The same elementwise update as torch's AdamW; the flat shard runs it over other tensor
    # boundaries (vectorized loop vs scalar tail), so an element may land an ulp or so away.
    assert torch.allclose(actual.float(), expected, rtol=1e-6, atol=1e-9), (what, (actual - expected).abs().max())


def _save(rank, world, folder):
    model = make_model()
    opt = build(model)
    for step in range(3):  # every rank the same batch: the averaged gradient is the gradient
        forward(model, batch(step)).backward()
        opt.step()
        opt.zero_grad()
    state_io.save_shards(opt, folder, state_io.param_names(model))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{folder}/../model.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / state_io.FOLDER
    spawn(_save, 2, str(folder))
    return folder


def _load_and_compare(rank, world, folder, stage, offload_device, nvme_path):
    model = make_model()  # fresh weights: the load must bring the saved ones
    offload = OffloadSpec(offload_device, nvme_path=nvme_path and f"{nvme_path}/{world}") if offload_device else None
    opt = build(model, stage=stage, offload=offload)
    state_io.load_shards(opt, folder, state_io.param_names(model))
    saved_model = torch.load(f"{folder}/../model.pt")
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved_model[name]), name
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        full, reference = opt.state_dict(), plain_reference()
        for pid, (name, p) in enumerate(model.named_parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(full["state"][pid][key], reference[name][key], (name, key))
            assert float(full["state"][pid]["step"]) == 3.0
            if p.dtype == torch.bfloat16:  # the fp32 master, not the bf16 parameter
                assert_close(full["master_params"][pid], reference[name]["master"], (name, "master"))
            else:
                assert_close(p.detach(), reference[name]["master"], (name, "weights"))
        assert full["param_groups"][0]["lr"] == 1e-2
    opt.release_consolidated()
    opt.close()


@pytest.mark.parametrize(
    "world, stage, offload",
    [(1, 2, None), (3, 1, None), (1, 2, "nvme"), (3, 2, "cpu")],
    ids=["2to1-zero2", "2to3-zero1", "2to1-disk", "2to3-cpu-offload"],
)
def test_resharded_state_equals_saved(saved, tmp_path, world, stage, offload):
    spawn(_load_and_compare, world, str(saved), stage, offload, str(tmp_path / "nvme") if offload == "nvme" else None)


def test_plain_optimizer_takes_the_full_state(saved):
    model = make_model().float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state_io.load_into_plain(opt, model, saved)
    reference = plain_reference()
    for p, (name, _) in zip(opt.param_groups[0]["params"], model.named_parameters()):
        assert_close(p.detach(), reference[name]["master"], name)  # fp32 masters, not the bf16 weights
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(opt.state[p][key], reference[name][key], (name, key))
        assert float(opt.state[p]["step"]) == 3.0
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1


def test_shard_files_are_streamed_safetensors_with_an_index(saved):
    index = json.loads((saved / state_io.INDEX).read_text())
    assert index["world_size"] == 2 and index["stage"] == 2 and index["optimizer"] == "AdamW"
    assert [f["dtype"] for f in index["flats"]] == ["float32", "bfloat16"]
    names = {p["name"] for f in index["flats"] for p in f["params"]}
    assert names == {n for n, _ in make_model().named_parameters()}
    for rank in range(2):
        f = SafetensorsFile(saved / state_io.rank_file(rank, 2))
        assert set(f.keys()) >= {"flat0.master", "flat0.exp_avg", "flat0.exp_avg_sq", "flat0.step", "flat1.master"}
        assert f.read("flat0.step").item() == 3.0
        f.close()


def test_damaged_shards_are_named(saved, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    state_io.verify_files(copy, state_io.read_index(copy))  # intact
    target = copy / state_io.rank_file(1, 2)
    data = bytearray(target.read_bytes())
    data[-3] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank-00001-of-00002.safetensors' is corrupt"):
        state_io.verify_files(copy, state_io.read_index(copy))
    target.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="rank-00001-of-00002.safetensors' has 100 bytes.*were saved: truncated"):
        state_io.verify_files(copy, state_io.read_index(copy))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        SafetensorsFile(target)
    target.unlink()
    with pytest.raises(CheckpointError, match="rank-00001-of-00002.safetensors' is missing"):
        state_io.verify_files(copy, state_io.read_index(copy))
    (copy / state_io.INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json' is corrupt"):
        state_io.read_index(copy)
    (copy / state_io.INDEX).unlink()
    with pytest.raises(CheckpointError, match="index.json' is missing"):
        state_io.read_index(copy)


def test_manifest_names_missing_and_changed_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"abcdef")
    (tmp_path / "sub" / "b.bin").write_bytes(b"xyz")
    write_manifest(tmp_path)
    assert manifest_problems(tmp_path) == []
    (tmp_path / "a.bin").write_bytes(b"abcdeF")
    (tmp_path / "sub" / "b.bin").unlink()
    problems = manifest_problems(tmp_path)
    assert any("a.bin' is corrupt" in p for p in problems) and any("b.bin' is missing" in p for p in problems)
    assert manifest_problems(tmp_path / "sub") == []  # no manifest: a plain Trainer's checkpoint


def _load_into_other_model(rank, world, folder):
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(7, 5)})
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-2)
    with pytest.raises(CheckpointError, match="saved for other parameters: 'b.bias' is in the checkpoint"):
        state_io.load_shards(opt, folder, state_io.param_names(model))


def test_a_checkpoint_of_another_model_is_refused(saved):
    spawn(_load_into_other_model, 1, str(saved))
