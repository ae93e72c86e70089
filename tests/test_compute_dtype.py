"""The compute dtype apart from the storage dtype (issue 33): `choose_compute_dtype` with forced
timings, and `ComputeCast` (16-bit parameters, fp32 products) against independent references: an
fp32 model holding the same bf16-rounded weights, the pure bf16 run, the allocator's own count of
live bytes (the profiler), and plain PyTorch checkpointing and autocast."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from trainer_shard import compute
from trainer_shard.compute import SLOWER_THAN, ComputeCast, choose_compute_dtype
from trainer_shard.dtypes import DTYPES
from trainer_shard.sharding.zero3.selection import auto_wrap_units

BF16, FP32 = torch.bfloat16, torch.float32


# -- choose_compute_dtype
def never_timed(dtype, device_type):
    raise AssertionError("timed although nothing needed timing")


def timings(ratio):
    return lambda dtype, device_type: 1e-3 * (ratio if dtype != FP32 else 1.0)


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "float32", "bfloat16"])
def test_a_named_dtype_is_taken_as_it_is(name):
    dtype, line = choose_compute_dtype(name, BF16, "cpu", timer=never_timed)
    assert dtype is DTYPES[name]
    assert line.startswith("compute dtype ") and "parameters stay bf16" in line


@pytest.mark.parametrize("storage", [BF16, torch.float16])
def test_auto_computes_in_fp32_where_16_bit_is_more_than_twice_as_slow(storage):
    dtype, line = choose_compute_dtype("auto", storage, "cpu", timer=timings(3.0))
    assert dtype is FP32
    assert "compute dtype fp32" in line and "3.0x" in line and "3.00 ms against 1.00 ms" in line


def test_auto_keeps_16_bit_compute_where_it_is_fast_enough(monkeypatch):
    monkeypatch.setattr(compute, "time_matmul", timings(1.5))  # the default timer, replaced
    dtype, line = choose_compute_dtype("auto", BF16, torch.device("cpu"))
    assert dtype is BF16 and "compute dtype bf16" in line and "1.5x" in line
    assert SLOWER_THAN == 2.0


def test_auto_with_fp32_parameters_or_on_cuda_times_nothing():
    assert choose_compute_dtype("auto", FP32, "cpu", timer=never_timed)[0] is FP32
    dtype, line = choose_compute_dtype("auto", BF16, "cuda", timer=never_timed)  # no GPU needed
    assert dtype is BF16 and "cuda" in line


def test_an_unknown_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="auto, fp32"):
        choose_compute_dtype("float64", BF16, "cpu")


def test_the_real_probe_times_both_dtypes_once_a_process():
    first = compute.time_matmul(BF16, "cpu")
    assert first > 0 and compute.time_matmul(BF16, "cpu") == first  # cached
    assert compute.time_matmul(FP32, "cpu") > 0


# -- models
class Twice(torch.nn.Module):
    """A shared Linear run twice in one forward (scaled by a parameter of its own), and a
    module whose forward may raise after a hooked child ran."""

    def __init__(self, width):
        super().__init__()
        self.shared = torch.nn.Linear(width, width)
        self.scale = torch.nn.Parameter(torch.ones(width))
        self.fail = False

    def forward(self, x):
        if self.fail:
            _ = self.shared(x) * self.scale
            raise RuntimeError("inside forward")
        return self.shared(torch.nn.functional.gelu(self.shared(x))) * self.scale


def mlp(vocab=50, width=32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(vocab, width), torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
        torch.nn.LayerNorm(2 * width), torch.nn.Linear(2 * width, width), Twice(width),
        torch.nn.Linear(width, vocab))  # fmt: skip


def mlp_loss(model, batch):
    ids, labels = batch
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def mlp_batch(vocab=50):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (4, 12), generator=generator), torch.randint(0, vocab, (4, 12), generator=generator)


def t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def t5_loss(model, batch):
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss.float()


def t5_batch():
    generator = torch.Generator().manual_seed(2)
    return torch.randint(1, 64, (3, 10), generator=generator), torch.randint(1, 64, (3, 7), generator=generator)


def run(model, loss_fn, batch):
    """(loss, {name: grad as fp32}) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def errors(grads, reference) -> dict:
    return {n: ((grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in reference.items()}


# -- numerics
@pytest.mark.parametrize("block_numel", [None, 128], ids=["whole", "row-blocks"])
@pytest.mark.parametrize("build, loss_fn, batch", [(mlp, mlp_loss, mlp_batch), (t5, t5_loss, t5_batch)],
                         ids=["mlp", "t5"])  # fmt: skip
def test_fp32_compute_matches_an_fp32_model_holding_the_bf16_weights(build, loss_fn, batch, block_numel, monkeypatch):
    if block_numel:  # every Linear's weight cast and its gradient computed a few rows at a time
        monkeypatch.setattr(compute, "BLOCK_NUMEL", block_numel)
    model = build().to(BF16)
    batch = batch()
    pure = copy.deepcopy(model)
    reference = copy.deepcopy(model).float()  # the same bf16-rounded values, fp32 everywhere
    ref_loss, ref_grads = run(reference, loss_fn, batch)
    ref_grads = {n: g.to(BF16).float() for n, g in ref_grads.items()}  # as the bf16 parameters receive them
    pure_loss, pure_grads = run(pure, loss_fn, batch)

    params = list(model.parameters())
    with ComputeCast(model, FP32, units=auto_wrap_units(model)[0]):  # T5Block for T5, none for the MLP
        loss, grads = run(model, loss_fn, batch)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(p.dtype == BF16 and p.grad.dtype == BF16 for p in model.parameters())
    assert set(grads) == set(ref_grads)

    cast_errors, pure_errors = errors(grads, ref_grads), errors(pure_grads, ref_grads)
    assert loss == pytest.approx(ref_loss, rel=1e-3, abs=1e-4)
    assert max(cast_errors.values()) < 1e-2, cast_errors  # the gradients' own rounding to bf16, about
    assert abs(loss - ref_loss) <= abs(pure_loss - ref_loss)
    assert sum(cast_errors.values()) < 0.2 * sum(pure_errors.values()), (cast_errors, pure_errors)


def test_a_unit_is_cast_whole_so_a_parent_reading_a_childs_weight_sees_the_compute_dtype():
    model, batch = t5().to(BF16), t5_batch()
    seen = []
    for block in auto_wrap_units(model)[0]:
        ff = block.layer[-1].DenseReluDense  # reads self.wo.weight.dtype to cast its activations
        ff.register_forward_hook(lambda m, args, out: seen.append((m.wo.weight.dtype, out.dtype)))
    with ComputeCast(model, FP32, units=auto_wrap_units(model)[0]) as cast:
        run(model, t5_loss, batch)
        assert cast.held_bytes() == 0
    assert seen and set(seen) == {(FP32, FP32)}
    assert all(p.dtype == BF16 for p in model.parameters())


def test_parameters_come_back_after_a_forward_that_raises():
    model = mlp().to(BF16)
    shared = model[5].shared
    weight, bias, scale = shared.weight, shared.bias, model[5].scale
    cast = ComputeCast(model, FP32)
    model[5].fail = True
    with torch.autocast("cpu", dtype=BF16), pytest.raises(RuntimeError, match="inside forward"):
        mlp_loss(model, mlp_batch())
    assert shared.weight is weight and shared._parameters["bias"] is bias and weight.dtype == BF16
    assert model[5]._parameters["scale"] is scale
    assert cast.held_bytes() == 0 and not cast._frames
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not torch.is_autocast_enabled("cpu")
    model[5].fail = False
    model.zero_grad()
    mlp_loss(model, mlp_batch()).backward()  # still works
    assert weight.grad.dtype == BF16
    cast.remove()


def test_an_enclosing_autocast_does_not_reach_the_cast_modules():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(BF16)
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    x = torch.randn(3, 16, dtype=BF16)
    with ComputeCast(model, FP32), torch.autocast("cpu", dtype=BF16):
        out = model(x)
        after = torch.mm(torch.randn(2, 2), torch.randn(2, 2))  # autocast again outside the modules
    assert seen == [(FP32, FP32)] and out.dtype == FP32 and after.dtype == BF16


def test_integer_inputs_are_left_alone():
    model = torch.nn.Embedding(10, 4).to(BF16)
    got = []
    model.register_forward_pre_hook(lambda m, args: got.append(args[0].dtype))
    with ComputeCast(model, FP32):
        out = model(torch.tensor([1, 2]))
    assert got == [torch.int64] and out.dtype == FP32


# -- no whole fp32 copy
def deep(layers=8, width=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(BF16)


def bytes_allocated_and_kept(fn):
    """Bytes allocated inside `fn` and still alive after it, by the allocator (the profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return result, sum(e.self_cpu_memory_usage for e in prof.events())


def test_forward_keeps_about_one_layer_of_fp32_weights_not_the_model():
    model, x = deep(), torch.randn(2, 256, dtype=BF16)
    layer = 256 * 256 * 4  # one Linear's weight in fp32 (the bias is cast as it is added)
    with ComputeCast(model, FP32) as cast:
        loss, kept = bytes_allocated_and_kept(lambda: model(x).float().sum())
        assert cast.held_bytes() == 0  # between forwards
        assert cast.pool_bytes() == layer  # the pool: one layer's buffers, reused by all eight
        assert kept < 2 * layer, f"{kept} bytes kept past forward; the model is {8 * layer} in fp32"
        loss.backward()
        pooled = cast.pool_bytes()
        model(x).float().sum().backward()  # a second step reuses the pool
        assert cast.pool_bytes() == pooled
    assert all(p.grad.dtype == BF16 for p in model.parameters())


def test_held_bytes_count_one_layer_while_it_runs():
    model, x = deep(layers=3), torch.randn(2, 256, dtype=BF16)
    held = []
    with ComputeCast(model, FP32, units=list(model)) as cast:
        for layer in model:  # registered after ComputeCast's pre-hook: runs while the cast copies live
            layer.register_forward_pre_hook(lambda m, args: held.append(cast.held_bytes()))
        model(x)
    assert held == [256 * 256 * 4 + 256 * 4] * 3


def test_a_large_linear_outside_the_units_is_cast_a_block_of_rows_at_a_time(monkeypatch):
    """T5's lm_head (32128 rows, shared with the embedding): never a whole fp32 copy, forward or
    backward: the pool holds a buffer of each block size, forward and backward."""
    monkeypatch.setattr(compute, "BLOCK_NUMEL", 64 * 32)  # 64 rows of 32 columns a block
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 1000, bias=False).to(BF16)
    reference = copy.deepcopy(head).float()
    x = torch.randn(6, 32, dtype=BF16)
    with ComputeCast(head, FP32) as cast:
        out = head(x)
        block = (64 + 1000 % 64) * 32 * 4  # a buffer of 64 rows and one of the last 40
        assert out.dtype == FP32 and cast.held_bytes() == 0 and cast.pool_bytes() == block
        out.square().sum().backward()
        assert cast.pool_bytes() == block  # backward's recasts and products take the same buffers
    expected = reference(x.float())
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    assert head.weight.grad.dtype == BF16
    torch.testing.assert_close(head.weight.grad, reference.weight.grad.to(BF16), rtol=0, atol=0)


def test_a_cast_copy_that_escapes_its_forward_is_not_reused():
    class ReturnsWeight(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x), self.weight

    first, second = ReturnsWeight(8, 8).to(BF16), torch.nn.Linear(8, 8).to(BF16)
    with ComputeCast(torch.nn.ModuleList([first, second]), FP32):
        _, escaped = first(torch.randn(2, 8))
        second(torch.randn(2, 8))  # same numel: would take the pooled buffer
    torch.testing.assert_close(escaped, first.weight.float(), rtol=0, atol=0)


# -- checkpointing, shared modules, saved-tensor delegation
class Blocks(torch.nn.Module):
    def __init__(self, reentrant=None, width=32, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)) for _ in range(depth))  # fmt: skip
        self.head = torch.nn.Linear(width, 50)
        self.reentrant = reentrant

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + (block(h) if self.reentrant is None else checkpoint(block, h, use_reentrant=self.reentrant))
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant):
    model, batch = Blocks().to(BF16), mlp_batch()
    with ComputeCast(model, FP32):
        loss, grads = run(model, mlp_loss, batch)
        model.reentrant = reentrant
        ckpt_loss, ckpt_grads = run(model, mlp_loss, batch)
    assert ckpt_loss == loss
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_t5_with_gradient_checkpointing_gives_the_same_gradients(reentrant):
    """transformers checkpoints a layer's forward inside its __call__ (module hooks stay out of the
    recompute): the recompute must cast the unit too, else its Linears meet fp32 inputs with bf16
    weights. Equal to the unchecked run up to the rounding checkpointing itself moves in T5
    (its position-bias mask is made contiguous in the recompute: about 1e-6)."""
    model, batch = t5().to(BF16), t5_batch()
    with ComputeCast(model, FP32, units=auto_wrap_units(model)[0]) as cast:
        loss, grads = run(model, t5_loss, batch)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        ckpt_loss, ckpt_grads = run(model, t5_loss, batch)
        assert cast.held_bytes() == 0
    assert ckpt_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-2, atol=1e-5, msg=name)  # bf16 gradients: 1 ulp
    assert all(type(b._gradient_checkpointing_func).__name__ != "_CastCheckpoint" for b in auto_wrap_units(model)[0])


def counting_hooks(seen):
    def pack(t):
        seen["pack"].append((t.dtype, tuple(t.shape)))
        return ("packed", t)

    def unpack(packed):
        seen["unpack"] += 1
        assert packed[0] == "packed"
        return packed[1]

    return pack, unpack


def fp32_weights_among(saved, model):
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}
    return [s for dtype, s in saved if dtype == FP32 and s in shapes]


@pytest.mark.parametrize("given", [True, False], ids=["outer given", "enclosing hooks"])
def test_tensors_that_are_not_cast_copies_reach_the_outer_hooks(given):
    model, batch = Blocks().to(BF16), mlp_batch()
    units = list(model.blocks)  # the head, alone, is cast by its own forward: no frame, no hooks of ours
    with ComputeCast(model, FP32, units=units):
        _, expected = run(model, mlp_loss, batch)
    seen = {"pack": [], "unpack": 0}
    hooks = counting_hooks(seen)
    readied = []
    with ComputeCast(model, FP32, units=units, outer=hooks if given else None, ensure_ready=readied.append):
        if given:
            loss = mlp_loss(model, batch)
        else:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):  # as ZeRO-3 pushes its own for the forward
                loss = mlp_loss(model, batch)
        model.zero_grad(set_to_none=True)
        loss.backward()
    assert len(seen["pack"]) > 0 and seen["unpack"] > 0
    assert fp32_weights_among(seen["pack"], model) == []  # the cast copies were ours to save
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert {id(p) for p in readied} == linear_weights  # each was cast again for backward
    for name, p in model.named_parameters():
        assert p.grad.dtype == BF16
        torch.testing.assert_close(p.grad.float(), expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_auto_on_a_cpu_without_bf16_kernels_computes_in_fp32():
    """oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA) is a CPU without bf16 matrix kernels as torch
    sees it (`_is_mkldnn_bf16_supported()` False: products in the reference loop; the probe's took
    70-79x fp32's in bench/results/infinity_compute_avx2.md); on any x86 CPU, auto picks fp32 there."""
    import subprocess
    import sys

    code = ("import torch; from trainer_shard.compute import choose_compute_dtype\n"
            "print(torch.ops.mkldnn._is_mkldnn_bf16_supported())\n"
            "print(choose_compute_dtype('auto', torch.bfloat16, 'cpu')[1])")  # fmt: skip
    env = {**__import__("os").environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    kernels, line = proc.stdout.strip().splitlines()[-2:]
    if kernels != "False":
        pytest.skip("ONEDNN_MAX_CPU_ISA does not take bf16 kernels away on this CPU (not x86?)")
    assert line.startswith("compute dtype fp32: a 64x256x256 bf16 matmul took"), line


def test_lora_adapters_over_frozen_bf16_linears_get_fp32_computed_gradients():
    """PEFT wraps each target nn.Linear as `base_layer`: the frozen base runs through the cast
    Linear (an input gradient, no weight gradient), the adapters get the same gradients as an fp32
    model holding the bf16 weights."""
    from peft import LoraConfig, get_peft_model

    def lora():
        model = get_peft_model(t5(), LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], lora_dropout=0.0))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # nonzero, so that lora_A's gradient is too
                torch.nn.init.normal_(p, std=0.02)
        return model.to(BF16)

    model, batch = lora(), t5_batch()
    reference = copy.deepcopy(model).float()
    _, ref_grads = run(reference, t5_loss, batch)
    with ComputeCast(model, FP32, units=auto_wrap_units(model)[0]) as cast:
        assert cast._linears  # the frozen bases among them
        _, grads = run(model, t5_loss, batch)
    assert set(grads) == set(ref_grads) and all("lora_" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name].to(BF16).float(), rtol=2e-2, atol=1e-5, msg=name)


