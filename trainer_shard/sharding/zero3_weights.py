"""A ZeRO-3 model's weights to and from the plain Hugging Face files, one unit at a time.

    files = save_weights(sharded, "out/", max_shard_size, write=rank == 0)   # collective
    load_weights(sharded, "checkpoint-10/")                                  # collective

No rank ever holds the whole model: saving gathers each unit in turn (every rank takes part in
each gather) and the writing ranks stream its tensors into `model.safetensors` (or files of at
most `max_shard_size` and their index, as `checkpoint.save_model` splits them), then release it;
loading reads each unit's tensors from the files (`pread`, a tensor at a time) into the gathered
unit and keeps this rank's slice. The files are the ones `from_pretrained` reads.

A writer that fails (a full disk) still takes part in every remaining gather before it raises,
so the other ranks do not hang.
"""

import contextlib
from pathlib import Path

import torch

from ..checkpoint import Chunked, SafetensorsFile, current_weights, save_configs, save_sharded, unique_state_dict
from ..errors import CheckpointError


class _UnitCursor:
    """Gathers the units in order, each once, as the tensors of one after another are read."""

    def __init__(self, sharded):
        self.sharded, self.next, self.held = sharded, 0, contextlib.ExitStack()
        self.position = {id(unit): i for i, unit in enumerate(sharded.units)}

    def at(self, unit) -> None:
        """Have `unit` gathered (and every unit before it in order gathered and released)."""
        target = self.position[id(unit)]
        while self.next <= target:
            self.held.close()
            self.held = contextlib.ExitStack()
            self.held.enter_context(self.sharded.gathered([self.sharded.units[self.next]]))
            self.next += 1

    def finish(self) -> None:
        """Gather (and release) the units not reached yet: every rank ends at the same count."""
        if self.sharded.units:
            self.at(self.sharded.units[-1])
        self.held.close()


def _ordered_tensors(sharded, cursor) -> dict:
    """{name: tensor or Chunked} as `checkpoint.save_model` names them, the units' tensors first,
    unit by unit (read through `cursor`), then the whole ones (persistent parameters, buffers)."""
    state = unique_state_dict(sharded.model)  # detached: new tensor objects, so matched by name
    unit_of = {id(p): unit for unit in sharded.units for p in unit.params}
    params = dict(sharded.model.named_parameters(remove_duplicate=False))
    by_unit = {id(unit): [] for unit in sharded.units}
    rest = []
    for name in state:
        unit = unit_of.get(id(params[name])) if name in params else None
        (by_unit[id(unit)] if unit is not None else rest).append(name)
    out = {}
    for unit in sharded.units:  # read from the parameter itself once gathered: empty between uses
        for name in by_unit[id(unit)]:
            param = params[name]
            out[name] = Chunked(param.dtype, param.ds_shape, _reader(cursor, unit, param))
    for name in rest:
        out[name] = state[name].detach()
    return out


def _reader(cursor, unit, param):
    def read(start: int, out: torch.Tensor) -> None:
        cursor.at(unit)
        out.copy_(param.detach().reshape(-1)[start : start + out.numel()])

    return read


@torch.no_grad()
def save_weights(sharded, output_dir, max_shard_size: int, write: bool) -> dict | None:
    """The model's weights and configuration into `output_dir`, written by the ranks with
    `write`; {file: {"bytes", "crc32", "tensors"}} there, None elsewhere. Collective."""
    model = sharded.model
    cursor = _UnitCursor(sharded)
    files = None
    try:
        if write:
            output_dir = Path(output_dir)
            output_dir.mkdir(parents=True, exist_ok=True)
            files = save_sharded(_ordered_tensors(sharded, cursor), output_dir, max_shard_size)
            save_configs(model, output_dir)
    finally:
        cursor.finish()  # also after a failed write: the others are waiting in these gathers
    return files


SCRATCH_NUMEL = 1 << 22  # elements a conversion chunk (16 MiB in fp32)


class _Weights:
    """The tensors of a saved model's safetensors files, read one at a time (a Mapping as
    `ShardedModel.load_full_state_dict` wants it)."""

    def __init__(self, folder):
        names, problems = current_weights(folder)
        if problems or not names:
            raise CheckpointError(f"{str(folder)!r} has no readable safetensors weights"
                                  f"{': ' + '; '.join(problems) if problems else ''}")  # fmt: skip
        self.files = [SafetensorsFile(Path(folder) / name) for name in names]
        self.where = {key: f for f in self.files for key in f.keys()}
        self._scratch = None  # `read_into`'s conversion buffer

    def __contains__(self, name) -> bool:
        return name in self.where

    def __getitem__(self, name):
        return self.where[name].read(name)

    def shape(self, name) -> tuple:
        return self.where[name].shape(name)

    def read_into(self, name, out: torch.Tensor, start: int = 0) -> None:
        """`out` (contiguous) <- elements [start, start + out.numel()) of tensor `name`, flattened:
        read straight into it when it is in CPU memory in the file's dtype, else a chunk at a time
        through one scratch buffer, converted; no tensor of the checkpoint's size is allocated
        (the heap would keep the freed ones)."""
        f, flat = self.where[name], out.view(-1)
        dtype = f.dtype(name)
        if dtype == out.dtype and out.device.type == "cpu":
            f.read(name, start, start + flat.numel(), out=flat)
            return
        if self._scratch is None or self._scratch.dtype != dtype:
            self._scratch = torch.empty(SCRATCH_NUMEL, dtype=dtype)
        for at in range(0, flat.numel(), SCRATCH_NUMEL):
            end = min(at + SCRATCH_NUMEL, flat.numel())
            flat[at:end].copy_(f.read(name, start + at, start + end, out=self._scratch[: end - at]))

    def close(self) -> None:
        self._scratch = None
        for f in self.files:
            f.close()


def checkpoint_weights(folder) -> _Weights:
    """The weights of a saved model (safetensors files, as `save_pretrained` writes them) as the
    mapping `shard_model(..., weights=...)` reads a meta-device model from, a tensor at a time.
    Close it when done (`.close()`)."""
    return _Weights(folder)


@torch.no_grad()
def load_weights(sharded, folder) -> None:
    """Load the weights `save_weights` (or `save_model`, or `save_pretrained` in safetensors)
    wrote in `folder` into the sharded model, unit by unit. Collective."""
    weights = _Weights(folder)
    try:
        sharded.load_full_state_dict(weights)
    finally:
        weights.close()

