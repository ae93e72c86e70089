"""Parameters that change trainability after the optimizer is built, as torch's optimizers treat them.

[Note: trainability] torch's optimizers step a parameter only when it has a gradient, so a
parameter frozen at construction and unfrozen later is trained from then on (progressive
unfreezing), and one frozen later is left alone. `ShardedOptimizer` does the same:

- A parameter that does not require grad when its group is added is kept out of the flat
  buffers. Once it does (checked when the gradients are prepared, agreed by every rank), the
  newly trainable parameters of each group become a new `FlatGroup` of their own: fresh state,
  their own step count from their first step, as torch's would have. ZeRO-2 reduces the
  gradients they accumulated in `.grad` before their hooks existed; ZeRO-1 relies on DDP, which
  reduces only the parameters that required grad when it was built (torch's rule: wrap the
  model in DDP again after unfreezing). While any parameter waits, each step costs one
  all-reduce of two integers, by which the ranks agree on what to flatten.
- A flattened parameter that no longer requires grad has its part of this rank's shard (master
  weights and per-element state) read before the step and written back after it (`Held`), so it
  does not move, by weight decay or momentum, where torch would skip it. The step count of its
  flat goes on (one per flat): unfrozen again, its bias correction is that of its flat, not
  torch's paused count.
"""

import logging

import torch

logger = logging.getLogger(__name__)


def frozen_segments(flat) -> list:
    """The segments of this rank's shard whose parameters do not require grad now."""
    if all(p.requires_grad for p in flat.params):
        return []
    return [seg for seg in flat.segments if not flat.params[seg.index].requires_grad]


class Held:
    """What a step must not change: the frozen segments of every flat, read from the stepper."""

    _logged = False

    def __init__(self, stepper, flats, device):
        self.stepper, self.flats, self.device = stepper, flats, device
        self.saved = []  # (flat index, segments, {name: [values per segment]})
        for index, flat in enumerate(flats):
            segments = frozen_segments(flat)
            if segments:
                self.saved.append((index, segments, self._read(index, segments)))
        if self.saved and not Held._logged:
            Held._logged = True
            logger.info("parameters that no longer require grad are held unchanged in each step (see "
                        "[Note: trainability]); build the optimizer without them to spare the copy")  # fmt: skip

    def _read(self, index: int, segments: list) -> dict:
        return {name: [self.stepper.read(index, name, seg.shard_start, torch.empty(seg.numel, device=self.device))
                       for seg in segments]
                for name in self.stepper.tensor_names(index)}  # fmt: skip

    @torch.no_grad()
    def restore(self) -> None:
        """Write the held values back (zeros for state the step created); masters into the parameters too."""
        for index, segments, values in self.saved:
            flat = self.flats[index]
            for name in self.stepper.tensor_names(index):
                for seg, value in zip(segments, values.get(name) or [None] * len(segments)):
                    value = value if value is not None else torch.zeros(seg.numel, device=self.device)
                    self.stepper.write(index, name, seg.shard_start, value)
                    if name == "master":
                        flat.write_shard(seg.shard_start, value)
