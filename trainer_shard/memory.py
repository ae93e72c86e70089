"""Process memory helpers."""


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
