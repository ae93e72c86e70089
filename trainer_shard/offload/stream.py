"""Step a shard that lives in a store, chunk by chunk, with torch's fused AdamW on the CPU.

    adam = ChunkedAdamW(store, chunk_numel=2**22, buffer_count=2)
    adam.step(grad_shard, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
              on_chunk=lambda start, master: params[start:start + master.numel()].copy_(master))

The store holds "master", "exp_avg" and "exp_avg_sq" (fp32, shard-sized). For a CPU store the
chunks are views and the step runs in place. For a disk store a reader thread loads chunk i+1
while chunk i is stepped and a writer thread writes chunk i-1 back, so disk time overlaps the
step; `buffer_count` sets of chunk buffers are all the RAM it uses. `on_chunk` receives each
updated master chunk, to copy it into the model's (16-bit) parameters.

The update is torch's own fused AdamW, elementwise, so stepping by chunks gives the same result,
bit for bit, as stepping the whole shard at once.
"""

from concurrent.futures import ThreadPoolExecutor

import torch

from .store import CpuStore

NAMES = ("master", "exp_avg", "exp_avg_sq")


class ChunkedAdamW:
    def __init__(self, store, chunk_numel: int, buffer_count: int = 2):
        if chunk_numel < 1 or buffer_count < 1:
            raise ValueError("chunk_numel and buffer_count must be at least 1")
        self.store = store
        self.numel = store.numel
        self.chunk_numel = min(chunk_numel, self.numel)
        self.steps = 0
        self._param = torch.zeros(0)
        self._adam = torch.optim.AdamW([self._param], fused=True)
        self._in_place = isinstance(store, CpuStore)
        if not self._in_place:
            self._buffers = [{n: torch.empty(self.chunk_numel) for n in NAMES} for _ in range(buffer_count)]
            self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trainer_shard-offload")

    def _ranges(self):
        return [(s, min(s + self.chunk_numel, self.numel)) for s in range(0, self.numel, self.chunk_numel)]

    def _read(self, start, end, slot):
        if self._in_place:
            return {n: self.store.read(n, start)[: end - start] for n in NAMES}
        buffers = self._buffers[slot]
        return {n: self.store.read(n, start, buffers[n][: end - start]) for n in NAMES}

    def _write(self, start, chunk):
        for n in NAMES:
            self.store.write(n, start, chunk[n])

    @torch.no_grad()
    def step(self, grad: torch.Tensor, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
             weight_decay: float = 0.0, on_chunk=None) -> None:  # fmt: skip
        """One AdamW step of the whole shard, given its fp32 gradient (in RAM)."""
        group = self._adam.param_groups[0]
        group.update(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.steps += 1
        ranges = self._ranges()
        if self._in_place:
            for start, end in ranges:
                self._step_chunk(self._read(start, end, 0), grad[start:end], start, on_chunk)
            return
        slots = len(self._buffers)
        reads = {0: self._io.submit(self._read, *ranges[0], 0)}
        writes = {}
        for i, (start, end) in enumerate(ranges):
            chunk = reads.pop(i).result()
            if i + 1 < len(ranges):
                slot = (i + 1) % slots
                if slot in writes:  # that buffer set is still being written back
                    writes.pop(slot).result()
                reads[i + 1] = self._io.submit(self._read, *ranges[i + 1], slot)
            self._step_chunk(chunk, grad[start:end], start, on_chunk)
            writes[i % slots] = self._io.submit(self._write, start, chunk)
        for future in writes.values():
            future.result()

    def _step_chunk(self, chunk, grad, start, on_chunk) -> None:
        param = self._param
        param.data = chunk["master"]
        param.grad = grad
        self._adam.state[param] = {
            "step": torch.tensor(float(self.steps - 1)),
            "exp_avg": chunk["exp_avg"],
            "exp_avg_sq": chunk["exp_avg_sq"],
        }
        self._adam.step()
        if on_chunk is not None:
            on_chunk(start, chunk["master"])

    def close(self) -> None:
        if not self._in_place:
            self._io.shutdown(wait=True)
        self.store.close()
