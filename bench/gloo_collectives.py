"""Gloo collectives on one machine, as trainer_shard's ZeRO-2 uses them (the figures quoted in
trainer_shard/comm.py and bench/results/sharding.md).

    torchrun --nproc_per_node 2 bench/gloo_collectives.py
    TRAINER_SHARD_SHM_COLLECTIVES=0 torchrun --nproc_per_node 2 bench/gloo_collectives.py

`comm.reduce_scatter` and `comm.all_gather` go through shared memory when the ranks share a
host, through gloo point to point with TRAINER_SHARD_SHM_COLLECTIVES=0 (the rows say which).

For each size: median of 10 timed calls (after 2 warm-up) of: torch's all-reduce and a copy of
this rank's chunk (the old reduce-scatter), `comm.reduce_scatter` (point to point), torch's
reduce-scatter, one broadcast per chunk (the old all-gather) and `comm.all_gather`. Prints a markdown table on rank 0.
"""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_shard import comm  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    via = "shared memory" if comm._shared_memory(None, torch.zeros(1)) is not None else "point to point"
    for mb in (16, 64):
        numel = mb * 2**20 // 4 // world * world
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        n = numel // world
        out, full = torch.empty(n), torch.empty(numel)

        def all_reduce_slice():
            y = x.clone()
            dist.all_reduce(y)
            out.copy_(y[rank * n : (rank + 1) * n])

        def point_to_point():
            comm.reduce_scatter(out, x.clone())

        def torch_reduce_scatter():
            dist.reduce_scatter_tensor(out, x.clone())

        def broadcasts():
            works = [dist.broadcast(full[i * n : (i + 1) * n], src=i, async_op=True) for i in range(world)]
            for work in works:
                work.wait()

        def gather_point_to_point():
            comm.all_gather(full, out)

        cases = [("reduce: all-reduce + slice", all_reduce_slice), (f"reduce: comm.reduce_scatter ({via})", point_to_point),
                 ("reduce: torch reduce_scatter_tensor", torch_reduce_scatter), ("gather: one broadcast per chunk", broadcasts),
                 (f"gather: comm.all_gather ({via})", gather_point_to_point)]  # fmt: skip
        for name, fn in cases:
            times = []
            for i in range(12):
                dist.barrier()
                began = time.perf_counter()
                fn()
                if i >= 2:
                    times.append(time.perf_counter() - began)
            rows.append((mb, name, statistics.median(times) * 1e3))
    if rank == 0:
        print(f"| size (MB) | collective, {world} ranks on gloo | median (ms) |\n|---|---|---|")
        for mb, name, ms in rows:
            print(f"| {mb} | {name} | {ms:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
