"""Norms of gradient shards, exact enough to clip as DDP does and at the speed of one pass."""

import torch


def power_sum(t: torch.Tensor, p: float, row: int = 4096, rows_per_pass: int = 256) -> torch.Tensor:
    """sum(|t|^p) in float64, from fp32 norms of short rows.

    One fp32 norm over a shard of tens of millions of elements is off by about 0.2% on CPU
    (measured: 30 M elements, -1.9e-3), which moved the clipping and the logged grad norm away
    from DDP's per-parameter norms; rows of 4096 bring it to about 1e-7, at the speed of one norm.
    A 16-bit shard is upcast `rows_per_pass` rows at a time into one fp32 buffer that stays in
    cache, then normed: the same values as norming the 16-bit rows with dtype=float32, 2.3x as
    fast on CPU (64 M bf16 elements: 17.6 against 40.1 ms, measured by hand).
    """
    n = t.numel() // row * row
    matrix = t[:n].view(-1, row)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    upcast = None
    if t.dtype != torch.float32:
        upcast = torch.empty(min(rows_per_pass, matrix.shape[0]), row, device=t.device)
    for start in range(0, matrix.shape[0], rows_per_pass):
        rows = matrix[start : start + rows_per_pass]
        if upcast is not None:
            rows = upcast[: rows.shape[0]].copy_(rows)
        norms = torch.linalg.vector_norm(rows, ord=p, dim=1, dtype=torch.float32)
        total += norms.double().pow(p).sum()
    return total + t[n:].double().abs().pow(p).sum()
