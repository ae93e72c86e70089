"""The offload engine: fp32 master weights and optimizer state of this rank's shard in CPU RAM or
on disk, streamed through a CPU step chunk by chunk. `ShardedOptimizer(offload=OffloadSpec(...))`
uses it; `--offload CONFIG.json` configures it (see configs/README.md)."""

from .engine import OffloadEngine, OffloadSpec
from .store import CpuStore, DiskStore, OffloadStoreError

__all__ = ["CpuStore", "DiskStore", "OffloadEngine", "OffloadSpec", "OffloadStoreError"]
