"""Evaluation and prediction with generate() through the Trainer, with ZeRO-3's parameters on disk
(`--sharded_ddp "zero_dp_3 offload"`, offload_param and offload_optimizer on nvme, the model built
on the meta device): on 2 ranks, evaluating a trained model without training it further, the
same eval loss, metrics and generations as the unsharded Trainer gave for that model on one
process. (The engine alone, on one process:
tests/test_zero3_offload_param.py::test_eval_and_generate_stream_from_disk.) And without offload:
each rank reads only its slice of the checkpoint for evaluation alone (issue 35)."""

import json

import pytest

from conftest import ROOT, TINY_FLAGS, assert_ok, run_script
from test_zero3_offload_param_trainer import files_under, offload_config
from trainer_shard.offload.param_store import PARAM_FOLDER

WATCH = ROOT / "tests" / "helpers" / "watch_param_store.py"

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

# Batches of 2 on each rank: padded inputs in generate(), beams of different lengths on the two
# ranks (synced_gpus); 10 test examples leave rank 1 a batch repeated from the start, which the
# gather drops. The plain run's batches of 2 are the same batches, so the losses match exactly.
EVAL = ["--do_eval", "--do_predict", "--predict_with_generate", "--eval_beams", "2", "--n_val", "8", "--n_test", "10",
        "--per_device_eval_batch_size", "2"]  # fmt: skip
# what must match; the runtimes and the sample rates need not
SAME = ("val_loss", "val_bleu", "val_chrf", "val_gen_len", "val_n_objs", "test_loss", "test_bleu", "test_chrf",
        "test_gen_len", "test_n_objs")  # fmt: skip


@pytest.fixture(scope="module")
def plain(tiny_model, tiny_data, tmp_path_factory):
    """The plain Trainer on one process: 300 short steps (3 s; the untrained model generates the
    same token 31 times over, which would compare nothing), saved, then evaluated and predicting."""
    out = tmp_path_factory.mktemp("plain") / "out"
    flags = ["--model_name_or_path", tiny_model, "--data_dir", tiny_data, "--output_dir", out, *TINY_FLAGS,
             "--use_cpu", "--do_train", "--max_steps", "300", "--per_device_train_batch_size", "16",
             "--logging_steps", "50", *EVAL]  # fmt: skip
    assert_ok(run_script(flags))
    return out


def evaluated_as_plain(plain, tiny_data, tmp_path, sharded_ddp: str, config):
    """The trained model evaluated and predicting on 2 ranks (under WATCH) with `--sharded_ddp
    sharded_ddp --offload config`: built on the meta device (never whole), and the plain Trainer's
    val and test loss, BLEU, chrF and generation lengths, test_generations.txt line for line.
    Returns the output folder."""
    out = tmp_path / "out"
    flags = ["--model_name_or_path", plain, "--data_dir", tiny_data, "--output_dir", out, *TINY_FLAGS, *EVAL,
             "--sharded_ddp", sharded_ddp, "--offload", config, "--log_level", "info"]  # fmt: skip
    proc = run_script(flags, nproc=2, script=WATCH)
    assert_ok(proc)
    assert "built on the meta device; its weights were read from" in proc.stdout + proc.stderr  # never whole
    want, got = (json.loads((d / "all_results.json").read_text()) for d in (plain, out))
    assert {k: got[k] for k in SAME} == {k: want[k] for k in SAME}
    generations, reference = ((d / "test_generations.txt").read_text(encoding="utf-8").splitlines()
                              for d in (out, plain))  # fmt: skip
    assert len(generations) == 10 and generations == reference
    assert len(set(generations)) > 5, generations  # a model that translates, not one repeating a token
    return out


def test_eval_and_predict_with_generate_match_the_plain_trainer(plain, tiny_data, tmp_path):
    """The trained model, evaluated by 2 ranks with every parameter in the stores' files (none in
    RAM, none whole): val and test loss, BLEU, chrF and generation lengths as the plain Trainer's,
    test_generations.txt line for line; both loops read their parameters from the files, left
    nothing gathered, and the stores' folders are gone once the run ends."""
    out = evaluated_as_plain(plain, tiny_data, tmp_path, "zero_dp_3 offload", offload_config(tmp_path))

    for rank in (0, 1):
        seen = json.loads((out / f"store{rank}.json").read_text())
        assert seen.keys() == {"val", "test"}
        for split, loop in seen.items():
            assert loop["folder"] == str(tmp_path / "store" / PARAM_FOLDER / f"rank{rank}")
            assert "0.param.f32" in loop["files"], (rank, split, loop["files"])
            held = loop["held"]
            assert held["on_disk"] > 0 and held["shards"] == held["persistent"] == held["gathered"] == 0, held
            assert loop["read_bytes"] >= held["on_disk"], (rank, split, loop)  # each unit read at least once
    assert files_under(tmp_path / "store") == [] and not (tmp_path / "store").exists()


def test_evaluation_alone_under_zero_dp_3_reads_each_ranks_slice(plain, tiny_data, tmp_path):
    """Issue 35: `--sharded_ddp "zero_dp_3 auto_wrap"` without offload, evaluating and predicting
    only: the model is built on the meta device and each rank keeps its slice of the checkpoint
    (was: `from_pretrained` on every rank, the whole model held through both loops, since only
    training sharded it), and no gradient shard (made by the optimizer or the first backward);
    the plain Trainer's losses, metrics and generations."""
    config = tmp_path / "zero3.json"  # every parameter sharded: the tiny model's are below the default threshold
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    out = evaluated_as_plain(plain, tiny_data, tmp_path, "zero_dp_3 auto_wrap", config)
    for rank in (0, 1):
        for split, loop in json.loads((out / f"store{rank}.json").read_text()).items():
            held, whole = loop["held"], loop["model_bytes"]
            assert held["persistent"] == held["gathered"] == held["on_disk"] == held["grad_shards"] == 0, (rank, split, held)
            assert whole / 2 <= held["shards"] <= whole / 2 + 1024, (rank, split, held, whole)  # half, padded