MEMORY_PY = Path(__file__).resolve().parents[1] / "trainer_shard" / "memory.py"


@pytest.mark.slow  # processes of their own: glibc's threshold is the process's
def test_large_blocks_mapped_apart_go_back_to_the_os_when_freed():
    """After `map_large_blocks`, a 4 MiB tensor is mapped apart (freed: back to the OS), where
    glibc, its threshold raised by an earlier 16 MiB free, would serve it from the heap, which
    keeps it (what fp32 compute's per-layer blocks did: bench/results/infinity_compute_avx2.md)."""
    import subprocess
    import sys

    load = (f"import importlib.util; spec = importlib.util.spec_from_file_location('memory', {str(MEMORY_PY)!r}); "
            "memory = importlib.util.module_from_spec(spec); spec.loader.exec_module(memory); "
            "map_large_blocks = memory.map_large_blocks")  # the module alone: the package's imports take seconds
    code = load + """
if True:
        import ctypes, json, sys, torch
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Info
        was_set = map_large_blocks() if sys.argv[1] == "set" else False
        big = torch.empty(16 << 20, dtype=torch.uint8)
        del big  # glibc's own threshold rises past 16 MiB on this free
        before = libc.mallinfo2().hblkhd
        block = torch.empty(4 << 20, dtype=torch.uint8)
        print(json.dumps({"set": was_set, "mapped": libc.mallinfo2().hblkhd - before}))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    results = {}
    for mode in ("set", "unset"):
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["unset"] == {"set": False, "mapped": 0}, results  # the heap's: kept when freed
    assert results["set"]["set"] and results["set"]["mapped"] >= 4 << 20, results
    user = subprocess.run([sys.executable, "-c", load + "; print(map_large_blocks())"], capture_output=True,
                          text=True, timeout=120,
                          env={**env, "MALLOC_MMAP_THRESHOLD_": "65536"})  # fmt: skip
    assert user.stdout.strip() == "False", user.stderr  # the user's own setting wins


def test_remove_gives_the_linears_their_own_forward_back():
    model, ids = Blocks().to(BF16), torch.randint(0, 50, (2, 5))
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    cast = ComputeCast(model, FP32, units=list(model.blocks))
    assert all("forward" in m.__dict__ for m in linears) and model(ids).dtype == FP32
    cast.remove()
    assert not any("forward" in m.__dict__ for m in linears)
    assert model(ids).dtype == BF16  # the module's own forward, on its bf16 weight
