"""Saving the model of a sharded run without a second copy of it in memory.

The sharded optimizer keeps every parameter as a view of one flat buffer. `save_pretrained`
sees tensors that share storage and clones each of them before writing (safetensors does not
allow aliasing): a full copy of the model at every save, 5.7 GB for t5-3b in bf16. Here the
safetensors file is written tensor by tensor straight from the views:

    save_model(model, "output/")   # model.safetensors, config.json, generation_config.json

The file is the standard format (8-byte header length, JSON header, raw little-endian bytes),
loaded by `from_pretrained` and `safetensors.torch.load_file` as any other.
"""

import functools
import json
import os
import re
import shutil
import struct
import warnings
import zlib
from pathlib import Path

import torch

from .constants import CHUNK_NUMEL
from .disk import existing_parent, format_bytes, free_bytes, is_writable
from .errors import CheckpointError

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}  # fmt: skip
_NAMES = {name: dtype for dtype, name in _DTYPES.items()}


def unique_state_dict(model) -> dict:
    """`model.state_dict()` without tied duplicates, keeping the names `from_pretrained` expects.
    The values are the parameters and buffers themselves, detached. Tensors are the same when
    they share memory, or (a ZeRO-3 parameter between gathers: no memory) are one object."""
    state = model.state_dict(keep_vars=True)
    tied = _tied_patterns(model)
    groups = {}
    for name, tensor in state.items():
        if tensor.untyped_storage().nbytes() == 0:
            key = id(tensor)
        else:
            key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        groups.setdefault(key, []).append(name)
    keep = {}
    for names in groups.values():
        untied = [n for n in names if not any(re.search(p, n) for p in tied)]
        name = (untied or sorted(names))[0]
        keep[name] = state[name]
    return {name: keep[name].detach() for name in state if name in keep}


def _tied_patterns(model) -> list:
    keys = getattr(model, "_tied_weights_keys", None) or []
    return list(keys.keys() if isinstance(keys, dict) else keys)


class Chunked:
    """A tensor written piece by piece: `read(start, out)` fills `out` with its flattened
    elements [start, start + len(out)). For state that is never whole in memory (a disk store)."""

    def __init__(self, dtype, shape, read, chunk_numel: int = CHUNK_NUMEL):
        self.dtype, self.shape, self.read, self.chunk_numel = dtype, tuple(shape), read, chunk_numel

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def save_safetensors(tensors: dict, path, metadata: dict | None = None, per_tensor: bool = False) -> dict:
    """Write `tensors` (tensors or `Chunked`) to `path` in safetensors format, one at a time,
    copying none of them (a CPU tensor is written from its own memory, a `Chunked` through one
    chunk buffer). Written to `path.tmp`, fsynced, then renamed. Returns {"bytes", "crc32"} of the
    file, and with `per_tensor` "tensors": {name: {"dtype", "shape", "crc32"}}, the CRC-32 of each
    tensor's bytes (what a checkpoint's manifest records of its weights, whatever files they are
    later split into); both come from one pass over the bytes."""
    tmp = Path(f"{path}.tmp")
    written = write_safetensors(tensors, tmp, metadata, per_tensor)
    os.replace(tmp, path)  # a save that fails half-way leaves the previous file in place
    return written


