"""Process memory helpers."""

import os

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)

MAPPED_FROM = 1 << 20
"""Bytes from which `map_large_blocks` has glibc map each block apart (1 MiB)."""


def release_freed_memory() -> None:
    """Hand memory freed into the C heap back to the OS (glibc's `malloc_trim`; elsewhere nothing).

    glibc raises its mmap threshold as large blocks are freed, after which blocks of a few MB
    (most weight matrices) come from the heap, and freeing them does not lower the process's
    RSS. Moving a model's parameters into a flat buffer frees exactly such blocks.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def map_large_blocks(threshold: int = MAPPED_FROM) -> bool:
    """Have glibc serve every block of `threshold` bytes or more from a mapping of its own, handed
    back to the OS when it is freed (`mallopt(M_MMAP_THRESHOLD)`, which also stops glibc raising
    the threshold as large blocks are freed). For the whole process, from now on. True where set;
    False where the C library is not glibc or the user set the threshold already
    (`MALLOC_MMAP_THRESHOLD_`, or `GLIBC_TUNABLES` naming it), which wins.

    Why: with fp32 compute over 16-bit parameters every layer allocates and frees fp32 blocks of
    1-16 MiB (activations, their gradients, products), and with glibc's rising threshold they come
    from the heap, which keeps them: a t5-large ZeRO-3 step with everything on disk peaked at 2.57
    GiB, and at 1.98 GiB with blocks mapped apart (bf16 compute: 1.97; bench/results/
    infinity_compute_avx2.md). Each such block is faulted in anew, which costs time: the same run
    with a heap kept instead (MALLOC_MMAP_THRESHOLD_ 256 MiB, MALLOC_TRIM_THRESHOLD_ 8 GiB) took 13.13 s a step
    against 14.37 s, at 2.53 GiB against 1.79 (one run each, by hand); RSS was the bound to meet.
    Free space glibc's heap already holds serves the requests that fit it first: call it early."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
