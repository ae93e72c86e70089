"""Sizes and names shared across the package, each defined once. Plain values, no imports: every
layer may use them (config/ included, which must not import sharding/ or offload/).
"""

CHUNK_NUMEL = 2**22
"""Elements a chunk when state is streamed a piece at a time (16 MB of fp32): the offload engine's
chunks, checkpoint writing and reading, re-partitioning, consolidation, the finite check. Measured
on 738 M elements (2 cores): 2**20 to 2**24 were within the machine's noise of each other (1.0-1.5 s
a step), 2**18 clearly slower (per-chunk calls)."""

BUCKET_NUMEL = 2**23
"""Elements a gradient (reduce) and all-gather bucket, the config's `reduce_bucket_size` and
`allgather_bucket_size` default: 16 MB of bf16 / 32 MB of fp32 gradients a bucket."""

PRECISIONS = ("fp32", "bf16", "fp16")
"""Training precisions, as `--bf16`/`--fp16`, the config's sections and `data_types` name them."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The same three dtypes as torch names them (`--dtype` of consolidate, the inference section)."""
