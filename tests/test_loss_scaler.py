"""`DynamicLossScaler` against DeepSpeed's own loss scaler: every scale and hysteresis budget after
every update, as DeepSpeed 0.19.8 produced them (tests/data/loss_scaler/deepspeed_sequences.json,
recorded by bench/record_loss_scaler.py; DeepSpeed is not imported here). Pure: no process group."""

import json
from pathlib import Path

import pytest

from trainer_shard.sharding import scaler as scaler_module
from trainer_shard.sharding.scaler import DynamicLossScaler

FIXTURE = Path(__file__).resolve().parent / "data" / "loss_scaler" / "deepspeed_sequences.json"
RECORDED = json.loads(FIXTURE.read_text())
CASES = RECORDED["cases"]


def ours(settings: dict, **overrides) -> DynamicLossScaler:
    """Our scaler with DeepSpeed's constructor arguments (`settings`), under our names; the
    arguments at their defaults are left out, so that a scaler without hysteresis is built the
    way it was before hysteresis existed."""
    kwargs = {"init_scale": settings["init_scale"], "growth_interval": settings["scale_window"],
              "min_scale": settings["min_scale"]}  # fmt: skip
    optional = {"hysteresis": (settings["delayed_shift"], 1),
                "consecutive_hysteresis": (settings["consecutive_hysteresis"], False),
                "raise_error_at_min_scale": (settings["raise_error_at_min_scale"], False)}  # fmt: skip
    kwargs.update({name: value for name, (value, default) in optional.items() if value != default})
    return DynamicLossScaler(**{**kwargs, **overrides})


def run(scaler: DynamicLossScaler, pattern: str) -> tuple:
    """(scales, hysteresis budgets, index of the update that raised or None), as recorded."""
    scales, budgets = [], []
    for i, char in enumerate(pattern):
        before = scaler.state_dict()
        try:
            scaler.update(char == "x")
        except scaler_module.LossScaleAtMinimumError:
            assert scaler.state_dict() == before, "the raising update must change nothing, as in DeepSpeed"
            return scales, budgets, i
        scales.append(scaler.scale)
        budgets.append(getattr(scaler, "cur_hysteresis", 1))
    return scales, budgets, None


def test_fixture_comes_from_deepspeed_and_covers_hysteresis():
    header = RECORDED["header"]
    assert header["deepspeed"] and header["source"].startswith("deepspeed.") and header["cases"] == len(CASES)
    settings = [c["settings"] for c in CASES]
    assert {s["delayed_shift"] for s in settings} == {1, 2, 3}
    assert {s["consecutive_hysteresis"] for s in settings} == {False, True}
    assert any(c["raised_at"] is not None for c in CASES) and any(c["raised_at"] is None for c in CASES)

    def held(case):  # an overflow that left the scale alone: hysteresis at work
        scales = [case["settings"]["init_scale"]] + case["scales"]
        return any(ch == "x" and scales[i + 1] == scales[i] for i, ch in enumerate(case["pattern"][: len(scales) - 1]))

    assert any(held(c) for c in CASES if c["settings"]["delayed_shift"] > 1)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reproduces_deepspeed(case):
    scales, budgets, raised_at = run(ours(case["settings"]), case["pattern"])
    assert raised_at == case["raised_at"]
    assert scales == case["scales"]
    assert budgets == case["cur_hysteresis"]
    assert all(type(s) is float for s in scales)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_state_dict_round_trip_continues_the_same(case):
    """Saved after any update and loaded (through JSON, as a checkpoint would carry it) into a
    fresh scaler with another initial scale, the run continues exactly as recorded."""
    pattern, recorded = case["pattern"], case["scales"]
    for split in range(1, len(recorded)):
        first = ours(case["settings"])
        for char in pattern[:split]:
            first.update(char == "x")
        resumed = ours(case["settings"], init_scale=1234.0)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        scales, budgets, raised_at = run(resumed, pattern[split:])
        assert scales == recorded[split:], f"resumed after update {split}"
        assert budgets == case["cur_hysteresis"][split:], f"resumed after update {split}"
        assert raised_at == (None if case["raised_at"] is None else case["raised_at"] - split)


