"""finetune_trainer.py's own flags: JSON argument files, task, phases, checkpoints."""

import json

import pytest

from trainer_shard import ArgumentError
from trainer_shard.finetune import parse_args, resolve_checkpoint, source_prefix, task_languages


def base(tmp_path, *extra):
    return ["--model_name_or_path", "m", "--data_dir", str(tmp_path), "--output_dir", str(tmp_path / "out"),
            "--use_cpu", "--report_to", "none", *extra]  # fmt: skip


def test_classic_flags_parse(tmp_path):
    model_args, data_args, training_args = parse_args(
        base(tmp_path, "--do_train", "--task", "translation_en_to_ro", "--n_train", "5", "--freeze_embeds",
             "--label_smoothing", "0.1", "--eval_beams", "3", "--predict_with_generate")  # fmt: skip
    )
    assert model_args.freeze_embeds and data_args.n_train == 5
    assert (data_args.src_lang, data_args.tgt_lang) == ("en", "ro")
    assert training_args.label_smoothing_factor == 0.1  # --label_smoothing is the classic name
    assert data_args.eval_beams == 3 and training_args.predict_with_generate


def test_json_file_then_flags_override(tmp_path):
    config = tmp_path / "args.json"
    config.write_text(json.dumps({
        "model_name_or_path": "m", "data_dir": str(tmp_path), "output_dir": str(tmp_path / "o"),
        "do_train": True, "num_train_epochs": 3, "use_cpu": True, "report_to": "none",
    }))  # fmt: skip
    _, _, training_args = parse_args([str(config), "--num_train_epochs", "1"])
    assert training_args.do_train and training_args.num_train_epochs == 1.0


def test_json_file_unknown_key(tmp_path):
    config = tmp_path / "args.json"
    config.write_text(json.dumps({"model_name_or_path": "m", "learning_rat": 1e-3}))
    with pytest.raises(ArgumentError, match="unknown key.*'learning_rat'"):
        parse_args([str(config)])


def test_json_file_malformed(tmp_path):
    config = tmp_path / "args.json"
    config.write_text("{'not': json")
    with pytest.raises(ArgumentError, match="not valid JSON"):
        parse_args([str(config)])


def test_problems_collected(tmp_path):
    with pytest.raises(ArgumentError) as e:
        parse_args(base(tmp_path, "--task", "translate", "--max_source_length", "0"))
    message = str(e.value)
    assert "--task 'translate' is unknown" in message
    assert "nothing to do" in message and "--max_source_length must be at least 1" in message


def test_needs_data_for_each_phase(tmp_path):
    args = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--do_eval", "--use_cpu"]
    with pytest.raises(ArgumentError, match="--do_eval needs data: pass --data_dir DIR or --validation_file"):
        parse_args(args)


def test_conflicting_beams(tmp_path):
    with pytest.raises(ArgumentError, match="--eval_beams 2 and --generation_num_beams 4 disagree"):
        parse_args(base(tmp_path, "--do_eval", "--eval_beams", "2", "--generation_num_beams", "4"))


def test_task_languages():
    assert task_languages("translation_en_to_ro") == ("en", "ro")
    assert task_languages("summarization") == (None, None)


def test_source_prefix_from_config():
    class Config:
        task_specific_params = {"translation_en_to_ro": {"prefix": "translate English to Romanian: "}}

    class Data:
        source_prefix = None
        task = "translation_en_to_ro"

    assert source_prefix(Data, Config) == "translate English to Romanian: "
    Data.source_prefix = ">> "
    assert source_prefix(Data, Config) == ">> "


def checkpoint_args(tmp_path, *extra):
    return parse_args(base(tmp_path, "--do_train", *extra))


def make_checkpoint(tmp_path, step):
    folder = tmp_path / "out" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    return folder


def test_existing_checkpoints_are_not_trained_over(tmp_path):
    make_checkpoint(tmp_path, 5)
    _, data_args, training_args = checkpoint_args(tmp_path)
    with pytest.raises(ArgumentError, match="already holds checkpoints \\(newest: checkpoint-5\\)"):
        resolve_checkpoint(data_args, training_args)
    _, data_args, training_args = checkpoint_args(tmp_path, "--overwrite_output_dir")
    assert resolve_checkpoint(data_args, training_args) is None


def test_resume_latest_and_explicit(tmp_path):
    make_checkpoint(tmp_path, 5)
    newest = make_checkpoint(tmp_path, 10)
    _, data_args, training_args = checkpoint_args(tmp_path, "--resume_from_checkpoint", "latest")
    assert resolve_checkpoint(data_args, training_args) == str(newest)
    _, data_args, training_args = checkpoint_args(tmp_path, "--resume_from_checkpoint", str(newest))
    assert resolve_checkpoint(data_args, training_args) == str(newest)


def test_resume_from_a_folder_that_is_no_checkpoint(tmp_path):
    _, data_args, training_args = checkpoint_args(tmp_path, "--resume_from_checkpoint", str(tmp_path))
    with pytest.raises(ArgumentError, match="not a Trainer checkpoint"):
        resolve_checkpoint(data_args, training_args)
    _, data_args, training_args = checkpoint_args(tmp_path, "--resume_from_checkpoint", "latest")
    with pytest.raises(ArgumentError, match="no checkpoint-\\* folder"):
        resolve_checkpoint(data_args, training_args)
