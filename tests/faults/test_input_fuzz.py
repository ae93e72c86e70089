"""Hostile and malformed input: the offload config loader and `--sharded_ddp` fuzzed.

Whatever the JSON (random values, types, nesting, huge numbers, NaN, unicode keys), whatever
the bytes (invalid UTF-8, truncated JSON), whatever the `--sharded_ddp` text, the only outcome
besides success is the project's own error, with a short message that names the place (a JSON
path from `$`) and never a traceback from deep inside. Each fuzz test runs a fixed number of
derandomized examples, so a CI failure reproduces on any machine; the `@example`s are the
inputs that broke the loader once.
"""

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trainer_shard.args import ShardedSeq2SeqTrainingArguments, ShardedDDPOption, parse_sharded_ddp
from trainer_shard.config import OffloadConfig, load_config
from trainer_shard.config.schema import TOP
from trainer_shard.errors import ArgumentError, ConfigError

MAX_MESSAGE = 5000  # characters, whatever the input's size
MAX_PROBLEM = 600  # characters for one problem line

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same examples on every run and machine
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Literals json.dumps cannot write, put in by `dump`: 1e999 (read back as inf, so that inf
# reaches the type checks: Infinity is refused at parse time) and a 5,000-digit integer (more
# than Python converts).
INF_LITERAL = "\x00inf-literal\x00"
LONG_LITERAL = "\x00long-literal\x00"
HUGE = [10**400, -(10**400), 2**63, 2**64 + 1, -1, 0, 10**4000, INF_LITERAL, LONG_LITERAL]


# ---- strategies ---------------------------------------------------------------------------------


def _schema_words(spec: dict) -> set:
    words = set()
    for name, key in spec.items():
        words.add(name)
        words.update(str(c) for c in key.choices)
        words.update(_schema_words(key.children))
    return words


SCHEMA_WORDS = sorted(_schema_words(TOP) | {"auto", "cpu", "disk", "cuda:0", "0", "2GiB", "500MB"})

keys = st.text(max_size=12) | st.sampled_from(SCHEMA_WORDS) | st.sampled_from(["x" * 5000, "\ud800", "a.b", "$"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(HUGE)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(SCHEMA_WORDS)
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=20
)


def _number_for(key):
    """Numbers around a key's bounds, the usual suspects, and inf reaching the checks."""
    edges = [v for v in (key.minimum, key.maximum) if v is not None]
    near = [e + d for e in edges for d in (-1, -0.5, 0, 0.5, 1)]
    return (
        st.sampled_from(near + HUGE + [0.0, -0.0, 1e-300, 1e300, 2.5])
        | st.integers(min_value=-5, max_value=70)
        | st.floats(allow_nan=False, allow_infinity=False)
    )


def _value_for(key):
    """A value for one schema key: mostly of roughly the right kind, sometimes anything."""
    kind = key.kind
    if kind == "object":
        right = _document(key.children)
    elif kind in ("int", "float"):
        right = _number_for(key)
    elif kind == "bool":
        right = st.booleans()
    elif kind in ("choice", "str"):
        right = st.sampled_from([*map(str, key.choices), "", "x" * 300]) | st.text(max_size=30)
    elif kind == "floats":
        right = st.lists(_number_for(key), min_size=0, max_size=3)
    elif kind == "strs":
        right = st.lists(st.text(max_size=10), max_size=3)
    elif kind == "memory":
        devices = st.sampled_from(["cpu", "disk", "mps", "0", "cuda:1", "gpu", "-1", "²", "٣", "1" * 5000])
        devices |= st.text(max_size=8)
        sizes = st.sampled_from(["2GiB", "500MB", "1.5 kb", "9" * 400 + "TB", "-1GB", "1e9", ""]) | _number_for(key)
        right = st.dictionaries(devices, sizes, max_size=3)
    elif kind == "device_map":
        modules = st.sampled_from(["encoder", "decoder.block.0", "x" * 300]) | st.text(max_size=8)
        devices = st.sampled_from(["cpu", "disk", 0, "cuda:0", -1, "²", 10**400, True])
        right = st.sampled_from(["auto", "balanced", "nope"]) | st.dictionaries(modules, devices, max_size=3)
    elif kind == "any":  # ignored, ZeRO-3 and refused keys: anything a JSON file can hold
        right = json_values
    else:
        raise AssertionError(f"no strategy for kind {kind}")
    return right | st.just("auto") | json_values


def _document(spec: dict):
    """Objects built from the real schema: known keys with random values, now and then a stray key."""
    optional = {name: st.deferred(lambda key=key: _value_for(key)) for name, key in spec.items()}
    known = st.fixed_dictionaries({}, optional=optional)
    stray = st.dictionaries(keys, json_values, max_size=2)
    stray |= st.dictionaries(st.text(), st.none(), min_size=20, max_size=40)  # many unknown keys in one object
    return st.tuples(known, stray | st.just({})).map(lambda pair: {**pair[1], **pair[0]})


schema_documents = _document(TOP)


def dump(document) -> bytes:
    text = json.dumps(document, ensure_ascii=False, allow_nan=True)  # NaN, Infinity: loads accepts them
    text = text.replace(json.dumps(INF_LITERAL), "1e999").replace(json.dumps(LONG_LITERAL), "7" * 5000)
    return text.encode("utf-8", "backslashreplace")  # a lone surrogate becomes the JSON escape \ud800


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def _spliced(document, junk: bytes, at: int) -> bytes:
    text = dump(document)
    return text[:at] + junk + text[at:]


raw_bytes = (
    st.binary(max_size=200)
    | st.integers(min_value=1, max_value=100_000).map(lambda n: nested(n).encode())
    | st.integers(min_value=1, max_value=5_000).map(lambda n: f'{{"optimizer": {nested(n)}}}'.encode())
    | st.builds(lambda d, n: dump(d)[:n], schema_documents, st.integers(min_value=0, max_value=400))  # truncated
    | st.builds(_spliced, schema_documents, st.binary(min_size=1, max_size=3), st.integers(min_value=0, max_value=60))
)


# ---- checks -------------------------------------------------------------------------------------


def readable(message) -> None:
    assert isinstance(message, str) and message
    assert len(message) < MAX_MESSAGE, f"{len(message)} characters: {message[:300]}..."
    assert "Traceback" not in message
    message.encode("utf-8")  # printable: a lone surrogate from JSON "\ud800" would fail here


def check_config_error(error: ConfigError) -> None:
    assert type(error) is ConfigError
    readable(str(error))
    assert error.problems
    for where, message in error.problems:
        assert isinstance(where, str) and where.startswith("$"), where
        assert len(where) + len(message) < MAX_PROBLEM, f"{where}: {message[:300]}..."


def load(path, **kwargs):
    """The loader's outcome: an OffloadConfig, or its ConfigError checked. Anything else escapes."""
    try:
        config = load_config(path, **kwargs)
    except ConfigError as e:
        check_config_error(e)
        return e
    assert isinstance(config, OffloadConfig)
    return config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def training_args(workdir):
    return ShardedSeq2SeqTrainingArguments(output_dir=str(workdir / "out"), use_cpu=True)


def write(workdir, data: bytes):
    path = workdir / "config.json"
    path.write_bytes(data)
    return path


# ---- the offload config -------------------------------------------------------------------------


@FUZZ
@given(document=json_values)
@example(document={"zero_optimization": {"reduce_bucket_size": 10**400}})  # OverflowError once
@example(document={f"k{i}": i for i in range(1000)})  # 224,000 characters once
def test_any_json_document(workdir, training_args, document):
    path = write(workdir, dump(document))
    load(path)
    load(path, training_args=training_args, world_size=1)
    load(path, training_args=training_args, world_size=2)


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
@FUZZ
@given(document=schema_documents)
@example(document={"scheduler": "auto"})  # TypeError once: the object's default (None) stood in
@example(document={"optimizer": {"params": "auto"}})  # AttributeError once
@example(document={"max_memory": {"cpu": "9" * 400 + "TB"}})  # OverflowError once (float inf to int)
@example(document={"train_micro_batch_size_per_gpu": 10**400})  # OverflowError once, also against the arguments
def test_documents_from_the_schema(workdir, training_args, document):
    path = write(workdir, dump(document))
    load(path, world_size=1)
    load(path, training_args=training_args, world_size=1)
    load(path, training_args=training_args, world_size=2)


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
@FUZZ
@given(data=raw_bytes)
@example(data=b"[" * 100_000)  # RecursionError once
@example(data=b'{"\\ud800": 1}')  # a message that could not be printed once
def test_raw_bytes(workdir, data):
    load(write(workdir, data))


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
@settings(FUZZ, max_examples=150)
@given(document=schema_documents)
def test_offload_flag(workdir, document):
    path = write(workdir, dump(document))
    try:
        ShardedSeq2SeqTrainingArguments(output_dir=str(workdir / "out"), offload=str(path), use_cpu=True)
    except ArgumentError as e:
        assert type(e) is ArgumentError
        readable(str(e))
        assert all(p.startswith("--") for p in e.problems), e.problems


# ---- --sharded_ddp ------------------------------------------------------------------------------

OPTION_WORDS = [o.value for o in ShardedDDPOption]
sharded_ddp_text = (
    st.text(max_size=60)
    | st.lists(st.sampled_from(OPTION_WORDS) | st.text(max_size=8), max_size=5).map(" ".join)
    | st.lists(st.sampled_from(OPTION_WORDS), max_size=5).map(",".join)
)
sharded_ddp_values = sharded_ddp_text | st.lists(json_values | st.sampled_from(OPTION_WORDS), max_size=5) | json_values


@FUZZ
@given(value=sharded_ddp_values)
@example(value=[10**5000])  # ValueError from repr() once
@example(value=" ".join(["bogus"] * 10_000))  # 10,000 problems once
def test_parse_sharded_ddp(value):
    options, problems = parse_sharded_ddp(value)
    assert all(isinstance(o, ShardedDDPOption) for o in options)
    for problem in problems:
        readable(problem)
        assert problem.startswith("--sharded_ddp"), problem
    readable("\n".join(problems) or "ok")


@settings(FUZZ, max_examples=150)
@given(text=sharded_ddp_text)
def test_sharded_ddp_flag(workdir, text):
    try:
        args = ShardedSeq2SeqTrainingArguments(output_dir=str(workdir / "out"), sharded_ddp=text, use_cpu=True)
    except ArgumentError as e:
        assert type(e) is ArgumentError
        readable(str(e))
        return
    assert all(isinstance(o, ShardedDDPOption) for o in args.sharded_ddp)


# ---- the inputs the fuzz found, one by one, with what the message says now ----------------------

REGRESSIONS = [
    # (file content, JSON path, fragment of its message)
    ({"zero_optimization": {"reduce_bucket_size": 10**400}}, "$.zero_optimization.reduce_bucket_size",
     "must be at most 9,223,372,036,854,775,807 (2**63 - 1), got 100000... (401 digits)"),
    ({"zero_optimization": {"allgather_bucket_size": 1e300}}, "$.zero_optimization.allgather_bucket_size",
     "must be at most 9,223,372,036,854,775,807 (2**63 - 1), got 1e+300"),
    ({"optimizer": {"params": {"lr": -(10**400)}}}, "$.optimizer.params.lr", "must be >= 0.0, got -100000... (401 digits)"),
    ({"zero_optimization": {"stage": 10**400}}, "$.zero_optimization.stage", "must be <= 3, got 100000... (401 digits)"),
    ({"max_memory": {"cpu": "9" * 400 + "TB"}}, "$.max_memory", '"cpu": must be a size such as 2GiB'),
    ({"max_memory": {"cpu": "9" * 20 + "TB"}}, "$.max_memory", "is more than 2**63 - 1 bytes; write a size such as 24GiB"),
    ({"scheduler": "auto"}, "$.scheduler", 'must be an object {...}, got "auto"'),
    ({"zero_optimization": {"offload_optimizer": "auto"}}, "$.zero_optimization.offload_optimizer", "must be an object"),
    ({"optimizer": {"params": "auto"}}, "$.optimizer.params", "must be an object"),
    ({"inference": "auto"}, "$.inference", "must be an object"),
    ({f"k{i}": i for i in range(1000)}, "$", 'has 1000 unknown keys ("k0", "k1", "k2", "k3", "k4", ...); remove them'),
    ({"x" * 100_000: 1}, '$["xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...]', "unknown key"),
    ({"steps-per-print": 1}, '$["steps-per-print"]', "unknown key (did you mean steps_per_print?)"),
    (b'{"\\ud800": 1}', '$["\\ud800"]', "unknown key"),
    (b"[" * 100_000, "$", "nests lists or objects too deeply to read"),
    (b'{"train_batch_size": ' + b"7" * 5000 + b"}", "$", "an integer of 5,000 digits (777777777777...); no setting takes"),
    ({"max_memory": {"\u00b2": "1GB"}}, "$.max_memory", 'key "\u00b2" is not a device: use cpu, disk, mps or a GPU index'),
    ({"max_memory": {"0": "1GB", "cuda:0": "2GB"}}, "$.max_memory", 'names device 0 twice ("0" and "cuda:0"); keep one'),
    ({"inference": {"device_map": {"encoder": 10**400}}}, "$.inference.device_map",
     "module 'encoder': value 100000... (401 digits) is not a device"),
    (b'{"bf16": {"enabled": true}, "bf16": {"enabled": false}}', "$", 'key "bf16" written twice in one object'),
    (b"\xef\xbb{}", "$", "not UTF-8 text (byte 0xef at line 1, byte offset 0); save the file as UTF-8"),
    (b" " * (2**20 + 1), "$", "is 1,048,577 bytes; an offload config is a few hundred"),
]  # fmt: skip


@pytest.mark.parametrize("content, where, fragment", REGRESSIONS)
def test_what_the_fuzz_found(tmp_path, content, where, fragment):
    path = tmp_path / "c.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    with pytest.raises(ConfigError) as e:
        load_config(path)
    check_config_error(e.value)
    found = dict(e.value.problems)
    assert where in found and fragment in found[where], str(e.value)


def test_a_byte_order_mark_is_fine(tmp_path):
    path = tmp_path / "c.json"
    path.write_bytes(b'\xef\xbb\xbf{"bf16": {"enabled": true}}')  # as some Windows editors save UTF-8
    assert load_config(path).precision == "bf16"


def test_a_folder_is_named_as_one(tmp_path):
    with pytest.raises(ConfigError, match="is a folder; pass the path of a JSON config file"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    "value, fragment",
    [
        ([10**5000], "unknown option <int, too large to show>"),
        ("x" * 100_000, "unknown option 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...;"),
        (" ".join(["bogus"] * 10_000), "unknown option 'bogus'; the options are"),
        ("zero2 offlaod q1 q2", "unknown options 'zero2' (did you mean 'zero_dp_2'?), 'offlaod' (did you mean "
         "'offload'?), 'q1' and 1 more; the options are: simple"),
        ({"a": "x" * 10_000}, "must be a string of space-separated options, got {'a': 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx..."),
    ],
)  # fmt: skip
def test_sharded_ddp_what_the_fuzz_found(value, fragment):
    _, problems = parse_sharded_ddp(value)
    assert len(problems) == 1 and fragment in problems[0] and len(problems[0]) < 300, problems
