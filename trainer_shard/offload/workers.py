"""The offload code's background threads.

[Note: a finished job keeps nothing] `ThreadPoolExecutor`'s worker thread sets a job's result,
which wakes the waiting thread, and drops the job (its function and arguments) only when it next
runs Python itself: with two cores and the GIL, after the waiting thread has gone on for a while.
The engine's last chunk write of a step holds the flat buffer, its parameters and the engine, so a
model and optimizer the user dropped right after a step stayed alive through a `gc.collect()`
(their disk stores still open at their paths), one time in five. `Workers.submit` hands the pool
a job that lets go of its function and arguments before its result is set; and a job that
outlasts the call that started it (the disk store's write-back, after the step) holds the store
it works on, not the engine.
"""

from concurrent.futures import ThreadPoolExecutor


class _Job:
    __slots__ = ("call",)

    def __init__(self, fn, args):
        self.call = (fn, args)

    def __call__(self):
        fn, args = self.call
        self.call = None
        return fn(*args)  # the frame, and with it `fn` and `args`, is gone before the result is set


class Workers(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose jobs hold nothing once done: see [Note: a finished job keeps nothing]."""

    def submit(self, fn, /, *args):
        return super().submit(_Job(fn, args))