def test_state_dict_holds_the_counters():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2, hysteresis=3)
    for found_inf in (False, True, False, True):
        scaler.update(found_inf)
    assert scaler.state_dict() == {"scale": 8.0, "cur_hysteresis": 1, "cur_iter": 4, "last_overflow_iter": 3}


@pytest.mark.parametrize("good_steps", [0, 1, 2])
def test_loads_a_state_saved_before_hysteresis(good_steps):
    """{"scale", "good_steps"} alone: `good_steps` good updates since the last overflow, a full
    hysteresis budget, so the run goes on as a fresh scaler's after that many good updates."""
    pattern = "...x.x..x.xx......x"
    fresh = DynamicLossScaler(init_scale=64.0, growth_interval=3, hysteresis=2)
    for _ in range(good_steps):
        fresh.update(False)
    assert fresh.scale == 64.0  # no growth yet: an old state never held a full window
    old = DynamicLossScaler(init_scale=1.0, growth_interval=3, hysteresis=2)
    old.load_state_dict({"scale": 64.0, "good_steps": good_steps})
    assert run(old, pattern) == run(fresh, pattern)


def test_missing_keys_load_as_a_fresh_scaler():
    loaded = DynamicLossScaler(init_scale=1.0, growth_interval=2, hysteresis=2)
    loaded.load_state_dict({"scale": 32.0})
    fresh = DynamicLossScaler(init_scale=32.0, growth_interval=2, hysteresis=2)
    assert loaded.state_dict() == fresh.state_dict()


def test_a_budget_above_hysteresis_is_cut_down():
    scaler = DynamicLossScaler(hysteresis=2)
    scaler.load_state_dict({"scale": 16.0, "cur_hysteresis": 5, "cur_iter": 3, "last_overflow_iter": 1})
    assert scaler.cur_hysteresis == 2
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 8.0


def test_hysteresis_one_lowers_on_every_overflow():
    scaler = DynamicLossScaler(init_scale=2.0**16)
    scaler.update(True)
    assert scaler.scale == 2.0**15


def test_factors_other_than_two():
    """DeepSpeed fixes both factors at 2; the other values keep their meaning under its rules."""
    scaler = DynamicLossScaler(init_scale=64.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2,
                               min_scale=2.0, hysteresis=2)  # fmt: skip
    scales, _, _ = run(scaler, "...x.xx....xx")
    assert scales == [64.0, 64.0, 256.0, 256.0, 256.0, 64.0, 16.0, 16.0, 16.0, 64.0, 64.0, 64.0, 16.0]


def test_static_never_changes():
    scaler = DynamicLossScaler(init_scale=128.0, growth_interval=1, static=True, hysteresis=2)
    state = scaler.state_dict()
    for found_inf in (True, True, True, False, False, False):
        scaler.update(found_inf)
    assert scaler.state_dict() == state and scaler.scale == 128.0


def test_the_minimum_error_names_the_fix():
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, raise_error_at_min_scale=True)
    with pytest.raises(scaler_module.LossScaleAtMinimumError, match="min_loss_scale"):
        scaler.update(True)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"hysteresis": 0}, "hysteresis"),
        ({"hysteresis": -1}, "hysteresis"),
        ({"hysteresis": 2.0}, "hysteresis"),
        ({"hysteresis": True}, "hysteresis"),
        ({"consecutive_hysteresis": 1}, "consecutive_hysteresis"),
        ({"raise_error_at_min_scale": "yes"}, "raise_error_at_min_scale"),
        ({"static": None}, "static"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"min_scale": 0.0}, "min_scale"),
    ],
)  # fmt: skip
def test_bad_arguments_raise_value_error(kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}="):
        DynamicLossScaler(**kwargs)


def test_every_bad_argument_is_named_at_once():
    with pytest.raises(ValueError) as error:
        DynamicLossScaler(hysteresis=0, growth_interval=0, consecutive_hysteresis=None)
    message = str(error.value)
    assert "hysteresis=0" in message and "growth_interval=0" in message and "consecutive_hysteresis=None" in message


def test_the_old_keyword_arguments_still_work():
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000,
                               min_scale=1.0, static=False)  # fmt: skip
    assert (scaler.scale, scaler.hysteresis, scaler.consecutive_hysteresis) == (1024.0, 1, False)