def write_safetensors(tensors: dict, path, metadata: dict | None = None, per_tensor: bool = False) -> dict:
    """`save_safetensors` straight into `path`, fsynced, with no rename; a write that fails
    (a full disk) removes what it wrote."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {tensor.dtype} cannot be saved in safetensors")
        size = tensor.numel() * _itemsize(tensor.dtype)
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    crcs = {}
    try:
        with open(path, "wb") as f:
            crc = _Crc(f)
            crc.write(struct.pack("<Q", len(encoded)))
            crc.write(encoded)
            for name, tensor in tensors.items():
                crcs[name] = crc.write_tensor(_pieces(tensor))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)  # a full disk leaves no partial file behind
        raise
    written = {"bytes": crc.bytes, "crc32": crc.value}
    if per_tensor:
        written["tensors"] = {name: {**{k: header[name][k] for k in ("dtype", "shape")}, "crc32": crcs[name]}
                              for name in tensors}  # fmt: skip
    return written


def _pieces(tensor):
    """CPU, contiguous pieces of `tensor` in order."""
    if isinstance(tensor, Chunked):
        buffer = torch.empty(min(tensor.chunk_numel, max(tensor.numel(), 1)), dtype=tensor.dtype)
        for start in range(0, tensor.numel(), tensor.chunk_numel):
            out = buffer[: min(tensor.chunk_numel, tensor.numel() - start)]
            tensor.read(start, out)
            yield out
        return
    data = tensor.detach()
    if data.device.type != "cpu" or not data.is_contiguous():
        data = data.to("cpu").contiguous()
    if data.numel():
        yield data


class _Crc:
    """A file writer that counts bytes and keeps the CRC-32 of what went through it."""

    def __init__(self, f):
        self.f, self.bytes, self.value = f, 0, 0

    def write(self, data) -> None:
        self.f.write(data)
        self.value = zlib.crc32(data, self.value)
        self.bytes += len(data)

    def write_tensor(self, pieces) -> int:
        """Write a tensor's pieces; returns the CRC-32 of its bytes alone (the file's follows by
        `crc32_combine`, so the bytes are read once)."""
        value = size = 0
        for piece in pieces:
            data = memoryview(piece.reshape(-1).view(torch.uint8).numpy())
            self.f.write(data)
            value = zlib.crc32(data, value)
            size += len(data)
        self.value = crc32_combine(self.value, value, size)
        self.bytes += size
        return value


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len(B) (zlib's
    `crc32_combine`, which Python does not expose): crc1 is run through `length2` zero bytes by
    the GF(2) operators for 2**k zero bytes, one per set bit of `length2`."""
    k = 0
    while length2:
        if length2 & 1:
            crc1 = _gf2_times(_zero_bytes_operator(k), crc1)
        length2 >>= 1
        k += 1
    return crc1 ^ crc2


