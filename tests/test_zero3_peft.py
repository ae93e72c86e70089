"""LoRA (PEFT) on a Llama-architecture model through a user's own `ShardedTrainerMixin` +
`transformers.Trainer` subclass, 2 ranks: ZeRO-3 logs what DDP logs, and its frozen base is
sharded (it stayed whole on every rank: "0 of N parameter elements sharded")."""

import json

import pytest

from conftest import ROOT, assert_ok, run_script

SCRIPT = ROOT / "tests" / "helpers" / "peft_llama.py"

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_lora_under_zero3_logs_as_ddp_and_holds_half_the_base(tmp_path):
    """Losses and grad norms equal DDP's (rel 1e-4); between steps a rank's live tensors hold at
    most half the base model's sharded bytes, the base parameters small enough to stay whole
    (Llama's k and v projections here: 7% of the base), the gather pool's unit buffers, and what
    DDP holds beside the model (adapters, their optimizer state, the data): measured from the
    live tensors, not from the project's accounting."""
    ddp, zero3 = tmp_path / "ddp", tmp_path / "zero3"
    assert_ok(run_script([ddp], nproc=2, script=SCRIPT))
    assert_ok(run_script([zero3, "zero_dp_3 auto_wrap"], nproc=2, script=SCRIPT))
    want, got = json.loads((ddp / "log.json").read_text()), json.loads((zero3 / "log.json").read_text())
    steps = [v for e in want if "loss" in e for v in (e["loss"], e["grad_norm"])]
    assert len(steps) == 8
    assert [v for e in got if "loss" in e for v in (e["loss"], e["grad_norm"])] == pytest.approx(steps, rel=1e-4)
    for rank in (0, 1):
        plain, sharded = (json.loads((d / f"held{rank}.json").read_text()) for d in (ddp, zero3))
        base, pool, whole = sharded["base"], sharded["pool"], sharded["whole"]
        beside = max(plain["live"]) - base  # what DDP holds beside the model
        assert 0 < pool <= 3 * sharded["largest_unit"] and whole < 0.1 * base
        assert max(sharded["live"]) <= (base - whole) / 2 + whole + pool + beside + 2**16, (sharded, plain)
