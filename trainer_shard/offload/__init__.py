"""The offload engine's parts: stores (CPU RAM, disk) and the chunked AdamW step that streams a
shard through them. `--offload` is not wired to them yet (see configs/README.md)."""

from .store import CpuStore, DiskStore, OffloadStoreError
from .stream import ChunkedAdamW

__all__ = ["ChunkedAdamW", "CpuStore", "DiskStore", "OffloadStoreError"]