def _gf2_times(matrix: list, vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


@functools.cache
def _zero_bytes_operator(k: int) -> list:
    """The 32x32 GF(2) matrix that appends 2**k zero bytes to a CRC-32 (one squaring per k)."""
    if k == 0:
        operator = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit: the reflected polynomial
        for _ in range(3):  # 2, 4, 8 bits
            operator = [_gf2_times(operator, row) for row in operator]
        return operator
    previous = _zero_bytes_operator(k - 1)
    return [_gf2_times(previous, row) for row in previous]


def file_crc32(path, block: int = 2**24) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            value = zlib.crc32(chunk, value)
    return value


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class SafetensorsFile:
    """Reads tensors, or element ranges of them, from a safetensors file with `pread`: nothing is
    memory-mapped, so reading a piece costs only that piece (mapped pages would count in the
    process's resident memory as the whole file is read).

        f = SafetensorsFile("rank-00000-of-00002.safetensors")
        f.read("flat0.exp_avg", 1000, 2000)   # elements [1000, 2000) of the flattened tensor

    A file too short for its header, or a header that is not valid, raises `CheckpointError`
    naming the file; its `problem` says what is wrong without the advice. Close it (or use it in
    a `with` block): one left open warns, as Python's own files do (`ResourceWarning`).
    """

    _fd = None

    def __init__(self, path):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise _unreadable(f"cannot open checkpoint file {str(self.path)!r}: {e.strerror}") from None
        size = os.fstat(self._fd).st_size
        try:
            (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if not 0 < length <= size - 8:
                raise ValueError(f"header length {length} for a {size}-byte file")
            header = json.loads(os.pread(self._fd, length, 8))
            self.metadata = header.pop("__metadata__", None) or {}
            self._data_start = 8 + length
            self.tensors = {}
            for name, info in header.items():
                begin, end = info["data_offsets"]
                dtype = _NAMES[info["dtype"]]
                if not 0 <= begin <= end <= size - self._data_start:
                    raise ValueError(f"{name!r} lies beyond the end of the file")
                self.tensors[name] = (dtype, tuple(info["shape"]), begin, end)
        except (ValueError, KeyError, TypeError, struct.error) as e:
            self.close()
            raise _unreadable(f"checkpoint file {str(self.path)!r} is corrupt or truncated ({e})") from None

    def keys(self):
        return self.tensors.keys()

    def dtype(self, name: str):
        return self.tensors[name][0]

    def shape(self, name: str) -> tuple:
        return self.tensors[name][1]

    def read(self, name: str, start: int = 0, end: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of tensor `name`, flattened (into `out` when given); the whole
        tensor in its shape when neither bound is given."""
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint file {str(self.path)!r} has no tensor {name!r}")
        dtype, shape, begin, _ = self.tensors[name]
        whole = start == 0 and end is None
        numel = 1
        for d in shape:
            numel *= d
        end = numel if end is None else end
        if out is None:
            out = torch.empty(end - start, dtype=dtype)
        if out.numel():
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            self._read_into(view, self._data_start + begin + start * _itemsize(dtype), name)
        return out.view(shape) if whole else out

    def crc32(self, name: str, block: int = 2**24) -> int:
        """The CRC-32 of tensor `name`'s bytes, read `block` bytes at a time."""
        _, _, begin, end = self.tensors[name]
        value, offset, stop = 0, self._data_start + begin, self._data_start + end
        buffer = memoryview(bytearray(min(block, max(end - begin, 1))))
        while offset < stop:
            view = buffer[: min(len(buffer), stop - offset)]
            self._read_into(view, offset, name)
            value = zlib.crc32(view, value)
            offset += len(view)
        return value

    def _read_into(self, view: memoryview, offset: int, name: str) -> None:
        """Fill `view` from `offset`. One read call returns at most 0x7ffff000 bytes on Linux
        (about 2 GiB; and any call may return fewer), so read until it is full; only a read that
        returns nothing means the file ends early."""
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(f"checkpoint file {str(self.path)!r} ends inside {name!r}: truncated")
            done += got

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        if self._fd is not None:
            warnings.warn(f"unclosed checkpoint file {str(self.path)!r}", ResourceWarning, stacklevel=2)
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _unreadable(problem: str) -> CheckpointError:
    error = CheckpointError(f"{problem}; resume from an earlier checkpoint")
    error.problem = problem
    return error


def save_model(model, output_dir, max_shard_size: int = 5 * 10**9) -> dict:
    """The weights (model.safetensors, or files of at most `max_shard_size` bytes and their
    index) and the configuration files `from_pretrained` reads, each replaced in place only once
    its new version is written (see [Note: saving weights in place]). Returns {file: {"bytes",
    "crc32"}} of the weights files."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    files = save_sharded(unique_state_dict(model), output_dir, max_shard_size)
    save_configs(model, output_dir)
    return files


def save_configs(model, output_dir) -> None:
    """config.json, and generation_config.json when the model generates, into `output_dir`: written
    in a temporary folder there, fsynced, then renamed over the previous ones (a failed write
    leaves those as they were)."""
    output_dir = Path(output_dir)
    tmp = output_dir / ".trainer_shard-config.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(tmp)
        for path in sorted(tmp.iterdir()):
            _fsync(path)
            os.replace(path, output_dir / path.name)
        _fsync(output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# [Note: saving weights in place]
# A model folder is saved over in place (`save_model`, `consolidate OUT`, ZeRO-3's weights), and
# a save may fail half-way (a full disk). So nothing is removed first: every new weights file is
# written under a temporary name (its own name + ".tmp") in the same folder and fsynced; a
# failure removes these and leaves the previous model as it was. Then they are renamed into
# place, the index last, and the folder fsynced; only then are the weights files of the previous
# save that the new layout does not name removed (model.safetensors last: `from_pretrained` reads
# it whenever it is there, so until then it still reads the previous model whole). Only files of
# exactly the shapes written here are ever removed: model.safetensors, model-NNNNN-of-NNNNN
# .safetensors, model.safetensors.index.json (and their ".tmp", left by a killed save); a user's
# model_ema.safetensors stays. One window remains: a split saved over a split of the same number
# of files replaces them one rename at a time (no write can fail there, but a crash in it leaves
# a mix).

_OWN_WEIGHTS = re.compile(r"(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)"
                          r"(\.tmp)?")


def save_sharded(tensors: dict, out, limit: int) -> dict:
    """`out/model.safetensors`, or several files of at most `limit` bytes (a bigger tensor alone)
    with `model.safetensors.index.json`, the layout `from_pretrained` reads a file at a time,
    saved over a previous model in place (see [Note: saving weights in place]). Returns
    {file name: {"bytes", "crc32", "tensors"}} (see `save_safetensors`)."""
    out = Path(out)
    groups = _split(tensors, limit)
    names = [WEIGHTS] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                  for i in range(len(groups))]  # fmt: skip
    staged, files = [], {}
    try:
        for name, group in zip(names, groups):
            staged.append(out / f"{name}.tmp")
            files[name] = write_safetensors(group, staged[-1], {"format": "pt"}, True)
        if len(groups) > 1:
            staged.append(out / f"{WEIGHTS_INDEX}.tmp")
            _write_synced(staged[-1], json.dumps(_index(groups, names), indent=2))
        for tmp in staged:  # the index last: it names only files already in place
            os.replace(tmp, tmp.with_suffix(""))
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)  # nothing left when it failed; already renamed when it did not
    _fsync(out)
    _remove_stale_weights(out, {tmp.with_suffix("").name for tmp in staged})
    return files


def _split(tensors: dict, limit: int) -> list:
    """`tensors` in order, in groups of at most `limit` bytes (a bigger tensor alone)."""
    groups, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * _itemsize(tensor.dtype)
        if current and size + nbytes > limit:
            groups.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    groups.append(current)
    return groups


def _index(groups: list, names: list) -> dict:
    total = sum(t.numel() * _itemsize(t.dtype) for group in groups for t in group.values())
    weight_map = {tensor: name for name, group in zip(names, groups) for tensor in group}
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def _remove_stale_weights(out: Path, keep: set) -> None:
    """The weights files (of the shapes this module writes, see `_OWN_WEIGHTS`) in `out` that are
    not in `keep`: a previous save's other split. model.safetensors last."""
    stale = sorted((p for p in out.iterdir() if p.name not in keep and _OWN_WEIGHTS.fullmatch(p.name) and p.is_file()),
                   key=lambda p: p.name == WEIGHTS)  # fmt: skip
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        _fsync(out)


def _write_synced(path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def check_writable(folder, needed: int, what: str, purpose: str = "") -> None:
    """Raise `CheckpointError` unless `folder` (made or not yet) can take `needed` more bytes
    (`purpose`: for what, said in the message)."""
    base = existing_parent(folder)
    if not is_writable(base):
        raise CheckpointError(f"{what} {str(folder)!r} cannot be written: {str(base)!r} is read-only; point it at a "
                              "writable folder")  # fmt: skip
    free = free_bytes(base)
    if free < needed:
        raise CheckpointError(f"{what} {str(folder)!r}: {format_bytes(needed)} are needed{purpose} and {str(base)!r} has "
                              f"{format_bytes(free)} free; free space there or point it at a disk with room")  # fmt: skip


# ---- crash safety ---------------------------------------------------------------------------------

MANIFEST = "checkpoint_manifest.json"
STAGING = ".checkpoint-staging"  # checkpoints are written here, then renamed into place
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# [Note: the manifest and the weights' form]
# The manifest records what a checkpoint needs, so that resuming refuses a missing, truncated or
# altered file. Most files are recorded whole (size and CRC-32). The model's weights are recorded
# by tensor (dtype, shape, CRC-32 of its bytes) under "weights", not by file: transformers'
# tooling and `save_pretrained(max_shard_size=...)` re-split model.safetensors into
# model-0000k-of-0000n.safetensors with an index (or merge them back), and the Trainer resumes
# from either form. What is checked is the form `from_pretrained` reads now (model.safetensors
# when present, else the files its index names): every saved tensor in it, with its dtype, shape
# and bytes. A manifest written before this (weights files under "files") is checked file by file.


def write_manifest(folder, known: dict | None = None) -> None:
    """`folder/checkpoint_manifest.json`: every file's size and CRC-32, and the weights tensor by
    tensor (see [Note: the manifest and the weights' form]). `known` entries, by relative path,
    are taken as given: the writer computed them as it wrote (with "tensors" for weights files)."""
    folder = Path(folder)
    known = known or {}
    weights_files, _ = current_weights(folder)
    files, weights = {}, {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = path.relative_to(folder).as_posix()
        if name == WEIGHTS_INDEX:
            continue  # part of the weights' form, checked through the files it names
        tensors = (known.get(name) or {}).get("tensors") if name in weights_files else None
        if name in weights_files and tensors is None:
            tensors = _tensor_records(path)
        if tensors is not None:
            weights.update(tensors)
            continue
        entry = known.get(name) or {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
        files[name] = {"bytes": entry["bytes"], "crc32": entry["crc32"]}
    manifest = {"files": files, **({"weights": weights} if weights else {})}
    tmp = folder / f"{MANIFEST}.tmp"
    _write_synced(tmp, json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)


def _tensor_records(path) -> dict | None:
    """{tensor: {"dtype", "shape", "crc32"}} of a safetensors file; None when it is not one."""
    try:
        with SafetensorsFile(path) as f:
            return {name: {"dtype": _DTYPES[f.dtype(name)], "shape": list(f.shape(name)), "crc32": f.crc32(name)}
                    for name in f.keys()}  # fmt: skip
    except CheckpointError:
        return None


def current_weights(folder) -> tuple:
    """(file names, problems): the safetensors weights `from_pretrained` and the Trainer read in
    `folder`: model.safetensors when it is there, else the files model.safetensors.index.json
    names; no files when there are neither."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        return [WEIGHTS], []
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        return [], []
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values())), []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [], [f"{str(index)!r} is corrupt ({type(e).__name__}: {e})"]


def manifest_problems(folder, rank: int = 0, world_size: int = 1) -> list:
    """What is wrong with a checkpoint against its manifest: missing files, sizes, and the CRC-32
    of every `world_size`-th file (this rank's share); the weights in whatever form they are now
    (`weights_problems`). [] without a manifest (a plain Trainer's)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return []
    try:
        manifest = json.loads(path.read_text())
        files, weights = manifest["files"], manifest.get("weights")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{str(path)!r} is corrupt ({e})"]
    problems = file_problems(folder, files, rank, world_size)
    if weights:
        problems += weights_problems(folder, weights, rank, world_size)
    return problems


def file_problems(folder, files: dict, rank: int = 0, world_size: int = 1) -> list:
    """Files of `files` ({relative path: {"bytes", "crc32"}}) missing or of another size under
    `folder`; and the CRC-32 of every `world_size`-th file, this rank's share of the reading."""
    problems = []
    for position, (name, info) in enumerate(sorted(files.items())):
        file = Path(folder) / name
        if not file.is_file():
            problems.append(f"{str(file)!r} is missing")
        elif file.stat().st_size != info["bytes"]:
            problems.append(f"{str(file)!r} has {file.stat().st_size} bytes, {info['bytes']} were saved: truncated")
        elif position % world_size == rank and file_crc32(file) != info["crc32"]:
            problems.append(f"{str(file)!r} is corrupt: its CRC-32 differs from the one recorded when it was saved")
    return problems


def weights_problems(folder, saved: dict, rank: int = 0, world_size: int = 1) -> list:
    """The weights as `from_pretrained` finds them in `folder` now (`current_weights`: one file,
    or any split with its index) against the tensors `saved` ({name: {"dtype", "shape",
    "crc32"}}): each file there and readable to its end, every saved tensor in one of them with
    the same dtype and shape, and (every `world_size`-th file, this rank's share) the same bytes.
    Tensors that were not saved are not looked at. See [Note: the manifest and the weights' form]."""
    folder = Path(folder)
    names, problems = current_weights(folder)
    if problems:
        return problems
    if not names:
        return [f"{str(folder / WEIGHTS)!r} is missing (and no {WEIGHTS_INDEX} names other weights files)"]
    found = set()
    for position, name in enumerate(names):
        path = folder / name
        if not path.is_file():
            problems.append(f"{str(path)!r} is missing" + (f" ({WEIGHTS_INDEX} names it)" if name != WEIGHTS else ""))
            continue
        try:
            with SafetensorsFile(path) as f:
                for tensor in f.keys():
                    found.add(tensor)
                    problem = _tensor_problem(f, tensor, saved.get(tensor), position % world_size == rank)
                    if problem:
                        problems.append(problem)
        except CheckpointError as e:
            problems.append(getattr(e, "problem", str(e)))
    lacking = sorted(set(saved) - found)
    if lacking and not problems:  # a file that cannot be read already explains its tensors
        shown = ", ".join(map(repr, lacking[:5])) + (f" and {len(lacking) - 5} more" if len(lacking) > 5 else "")
        problems.append(f"the weights in {str(folder)!r} ({', '.join(names)}) lack {shown}, saved with this "
                        "checkpoint")  # fmt: skip
    return problems


def _tensor_problem(f: "SafetensorsFile", tensor: str, saved: dict | None, check_bytes: bool) -> str | None:
    if saved is None:
        return None
    dtype, shape = _DTYPES[f.dtype(tensor)], list(f.shape(tensor))
    if (dtype, shape) != (saved["dtype"], list(saved["shape"])):
        return (f"{str(f.path)!r} holds {tensor!r} as {dtype} {shape}, it was saved as {saved['dtype']} "
                f"{list(saved['shape'])}: altered")  # fmt: skip
    if check_bytes and f.crc32(tensor) != saved["crc32"]:
        return f"{str(f.path)!r} is corrupt: the bytes of {tensor!r} differ from those saved (CRC-32)"
    return None


def publish(staging, final) -> None:
    """Rename a complete checkpoint folder into place, durably: every file and folder in it is
    fsynced first (`fsync_tree`) and the folders it is renamed between after, so that once this
    returns a crash or power loss finds the checkpoint whole (and only then may older ones be
    rotated away). A folder already there (the same step saved again) is moved aside to
    `staging` + ".old" and removed once the new one is in place: put back when the second rename
    fails, and after a crash between the two `finish_publish` puts one of them back."""
    staging, final = Path(staging), Path(final)
    fsync_tree(staging)
    old = staging.with_name(staging.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        _fsync(old.parent)
    try:
        os.replace(staging, final)
    except OSError:
        if old.is_dir() and not final.exists():
            os.replace(old, final)  # an error, not a crash: the published one back in place
        raise
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    try:
        staging.parent.rmdir()  # the staging folder itself, when nothing else is in it
    except OSError:
        pass


def finish_publish(run_dir) -> list:
    """After a crash between `publish`'s two renames (`run_dir/checkpoint-N` moved aside to
    `.checkpoint-staging/checkpoint-N.old`, the new one not yet renamed into its place): put a
    complete one in its place, the new one when its manifest was written (`publish` runs only
    after it, and fsyncs it first), else the one moved aside. Returns the folders put back."""
    staging_root = Path(run_dir) / STAGING
    restored = []
    for old in sorted(staging_root.glob("*.old")) if staging_root.is_dir() else []:
        final = Path(run_dir) / old.name.removesuffix(".old")
        if final.exists() or not old.is_dir():
            continue
        new = staging_root / final.name
        os.replace(new if (new / MANIFEST).is_file() else old, final)
        _fsync(run_dir)
        restored.append(final)
    return restored


def fsync_tree(folder) -> None:
    """fsync every file and folder under `folder`, each folder after what it holds, `folder` last:
    its files' data and their names in their folders are then on the disk."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def _fsync(path) -> None:
    """fsync a file or a folder (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
